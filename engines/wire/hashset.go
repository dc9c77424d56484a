package wire

import (
	"math/bits"
	"math/rand/v2"
)

// hashSet finds a repeated hash in one store (the self-referencing check,
// N15) without a Go map: an open-addressed table whose slots are stamped
// with the current round, so emptying it between stores costs one
// increment, not a clear. It replaced a map[int64]struct{} whose clear,
// hashing and probing were a tenth of normalizing a realistic batch.
//
// Slots are picked by multiply-shift hashing with a random odd multiplier
// drawn per set (a universal family), so a publisher cannot choose hashes
// that all land in one probe chain without knowing it.
type hashSet struct {
	keys  []int64
	round []uint32 // slot i is full when round[i] == cur
	cur   uint32
	mul   uint64
	shift uint8
}

// maxKeptSlots is the largest table a set keeps between stores: one huge
// store should not pin its table for ever.
const maxKeptSlots = 1 << 14

// reset empties the set and sizes it for n keys (at most half full).
func (s *hashSet) reset(n int) {
	if s.mul == 0 {
		s.mul = rand.Uint64() | 1
	}
	want := 16
	for want < 2*n {
		want *= 2
	}
	if len(s.keys) < want || len(s.keys) > maxKeptSlots && want <= maxKeptSlots {
		s.keys = make([]int64, want)
		s.round = make([]uint32, want)
		s.cur = 0
		s.shift = uint8(64 - bits.TrailingZeros(uint(want)))
	}
	s.cur++
	if s.cur == 0 {
		// The stamps wrapped: a stale slot could read as full.
		clear(s.round)
		s.cur = 1
	}
}

// add inserts h and reports whether it was there already.
func (s *hashSet) add(h int64) (dup bool) {
	mask := len(s.keys) - 1
	for i := int((uint64(h) * s.mul) >> s.shift); ; i = (i + 1) & mask {
		if s.round[i] != s.cur {
			s.keys[i], s.round[i] = h, s.cur
			return false
		}
		if s.keys[i] == h {
			return true
		}
	}
}
