package relay

import (
	"fmt"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrelay/kvrelay/engines"
	"github.com/kvrelay/kvrelay/engines/wire"
)

// metrics are the relay's Prometheus series. Every series carries the
// engine and the relay instance as constant labels; per-rank series add
// "rank". No label ever
// holds a sequence number or a hash.
type metrics struct {
	batches, events, blocks *prometheus.CounterVec // rank
	drops                   *prometheus.CounterVec // reason
	undecodable             *prometheus.CounterVec // rank
	duplicates              *prometheus.CounterVec // rank
	stale                   *prometheus.CounterVec // rank
	reannounced             *prometheus.CounterVec // rank, suppressed
	gaps                    *prometheus.CounterVec // rank
	replays                 *prometheus.CounterVec // rank, result
	replayStale             *prometheus.CounterVec // rank
	recovered               *prometheus.CounterVec // rank
	primed                  *prometheus.CounterVec // rank
	lost                    *prometheus.CounterVec // rank
	unknownBefore           *prometheus.GaugeVec   // rank
	unknownBeforeStart      *prometheus.CounterVec // rank
	restarts                *prometheus.CounterVec // rank, reason
	recordEvicted           *prometheus.CounterVec // rank

	served        *prometheus.CounterVec // how: history, snapshot, live, out_of_range
	subscribers   prometheus.Gauge
	lagged        prometheus.Counter
	refilled      prometheus.Counter
	ended         *prometheus.CounterVec // reason
	lag           prometheus.Histogram
	snapshotLock  prometheus.Histogram
	snapshotTotal prometheus.Histogram

	reg        prometheus.Registerer
	collectors []prometheus.Collector
}

func newMetrics(reg prometheus.Registerer, labels prometheus.Labels) (*metrics, error) {
	counter := func(name, help string, vars ...string) *prometheus.CounterVec {
		return prometheus.NewCounterVec(prometheus.CounterOpts{Name: name, Help: help, ConstLabels: labels}, vars)
	}
	m := &metrics{
		batches:     counter("kvrelay_batches_relayed_total", "Batches relayed (live and recovered), undecodable ones as empty batches.", "rank"),
		events:      counter("kvrelay_events_relayed_total", "KV cache events relayed after normalization.", "rank"),
		blocks:      counter("kvrelay_blocks_relayed_total", "Blocks carried by the stored events relayed.", "rank"),
		drops:       counter("kvrelay_events_dropped_total", "Events or blocks the normalizer dropped, by reason.", "reason"),
		undecodable: counter("kvrelay_undecodable_batches_total", "Batches whose envelope did not decode; relayed as empty batches under their sequence.", "rank"),
		duplicates:  counter("kvrelay_duplicate_batches_total", "Live batches skipped because they were already relayed.", "rank"),
		stale:       counter("kvrelay_stale_batches_total", "Live batches skipped because a replay had moved the cursor past them while they waited on the socket (the engine still held the cursor's batch: no restart).", "rank"),
		gaps:        counter("kvrelay_publisher_gaps_total", "Gaps in a publisher's sequence seen on the live stream.", "rank"),
		replays:     counter("kvrelay_replays_total", "Replay requests, by result (complete, truncated, error).", "rank", "result"),
		replayStale: counter("kvrelay_replay_stale_replies_total", "Replay replies below the sequence asked for, dropped.", "rank"),
		recovered:   counter("kvrelay_batches_recovered_total", "Batches obtained from a replay (gaps, late joins and priming).", "rank"),
		primed:      counter("kvrelay_batches_primed_total", "Batches obtained by the start replay.", "rank"),
		lost:        counter("kvrelay_batches_lost_total", "Publisher sequences no replay could give, recorded as holes.", "rank"),
		reannounced: counter("kvrelay_record_reannounced_stores_total", "Stored events the record took for report-mode re-announcements of prefix-cache hits (no new copy), by whether the stream left them out.", "rank", "suppressed"),
		unknownBefore: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "kvrelay_unknown_before",
			Help: "Publisher sequences before the relay's record that it never obtained, for the current incarnation.", ConstLabels: labels}, []string{"rank"}),
		unknownBeforeStart: counter("kvrelay_unknown_before_total", "unknown_before summed over every incarnation.", "rank"),
		restarts:           counter("kvrelay_publisher_restarts_total", "Publisher restarts detected, by reason.", "rank", "reason"),
		recordEvicted:      counter("kvrelay_record_evicted_total", "Live-block record entries evicted (oldest-stored first) to keep a rank within --record-max-entries.", "rank"),

		served: counter("kvrelay_subscriptions_total", "Subscriptions, by what they were served first (history, snapshot, live, out_of_range).", "served"),
		subscribers: prometheus.NewGauge(prometheus.GaugeOpts{Name: "kvrelay_subscribers",
			Help: "Subscribers open now.", ConstLabels: labels}),
		lagged: prometheus.NewCounter(prometheus.CounterOpts{Name: "kvrelay_subscribers_lagged_total",
			Help: "Times a subscriber's live queue overflowed.", ConstLabels: labels}),
		refilled: prometheus.NewCounter(prometheus.CounterOpts{Name: "kvrelay_subscriber_refills_total",
			Help: "Refills of a lagged subscriber from the history.", ConstLabels: labels}),
		ended: counter("kvrelay_subscribers_ended_total", "Subscriptions ended, by reason (closed, publisher_restart, fell_behind).", "reason"),
		lag: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "kvrelay_subscriber_lag_batches",
			Help: "How many log entries behind the newest a live batch was when a subscriber took it.", ConstLabels: labels,
			Buckets: []float64{0, 1, 4, 16, 64, 256, 1024, 4096, 16384}}),
		snapshotLock: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "kvrelay_snapshot_lock_seconds",
			Help: "Time a snapshot held the admission lock.", ConstLabels: labels,
			Buckets: prometheus.ExponentialBuckets(0.0001, 4, 9)}),
		snapshotTotal: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "kvrelay_snapshot_seconds",
			Help: "Time to cut, order and encode a snapshot.", ConstLabels: labels,
			Buckets: prometheus.ExponentialBuckets(0.001, 4, 9)}),
		reg: reg,
	}
	m.collectors = []prometheus.Collector{m.batches, m.events, m.blocks, m.drops, m.undecodable, m.duplicates, m.stale, m.gaps,
		m.replays, m.replayStale, m.recovered, m.primed, m.lost, m.reannounced, m.unknownBefore, m.unknownBeforeStart, m.restarts,
		m.recordEvicted, m.served, m.subscribers, m.lagged, m.refilled, m.ended, m.lag, m.snapshotLock, m.snapshotTotal}
	if err := m.register(m.collectors...); err != nil {
		return nil, err
	}
	return m, nil
}

