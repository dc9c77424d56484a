package index

import (
	"fmt"
	"math/rand/v2"
	"reflect"
	"testing"

	"github.com/google/go-cmp/cmp"
	"github.com/kvrelay/kvrelay/proto/kvpb"
)

// TestRevSlotIs12Bytes: a reverse slot holds its engine hash and a 32-bit
// position in 12 bytes (a uint64 key field would pad it to 16).
func TestRevSlotIs12Bytes(t *testing.T) {
	if n := reflect.TypeFor[rslot]().Size(); n != 12 {
		t.Fatalf("rslot is %d bytes, want 12", n)
	}
	rt := newRevTable(nil)
	if got, want := rt.bytes(), len(rt.slots)*14; got != want {
		t.Fatalf("bytes() = %d for %d slots, want %d (12 + 2 of metadata a slot)", got, len(rt.slots), want)
	}
	for _, k := range []uint64{0, 1, 1 << 32, 1<<32 - 1, ^uint64(0), 0x8000_0000_0000_0001} {
		i, _ := rt.upsert(k, uint32(k>>7), 1)
		if s := rt.slots[i]; s.key() != k || s.pos != uint32(k>>7) {
			t.Fatalf("slot of %#x reads key %#x pos %#x", k, s.key(), s.pos)
		}
	}
}

// TestPackLocRoundTrip: every position a shard can hand out packs into 32
// bits and back, never to noPos, for the smallest, default and largest
// shard counts; the run cap is what the 24-shardBits run bits allow.
func TestPackLocRoundTrip(t *testing.T) {
	for _, sb := range []uint8{1, defaultShardBits, 12} {
		maxRuns := maxRunsFor(sb)
		if want := 1<<(24-int(sb)) - 1; maxRuns != want {
			t.Fatalf("sb %d: maxRunsFor = %d, want %d", sb, maxRuns, want)
		}
		for _, run := range []uint32{0, 1, 12345 % uint32(maxRuns), uint32(maxRuns) - 1} {
			for _, sh := range []int{0, 1<<sb - 1, (1 << sb) / 3} {
				for _, off := range []int{0, 1, maxRunLen - 1} {
					l := makeLoc(sh, run, off)
					p := packLoc(l, sb)
					if p == noPos {
						t.Fatalf("sb %d: %v packs to noPos", sb, l)
					}
					if back := unpackLoc(p, sb); back != l {
						t.Fatalf("sb %d: run %d shard %d off %d → %#x → run %d shard %d off %d",
							sb, run, sh, off, p, back.run(), back.shard(), back.off())
					}
				}
			}
		}
	}
}

// capShards sets every shard's run cap to the runs it has now: no new run
// can start until one is freed.
func capShards(ix *Index) {
	for i := range ix.shards {
		sh := &ix.shards[i]
		sh.mu.Lock()
		sh.maxRuns = sh.runsUsed
		sh.mu.Unlock()
	}
}

