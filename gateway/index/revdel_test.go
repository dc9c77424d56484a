package index

import (
	"math/rand/v2"
	"slices"
	"testing"
)

// refDel is the backward-shift deletion as it was before del copied every
// entry into the hole and moved the hole without a branch (2026-12-05): the
// entry at j moves only when fillsHole says so (its distance field set anew
// from its home).
func refDel(slots []rslot, meta []uint16, i int) {
	n := len(slots)
	home := func(k uint64) int { return (&revTable{slots: slots}).homeOf(mix(k)) }
	j := i
	for {
		if j++; j == n {
			j = 0
		}
		if meta[j]&0xff == 0 {
			break
		}
		if h := home(slots[j].key()); fillsHole(i, j, h) {
			d := i - h
			if d < 0 {
				d += n
			}
			slots[i], meta[i] = slots[j], meta[j]&^metaDist|distBits(d)
			i = j
		}
	}
	meta[i] = 0
}

// TestRevTableDeleteMatchesFillsHole checks del against the deletion it
// replaced, on tables crowded at a load of 0.81 with keys chosen to share
// home slots and to wrap around the table's end: after every deletion the
// live slots (which entry sits where, its position and counts) are exactly
// those refDel leaves, every entry is found, every slot between an entry's
// home and the entry is occupied, and every entry's distance field is its
// distance from its home (15 for 15 or more: the crowded bands make such
// distances).
func TestRevTableDeleteMatchesFillsHole(t *testing.T) {
	rng := rand.New(rand.NewPCG(31, 5))
	saturated := 0 // entries seen 15 or more slots from their homes
	for round := range 40 {
		size := 16 + rng.IntN(300)
		rt := &revTable{slots: make([]rslot, size), meta: make([]uint16, size), growAt: size * revMaxLoad16 / 16}
		// Keys whose homes fall in a few narrow bands, one of them at the
		// table's end, so that clusters are long and wrap.
		var keys []uint64
		for len(keys) < size*13/16 {
			k := rng.Uint64()
			h := rt.homeOf(mix(k))
			if round%2 == 0 && h < size-8 && h > 8 && rng.IntN(4) != 0 {
				continue
			}
			if _, found := rt.upsert(k, uint32(k>>7), uint8(1+rng.IntN(0x88))); !found {
				keys = append(keys, k)
			}
		}
		if len(rt.slots) != size {
			t.Fatalf("round %d: the table grew (%d → %d slots); the test wants it crowded", round, size, len(rt.slots))
		}
		rng.Shuffle(len(keys), func(a, b int) { keys[a], keys[b] = keys[b], keys[a] })
		for d, k := range keys {
			i := rt.find(k)
			if i < 0 {
				t.Fatalf("round %d, deletion %d: %#x not found", round, d, k)
			}
			wantSlots, wantMeta := slices.Clone(rt.slots), slices.Clone(rt.meta)
			refDel(wantSlots, wantMeta, i)
			n := rt.n
			rt.windowLeft = 1 << 40 // no peak window ends: keep the table's size
			rt.peak, rt.prevPeak = size, size
			rt.del(i)
			if rt.n != n-1 {
				t.Fatalf("round %d: n %d after deleting from %d", round, rt.n, n)
			}
			if len(rt.slots) != size {
				t.Fatalf("round %d: the table resized during the check", round)
			}
			for s := range size {
				if rt.meta[s] != wantMeta[s] || rt.meta[s]&0xff != 0 && rt.slots[s] != wantSlots[s] {
					t.Fatalf("round %d, deletion %d of slot %d: slot %d holds %#x (meta %#x), the old deletion left %#x (meta %#x)",
						round, d, i, s, rt.slots[s].key(), rt.meta[s], wantSlots[s].key(), wantMeta[s])
				}
			}
			for s := range size {
				if rt.meta[s]&0xff == 0 {
					continue
				}
				dist := 0
				for h := rt.homeOf(mix(rt.slots[s].key())); h != s; h = (h + 1) % size {
					if rt.meta[h]&0xff == 0 {
						t.Fatalf("round %d: slot %d empty between the home and slot %d of %#x", round, h, s, rt.slots[s].key())
					}
					dist++
				}
				if got := int(rt.meta[s]&metaDist) >> distShift; got != min(dist, distMax) {
					t.Fatalf("round %d, deletion %d: slot %d's distance field is %d, its distance %d", round, d, s, got, dist)
				}
				if dist >= distMax {
					saturated++
				}
			}
			for _, k2 := range keys[d+1:] {
				if j := rt.find(k2); j < 0 || rt.slots[j].pos != uint32(k2>>7) {
					t.Fatalf("round %d, deletion %d: %#x lost", round, d, k2)
				}
			}
			if rt.find(k) >= 0 {
				t.Fatalf("round %d: %#x still found after its deletion", round, k)
			}
		}
	}
	if saturated == 0 {
		t.Fatal("no entry was 15 or more slots from its home; the test wants some")
	}
}

// TestReleaseCountsAsBefore drives retain and release over a few positions,
// with and without pruning, against a model of the references: release must
// report the last reference exactly when the model has none left, whether
// the worker's map is absent, empty or holds other positions.
func TestReleaseCountsAsBefore(t *testing.T) {
	for _, pruning := range []bool{false, true} {
		rng := rand.New(rand.NewPCG(7, 31))
		ws := &workerState{}
		refs := map[loc]int{} // reverse entries naming each position
		for step := range 20000 {
			l := loc(rng.IntN(6))
			if refs[l] == 0 || rng.IntN(2) == 0 {
				ws.retain(l, refs[l] > 0, pruning)
				refs[l]++
				continue
			}
			refs[l]--
			if last := ws.release(l, pruning); last != (refs[l] == 0) {
				t.Fatalf("pruning %v, step %d: release(%d) = %v with %d references left", pruning, step, l, last, refs[l])
			}
			if refs[l] == 0 {
				delete(refs, l)
			}
			if _, kept := ws.refs[l]; kept && refs[l] < 2 && !pruning {
				t.Fatalf("step %d: a count kept for %d with %d references (the holder bit implies one)", step, l, refs[l])
			}
		}
	}
}

// TestRevTableGrowsAtMaxLoad checks the cached growth threshold (growAt)
// against the load rule it stands for: an insert grows the table exactly
// when the table would otherwise pass revMaxLoad16 sixteenths full, through
// many growths (sizes not powers of two), with deletions between them.
func TestRevTableGrowsAtMaxLoad(t *testing.T) {
	rng := rand.New(rand.NewPCG(8, 13))
	rt := newRevTable(nil)
	grew := 0
	for step := range 200000 {
		if rng.IntN(8) == 0 && rt.n > 0 {
			// Delete the first entry at or after a random slot.
			for i := rng.IntN(len(rt.slots)); ; i = (i + 1) % len(rt.slots) {
				if rt.meta[i]&metaCounts != 0 {
					rt.del(i)
					break
				}
			}
			continue
		}
		size, n := len(rt.slots), rt.n
		if _, found := rt.upsert(rng.Uint64(), 1, 1); found {
			continue
		}
		want := (n+1)*16 > size*revMaxLoad16
		if got := len(rt.slots) > size; got != want {
			t.Fatalf("step %d: inserting the %dth entry into %d slots grew the table: %v, want %v", step, n+1, size, got, want)
		}
		if want {
			grew++
		}
	}
	if grew < 20 {
		t.Fatalf("the table grew %d times; the test wants many growths", grew)
	}
}
