package natsevents

import (
	"bytes"
	"context"
	"strconv"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"google.golang.org/protobuf/proto"

	"github.com/kvrelay/kvrelay/gateway/monitor"
	"github.com/kvrelay/kvrelay/proto/kvpb"
)

// spoilSnapshot rewrites worker's snapshot object with rank's blocks left
// out (its chunks kept, their events dropped, the block total the chunks
// declare lowered to match), at the same stream sequence: what a sink
// that wrote a cut hiding a rank left behind. (An object whose chunks
// store other than their declared total is refused before it is applied:
// TestForgedSnapshotObjectIsRefused.)
func spoilSnapshot(t *testing.T, url, worker string, rank int32) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), patience)
	defer cancel()
	_, jsc := jetStreamClient(t, url)
	obs, err := jsc.ObjectStore(ctx, BucketFor(DefaultStream))
	if err != nil {
		t.Fatal(err)
	}
	data, err := obs.GetBytes(ctx, WorkerToken(worker))
	if err != nil {
		t.Fatal(err)
	}
	o, err := decodeSnapshot(data)
	if err != nil {
		t.Fatal(err)
	}
	dropped, droppedBlocks := 0, uint64(0)
	chunks := make([]*kvpb.KvEventBatch, len(o.Chunks))
	for i, c := range o.Chunks {
		b := &kvpb.KvEventBatch{}
		if err := proto.Unmarshal(c, b); err != nil {
			t.Fatal(err)
		}
		chunks[i] = b
		if b.GetDpRank() != rank {
			continue
		}
		dropped += len(b.Events)
		droppedBlocks += storedBlocks(b)
		b.Events = nil
	}
	if dropped == 0 {
		t.Fatalf("the snapshot of %s holds no event of rank %d to leave out", worker, rank)
	}
	for i, b := range chunks {
		b.Snapshot.Blocks -= droppedBlocks
		if o.Chunks[i], err = proto.Marshal(b); err != nil {
			t.Fatal(err)
		}
	}
	meta := jetstream.ObjectMeta{Name: WorkerToken(worker), Metadata: map[string]string{streamSeqKey: strconv.FormatUint(o.StreamSeq, 10)}}
	if _, err := obs.Put(ctx, meta, bytes.NewReader(encodeSnapshot(o))); err != nil {
		t.Fatal(err)
	}
}

// TestDivergenceRepairsFromGRPC is issue 30's second fault: a replica
// applied a snapshot object that leaves a rank out; the live digest shows
// the divergence, and the resync must not read the same object again (it
// would stay wrong until the sink's next object) but the relay's gRPC
// stream, which is exact, and ask the sink for a new object (SnapshotEvery
// is an hour), on which the worker returns to JetStream.
func TestDivergenceRepairsFromGRPC(t *testing.T) {
	js, a := startPublishing(t, 30)
	spoilSnapshot(t, js.URL(), a.name, 1)

	r := startReplica(t, js.URL(), monitor.Worker{ID: a.name, Addr: a.addr})
	eventually(t, "the replica on JetStream", func() bool { return r.mode(a.name, "nats") == 1 })
	begin := time.Now()
	// Batches with the relay's live digests, until the replica checks one
	// of rank 1's (at most one check a second) and finds it short.
	eventually(t, "the divergence on rank 1 found", func() bool {
		a.stepRank(1, 1)
		return r.counter("kvrelay_gateway_events_repairs_total", map[string]string{"worker": a.name}) >= 1
	})
	r.exact(a.name, a.eng, "after the divergence")
	t.Logf("exact %v after the first batches past the spoilt snapshot", time.Since(begin).Round(time.Millisecond))
	if got := r.counter("kvrelay_gateway_events_repairs_total", map[string]string{"worker": a.name}); got != 1 {
		t.Errorf("kvrelay_gateway_events_repairs_total = %v, want 1", got)
	}
	if got := r.counter("kvrelay_gateway_digest_divergences_total", map[string]string{"worker": a.name, "rank": "1"}); got < 1 {
		t.Errorf("no divergence counted on rank 1 (%v): the test did not exercise the repair", got)
	}
	// The replica asked the sink for a new object, and returns to
	// JetStream on it.
	a.snapshotsWritten(2, "a new snapshot object on request")
	eventually(t, "the worker back on JetStream", func() bool { return r.mode(a.name, "nats") == 1 })
	a.run(10)
	r.exact(a.name, a.eng, "after the repair, later")
	if got := r.counter("kvrelay_gateway_events_repairs_total", map[string]string{"worker": a.name}); got != 1 {
		t.Errorf("kvrelay_gateway_events_repairs_total = %v after the return, want 1", got)
	}
}