// TestRunCapLeavesBlocksOutAndCountsThem: at a shard's run cap, a block that
// needs a new run there, and the blocks new to the rank after it in the
// event, are not indexed (counted in UnindexedBlocks; the worker is not
// taken to hold them), while known blocks keep their filing and copies, and
// appends to existing runs and other workers' stores of filed blocks go on;
// removals of left-out blocks count as unknown; a freed run number is used
// again.
func TestRunCapLeavesBlocksOutAndCountsThem(t *testing.T) {
	ix := New(Options{BlockSize: 4, ShardBits: 1})
	ix.Apply("w1", batch(0, stored(chainBlocks(100, seq(1, 12))))) // a0 a1 a2: engine 101..103
	capShards(ix)

	// A branch after a0 needs a run of its own: c1 (201) and c2 (202) are
	// left out; the known a2 (103) later in the same event stays filed and
	// gains its copy; the new 203 after it is left out too.
	branch := append(append(seq(1, 4), 90, 91, 92, 93), 94, 95, 96, 97)
	ix.Apply("w1", batch(0, stored([]*kvpb.KvBlock{blk(201, 90, 91, 92, 93), blk(202, 94, 95, 96, 97), blk(103, 9, 10, 11, 12), blk(203, 80, 81, 82, 83)}, withParent(101))))
	// The same engine hash twice in one event, its first filing refused.
	ix.Apply("w1", batch(0, stored([]*kvpb.KvBlock{blk(301, 70, 71, 72, 73), blk(301, 70, 71, 72, 73)})))
	// Appending to a0..a2's run needs no new run.
	ix.Apply("w1", batch(0, stored(chainBlocks(103, seq(13, 20)), withParent(103)))) // a3 a4: 104, 105
	// Another worker's store of filed blocks needs no new run either.
	ix.Apply("w2", batch(0, stored(chainBlocks(500, seq(1, 8)))))

	st := ix.Stats()
	if got := st.Workers["w1"].Counters.UnindexedBlocks; got != 5 {
		t.Errorf("w1 UnindexedBlocks = %d, want 5 (201, 202, 203, 301 twice)", got)
	}
	if got := st.Workers["w2"].Counters.UnindexedBlocks; got != 0 {
		t.Errorf("w2 UnindexedBlocks = %d, want 0", got)
	}
	var held []uint64
	for _, b := range ix.LiveSet("w1") {
		held = append(held, b.EngineHash)
	}
	if diff := cmp.Diff([]uint64{101, 102, 103, 104, 105}, held); diff != "" {
		t.Errorf("w1's live set (-want +got):\n%s", diff)
	}
	if c := ix.LiveSet("w1"); c[2].Copies != 2 {
		t.Errorf("a2 (103) has %d copies, want 2 (stored twice)", c[2].Copies)
	}
	for _, tc := range []struct {
		name   string
		tokens []uint32
		want   map[WorkerID]int
	}{
		{"the filed chain", seq(1, 20), map[WorkerID]int{"w1": 5, "w2": 2}},
		{"the refused branch", branch, map[WorkerID]int{"w1": 1, "w2": 1}},
		{"the refused chain", seq(70, 73), map[WorkerID]int{}},
	} {
		if diff := cmp.Diff(tc.want, matchMap(ix.FindMatches(tc.tokens, Namespace{}))); diff != "" {
			t.Errorf("%s: matches (-want +got):\n%s", tc.name, diff)
		}
	}
	if st.Memberships != 7 {
		t.Errorf("memberships = %d, want 7", st.Memberships)
	}

	ix.Apply("w1", batch(0, removed(unspec, 201, 203, 301)))
	if got := ix.Stats().Workers["w1"].Counters.UnknownRemovals; got != 3 {
		t.Errorf("removals of left-out blocks: UnknownRemovals = %d, want 3", got)
	}

	// Drop every reference to the run: its number is free, and a new chain
	// takes it although the cap has not moved.
	ix.Apply("w1", batch(0, removed(unspec, 101, 102, 103, 103, 104, 105)))
	ix.Apply("w2", batch(0, removed(unspec, 501, 502)))
	ix.Apply("w3", batch(0, stored(chainBlocks(700, seq(70, 77)))))
	if got := ix.Stats().Workers["w3"].Counters.UnindexedBlocks; got != 0 {
		t.Fatalf("after a run was freed: w3 UnindexedBlocks = %d, want 0", got)
	}
	if diff := cmp.Diff(map[WorkerID]int{"w3": 2}, matchMap(ix.FindMatches(seq(70, 77), Namespace{}))); diff != "" {
		t.Errorf("after a run was freed (-want +got):\n%s", diff)
	}
}

// TestRunBodyLayoutKeepsNeighbours: a run's arrays keep every position's
// prefix hash, holder word and stamp apart (stamps live past the holders'
// length in the same slice), through growth from the smallest size class to
// maxRunLen, stamped (an index that prunes) or not; a reused body comes
// back with holders and stamps zero.
func TestRunBodyLayoutKeepsNeighbours(t *testing.T) {
	for _, stamped := range []bool{false, true} {
		t.Run(fmt.Sprintf("stamped=%v", stamped), func(t *testing.T) {
			const sb = 6
			var s shard
			s.init(maxRunsFor(sb), &arrayPool{})
			idx, ok := s.newRunFor(1<<40, stamped, sb, 1)
			if !ok {
				t.Fatal("no run")
			}
			r := s.runAt(idx)
			holdOf := func(o int) uint32 { return uint32(o)*2 + 1 } // inline holder o
			stampOf := func(o int) uint32 { return 1000 + uint32(o)*7 }
			set := func(o int) {
				b := r.body.Load()
				b.setHold(o, holdOf(o))
				if stamped {
					b.setStamp(o, stampOf(o))
				}
			}
			set(0)
			for o := 1; o < maxRunLen; o++ {
				s.appendPos(r, 1<<40+uint64(o))
				set(o)
				b := r.body.Load()
				if b.stamped() != stamped || b.size()%4 != 0 || b.size() < o+1 {
					t.Fatalf("after %d positions: size %d, stamped %v", o+1, b.size(), b.stamped())
				}
				for p := 0; p <= o; p++ {
					if h := b.hash(p); h != 1<<40+uint64(p) {
						t.Fatalf("after %d positions: hash(%d) = %#x", o+1, p, h)
					}
					if h := b.loadHold(p); h != holdOf(p) || b.hold(p) != h {
						t.Fatalf("after %d positions: hold(%d) = %d, want %d", o+1, p, h, holdOf(p))
					}
					if stamped && b.loadStamp(p) != stampOf(p) {
						t.Fatalf("after %d positions: stamp(%d) = %d, want %d", o+1, p, b.loadStamp(p), stampOf(p))
					}
				}
				if wantBytes := b.size() * 12; !stamped && bodyBytes(b) != wantBytes || stamped && bodyBytes(b) != wantBytes+b.size()*4 {
					t.Fatalf("bodyBytes %d for size %d", bodyBytes(b), b.size())
				}
			}
			// A small run freed: its body goes to the spares, and the next
			// run of its size class gets it back cleared.
			idx2, _ := s.newRunFor(2<<40, stamped, sb, 1)
			r = s.runAt(idx2)
			for o := range minBody {
				if o > 0 {
					s.appendPos(r, 2<<40+uint64(o))
				}
				set(o)
			}
			b := r.body.Load()
			for o := range minBody {
				b.setHold(o, 0)
			}
			s.freeRun(idx2, sb)
			got := s.getBody(minBody, stamped)
			if got != b {
				t.Fatal("the freed body was not reused; the test no longer covers reuse")
			}
			for o := range minBody {
				if got.hold(o) != 0 || stamped && got.loadStamp(o) != 0 {
					t.Fatalf("reused body: position %d holder %d stamp %d", o, got.hold(o), got.loadStamp(o))
				}
			}
		})
	}
}

