package natsevents

import (
	"testing"

	"github.com/kvrelay/kvrelay/gateway/monitor"
)

// deadAddr is a gRPC address nothing serves: a replica given it for a
// worker can have that worker's blocks only from NATS.
const deadAddr = "127.0.0.1:1"

// TestLateReplicaCatchesUpExactly: a replica that starts after the workers
// have been busy builds its index from the snapshot object and the stream's
// tail alone (its gRPC addresses are dead), and holds exactly what a
// replica following the same relays over gRPC holds, the engines' live
// sets; then it follows what comes next.
func TestLateReplicaCatchesUpExactly(t *testing.T) {
	js := startJetStream(t)
	a := startWorker(t, "a.example:50061", 2)
	b := startWorker(t, "b", 1)
	a.startSink(js.url)
	b.startSink(js.url)
	overGRPC := startReplica(t, "", monitor.Worker{ID: a.name, Addr: a.addr}, monitor.Worker{ID: b.name, Addr: b.addr})

	a.run(30)
	b.run(30)
	for _, w := range []*worker{a, b} {
		eventually(t, w.name+"'s first snapshot object", func() bool {
			return w.sinkCount("kvrelay_nats_events_snapshots_total", "result", "written") >= 1
		})
	}
	a.run(20) // a tail after the snapshot
	b.run(20)

	late := startReplica(t, js.url, monitor.Worker{ID: a.name, Addr: deadAddr}, monitor.Worker{ID: b.name, Addr: deadAddr})
	for _, w := range []*worker{a, b} {
		late.exact(w.name, w.eng, "late replica")
		overGRPC.exact(w.name, w.eng, "gRPC replica")
		if late.mode(w.name, "nats") != 1 || late.mode(w.name, "grpc") != 0 {
			t.Errorf("%s: kvrelay_gateway_events_source says nats=%v grpc=%v", w.name, late.mode(w.name, "nats"), late.mode(w.name, "grpc"))
		}
	}
	a.run(25)
	b.run(25)
	for _, w := range []*worker{a, b} {
		late.exact(w.name, w.eng, "late replica, later")
		overGRPC.exact(w.name, w.eng, "gRPC replica, later")
	}
}
