package wire

import (
	"math/rand/v2"
	"testing"
)

// TestRecordTableAgreesWithAMap drives a recordTable and a Go map through
// the same random inserts, in-place updates and deletions, over keys drawn
// from a small range (long probe runs, deletions inside them, wrap-around
// at the table's end) and from all of int64 (0 and negatives included),
// checking every key's record after each phase and the sizes after every
// step.
func TestRecordTableAgreesWithAMap(t *testing.T) {
	for _, tc := range []struct {
		name string
		key  func(r *rand.Rand) int64
	}{
		{"dense keys", func(r *rand.Rand) int64 { return int64(r.IntN(3000)) - 1500 }},
		{"any int64", func(r *rand.Rand) int64 {
			if r.IntN(50) == 0 {
				return 0
			}
			return int64(r.Uint64())
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := rand.New(rand.NewPCG(5, 6))
			var tab recordTable
			want := map[int64]blockRecord{}
			var seen []int64
			check := func(step int) {
				for _, h := range seen {
					got, ok := tab.get(h)
					w, wok := want[h]
					if ok != wok || got != w {
						t.Fatalf("step %d: key %d: table %v %v, map %v %v", step, h, got, ok, w, wok)
					}
				}
				n := 0
				tab.each(func(h int64, rec *blockRecord) {
					n++
					if want[h] != *rec {
						t.Fatalf("step %d: each gave %d → %v, map has %v", step, h, *rec, want[h])
					}
				})
				if n != len(want) {
					t.Fatalf("step %d: each visited %d keys, map holds %d", step, n, len(want))
				}
			}
			for step := range 60000 {
				h := tc.key(r)
				seen = append(seen, h)
				i := tab.find(h)
				if _, ok := want[h]; ok != (i >= 0) {
					t.Fatalf("step %d: find(%d) = %d, map holds it: %v", step, h, i, ok)
				}
				switch op := r.IntN(10); {
				case i < 0 && op < 6:
					rec := blockRecord{ns: uint32(r.IntN(5)), copies: 1}
					tab.insert(h, rec)
					want[h] = rec
				case i >= 0 && op < 4:
					rec := &tab.slots[i].rec
					rec.copies = min(rec.copies+1, copiesCap)
					rec.ns = uint32(step)
					want[h] = *rec
				case i >= 0:
					tab.deleteAt(i)
					delete(want, h)
				}
				if tab.len() != len(want) {
					t.Fatalf("step %d: table holds %d, map %d", step, tab.len(), len(want))
				}
				if step%5000 == 4999 {
					check(step)
					if len(seen) > 4000 {
						seen = seen[len(seen)-4000:]
					}
				}
			}
			// Empty it, then fill it again: deletions must leave no trace.
			for h := range want {
				tab.deleteAt(tab.find(h))
				delete(want, h)
			}
			check(-1)
			for h := range int64(500) {
				tab.insert(h, blockRecord{ns: 1, copies: 1})
				want[h] = blockRecord{ns: 1, copies: 1}
			}
			check(-2)
		})
	}
}
