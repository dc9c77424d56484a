package index

import "math/bits"

// copiesCap bounds a tier's copy count (SMG COPIES_CAP): vLLM's "full" report
// mode re-announces hit chains without removals and would otherwise grow a
// count without bound.
const copiesCap = 8

// revTable maps one (worker, rank)'s engine block hashes to the prefix hash
// the index filed the block under, with its physical copies per tier. It is
// the index's memory hog (one slot per block a worker holds), so it is an
// open-addressing table in three parallel arrays, 18 bytes a slot, instead of
// a Go map of structs. Occupancy is cnt != 0: an entry whose copies all went
// is deleted, so a live entry always has a non-zero count.
type revTable struct {
	keys  []uint64 // engine block hash (the proto int64, bit for bit)
	pref  []uint64 // prefix hash in the index
	cnt   []uint16 // device copies in the low byte, host copies in the high
	n     int
	shift uint8
}

const revMinSlots = 16

func newRevTable() *revTable {
	t := &revTable{}
	t.alloc(revMinSlots)
	return t
}

func (t *revTable) alloc(slots int) {
	t.keys = make([]uint64, slots)
	t.pref = make([]uint64, slots)
	t.cnt = make([]uint16, slots)
	t.shift = uint8(64 - bits.TrailingZeros(uint(slots)))
	t.n = 0
}

// home spreads engine hashes with a multiplicative mix: engines' hashes are
// not all uniform (small integers are legal), so the raw low bits would cluster.
func (t *revTable) home(k uint64) int { return int((k * 0x9E3779B97F4A7C15) >> t.shift) }

func (t *revTable) mask() int { return len(t.keys) - 1 }

// find returns the slot holding k, or -1.
func (t *revTable) find(k uint64) int {
	m := t.mask()
	for i := t.home(k); ; i = (i + 1) & m {
		if t.cnt[i] == 0 {
			return -1
		}
		if t.keys[i] == k {
			return i
		}
	}
}

// upsert returns k's slot and whether it was there; if not, k now occupies
// the returned slot with pref and cnt. One probe sequence serves both.
func (t *revTable) upsert(k, pref uint64, cnt uint16) (int, bool) {
	if (t.n+1)*5 > len(t.keys)*4 {
		t.grow()
	}
	m := t.mask()
	i := t.home(k)
	for ; t.cnt[i] != 0; i = (i + 1) & m {
		if t.keys[i] == k {
			return i, true
		}
	}
	t.keys[i], t.pref[i], t.cnt[i] = k, pref, cnt
	t.n++
	return i, false
}

// insert adds k (which must be absent) and returns its slot.
func (t *revTable) insert(k, pref uint64, cnt uint16) int {
	if (t.n+1)*5 > len(t.keys)*4 { // keep load ≤ 0.8: linear probing degrades fast above
		t.grow()
	}
	m := t.mask()
	i := t.home(k)
	for t.cnt[i] != 0 {
		i = (i + 1) & m
	}
	t.keys[i], t.pref[i], t.cnt[i] = k, pref, cnt
	t.n++
	return i
}

func (t *revTable) grow() {
	keys, pref, cnt := t.keys, t.pref, t.cnt
	t.alloc(len(keys) * 2)
	for i, c := range cnt {
		if c != 0 {
			t.insert(keys[i], pref[i], c)
		}
	}
}

// del removes slot i with backward-shift deletion, so lookups need no
// tombstones and the table never degrades under churn.
func (t *revTable) del(i int) {
	m := t.mask()
	j := i
	for {
		j = (j + 1) & m
		if t.cnt[j] == 0 {
			break
		}
		h := t.home(t.keys[j])
		// Move j back into the hole at i unless its home lies cyclically in (i, j].
		if (j > i && (h <= i || h > j)) || (j < i && (h <= i && h > j)) {
			t.keys[i], t.pref[i], t.cnt[i] = t.keys[j], t.pref[j], t.cnt[j]
			i = j
		}
	}
	t.cnt[i] = 0
	t.n--
	if t.n == 0 && len(t.keys) > 1<<16 {
		t.alloc(revMinSlots) // give a drained rank's memory back
	}
}

func (t *revTable) bytes() int { return len(t.keys) * 18 }

func tierCount(c uint16, tier Tier) uint8 { return uint8(c >> (8 * uint(tier))) }

func withTierCount(c uint16, tier Tier, v uint8) uint16 {
	s := 8 * uint(tier)
	return c&^(0xff<<s) | uint16(v)<<s
}
