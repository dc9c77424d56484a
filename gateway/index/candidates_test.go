package index

import (
	"fmt"
	"math/bits"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/google/go-cmp/cmp"
	"github.com/kvrelay/kvrelay/proto/kvpb"
)

// A fleet of 10,000 worker slots in which 16 workers, spread over the slot
// range (both ends, word boundaries), hold the queried prefixes: the holder
// bitsets are 157 words wide and the walk keeps only the few live ones. The
// matches must equal the model's through stores, removals (holes), clears and
// worker removal, which take the candidates from many words to few, to one
// and to none.
func TestSparseCandidatesAgainstModelAtLargeFleet(t *testing.T) {
	const fleet = 10_000
	holderSlots := []int{0, 1, 63, 64, 127, 130, 1000, 2047, 2048, 4095, 5000, 6001, 7777, 9000, 9998, 9999}
	rng := rand.New(rand.NewPCG(19, 4))
	c := newCorpus(rng, 8)
	ix := New(Options{BlockSize: 4, ShardBits: 2})
	// Every worker takes a slot, in order, by storing one block of its own that
	// no query contains; the model leaves these out, as they match nothing.
	for i := range fleet {
		ix.Apply(fmt.Sprintf("w%05d", i), batch(0, stored([]*kvpb.KvBlock{blk(int64(1<<40+i), 100_000+uint32(i), 1, 2, 3)})))
	}
	ref := newRefModel()
	var holders []WorkerID
	for _, s := range holderSlots {
		holders = append(holders, WorkerID(fmt.Sprintf("w%05d", s)))
	}
	lookups, multi := 0, 0
	for op := range 3000 {
		w := holders[rng.IntN(len(holders))]
		r := int32(rng.IntN(2))
		switch x := rng.IntN(100); {
		case x < 65:
			b := c.storeBatch(rng, r)
			ix.Apply(w, b)
			ref.apply(w, b)
		case x < 97:
			b := c.removeBatch(rng, r)
			ix.Apply(w, b)
			ref.apply(w, b)
		case x < 99:
			b := batch(r, cleared())
			ix.Apply(w, b)
			ref.apply(w, b)
		default:
			// Drop the worker's held blocks but keep its slot.
			ix.ClearWorker(w)
			delete(ref.workers, w)
		}
		q, ns := c.query(rng)
		want := ref.find(q, 4, ns)
		got := matchMap(ix.FindMatches(q, ns))
		if op%3 == 0 {
			got = matchMap(ix.FindMatchesContent(ContentHashes(q, 4, ns.Seed())))
		}
		if diff := cmp.Diff(want, got); diff != "" {
			t.Fatalf("op %d: matches (-model +index):\n%s", op, diff)
		}
		lookups++
		if len(want) > 1 {
			multi++
		}
	}
	// The comparison is only as good as the lookups that had several
	// candidates to narrow.
	if multi < lookups/4 {
		t.Fatalf("only %d of %d lookups matched more than one worker", multi, lookups)
	}
}

// slabOf builds a slab of bitsets, each words wide, with the given slots set.
func slabOf(words int, sets ...[]uint32) *slab {
	sl := &slab{w: make([]uint64, words*len(sets)), words: words}
	for i, s := range sets {
		for _, id := range s {
			sl.w[i*words+int(id>>6)] |= 1 << (id & 63)
		}
	}
	return sl
}

// setWord is the holder word naming slab bitset i.
func setWord(i int) uint32 { return uint32(i+1) << 1 }

func liveSlots(c *candidates) []uint32 {
	var out []uint32
	for _, lw := range c.active {
		for x := lw.bits; x != 0; x &= x - 1 {
			out = append(out, lw.idx<<6+uint32(bits.TrailingZeros64(x)))
		}
	}
	return out
}

func liveIdx(c *candidates) []uint32 {
	var out []uint32
	for _, lw := range c.active {
		out = append(out, lw.idx)
	}
	return out
}

