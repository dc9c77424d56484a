package wire

import (
	"math/bits"
	"math/rand/v2"
)

// recordTable is one tier's namespace records (hash → blockRecord): an
// open-addressed table with linear probing, in place of a Go map. A
// namespaced store looks up every block and updates what it finds, which
// a map does with two probes (read, then write back) and its general
// hashing; here find returns the slot, updated in place. That loop was a
// fifth of AppendNormalized's CPU time on the realistic vLLM stream.
//
// A slot is empty when its copies count is 0: a held record always has at
// least one copy (removals delete it with its last). Slots are picked by
// multiply-shift hashing with a random odd multiplier drawn per table and
// again at each growth (as hashSet does), so a publisher cannot choose
// hashes that pile into one probe run. Deletion shifts the run back
// instead of leaving tombstones, so lookups never walk past dead slots.
type recordTable struct {
	slots []recordSlot // len is a power of two, at most 3/4 full; nil when empty
	n     int
	mul   uint64
	shift uint8 // 64 - log2(len(slots))
}

type recordSlot struct {
	h   int64
	rec blockRecord
}

func (t *recordTable) len() int { return t.n }

func (t *recordTable) home(h int64) int { return int((uint64(h) * t.mul) >> t.shift) }

// find returns the index of h's slot, or -1.
func (t *recordTable) find(h int64) int {
	if t.n == 0 {
		return -1
	}
	mask := len(t.slots) - 1
	for i := t.home(h); ; i = (i + 1) & mask {
		s := &t.slots[i]
		if s.rec.copies == 0 {
			return -1
		}
		if s.h == h {
			return i
		}
	}
}

// get returns h's record.
func (t *recordTable) get(h int64) (blockRecord, bool) {
	if i := t.find(h); i >= 0 {
		return t.slots[i].rec, true
	}
	return blockRecord{}, false
}

// insert adds h, which the table does not hold, with rec (rec.copies ≥ 1).
func (t *recordTable) insert(h int64, rec blockRecord) {
	if 4*(t.n+1) > 3*len(t.slots) {
		t.grow()
	}
	t.place(h, rec)
	t.n++
}

func (t *recordTable) place(h int64, rec blockRecord) {
	mask := len(t.slots) - 1
	i := t.home(h)
	for t.slots[i].rec.copies != 0 {
		i = (i + 1) & mask
	}
	t.slots[i] = recordSlot{h: h, rec: rec}
}

func (t *recordTable) grow() {
	old := t.slots
	size := max(64, 2*len(old))
	t.slots = make([]recordSlot, size)
	t.shift = uint8(64 - bits.TrailingZeros(uint(size)))
	t.mul = rand.Uint64() | 1
	for _, s := range old {
		if s.rec.copies != 0 {
			t.place(s.h, s.rec)
		}
	}
}

// deleteAt empties slot i and moves later members of its probe run back
// into the gap, so every key stays reachable from its home slot.
func (t *recordTable) deleteAt(i int) {
	mask := len(t.slots) - 1
	for j := (i + 1) & mask; t.slots[j].rec.copies != 0; j = (j + 1) & mask {
		// The key at j may fill the gap at i unless its home lies in the
		// cyclic range (i, j]: moving it before its home would lose it.
		if k := t.home(t.slots[j].h); (j-k)&mask >= (j-i)&mask {
			t.slots[i] = t.slots[j]
			i = j
		}
	}
	t.slots[i] = recordSlot{}
	t.n--
}

// each calls f with every held key and a pointer to its record, which f
// may change but not empty (copies stays ≥ 1).
func (t *recordTable) each(f func(h int64, rec *blockRecord)) {
	for i := range t.slots {
		if s := &t.slots[i]; s.rec.copies != 0 {
			f(s.h, &s.rec)
		}
	}
}
