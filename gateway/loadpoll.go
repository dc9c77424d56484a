package gateway

import (
	"context"
	"errors"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"

	"github.com/kvrelay/kvrelay/engines/load"
	"github.com/kvrelay/kvrelay/gateway/monitor"
	"github.com/kvrelay/kvrelay/proto/kvpb"
)

// Polling GetLoads, as SMG's gateway does for a worker whose stream pushes
// no load records (an engine servicer from before them, a relay without a
// load source): every LoadPollInterval, on the worker's own gRPC channel,
// a poll unless the stream pushed a record recently. The modes are SMG's
// (smg_engine_load_polls_total): poll, a worker that never pushed;
// fallback, one whose pushes stopped; skipped_fresh_push, no call made.

// Load polling defaults. SMG floors its tick at 1 s: GetLoads is a call
// into the engine's scheduler, not free.
const (
	DefaultLoadPollInterval = time.Second
	MinLoadPollInterval     = time.Second
	// pushFreshFor is how long a pushed record spares the polls: a stream
	// that is up sends one at least every 5 s (the heartbeat backoff), so
	// a worker silent for longer has stopped pushing.
	pushFreshFor = 6 * time.Second
	// loadPollMaxBytes caps one GetLoads answer; a real one with every
	// section for a few ranks is a few KiB.
	loadPollMaxBytes = 4 << 20
)

// Sources of an EngineLoad record.
const (
	LoadPushed = "push" // on the worker's event stream (gRPC or NATS)
	LoadPolled = "poll" // the gateway's own GetLoads call
)

type loadPollMetrics struct {
	polls    *prometheus.CounterVec // worker, mode
	failures *prometheus.CounterVec // worker, reason
}

func newLoadPollMetrics() loadPollMetrics {
	return loadPollMetrics{
		polls: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvrelay_gateway_load_polls_total",
			Help: "Load poll ticks per worker, by mode: poll (the worker never pushed a load record), fallback (its pushes stopped), skipped_fresh_push (its stream pushed one recently; no GetLoads call).",
		}, []string{"worker", "mode"}),
		failures: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvrelay_gateway_load_poll_failures_total",
			Help: "GetLoads calls that failed, by reason (unimplemented: the worker serves none and is not polled again; malformed; too_large; error).",
		}, []string{"worker", "reason"}),
	}
}

// pollInterval is the configured interval, defaulted and floored; 0 when
// polling is off.
func pollInterval(d time.Duration) time.Duration {
	switch {
	case d < 0:
		return 0
	case d == 0:
		return DefaultLoadPollInterval
	}
	return max(d, MinLoadPollInterval)
}

// pollLoads is the monitor's PollLoads: it runs beside w's subscription.
func (g *Gateway) pollLoads(ctx context.Context, w monitor.Worker, conn grpc.ClientConnInterface) {
	every := pollInterval(g.cfg.LoadPollInterval)
	log := g.log.With("worker", w.ID)
	f, err := load.NewGetLoads(conn, w.Service.FullName())
	if err != nil {
		log.Warn("no load polling for the worker", "err", err)
		return
	}
	t := time.NewTicker(every)
	defer t.Stop()
	failing := false
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		mode := g.pollMode(w.ID)
		g.metrics.loadPolls.polls.WithLabelValues(w.ID, mode).Inc()
		if mode == "skipped_fresh_push" {
			continue
		}
		cctx, cancel := context.WithTimeout(ctx, every)
		recs, err := f.Fetch(cctx, loadPollMaxBytes)
		cancel()
		if ctx.Err() != nil {
			return
		}
		if err != nil {
			reason := "error"
			switch {
			case errors.Is(err, load.ErrRefused):
				g.metrics.loadPolls.failures.WithLabelValues(w.ID, "unimplemented").Inc()
				log.Info("the worker serves no GetLoads; its load is known only if its stream pushes it", "err", err)
				return
			case errors.Is(err, load.ErrMalformed):
				reason = "malformed"
			case errors.Is(err, load.ErrTooLarge):
				reason = "too_large"
			}
			g.metrics.loadPolls.failures.WithLabelValues(w.ID, reason).Inc()
			if !failing {
				failing = true
				log.Warn("GetLoads failed; retrying every interval, logged again when it answers", "err", err, "interval", every)
			}
			continue
		}
		if failing {
			failing = false
			log.Info("GetLoads answers again")
		}
		for rank, l := range recs {
			g.recordLoad(w.ID, rank, l, LoadPolled)
		}
	}
}

// pollMode says what this tick does for worker.
func (g *Gateway) pollMode(worker string) string {
	g.mu.Lock()
	defer g.mu.Unlock()
	last, ok := g.lastPush[worker]
	switch {
	case !ok:
		return "poll"
	case g.now().Sub(last) <= pushFreshFor:
		return "skipped_fresh_push"
	}
	return "fallback"
}

// loadAgeCollector reports each rank's record age at scrape time.
var engineLoadAgeDesc = prometheus.NewDesc("kvrelay_gateway_engine_load_age_seconds",
	"Age of the worker rank's last load record (its sample's age when it arrived plus the time since); past 15 s it no longer steers routing.", []string{"model", "worker", "rank", "source"}, nil)

// onEngineLoad takes a record a worker's stream pushed.
func (g *Gateway) onEngineLoad(worker string, rank int32, l *kvpb.EngineLoad) {
	g.recordLoad(worker, rank, l, LoadPushed)
}