// The candidates keep exactly the non-zero words of their slot bitset, in
// word order, from the first step on, and drop a word once it has no
// candidate left: a step visits the live words, not the fleet's width.
func TestCandidatesKeepOnlyLiveWords(t *testing.T) {
	const words = 157 // 10,000 slots
	sl := slabOf(words,
		[]uint32{5, 70, 71, 4000, 9999}, // block 0
		[]uint32{5, 71, 4000, 9999, 12}, // block 1: 70 drops (12 never was a candidate)
		[]uint32{71, 9999},              // block 2: 5 and 4000 drop, words 0 and 62 empty
		[]uint32{9999},                  // block 3: 71 drops
	)
	tests := []struct {
		h        uint32
		wantIdx  []uint32
		wantLive []uint32
		wantDone []slotMatch
		wantMore bool
	}{
		{setWord(0), []uint32{0, 1, 62, 156}, []uint32{5, 70, 71, 4000, 9999}, nil, true},
		{setWord(1), []uint32{0, 1, 62, 156}, []uint32{5, 71, 4000, 9999}, []slotMatch{{70, 1}}, true},
		{setWord(2), []uint32{1, 156}, []uint32{71, 9999}, []slotMatch{{5, 2}, {4000, 2}}, true},
		{setWord(3), []uint32{156}, []uint32{9999}, []slotMatch{{71, 3}}, true},
		{0, []uint32{156}, []uint32{9999}, nil, false},
	}
	c := candidates{}
	for pos, tt := range tests {
		nDone := len(c.done)
		more, ok := c.step(pos, tt.h, sl)
		if !ok || more != tt.wantMore {
			t.Fatalf("pos %d: more %v ok %v, want %v true", pos, more, ok, tt.wantMore)
		}
		if tt.h == 0 {
			continue // nobody holds it: the caller ends the walk
		}
		if got := liveIdx(&c); !slices.Equal(got, tt.wantIdx) {
			t.Errorf("pos %d: live words %v, want %v", pos, got, tt.wantIdx)
		}
		if got := liveSlots(&c); !slices.Equal(got, tt.wantLive) {
			t.Errorf("pos %d: candidates %v, want %v", pos, got, tt.wantLive)
		}
		if diff := cmp.Diff(tt.wantDone, c.done[nDone:], cmp.AllowUnexported(slotMatch{})); diff != "" {
			t.Errorf("pos %d: dropped (-want +got):\n%s", pos, diff)
		}
	}
	for _, lw := range c.active {
		if lw.bits == 0 {
			t.Errorf("word %d kept with no candidate", lw.idx)
		}
	}
}

// A run read that must be redone rolls the candidates back to what they were
// before it, word list included, though the steps meanwhile compacted the
// list in place; a torn holder word (a bitset the slab does not have) changes
// nothing.
func TestCandidatesRollbackRestoresWordList(t *testing.T) {
	const words = 157
	sl := slabOf(words,
		[]uint32{1, 2, 64, 65, 200, 5000, 9999},
		[]uint32{1, 64, 200, 5000, 9999},
		[]uint32{1, 9999},
	)
	run := func(c *candidates, hs ...uint32) {
		for i, h := range hs {
			if _, ok := c.step(i+1, h, sl); !ok {
				t.Fatalf("step %d torn", i+1)
			}
		}
	}
	var c candidates
	c.step(0, setWord(0), sl)
	var saved savedCandidates
	c.save(&saved)
	before := slices.Clone(c.active)

	run(&c, setWord(1), setWord(2)) // compacts 5 words down to 2
	if len(c.active) != 2 || len(c.done) == 0 {
		t.Fatalf("steps did not narrow: %d words, %d dropped", len(c.active), len(c.done))
	}
	c.restore(&saved)
	if diff := cmp.Diff(before, c.active, cmp.AllowUnexported(liveWord{})); diff != "" {
		t.Fatalf("restored word list (-saved +got):\n%s", diff)
	}
	if len(c.done) != 0 {
		t.Fatalf("restored done has %d entries", len(c.done))
	}

	// A torn word in the middle of a read: ok false, nothing changed.
	snapshot := slices.Clone(c.active)
	if more, ok := c.step(1, setWord(9), sl); ok || more {
		t.Fatalf("torn word: more %v ok %v", more, ok)
	}
	if diff := cmp.Diff(snapshot, c.active, cmp.AllowUnexported(liveWord{})); diff != "" {
		t.Fatalf("torn step changed the candidates (-before +after):\n%s", diff)
	}

	// Redone from the rollback, the walk ends as one that never rolled back.
	run(&c, setWord(1), setWord(2))
	var fresh candidates
	fresh.step(0, setWord(0), sl)
	run(&fresh, setWord(1), setWord(2))
	if !slices.Equal(liveSlots(&c), liveSlots(&fresh)) {
		t.Errorf("after rollback %v, without %v", liveSlots(&c), liveSlots(&fresh))
	}
	if diff := cmp.Diff(fresh.done, c.done, cmp.AllowUnexported(slotMatch{})); diff != "" {
		t.Errorf("dropped after rollback (-fresh +got):\n%s", diff)
	}
}
