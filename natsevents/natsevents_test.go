package natsevents

import (
	"context"
	"fmt"
	"testing"

	"github.com/nats-io/nats.go/jetstream"
	"google.golang.org/protobuf/proto"

	"github.com/kvrelay/kvrelay/gateway/monitor"
	"github.com/kvrelay/kvrelay/proto/kvpb"
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
	a.startSink(js.URL())
	b.startSink(js.URL())
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

	late := startReplica(t, js.URL(), monitor.Worker{ID: a.name, Addr: deadAddr}, monitor.Worker{ID: b.name, Addr: deadAddr})
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

// TestRelayRestartPublishesNoDuplicates: a relay restarted on the same
// engine serves its history from the engine's replay again, and its sink
// publishes it again; the stream's duplicate window drops every batch it
// already holds, so the stream holds each engine batch once, and a replica
// that followed the stream across the restart neither resyncs nor holds a
// second copy of anything.
func TestRelayRestartPublishesNoDuplicates(t *testing.T) {
	js, a := startPublishing(t, 20)
	follower := startReplica(t, js.URL(), monitor.Worker{ID: a.name, Addr: deadAddr})
	follower.exact(a.name, a.eng, "before the restart")

	a.down()
	// The engine's replay answers the restarted relay only once its sink
	// has subscribed, so the primed history reaches the sink batch by
	// batch (re-published: duplicates), not as the relay's snapshot.
	a.holdReplay(nil)
	a.startRelay()
	a.startSink(js.URL())
	eventually(t, "the sink subscribed", func() bool { return a.rel.Status().Subscribers >= 1 })
	a.releaseReplay(nil)
	eventually(t, "the restarted relay primed", func() bool {
		for _, r := range a.rel.Status().Ranks {
			if r.Cursor == nil {
				return false
			}
		}
		return true
	})
	a.run(15)
	follower.exact(a.name, a.eng, "after the restart")
	if got := a.sinkCount("kvrelay_nats_events_published_total", "result", "duplicate"); got == 0 {
		t.Error("the restarted relay's sink published nothing the stream already held: the test did not exercise re-publication")
	}
	if got := follower.counter("kvrelay_gateway_resyncs_total", map[string]string{"worker": a.name, "reason": "publisher_restart"}); got != 0 {
		t.Errorf("the follower read the re-published history as %v publisher restarts (each clears its index)", got)
	}
	late := startReplica(t, js.URL(), monitor.Worker{ID: a.name, Addr: deadAddr})
	late.exact(a.name, a.eng, "a replica started after the restart")

	seen := map[string]int{}
	for _, b := range streamBatches(t, js.URL(), a.name) {
		if b.GetSnapshot() != nil {
			continue
		}
		seen[fmt.Sprintf("rank %d seq %d ts %v", b.GetDpRank(), b.GetSequenceNumber(), b.GetTimestamp())]++
	}
	if len(seen) == 0 {
		t.Fatal("the stream holds no batch of the worker")
	}
	for k, n := range seen {
		if n > 1 {
			t.Errorf("the stream holds %s %d times", k, n)
		}
	}
}

// streamBatches reads every message of worker on the stream.
func streamBatches(t *testing.T, url, worker string) []*kvpb.KvEventBatch {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), patience)
	defer cancel()
	filter := workerFilter(DefaultSubjectPrefix, WorkerToken(worker))
	st, err := openDefaultStream(ctx, t, url)
	if err != nil {
		t.Fatal(err)
	}
	info, err := st.Info(ctx, jetstream.WithSubjectFilter(filter))
	if err != nil {
		t.Fatal(err)
	}
	var want uint64
	for _, n := range info.State.Subjects {
		want += n
	}
	cons, err := st.OrderedConsumer(ctx, jetstream.OrderedConsumerConfig{FilterSubjects: []string{filter}})
	if err != nil {
		t.Fatal(err)
	}
	var out []*kvpb.KvEventBatch
	for uint64(len(out)) < want {
		msgs, err := cons.Fetch(int(want)-len(out), jetstream.FetchMaxWait(patience))
		if err != nil {
			t.Fatal(err)
		}
		for m := range msgs.Messages() {
			b := &kvpb.KvEventBatch{}
			if err := proto.Unmarshal(m.Data(), b); err != nil {
				t.Fatal(err)
			}
			out = append(out, b)
		}
		if msgs.Error() != nil {
			t.Fatal(msgs.Error())
		}
	}
	return out
}

// openDefaultStream connects to url (closed when the test ends) and opens
// the default stream.
func openDefaultStream(ctx context.Context, t *testing.T, url string) (jetstream.Stream, error) {
	t.Helper()
	_, jsc := jetStreamClient(t, url)
	return jsc.Stream(ctx, DefaultStream)
}