// restartReasonsOf lists the restart reasons engine's publishers can show
// (a startup clear only where the engine begins with one).
func restartReasonsOf(engine engines.Engine) []restartReason {
	reasons := []restartReason{sequenceRegression, counterRestarted, replayMismatch, sequenceJump}
	if engine.StartupClear {
		reasons = append(reasons, startupClearRestart)
	}
	return reasons
}

// zeroSeries creates every per-rank series at 0, and the drop and restart
// series for each reason that can occur, so that alerts and rate() work
// before the first event (a counter vector shows a label set only once it
// was touched).
func (m *metrics) zeroSeries(rankLabels []string, restartReasons []restartReason) {
	for _, rank := range rankLabels {
		for _, v := range []*prometheus.CounterVec{m.batches, m.events, m.blocks, m.undecodable, m.duplicates, m.stale, m.gaps,
			m.replayStale, m.recovered, m.primed, m.lost, m.unknownBeforeStart} {
			v.WithLabelValues(rank)
		}
		m.unknownBefore.WithLabelValues(rank)
		for _, reason := range restartReasons {
			m.restarts.WithLabelValues(rank, string(reason))
		}
	}
	for _, reason := range wire.DropReasons() {
		m.drops.WithLabelValues(reason.String())
	}
}

func (m *metrics) register(cs ...prometheus.Collector) error {
	if m.reg == nil {
		return nil
	}
	for i, c := range cs {
		if err := m.reg.Register(c); err != nil {
			// Leave the registry as it was, so a corrected retry works.
			for _, done := range cs[:i] {
				m.reg.Unregister(done)
			}
			return fmt.Errorf("relay: register metrics (do two relays share an instance name?): %w", err)
		}
	}
	return nil
}

// registerState adds the gauges read from the relay's state at scrape time
// (history and record sizes), which would cost too much to keep current on
// every batch.
// unregister removes what newMetrics registered.
func (m *metrics) unregister() {
	if m.reg == nil {
		return
	}
	for _, c := range m.collectors {
		m.reg.Unregister(c)
	}
}

func (m *metrics) registerState(r *Relay, labels prometheus.Labels) error {
	gauge := func(name, help string, f func(Status) float64) prometheus.Collector {
		return prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: name, Help: help, ConstLabels: labels},
			func() float64 { return f(r.Status()) })
	}
	return m.register(
		newSourceCollector(r, labels),
		gauge("kvrelay_history_entries", "Entries (batches and hole runs) in the history window.",
			func(s Status) float64 { return float64(s.History.Entries) }),
		gauge("kvrelay_history_bytes", "Bytes the history window is charged (encoded size + 96 per entry).",
			func(s Status) float64 { return float64(s.History.Bytes) }),
		gauge("kvrelay_history_holes", "Hole runs in the history window.",
			func(s Status) float64 { return float64(s.History.Holes) }),
		gauge("kvrelay_record_blocks", "Live physical block copies in the record.",
			func(s Status) float64 { return float64(s.RecordBlocks) }),
		gauge("kvrelay_record_entries", "Live (rank, tier, hash) entries in the record.",
			func(s Status) float64 { return float64(s.RecordEntries) }),
	)
}
