package natsevents

import (
	"bytes"
	"context"
	"math"
	"math/rand/v2"
	"runtime"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"google.golang.org/protobuf/proto"

	"github.com/kvrelay/kvrelay/gateway/index"
	"github.com/kvrelay/kvrelay/gateway/monitor"
	"github.com/kvrelay/kvrelay/proto/kvpb"
	"github.com/kvrelay/kvrelay/testkit/memstats"
	"github.com/kvrelay/kvrelay/testkit/testrelay"
)

// The hostile NATS clients of issue 29, against the JetStream events path:
// a client that can publish on a worker's subjects or write its snapshot
// object (NATS's permissions keep it off them in a deployment; these tests
// give it every right) forges snapshots, batches and announcements. Each
// must end held: the replica refuses what its worker's stream does not
// bear out, keeps the worker's blocks, follows the worker's gRPC stream
// meanwhile, and no forged block reaches the index.

// forger is a hostile NATS client with every right on the server.
type forger struct {
	t  testing.TB
	nc *nats.Conn
	js jetstream.JetStream
	// The forged blocks' hashes are forgedHash(base+i) for i below next:
	// told from the engine's by inverting forgedHash, so that the test
	// keeps no set of them (a flood's set would weigh more than the
	// heap ceiling the test holds the replica to).
	mu         sync.Mutex
	base, next uint64
}

// forgedMul is odd, so multiplying by it is a bijection of uint64, undone
// by its inverse modulo 2^64.
const forgedMul = 0x9e3779b97f4a7c15

var forgedMulInverse = func() uint64 {
	// Newton's iteration: each step doubles the correct low bits.
	x := uint64(forgedMul)
	for range 6 {
		x *= 2 - forgedMul*x
	}
	return x
}()

func forgedHash(k uint64) uint64 { return k * forgedMul }

func newForger(t testing.TB, url string) *forger {
	t.Helper()
	nc, js := jetStreamClient(t, url)
	return &forger{t: t, nc: nc, js: js, base: rand.Uint64() >> 2}
}

// stored is a Stored event of n forged blocks of one token each.
func (f *forger) stored(n int) *kvpb.KvCacheEvent {
	f.mu.Lock()
	defer f.mu.Unlock()
	blocks := make([]*kvpb.KvBlock, n)
	for i := range blocks {
		h := forgedHash(f.base + f.next)
		f.next++
		blocks[i] = &kvpb.KvBlock{BlockHash: int64(h), TokenIds: []uint32{uint32(i)}, BlockSize: 16}
	}
	return &kvpb.KvCacheEvent{Data: &kvpb.KvCacheEvent_Stored{Stored: &kvpb.KvBlocksStored{Blocks: blocks}}}
}

// planted counts the forged blocks in the index's live set of id.
func (f *forger) planted(ix *index.Index, id string) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	n := 0
	for _, b := range ix.LiveSet(id) {
		if k := b.EngineHash * forgedMulInverse; k >= f.base && k-f.base < f.next {
			n++
		}
	}
	return n
}

// publish stores b on the stream under subject.
func (f *forger) publish(subject string, b *kvpb.KvEventBatch) {
	f.t.Helper()
	data, err := proto.Marshal(b)
	if err != nil {
		f.t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), patience)
	defer cancel()
	if _, err := f.js.Publish(ctx, subject, data); err != nil {
		f.t.Fatal(err)
	}
}

// chunk is a forged snapshot chunk of rank 0.
func (f *forger) chunk(index, count uint32, blocks uint64, seq uint64, stored int) *kvpb.KvEventBatch {
	b := &kvpb.KvEventBatch{SequenceNumber: seq, DpRank: proto.Int32(0), Timestamp: float64(time.Now().UnixNano()) / 1e9,
		Snapshot: &kvpb.KvSnapshotChunk{Index: index, Count: count, Blocks: blocks}}
	if index == 0 {
		b.Events = append(b.Events, &kvpb.KvCacheEvent{Data: &kvpb.KvCacheEvent_Cleared{Cleared: &kvpb.KvCacheCleared{}}})
	}
	if stored > 0 {
		b.Events = append(b.Events, f.stored(stored))
	}
	return b
}

