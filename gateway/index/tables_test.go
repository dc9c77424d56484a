package index

import (
	"math/rand/v2"
	"testing"
)

// TestRevTableAgainstMap drives one reverse table through growth (its sizes
// are not powers of two), wrap-around probing and backward-shift deletions,
// and compares it with a map after every step. Keys include small integers
// and keys crowding the same home slots.
func TestRevTableAgainstMap(t *testing.T) {
	rng := rand.New(rand.NewPCG(11, 11))
	rt := newRevTable()
	want := map[uint64][2]uint64{} // key → (pref, counts)
	var keys []uint64
	for step := range 25000 {
		var k uint64
		switch {
		case len(keys) > 0 && rng.IntN(3) == 0:
			k = keys[rng.IntN(len(keys))]
		case rng.IntN(4) == 0:
			k = uint64(rng.IntN(64))
		default:
			k = rng.Uint64()
		}
		if rng.IntN(5) < 3 || len(want) < 50 {
			c := uint8(1 + rng.IntN(200))
			i, found := rt.upsert(k, k^0x5555, c)
			_, had := want[k]
			if found != had {
				t.Fatalf("step %d: upsert(%#x) found=%v, map has=%v", step, k, found, had)
			}
			if !had {
				want[k] = [2]uint64{k ^ 0x5555, uint64(c)}
				keys = append(keys, k)
			} else if rt.slots[i].key != k {
				t.Fatalf("step %d: upsert(%#x) returned slot of %#x", step, k, rt.slots[i].key)
			}
		} else if i := rt.find(k); i >= 0 {
			if _, had := want[k]; !had {
				t.Fatalf("step %d: found %#x, not in map", step, k)
			}
			rt.del(i)
			delete(want, k)
		} else if _, had := want[k]; had {
			t.Fatalf("step %d: %#x in map, not found", step, k)
		}
		if rt.n != len(want) {
			t.Fatalf("step %d: n %d, map %d", step, rt.n, len(want))
		}
		if step%2500 == 0 {
			for k, v := range want {
				i := rt.find(k)
				if i < 0 || rt.slots[i].pref != v[0] || uint64(rt.counts(i)) != v[1] {
					t.Fatalf("step %d: %#x lost or changed", step, k)
				}
			}
		}
	}
}

// TestShardAgainstMap does the same for one forward shard: holders added
// and removed at random over a few workers (inline holder and bitset
// forms), through table growth and deletions, checked by lookup.
func TestShardAgainstMap(t *testing.T) {
	const sb = 6
	rng := rand.New(rand.NewPCG(12, 12))
	var s shard
	s.init(false)
	want := map[uint64]map[uint32]bool{}
	var keys []uint64
	for step := range 25000 {
		var k uint64
		if len(keys) > 0 && rng.IntN(2) == 0 {
			k = keys[rng.IntN(len(keys))]
		} else {
			k = rng.Uint64() >> sb // one shard: the top bits are the shard's
		}
		id := uint32(rng.IntN(130))
		if rng.IntN(5) < 3 {
			held := s.addHolder(k, id, 0, sb)
			if held != want[k][id] {
				t.Fatalf("step %d: addHolder(%#x, %d) held=%v, want %v", step, k, id, held, want[k][id])
			}
			if want[k] == nil {
				want[k] = map[uint32]bool{}
				keys = append(keys, k)
			}
			want[k][id] = true
		} else {
			had := want[k][id]
			if got := s.removeHolder(k, id, sb); got != had {
				t.Fatalf("step %d: removeHolder(%#x, %d) = %v, want %v", step, k, id, got, had)
			}
			if had {
				delete(want[k], id)
				if len(want[k]) == 0 {
					delete(want, k)
				}
			}
		}
		if step%5000 == 0 {
			n := 0
			for k, ids := range want {
				h := s.lookup(k, sb, false, 0, nil)
				if !h.found {
					t.Fatalf("step %d: %#x not found", step, k)
				}
				got := map[uint32]bool{}
				if h.single {
					got[h.id] = true
				} else {
					for wi, x := range h.set {
						for b := range 64 {
							if x&(1<<b) != 0 {
								got[uint32(wi*64+b)] = true
							}
						}
					}
				}
				if len(got) != len(ids) {
					t.Fatalf("step %d: %#x holders %v, want %v", step, k, got, ids)
				}
				for id := range ids {
					if !got[id] {
						t.Fatalf("step %d: %#x holders %v, want %v", step, k, got, ids)
					}
				}
				n++
			}
			if s.n != n {
				t.Fatalf("step %d: shard has %d entries, want %d", step, s.n, n)
			}
		}
	}
}
