package natsevents

import (
	"fmt"
	"slices"
	"testing"

	"github.com/kvrelay/kvrelay/gateway/monitor"
	"github.com/kvrelay/kvrelay/proto/kvpb"
	relaypkg "github.com/kvrelay/kvrelay/relay"
	"github.com/kvrelay/kvrelay/sim"
	"github.com/kvrelay/kvrelay/testkit/testrelay"
)

// TestMultiChunkSnapshotReachesTheStreamWhole: a sink whose relay no
// longer holds every rank from sequence 0 is served a snapshot of several
// chunks through its subscription, as raw bytes. Every chunk must be
// stored (none dropped as a duplicate of another chunk), the snapshot
// object must not be cut while the chunks arrive (a replica would start
// from it inside the snapshot, after its first chunk), and replicas must
// end with exactly the engine's live set: a late one built from the
// object, and one that follows the stream while a restarted sink
// publishes its snapshot again.
func TestMultiChunkSnapshotReachesTheStreamWhole(t *testing.T) {
	for _, tc := range []struct {
		name     string
		history  int // relay history window, in batches
		capacity int // blocks per rank
		// fill runs the engine until its history no longer holds every
		// rank from sequence 0.
		fill func(t *testing.T, e *sim.Engine, tok *uint32)
		// sharedSeqs: at least two chunks of one rank carry the same
		// sequence (more chunks than the rank has sequences).
		sharedSeqs bool
	}{
		{
			// Each rank's chunks carry sequences of their own.
			name: "a sequence per chunk", history: 4, capacity: 4096,
			fill: func(t *testing.T, e *sim.Engine, tok *uint32) {
				for range 5 {
					step(t, e, sim.Request{Rank: 0, Tokens: tokens(tok, 600)}, sim.Request{Rank: 1, Tokens: tokens(tok, 600)})
				}
			},
		},
		{
			// Rank 0 published one batch larger than a chunk can hold
			// (its cursor is 0), then rank 1 pushed it out of the
			// history: rank 0's chunks are all stamped sequence 0.
			name: "more chunks than sequences", history: 2, capacity: 70_000, sharedSeqs: true,
			fill: func(t *testing.T, e *sim.Engine, tok *uint32) {
				step(t, e, sim.Request{Rank: 0, Tokens: tokens(tok, 60_000)})
				step(t, e, sim.Request{Rank: 1, Tokens: tokens(tok, 1100)})
				step(t, e, sim.Request{Rank: 1, Tokens: tokens(tok, 1100)})
			},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Setenv(relaypkg.EnvHistoryBatches, itoa(tc.history))
			js := startJetStream(t)
			w := &worker{t: t, name: "chunky", eng: testrelay.StartEngine(t, 2, tc.capacity), dpSize: 2, addr: "127.0.0.1:0"}
			t.Cleanup(w.down)
			w.startRelay()
			overGRPC := startReplica(t, "", monitor.Worker{ID: w.name, Addr: w.addr})

			// Token ids above 2^28 take five bytes each, so that a chunk
			// holds fewer blocks in the "more chunks" case.
			tok := uint32(1 << 30)
			tc.fill(t, w.eng, &tok)
			overGRPC.exact(w.name, w.eng, "the gRPC replica, before the sink")

			// What a subscriber from zero gets now: the engine is idle,
			// so the sink's subscription is served the same chunks.
			chunks := w.rel.Snapshot()
			checkChunkShape(t, chunks, tc.sharedSeqs)

			stopSink := w.startSinkStoppable(js.URL())
			waitPass(t, w, len(chunks))
			checkStreamSnapshots(t, js.URL(), w.name, len(chunks), 1)

			late := startReplica(t, js.URL(), monitor.Worker{ID: w.name, Addr: deadAddr})
			// A batch after the snapshot, so that the exact state is the
			// one after the stream's tail (the object alone can match the
			// engine for a moment, before the replica reads the tail).
			step(t, w.eng, sim.Request{Rank: 0, Tokens: tokens(&tok, 3)}, sim.Request{Rank: 1, Tokens: tokens(&tok, 3)})
			late.exact(w.name, w.eng, "a late replica, from the snapshot object and the stream")

			// A new sink pass publishes the snapshot again, into the
			// stream the late replica follows.
			stopSink()
			w.startSinkStoppable(js.URL())
			waitPass(t, w, len(chunks))
			checkStreamSnapshots(t, js.URL(), w.name, len(chunks), 2)
			// A batch after the second snapshot: the replica applies the
			// stream in order, so holding it means it applied the chunks.
			step(t, w.eng, sim.Request{Rank: 0, Tokens: tokens(&tok, 3)}, sim.Request{Rank: 1, Tokens: tokens(&tok, 3)})
			late.exact(w.name, w.eng, "the replica following the stream across the second snapshot")
			overGRPC.exact(w.name, w.eng, "the gRPC replica, at the end")
			if st := late.mon.Workers(); len(st) != 1 || st[0].Snapshot {
				t.Errorf("the replica's monitor still waits for snapshot chunks: %+v", st)
			}
		})
	}
}

