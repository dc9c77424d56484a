package index

import (
	"math/bits"
	"sync/atomic"
)

// table is the heads table: an open-addressing map prefix hash → run number
// + 1 (12 bytes a slot: slots in pairs, three words a pair, the two keys then
// both values, so every word is written whole by one atomic store and a
// reader never sees a torn key). The slot count is not a power of two: a
// hash maps to its home slot by a multiply-high of the bits below the shard
// bits, and the table grows by a quarter.
type table struct {
	w []uint64
	n int // slots (even)
}

func keyWord(i int) int           { return 3*(i>>1) + i&1 }
func valWord(i int) int           { return 3*(i>>1) + 2 }
func valShift(i int) uint         { return 32 * uint(i&1) }
func (t *table) key(i int) uint64 { return t.w[keyWord(i)] }
func (t *table) val(i int) uint32 { return uint32(t.w[valWord(i)] >> valShift(i)) }
func (t *table) loadKey(i int) uint64 {
	return atomic.LoadUint64(&t.w[keyWord(i)])
}
func (t *table) loadVal(i int) uint32 {
	return uint32(atomic.LoadUint64(&t.w[valWord(i)]) >> valShift(i))
}

func (t *table) put(i int, k uint64, v uint32) {
	store64(&t.w[keyWord(i)], k)
	t.setVal(i, v)
}

func (t *table) setVal(i int, v uint32) {
	p := &t.w[valWord(i)]
	sh := valShift(i)
	store64(p, *p&^(0xffffffff<<sh)|uint64(v)<<sh)
}

func newTable(slots int) *table {
	w := fullAlloc[uint64](3 * ((slots + 1) / 2))
	n := 2 * (len(w) / 3)
	return &table{w: w[:3*n/2], n: n}
}

// home is k's first slot. Prefix hashes are XXH3 outputs, uniform: the bits
// below the shard-selection bits pick the slot directly.
func (t *table) home(k uint64, sb uint8) int {
	hi, _ := bits.Mul64(k<<sb, uint64(t.n))
	return int(hi)
}

// find returns the slot of k, or -1 (writers).
func (t *table) find(k uint64, sb uint8) int {
	n := t.n
	for i := t.home(k, sb); ; {
		if t.val(i) == 0 {
			return -1
		}
		if t.key(i) == k {
			return i
		}
		if i++; i == n {
			i = 0
		}
	}
}

// tryFind is the readers' find; ok is false when a torn read sent it
// somewhere impossible.
func (t *table) tryFind(k uint64, sb uint8) (val uint32, ok bool) {
	n := t.n
	i := t.home(k, sb)
	for probes := 0; probes < n; probes++ {
		v := t.loadVal(i)
		if v == 0 {
			return 0, true
		}
		if t.loadKey(i) == k {
			return v, true
		}
		if i++; i == n {
			i = 0
		}
	}
	return 0, false
}
