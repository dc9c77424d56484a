package natsevents

import (
	"net"
	"testing"
	"time"

	"github.com/kvrelay/kvrelay/gateway/monitor"
	"github.com/kvrelay/kvrelay/internal/freeport"
)

// TestNATSUnavailableAtStart: a replica whose NATS does not answer follows
// its workers' gRPC streams, exactly, and says so; once NATS and the sinks
// are up and a snapshot newer than its outage is there, it moves to
// JetStream on its own and stays exact.
func TestNATSUnavailableAtStart(t *testing.T) {
	port := freeport.ForTest(t, 1)
	a := startWorker(t, "a", 2)
	r := startReplica(t, "nats://"+net.JoinHostPort("127.0.0.1", itoa(port)), monitor.Worker{ID: a.name, Addr: a.addr})
	a.run(20)
	r.exact(a.name, a.eng, "NATS down from the start")
	if r.mode(a.name, "grpc") != 1 || r.mode(a.name, "nats") != 0 {
		t.Fatalf("with NATS down the source gauge says grpc=%v nats=%v", r.mode(a.name, "grpc"), r.mode(a.name, "nats"))
	}

	js := startJetStreamOn(t, port)
	a.startSink(js.URL(), func(o *SinkOptions) { o.SnapshotEvery = 100 * time.Millisecond })
	a.run(10)
	eventually(t, "the replica on JetStream", func() bool { return r.mode(a.name, "nats") == 1 })
	a.run(10)
	r.exact(a.name, a.eng, "back on JetStream")
}

// TestNATSLostDuringRun: a replica on JetStream that loses NATS falls back
// to the gRPC streams (resuming from its cursors) and stays exact while
// the engines go on; when NATS returns, the sinks publish a snapshot and
// the replica goes back to JetStream, exact again.
func TestNATSLostDuringRun(t *testing.T) {
	js := startJetStream(t)
	a := startWorker(t, "a", 2)
	a.startSink(js.URL(), func(o *SinkOptions) { o.SnapshotEvery = 100 * time.Millisecond })
	a.run(15)
	a.snapshotsWritten(1, "the first snapshot object")
	r := startReplica(t, js.URL(), monitor.Worker{ID: a.name, Addr: a.addr})
	r.exact(a.name, a.eng, "on JetStream")
	if r.mode(a.name, "nats") != 1 {
		t.Fatalf("the replica does not follow JetStream: grpc=%v nats=%v", r.mode(a.name, "grpc"), r.mode(a.name, "nats"))
	}

	js.Stop()
	eventually(t, "the fallback to gRPC", func() bool { return r.mode(a.name, "grpc") == 1 })
	a.run(20)
	r.exact(a.name, a.eng, "NATS down")

	js.Restart()
	// The sink's resync re-publishes what the stream holds already; its
	// snapshot waits for a new batch on every rank, so the engine goes on.
	eventually(t, "the return to JetStream", func() bool {
		a.run(1)
		return r.mode(a.name, "nats") == 1
	})
	a.run(20)
	r.exact(a.name, a.eng, "NATS back")
	if got := a.sinkCount("kvrelay_nats_events_resyncs_total", "reason", "nats_down") + a.sinkCount("kvrelay_nats_events_resyncs_total", "reason", "publish_failed"); got == 0 {
		t.Error("the sink never resynced after NATS came back")
	}
}