// waitPass waits until the current sink's pass has had an answer for each
// of its snapshot's n chunks and wrote its snapshot object.
func waitPass(t *testing.T, w *worker, n int) {
	t.Helper()
	eventually(t, fmt.Sprintf("answers to the %d snapshot chunks and the snapshot object", n), func() bool {
		return w.sinkCount("kvrelay_nats_events_published_total", "result", "stored")+
			w.sinkCount("kvrelay_nats_events_published_total", "result", "duplicate") >= float64(n) &&
			w.sinkCount("kvrelay_nats_events_snapshots_total", "result", "written") >= 1
	})
}

// checkChunkShape checks that the scenario exercises what it means to: at
// least two chunks per rank, and with sharedSeqs two chunks of one rank at
// one sequence.
func checkChunkShape(t *testing.T, chunks []*kvpb.KvEventBatch, sharedSeqs bool) {
	t.Helper()
	perRank := map[int32]int{}
	seqs := map[string]int{}
	shared := false
	for _, c := range chunks {
		perRank[c.GetDpRank()]++
		k := fmt.Sprint(c.GetDpRank(), "/", c.GetSequenceNumber())
		seqs[k]++
		shared = shared || seqs[k] > 1
	}
	if len(perRank) != 2 {
		t.Fatalf("the snapshot holds chunks of %d ranks, want 2", len(perRank))
	}
	for rank, n := range perRank {
		if n < 2 {
			t.Fatalf("rank %d has %d chunk(s): the scenario does not make a multi-chunk snapshot", rank, n)
		}
	}
	if shared != sharedSeqs {
		t.Fatalf("chunks sharing a rank's sequence: %v, want %v (rank/sequence counts %v)", shared, sharedSeqs, seqs)
	}
}

// checkStreamSnapshots checks that the stream holds passes snapshots of
// worker, each with every one of its n chunks exactly once. A snapshot's
// chunks share the timestamp its stream was planned at.
func checkStreamSnapshots(t *testing.T, url, worker string, n, passes int) {
	t.Helper()
	byStamp := map[float64][]uint32{}
	for _, b := range streamBatches(t, url, worker) {
		if s := b.GetSnapshot(); s != nil {
			if int(s.GetCount()) != n {
				t.Errorf("a chunk says its snapshot has %d chunks, the relay's has %d", s.GetCount(), n)
			}
			byStamp[b.GetTimestamp()] = append(byStamp[b.GetTimestamp()], s.GetIndex())
		}
	}
	if len(byStamp) != passes {
		t.Errorf("the stream holds %d snapshots, want %d", len(byStamp), passes)
	}
	want := make([]uint32, n)
	for i := range want {
		want[i] = uint32(i)
	}
	for ts, got := range byStamp {
		slices.Sort(got)
		if !slices.Equal(got, want) {
			t.Errorf("the snapshot stamped %v is stored as chunks %v, want each of 0..%d once", ts, got, n-1)
		}
	}
}

func step(t *testing.T, e *sim.Engine, reqs ...sim.Request) {
	t.Helper()
	if _, err := e.Step(reqs...); err != nil {
		t.Fatal(err)
	}
}

// tokens is a prompt of blocks 16-token blocks no other prompt shares.
func tokens(next *uint32, blocks int) []uint32 {
	out := make([]uint32, 16*blocks)
	for i := range out {
		out[i] = *next
		*next++
	}
	return out
}