func (r *replica) rejected(id, reason string) float64 {
	return r.counter("kvrelay_gateway_events_rejected_total", map[string]string{"worker": id, "reason": reason})
}

// TestForgedStreamSnapshotsAreRefused: the probe of issue 29. A forger
// publishes on worker a's rank subject a snapshot chunk claiming 10 M
// blocks and 2³²−1 chunks, its cursor 2⁴⁰ ahead; the replica following a
// from JetStream must refuse it before it clears anything, keep a's blocks
// and keep applying a's real batches. Then a flood: chunk 0 and 100 chunks
// of 20,000 forged blocks each (the probe's chunks went on from chunk 0 and
// planted 480,000 blocks); no forged block may reach the index, and the
// heap may keep at most 16 MiB more after it (the stream purged first, so
// that the embedded server's copy of the flood is not counted; the peak,
// which includes it and the forger's messages, is logged). Without the
// guard, the
// first chunk clears the worker and sets its cursor ahead (the real
// batches are dropped as stale), and the flood plants its blocks.
func TestForgedStreamSnapshotsAreRefused(t *testing.T) {
	js, a := startPublishing(t, 30)
	r := startReplica(t, js.URL(), monitor.Worker{ID: a.name, Addr: a.addr})
	eventually(t, "the replica on JetStream", func() bool { return r.mode(a.name, "nats") == 1 })
	r.exact(a.name, a.eng, "before the forger")
	f := newForger(t, js.URL())
	subject := rankSubject(DefaultSubjectPrefix, WorkerToken(a.name), 0)

	f.publish(subject, f.chunk(0, math.MaxUint32, 10_000_000, 1<<40, 1000))
	eventually(t, "the forged chunk refused or applied", func() bool {
		return r.rejected(a.name, reasonChunkCount) >= 1 || f.planted(r.ix, a.name) > 0
	})
	if n := f.planted(r.ix, a.name); n != 0 {
		t.Fatalf("the forged chunk was applied: %d forged blocks in the index, %d rows in all (the engine %d)", n, len(r.ix.LiveSet(a.name)), len(testrelay.EngineLive(a.eng)))
	}
	r.exact(a.name, a.eng, "right after the forged chunk")
	a.run(10)
	r.exact(a.name, a.eng, "real batches after the forged chunk")

	// Back on JetStream (a snapshot object written past the forged chunk)
	// before the flood, so that the replica reads it.
	eventually(t, "the worker back on JetStream", func() bool {
		a.run(1)
		return r.mode(a.name, "nats") == 1
	})
	r.exact(a.name, a.eng, "back on JetStream")

	// The flood.
	const flood, perChunk = 100, 20_000
	before := memstats.Settled().HeapInuse
	var peak uint64
	sample := make(chan struct{})
	sampled := make(chan struct{})
	go func() {
		defer close(sampled)
		var m runtime.MemStats
		for {
			select {
			case <-sample:
				return
			case <-time.After(20 * time.Millisecond):
			}
			runtime.ReadMemStats(&m)
			peak = max(peak, m.HeapInuse)
		}
	}()
	begin := time.Now()
	f.publish(subject, f.chunk(0, math.MaxUint32, 10_000_000, 1<<40, perChunk))
	for i := 1; i <= flood; i++ {
		f.publish(subject, f.chunk(uint32(i), math.MaxUint32, 10_000_000, 1<<40+uint64(i), perChunk))
		if i%10 == 0 {
			a.run(1)
		}
	}
	took := time.Since(begin)
	// Real batches after the flood: the replica returns to JetStream on a
	// snapshot object written past the forged messages, and stays exact.
	// A step every 50 ms, not every poll: each step's batch stays in the
	// relay's history and the stream, noise in the heap read below.
	var stepped time.Time
	eventually(t, "the worker back on JetStream after the flood", func() bool {
		if time.Since(stepped) >= 50*time.Millisecond {
			a.run(1)
			stepped = time.Now()
		}
		return r.mode(a.name, "nats") == 1 && f.planted(r.ix, a.name) == 0
	})
	a.run(10)
	r.exact(a.name, a.eng, "after the flood")
	close(sample)
	<-sampled
	// The embedded server's copy of the flood (its store's cache) is in
	// this heap too, and is not the replica's: the stream is purged
	// before the heap is read (the checks above are done).
	ctx, cancel := context.WithTimeout(context.Background(), patience)
	defer cancel()
	st, err := openDefaultStream(ctx, t, js.URL())
	if err != nil {
		t.Fatal(err)
	}
	if err := st.Purge(ctx); err != nil {
		t.Fatal(err)
	}
	after := memstats.Settled().HeapInuse
	if n := f.planted(r.ix, a.name); n != 0 {
		t.Fatalf("%d forged blocks in the index after the flood", n)
	}
	refused := 0.0
	for _, reason := range rejectReasons {
		refused += r.rejected(a.name, reason)
	}
	const ceiling = 16 << 20
	grown := int64(after) - int64(before)
	peakGrown := int64(peak) - int64(before)
	t.Logf("flood of %d forged chunks (%d blocks each) in %v: %v refusals, heap %+d KiB after (peak %+d KiB), ceiling %d KiB",
		flood+1, perChunk, took.Round(time.Millisecond), refused, grown>>10, peakGrown>>10, ceiling>>10)
	if grown > ceiling {
		t.Errorf("the heap grew %d KiB over the flood, ceiling %d KiB", grown>>10, ceiling>>10)
	}
	if refused < 2 {
		t.Errorf("%v refusals: the replica did not read the flood", refused)
	}
}

