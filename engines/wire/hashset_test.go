package wire

import (
	"math"
	"testing"
)

// TestSelfReferencingPastSixteenHashes checks the table-backed path against
// the obvious answer: distinct stores pass, a repeat anywhere or a hash equal
// to the parent fails, across sizes that grow and shrink the table, with the
// set reused from store to store (so a stale slot of an earlier store would
// show up as a false repeat).
func TestSelfReferencingPastSixteenHashes(t *testing.T) {
	distinct := func(n int, base int64) []int64 {
		hs := make([]int64, n)
		for i := range hs {
			hs[i] = base + int64(i)*0x10000 // the same low bits: a weak hash would collide
		}
		return hs
	}
	withRepeat := func(n, i, j int) []int64 {
		hs := distinct(n, 1)
		hs[j] = hs[i]
		return hs
	}
	cases := []struct {
		name   string
		hashes []int64
		parent optI64
		want   bool
	}{
		{"17 distinct", distinct(17, 1), optI64{}, false},
		{"17, parent distinct", distinct(17, 1), optI64{v: -1, ok: true}, false},
		{"17, parent repeated", distinct(17, 1), optI64{v: 1 + 16*0x10000, ok: true}, true},
		{"17, first and last equal", withRepeat(17, 0, 16), optI64{}, true},
		{"64, adjacent repeat", withRepeat(64, 30, 31), optI64{}, true},
		{"64 distinct again", distinct(64, 1), optI64{}, false},
		{"5000 distinct", distinct(5000, 7), optI64{}, false},
		{"5000, repeat at the end", withRepeat(5000, 2, 4999), optI64{}, true},
		{"20 after a big one", distinct(20, 7), optI64{}, false},
		{"extremes", append(distinct(20, 3), math.MinInt64, math.MaxInt64, 0), optI64{v: -2, ok: true}, false},
		{"zero twice", append(distinct(20, 3), 0, 0), optI64{}, true},
	}
	var seen hashSet
	for _, c := range cases {
		if got := selfReferencing(c.hashes, c.parent, &seen); got != c.want {
			t.Errorf("%s: selfReferencing = %v, want %v", c.name, got, c.want)
		}
	}
}

// TestHashSetSurvivesRoundWrap: when the round stamp wraps, slots of old
// rounds must not read as full.
func TestHashSetSurvivesRoundWrap(t *testing.T) {
	var s hashSet
	s.reset(4)
	s.add(42)
	s.cur = math.MaxUint32 // as after 2^32-1 stores
	s.reset(4)
	if s.add(42) {
		t.Fatal("42 from an earlier round reads as present after the stamps wrapped")
	}
	if !s.add(42) {
		t.Fatal("42 added in this round is not present")
	}
}
