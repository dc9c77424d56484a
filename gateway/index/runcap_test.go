package index

import (
	"fmt"
	"reflect"
	"sync/atomic"
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

// TestLocRoundTrip: every position a run can have packs into the reverse
// tables' 32 bits and back, never to noPos, up to the highest run id.
func TestLocRoundTrip(t *testing.T) {
	if maxRunID != 1<<24-2 || maxRunLen != 1<<posOffBits {
		t.Fatalf("maxRunID %d, maxRunLen %d: want 2^24-2 and 2^8", maxRunID, maxRunLen)
	}
	for _, run := range []uint32{1, 2, 12345, 1 << 20, maxRunID - 1, maxRunID} {
		for _, off := range []int{0, 1, 128, maxRunLen - 1} {
			l := makeLoc(run, off)
			if uint32(l) == noPos {
				t.Fatalf("run %d offset %d packs to noPos", run, off)
			}
			if l.run() != run || l.off() != off {
				t.Fatalf("run %d offset %d → %#x → run %d offset %d", run, off, uint32(l), l.run(), l.off())
			}
		}
	}
}

// capRuns sets the run cap to the run ids handed out so far: no new run id
// is handed out, and a new run takes a freed one or is refused.
func capRuns(ix *Index) {
	f := &ix.fw
	f.mu.Lock()
	f.maxRuns = f.nruns - 1
	f.mu.Unlock()
}

// TestRunCapLeavesBlocksOutAndCountsThem: at the run cap, a block that
// needs a new run, and the blocks new to the rank after it in the
// event, are not indexed (counted in UnindexedBlocks; the worker is not
// taken to hold them), while known blocks keep their filing and copies, and
// appends to existing runs and other workers' stores of filed blocks go on;
// removals of left-out blocks count as unknown; a freed run id is used
// again.
func TestRunCapLeavesBlocksOutAndCountsThem(t *testing.T) {
	ix := New(Options{BlockSize: 4, ShardBits: 1})
	ix.Apply("w1", batch(0, stored(chainBlocks(100, seq(1, 12))))) // a0 a1 a2: engine 101..103
	capRuns(ix)

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

	// Drop every reference to the run: its id is free, and a new chain
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

// TestRunArraysKeepNeighbours: a run's content and stamp arrays keep every
// position's content hash and stamp through growth from the smallest size
// class to maxRunLen, stamped (an index that prunes) or not, readers'
// arrays (the published body) included; arrays given back come back from
// the pool with stamps zero.
func TestRunArraysKeepNeighbours(t *testing.T) {
	for _, stamped := range []bool{false, true} {
		t.Run(fmt.Sprintf("stamped=%v", stamped), func(t *testing.T) {
			var f forward
			f.init(&arrayPool{}, stamped)
			f.mu.Lock()
			defer f.unlock()
			id, ok := f.newRun(0, 0, 1<<40, 1<<40, 1)
			if !ok {
				t.Fatal("no run")
			}
			r := f.run(id)
			stampOf := func(o int) uint32 { return 1000 + uint32(o)*7 }
			set := func(o int) {
				if stamped {
					atomic.StoreUint32(f.stampOf(r, o), stampOf(o)) // as a lookup does
				}
			}
			set(0)
			for o := 1; o < maxRunLen; o++ {
				f.appendPos(id, r, 1<<40+uint64(o), 1)
				set(o)
				b := r.body.Load()
				size := hsize(b.h, stamped)
				if size != bodySizes[bodyClass(size)] || size < o+1 || len(b.h) != arrLen(size, stamped) {
					t.Fatalf("after %d positions: %d words for %d positions", o+1, len(b.h), size)
				}
				if len(r.hs()) != o+1 || int(r.n) != o+1 {
					t.Fatalf("after %d positions: writer's length %d, readers' %d", o+1, len(r.hs()), r.n)
				}
				for p := 0; p <= o; p++ {
					if h := b.h[p]; h != 1<<40+uint64(p) || r.hs()[p] != h {
						t.Fatalf("after %d positions: content %d = %#x", o+1, p, h)
					}
					if stamped && *stampAt(b.h, size, p) != stampOf(p) {
						t.Fatalf("after %d positions: stamp %d = %d, want %d", o+1, p, *stampAt(b.h, size, p), stampOf(p))
					}
				}
				if want := len(b.h) * 8; f.bytes != want {
					t.Fatalf("forward.bytes %d for %d words, want %d", f.bytes, len(b.h), want)
				}
			}
			// A small run freed: its array goes to the pool, and the next run
			// of its size class gets it back, stamps cleared.
			id2, _ := f.newRun(0, 0, 2<<40, 2<<40, 1)
			r = f.run(id2)
			for o := range minBody {
				if o > 0 {
					f.appendPos(id2, r, 2<<40+uint64(o), 1)
				}
				set(o)
			}
			h := r.body.Load().h
			f.freeRun(id2)
			got := f.getArrays(minBody)
			if &got[0] != &h[0] {
				t.Fatal("the freed array was not reused; the test no longer covers reuse")
			}
			for o := range minBody {
				if stamped && *stampAt(got, minBody, o) != 0 {
					t.Fatalf("reused array: position %d stamp %d", o, *stampAt(got, minBody, o))
				}
			}
		})
	}
}