// forgedObject is a consistent snapshot object of rank 0: n chunks of
// perChunk blocks, sequences ending at 1 (0, …, 0, 1), at stream sequence
// seq; each case breaks one thing of it.
func (f *forger) forgedObject(n, perChunk int, seq uint64) []*kvpb.KvEventBatch {
	chunks := make([]*kvpb.KvEventBatch, n)
	for i := range chunks {
		s := uint64(0)
		if i == n-1 {
			s = 1
		}
		chunks[i] = f.chunk(uint32(i), uint32(n), uint64(n*perChunk), s, perChunk)
	}
	return chunks
}

// putObject writes chunks as worker's snapshot object, its metadata
// saying stream sequence seq.
func (f *forger) putObject(worker string, seq uint64, chunks []*kvpb.KvEventBatch) {
	f.t.Helper()
	o := snapshotObject{StreamSeq: seq}
	for _, c := range chunks {
		enc, err := proto.Marshal(c)
		if err != nil {
			f.t.Fatal(err)
		}
		o.Chunks = append(o.Chunks, enc)
	}
	ctx, cancel := context.WithTimeout(context.Background(), patience)
	defer cancel()
	obs, err := f.js.ObjectStore(ctx, BucketFor(DefaultStream))
	if err != nil {
		f.t.Fatal(err)
	}
	meta := jetstream.ObjectMeta{Name: WorkerToken(worker), Metadata: map[string]string{streamSeqKey: strconv.FormatUint(seq, 10)}}
	if _, err := obs.Put(ctx, meta, bytes.NewReader(encodeSnapshot(o))); err != nil {
		f.t.Fatal(err)
	}
}

