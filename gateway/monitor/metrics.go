package monitor

import (
	"errors"
	"fmt"

	"github.com/prometheus/client_golang/prometheus"
)

// metrics mirrors SMG's smg_kv_event_* set under kvrelay_gateway_*. Every
// series carries the worker label so one worker's trouble is visible.
type metrics struct {
	subscriptions *prometheus.CounterVec   // worker
	failures      *prometheus.CounterVec   // worker, reason
	batches       *prometheus.CounterVec   // worker, disposition
	gaps          *prometheus.CounterVec   // worker, outcome
	missed        *prometheus.CounterVec   // worker
	diverged      *prometheus.CounterVec   // worker, rank
	resyncs       *prometheus.CounterVec   // worker, reason
	lag           *prometheus.HistogramVec // worker
	apply         *prometheus.HistogramVec // worker
	degraded      *prometheus.GaugeVec     // worker
	streaming     *prometheus.GaugeVec     // worker
}

func newMetrics(reg prometheus.Registerer) (*metrics, error) {
	m := &metrics{
		subscriptions: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvrelay_gateway_subscriptions_total",
			Help: "SubscribeKvEvents calls the worker answered.",
		}, []string{"worker"}),
		failures: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvrelay_gateway_subscription_failures_total",
			Help: "Subscriptions that failed or ended with an error, by reason (deadline, unavailable, out_of_range, data_loss, unimplemented, error).",
		}, []string{"worker", "reason"}),
		batches: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvrelay_gateway_batches_total",
			Help: "Batches received, by disposition (applied, stale, snapshot, load_only, gap: not applied, a replay was asked for).",
		}, []string{"worker", "disposition"}),
		gaps: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvrelay_gateway_gaps_total",
			Help: "Sequence gaps, by outcome (replay_requested, unrecovered_kept, unrecovered_cleared).",
		}, []string{"worker", "outcome"}),
		diverged: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvrelay_gateway_digest_divergences_total",
			Help: "Times a rank's index digest differed from the relay's live digest at a batch both had applied.",
		}, []string{"worker", "rank"}),
		missed: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvrelay_gateway_missed_batches_total",
			Help: "Batches lost in gaps that no replay recovered.",
		}, []string{"worker"}),
		resyncs: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvrelay_gateway_resyncs_total",
			Help: "Times the worker's index state was reset, by reason (out_of_range, data_loss, publisher_restart, gap_cleared, snapshot, snapshot_abandoned, digest).",
		}, []string{"worker", "reason"}),
		lag: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "kvrelay_gateway_lag_seconds",
			Help:    "Publisher timestamp to apply, per applied batch.",
			Buckets: []float64{.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10},
		}, []string{"worker"}),
		apply: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "kvrelay_gateway_apply_seconds",
			Help:    "Time to apply one batch to the index.",
			Buckets: prometheus.ExponentialBuckets(1e-6, 4, 10),
		}, []string{"worker"}),
		degraded: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "kvrelay_gateway_degraded_ranks",
			Help: "DP ranks whose index state may be partial (a kept gap, or a snapshot with unknown_before > 0).",
		}, []string{"worker"}),
		streaming: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "kvrelay_gateway_streaming",
			Help: "1 while the worker's event stream is open.",
		}, []string{"worker"}),
	}
	if reg == nil {
		return m, nil
	}
	for _, c := range []prometheus.Collector{m.subscriptions, m.failures, m.batches, m.gaps, m.missed,
		m.resyncs, m.lag, m.apply, m.degraded, m.streaming, m.diverged} {
		if err := reg.Register(c); err != nil {
			var already prometheus.AlreadyRegisteredError
			if errors.As(err, &already) {
				return nil, fmt.Errorf("monitor metrics: %w (one Monitor per registry)", err)
			}
			return nil, fmt.Errorf("monitor metrics: %w", err)
		}
	}
	return m, nil
}

// forget drops a removed worker's series.
func (m *metrics) forget(worker string) {
	l := prometheus.Labels{"worker": worker}
	m.subscriptions.DeletePartialMatch(l)
	m.failures.DeletePartialMatch(l)
	m.batches.DeletePartialMatch(l)
	m.gaps.DeletePartialMatch(l)
	m.missed.DeletePartialMatch(l)
	m.resyncs.DeletePartialMatch(l)
	m.diverged.DeletePartialMatch(l)
	m.lag.DeletePartialMatch(l)
	m.apply.DeletePartialMatch(l)
	m.degraded.DeletePartialMatch(l)
	m.streaming.DeletePartialMatch(l)
}