// TestHeadFilterKeepsEveryHead: through runs started and freed at random
// (the heads table growing, heads deleted by backward shift), the shard's
// head filter has the bit of every live head, so tryHasHead and headLoc
// never miss one; it is rebuilt before its stale bits outnumber the heads,
// and it lets at most a fifth of non-heads through to the table's probe.
func TestHeadFilterKeepsEveryHead(t *testing.T) {
	const sb = 6
	ix := New(Options{ShardBits: sb})
	s := &ix.shards[0]
	rng := rand.New(rand.NewPCG(21, 21))
	live := map[uint64]uint32{} // head → run
	var heads []uint64
	check := func(step int) {
		t.Helper()
		for h, idx := range live {
			if has, ok := s.tryHasHead(h, sb); !ok || !has {
				t.Fatalf("step %d: tryHasHead(%#x) = %v, %v; want a head", step, h, has, ok)
			}
			if l, ok := ix.headLoc(0, h); !ok || l.run() != idx {
				t.Fatalf("step %d: headLoc(%#x) = run %d, %v; want run %d", step, h, l.run(), ok, idx)
			}
		}
		if bound := staleBound(s.heads, s.tab.Load().n); s.filterStale > bound {
			t.Fatalf("step %d: %d stale bits for %d heads (bound %d)", step, s.filterStale, s.heads, bound)
		}
	}
	for step := range 30000 {
		if len(heads) == 0 || rng.IntN(100) < 55 {
			h := rng.Uint64() >> sb // shard 0: its top bits are zero
			if _, dup := live[h]; dup {
				continue
			}
			idx, ok := s.newRunFor(h, false, sb, 1)
			if !ok {
				t.Fatal("run cap")
			}
			live[h] = idx
			heads = append(heads, h)
		} else {
			k := rng.IntN(len(heads))
			h := heads[k]
			heads[k] = heads[len(heads)-1]
			heads = heads[:len(heads)-1]
			s.freeRun(live[h], sb)
			delete(live, h)
		}
		if step%3000 == 0 {
			check(step)
		}
	}
	check(30000)
	through := 0
	const probes = 20000
	for range probes {
		if s.filter.Load().mayHave(rng.Uint64() >> sb) {
			through++
		}
	}
	if through > probes/5 {
		t.Errorf("the filter let %d of %d non-heads through (%d heads)", through, probes, len(live))
	}
}

// A shard whose heads drained after a peak keeps its peak-sized table; the
// filter must not be rebuilt (a scan of that whole table) every few
// deletions there: each rebuild is paid for by a quarter of the table's
// slots in deletions.
func TestHeadFilterRebuildsStayAmortizedInADrainedShard(t *testing.T) {
	const sb = 6
	ix := New(Options{ShardBits: sb})
	s := &ix.shards[0]
	rng := rand.New(rand.NewPCG(5, 8))
	var runs []uint32
	var heads []uint64
	for range 100_000 {
		h := rng.Uint64() >> sb
		idx, ok := s.newRunFor(h, false, sb, 1)
		if !ok {
			t.Fatal("run cap")
		}
		runs, heads = append(runs, idx), append(heads, h)
	}
	for _, idx := range runs {
		s.freeRun(idx, sb)
	}
	slots := s.tab.Load().n
	const cycles = 9000
	rebuilds := 0
	f := s.filter.Load()
	for range cycles {
		h := rng.Uint64() >> sb
		idx, ok := s.newRunFor(h, false, sb, 1)
		if !ok {
			t.Fatal("run cap")
		}
		s.freeRun(idx, sb)
		if g := s.filter.Load(); g != f {
			rebuilds, f = rebuilds+1, g
		}
	}
	if most := cycles/(slots/4) + 1; rebuilds > most {
		t.Errorf("%d filter rebuilds of a %d-slot table in %d start-and-free cycles, want at most %d", rebuilds, slots, cycles, most)
	}
}