// TestForgedSnapshotObjectIsRefused: a forger overwrites worker a's
// snapshot object with one that breaks one of the guard's rules; a replica
// that starts then must refuse it (counted under the rule's reason), serve
// a from its gRPC stream, exact, with no forged block in its index. The
// control case, consistent with itself and the stream, is served: what
// only NATS's permissions stop. Without the guard every other case is
// served too, its forged blocks planted.
func TestForgedSnapshotObjectIsRefused(t *testing.T) {
	js, a := startPublishing(t, 30)
	f := newForger(t, js.URL())
	ctx, cancel := context.WithTimeout(context.Background(), patience)
	defer cancel()
	st, err := openDefaultStream(ctx, t, js.URL())
	if err != nil {
		t.Fatal(err)
	}
	info, err := st.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	last := info.State.LastSeq
	tests := []struct {
		name   string
		reason string // "": served (the control)
		seq    uint64 // the object's stream sequence (0: the stream's last)
		// maxBytes is the replica's MaxSnapshotBytes (0: the default).
		maxBytes uint64
		spoil    func(c []*kvpb.KvEventBatch) []*kvpb.KvEventBatch
	}{
		{name: "consistent (control)", spoil: func(c []*kvpb.KvEventBatch) []*kvpb.KvEventBatch { return c }},
		{name: "2^32-1 chunks and 10 M blocks", reason: reasonChunkCount, spoil: func(c []*kvpb.KvEventBatch) []*kvpb.KvEventBatch {
			for _, b := range c {
				b.Snapshot.Count, b.Snapshot.Blocks = math.MaxUint32, 10_000_000
			}
			return c
		}},
		{name: "blocks above the cap", reason: reasonBlocks, spoil: func(c []*kvpb.KvEventBatch) []*kvpb.KvEventBatch {
			for _, b := range c {
				b.Snapshot.Blocks = maxSnapshotBlocks + 1
			}
			return c
		}},
		{name: "a gap", reason: reasonChunkOrder, spoil: func(c []*kvpb.KvEventBatch) []*kvpb.KvEventBatch {
			return append(c[:1:1], c[2:]...)
		}},
		{name: "chunks out of order", reason: reasonChunkOrder, spoil: func(c []*kvpb.KvEventBatch) []*kvpb.KvEventBatch {
			c[1], c[2] = c[2], c[1]
			return c
		}},
		{name: "a chunk declaring another count", reason: reasonChunkCount, spoil: func(c []*kvpb.KvEventBatch) []*kvpb.KvEventBatch {
			c[2].Snapshot.Count++
			return c
		}},
		{name: "more blocks stored than declared", reason: reasonBlocksStored, spoil: func(c []*kvpb.KvEventBatch) []*kvpb.KvEventBatch {
			for _, b := range c {
				b.Snapshot.Blocks--
			}
			return c
		}},
		{name: "fewer blocks stored than declared", reason: reasonBlocksStored, spoil: func(c []*kvpb.KvEventBatch) []*kvpb.KvEventBatch {
			for _, b := range c {
				b.Snapshot.Blocks++
			}
			return c
		}},
		{name: "ranks descending", reason: reasonRanks, spoil: func(c []*kvpb.KvEventBatch) []*kvpb.KvEventBatch {
			c[0].DpRank, c[1].DpRank = proto.Int32(1), proto.Int32(1)
			c[1].SequenceNumber = 1
			return c
		}},
		{name: "sequences not consecutive", reason: reasonSequence, spoil: func(c []*kvpb.KvEventBatch) []*kvpb.KvEventBatch {
			c[len(c)-1].SequenceNumber = 5
			return c
		}},
		{name: "a cursor beyond the stream's newest batch", reason: reasonSequenceAhead, spoil: func(c []*kvpb.KvEventBatch) []*kvpb.KvEventBatch {
			for i, b := range c {
				b.SequenceNumber = 1<<40 + uint64(i)
			}
			return c
		}},
		{name: "a batch among the chunks", reason: reasonChunkOrder, spoil: func(c []*kvpb.KvEventBatch) []*kvpb.KvEventBatch {
			c[1].Snapshot = nil
			return c
		}},
		{name: "a stream sequence beyond the stream", reason: reasonObjectSequence, seq: 1 << 40, spoil: func(c []*kvpb.KvEventBatch) []*kvpb.KvEventBatch { return c }},
		{name: "larger than MaxSnapshotBytes", reason: reasonSize, maxBytes: 64 << 10, spoil: func(c []*kvpb.KvEventBatch) []*kvpb.KvEventBatch { return c }},
	}
	written := a.sinkCount("kvrelay_nats_events_snapshots_total", "result", "written")
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			seq := tc.seq
			if seq == 0 {
				seq = last
			}
			// 4 chunks of 2,000 blocks: 8,000 blocks, about 100 KiB.
			f.putObject(a.name, seq, tc.spoil(f.forgedObject(4, 2000, seq)))
			r := startReplicaWith(t, js.URL(), func(_ *monitor.Options, o *SourceOptions) { o.MaxSnapshotBytes = tc.maxBytes }, monitor.Worker{ID: a.name, Addr: a.addr})
			if tc.reason == "" {
				eventually(t, "the consistent object served", func() bool { return r.mode(a.name, "nats") == 1 && f.planted(r.ix, a.name) == 8000 })
				return
			}
			eventually(t, "the object refused or served", func() bool {
				return r.rejected(a.name, tc.reason) >= 1 || f.planted(r.ix, a.name) > 0
			})
			if n := f.planted(r.ix, a.name); n != 0 {
				t.Fatalf("the forged object was served: %d forged blocks in the index", n)
			}
			eventually(t, "the worker on gRPC", func() bool { return r.mode(a.name, "grpc") == 1 })
			r.exact(a.name, a.eng, "refused object, on gRPC")
			if n := f.planted(r.ix, a.name); n != 0 {
				t.Fatalf("%d forged blocks in the index", n)
			}
			// The refusal asked the sink for a new object: the next case
			// starts once it replaced the forged one.
			written++
			a.snapshotsWritten(int(written), "the object the refusal asked for")
		})
	}
}

