package natsevents

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrelay/kvrelay/gateway/monitor"
)

// Repair. The live digest tells a replica when its index of a worker no
// longer matches the relay's record; the monitor then clears the worker
// and subscribes from zero. Served from JetStream, that subscription would
// read the very snapshot object it just applied, and if the object was the
// cause (a sink that wrote a cut hiding a rank, issue 30; a forged or
// corrupt object), the index would be wrong again until the next object,
// a period later. So the object a divergence was found on is distrusted:
// Open serves the worker from its relay's gRPC stream, which is exact, and
// switches back (by the switch-back rule) only to another object, which
// it asks the sink for (request.go). Meanwhile the worker is
// cleared and rebuilt from the relay's own snapshot: routing uses only
// what the relay served.

func newRepairCounter() *prometheus.CounterVec {
	return prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvrelay_gateway_events_repairs_total",
		Help: "Times a worker read from JetStream diverged from its relay's live digest; its snapshot object is then distrusted and the worker resyncs from its gRPC stream until another object is written."},
		[]string{"worker"})
}

// distrust marks nuid, the snapshot object (at stream sequence seq) w was
// served from when its index diverged, and asks for another.
func (s *Source) distrust(w monitor.Worker, nuid string, seq uint64) {
	s.mu.Lock()
	s.stale[w.ID] = staleObject{nuid: nuid, why: "the one its index diverged on"}
	s.mu.Unlock()
	s.repairs.WithLabelValues(w.ID).Inc()
	s.requestSnapshot(WorkerToken(s.name(w)))
	s.log.Warn("the index diverged from the relay's digest on a worker read from JetStream; it resyncs from its gRPC stream until another snapshot object is written",
		"worker", w.ID, "snapshot_stream_sequence", seq)
}