// TestForgedAliveDoesNotKeepASilentSinkTrusted: worker a's sink stops (its
// relay and NATS stay up); a forger announces it alive every 100 ms, with
// a made-up incarnation, or with its real incarnation (read off the
// stream) and a stream sequence the stream does not hold for a. The
// replica must count the announcements as mismatched and still find the
// sink silent within its bound, and follow a's gRPC stream, exact. Without
// the check the forger keeps the sink trusted for as long as it runs, and
// the replica's index of a freezes.
func TestForgedAliveDoesNotKeepASilentSinkTrusted(t *testing.T) {
	for _, tc := range []struct {
		name   string
		reason string
		forge  func(real announcement, newest uint64) announcement
	}{
		{"a made-up incarnation", mismatchIncarnation, func(real announcement, newest uint64) announcement {
			real.Incarnation ^= 0x5eed
			real.LastSeq = newest
			return real
		}},
		{"a sequence the stream does not hold for the worker", mismatchSequence, func(real announcement, newest uint64) announcement {
			real.LastSeq = newest + 1000
			return real
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			js := startJetStream(t)
			a := startWorker(t, "a", 2)
			const every = 500 * time.Millisecond // a bound of 1.5 s
			stopSink := a.startSinkStoppable(js.URL(), func(o *SinkOptions) { o.SnapshotEvery = 100 * time.Millisecond; o.AliveEvery = every })
			a.run(15)
			a.snapshotsWritten(1, "the first snapshot object")
			r := startReplica(t, js.URL(), monitor.Worker{ID: a.name, Addr: a.addr})
			eventually(t, "the replica on JetStream", func() bool { return r.mode(a.name, "nats") == 1 })
			token := WorkerToken(a.name)
			var real announcement
			eventually(t, "an announcement of the sink taken", func() bool {
				r.src.alive.mu.Lock()
				defer r.src.alive.mu.Unlock()
				st := r.src.alive.sinks[token]
				if st != nil {
					real = st.last
				}
				return st != nil
			})
			a.run(5)
			r.exact(a.name, a.eng, "on JetStream")

			stopSink()
			stopped := time.Now()
			ctx, cancel := context.WithTimeout(context.Background(), patience)
			defer cancel()
			st, err := openDefaultStream(ctx, t, js.URL())
			if err != nil {
				t.Fatal(err)
			}
			newest, err := st.GetLastMsgForSubject(ctx, workerFilter(DefaultSubjectPrefix, token))
			if err != nil {
				t.Fatal(err)
			}
			f := newForger(t, js.URL())
			forged := tc.forge(real, newest.Sequence)
			fctx, fstop := context.WithCancel(context.Background())
			done := make(chan struct{})
			go func() {
				defer close(done)
				for sleep(fctx, 100*time.Millisecond) {
					_ = f.nc.Publish(aliveSubject(DefaultSubjectPrefix, token), encodeAnnouncement(forged))
				}
			}()
			defer func() { fstop(); <-done }()

			// Held for as long as the forger could keep a sink trusted
			// otherwise: the patience of every wait here.
			eventually(t, "the fallback to gRPC despite the forger", func() bool { return r.mode(a.name, "grpc") == 1 })
			fellBack := time.Since(stopped)
			bound := DefaultSilentIntervals * every
			t.Logf("fell back %v after the sink stopped (bound %v + a silence check every 250 ms), the forger announcing", fellBack.Round(time.Millisecond), bound)
			if got := r.counter("kvrelay_gateway_events_sink_silent_total", map[string]string{"worker": a.name}); got != 1 {
				t.Errorf("kvrelay_gateway_events_sink_silent_total = %v, want 1", got)
			}
			eventually(t, "the forged announcements counted", func() bool {
				return r.counter("kvrelay_gateway_events_announcements_mismatched_total", map[string]string{"sink": token, "reason": tc.reason}) >= 1
			})
			a.run(20)
			r.exact(a.name, a.eng, "sink stopped, forger announcing")
			if r.mode(a.name, "grpc") != 1 {
				t.Fatal("the worker went back to JetStream while its sink is stopped")
			}
		})
	}
}

// TestForgedStreamMessagesAreRefused: forged messages on worker a's rank
// subject that break the other rules of the stream: a batch whose rank is
// not its subject's, a batch 2^20+1 past its rank's last sequence, and
// snapshots with a gap, stopping short, or storing other than their
// declared blocks. Each is refused under its reason, the replica keeps
// a's blocks (no forged one in the index) and stays exact, then returns to
// JetStream on the sink's next object. Without the guard the batch of
// another rank and every snapshot are applied (forged blocks planted), and
// the jump is taken as a gap the stream can never fill.
func TestForgedStreamMessagesAreRefused(t *testing.T) {
	js, a := startPublishing(t, 30)
	r := startReplicaWith(t, js.URL(), func(_ *monitor.Options, o *SourceOptions) { o.ChunkWait = 500 * time.Millisecond },
		monitor.Worker{ID: a.name, Addr: a.addr})
	f := newForger(t, js.URL())
	token := WorkerToken(a.name)
	subject := rankSubject(DefaultSubjectPrefix, token, 0)
	newest := func(rank int32) uint64 {
		ctx, cancel := context.WithTimeout(context.Background(), patience)
		defer cancel()
		st, err := openDefaultStream(ctx, t, js.URL())
		if err != nil {
			t.Fatal(err)
		}
		m, err := st.GetLastMsgForSubject(ctx, rankSubject(DefaultSubjectPrefix, token, rank))
		if err != nil {
			t.Fatal(err)
		}
		h, err := batchHeader(m.Data)
		if err != nil {
			t.Fatal(err)
		}
		return h.GetSequenceNumber()
	}
	batch := func(rank int32, seq uint64) *kvpb.KvEventBatch {
		return &kvpb.KvEventBatch{SequenceNumber: seq, DpRank: proto.Int32(rank), Events: []*kvpb.KvCacheEvent{f.stored(100)}}
	}
	for _, tc := range []struct {
		name, reason string
		// forge gets the sequence of the stream's newest message of a
		// rank.
		forge func(newest func(rank int32) uint64)
	}{
		// Rank 1's next sequence, on rank 0's subject.
		{"a batch of another rank than its subject's", reasonRankSubject, func(newest func(int32) uint64) {
			f.publish(subject, batch(1, newest(1)+1))
		}},
		{"a batch 2^20+1 past its rank's last sequence", reasonSequenceAhead, func(newest func(int32) uint64) {
			f.publish(subject, batch(0, newest(0)+maxSequenceJump+1))
		}},
		{"a snapshot with a gap", reasonChunkOrder, func(func(int32) uint64) {
			f.publish(subject, f.chunk(0, 3, 300, 0, 100))
			f.publish(subject, f.chunk(2, 3, 300, 1, 100))
		}},
		{"a snapshot that stops short", reasonChunkIncomplete, func(func(int32) uint64) {
			f.publish(subject, f.chunk(0, 2, 200, 0, 100))
		}},
		{"a snapshot storing more than it declares", reasonBlocksStored, func(func(int32) uint64) {
			f.publish(subject, f.chunk(0, 2, 150, 0, 100))
			f.publish(subject, f.chunk(1, 2, 150, 1, 100))
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			eventually(t, "the replica on JetStream", func() bool {
				a.run(1)
				return r.mode(a.name, "nats") == 1
			})
			r.exact(a.name, a.eng, "before the forger")
			tc.forge(newest)
			eventually(t, "the forged message refused or applied", func() bool {
				return r.rejected(a.name, tc.reason) >= 1 || f.planted(r.ix, a.name) > 0
			})
			if n := f.planted(r.ix, a.name); n != 0 {
				t.Fatalf("the forged message was applied: %d forged blocks in the index", n)
			}
			r.exact(a.name, a.eng, "after the refusal")
			a.run(5)
			r.exact(a.name, a.eng, "real batches after the refusal")
		})
	}
}

// TestAnnouncementsOfUnknownSinksAreNotKept: a forger announces 200 sinks
// the stream holds nothing of. None is taken (a worker of that name would
// otherwise be trusted, and the tracker would grow with every name), and
// they are counted under one series, sink="other", not one per name.
func TestAnnouncementsOfUnknownSinksAreNotKept(t *testing.T) {
	js, a := startPublishing(t, 10)
	r := startReplica(t, js.URL(), monitor.Worker{ID: a.name, Addr: a.addr})
	f := newForger(t, js.URL())
	// The replica's subscription to the announcements is at the server
	// once a round trip after it is done.
	if err := r.src.nc.Flush(); err != nil {
		t.Fatal(err)
	}
	const forged = 200
	for i := range forged {
		msg := encodeAnnouncement(announcement{Incarnation: uint64(i), Pass: 1, LastSeq: 1, Every: time.Second})
		if err := f.nc.Publish(aliveSubject(DefaultSubjectPrefix, "forged-"+strconv.Itoa(i)), msg); err != nil {
			t.Fatal(err)
		}
	}
	if err := f.nc.Flush(); err != nil {
		t.Fatal(err)
	}
	// By sink, every reason together (a stream look-up that times out
	// on a loaded machine counts as unverifiable).
	mismatched := func(sink string) float64 {
		return r.counter("kvrelay_gateway_events_announcements_mismatched_total", map[string]string{"sink": sink})
	}
	// One announcement per name: each is checked once.
	eventually(t, "the forged announcements checked", func() bool { return mismatched(otherSink) >= forged })
	if n := r.counter("kvrelay_gateway_events_announcements_mismatched_total", map[string]string{"sink": otherSink, "reason": mismatchNoMessage}); n == 0 {
		t.Error("no announcement counted as of a sink the stream holds nothing of")
	}
	r.src.alive.mu.Lock()
	for token := range r.src.alive.sinks {
		if token != WorkerToken(a.name) {
			t.Errorf("an announcement of %s was taken", token)
		}
	}
	r.src.alive.mu.Unlock()
	if n := mismatched(otherSink); n != forged {
		t.Errorf("%v mismatches counted for %d announcements", n, forged)
	}
	if n := mismatched("forged-0"); n != 0 {
		t.Errorf("a series for a forged sink name: %v", n)
	}
}
