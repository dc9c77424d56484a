package index

import (
	"math/bits"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
)

// table is one shard's open-addressing map prefix hash → holders (12 bytes a
// slot, 16 with pruning on). A slot's holder word (32 bits) is:
//
//	0                  empty slot
//	id<<1 | 1          exactly one holder, the worker in slot id (the common case:
//	                   a conversation's unique tail is held by one worker)
//	(set+1)<<1         two or more holders: bitset number set in slab, words wide
//
// The slot count is not a power of two: a hash maps to its home slot by a
// multiply-high of the bits below the shard bits (fastrange), and a table
// grows by a quarter, so its load stays between 0.64 and 0.8 instead of
// halving at each doubling (12-byte slots: 15–19 B per entry rather than 15–30 B).
//
// A table is replaced, never resized in place, so a reader holding an old
// one reads memory that stays valid; the shard's version tells it the
// snapshot went stale.
type table struct {
	// w holds the slots in pairs, three words a pair: the two keys, then
	// both holder words (slot 2p's in the low half). Slots cost 12 bytes, and
	// every word is written whole by one atomic store, so a reader never sees
	// a torn key (a stale one is caught by the seqlock).
	w     []uint64
	n     int      // slots (even)
	stamp []uint32 // last store or lookup, seconds since the index's epoch; nil without pruning
	slab  []uint64 // holder bitsets, words uint64s each
	words int
}

func keyWord(i int) int    { return 3*(i>>1) + i&1 }
func holdWord(i int) int   { return 3*(i>>1) + 2 }
func holdShift(i int) uint { return 32 * uint(i&1) }

// key returns slot i's key and hold its holder word (writers: plain reads).
func (t *table) key(i int) uint64  { return t.w[keyWord(i)] }
func (t *table) hold(i int) uint32 { return uint32(t.w[holdWord(i)] >> holdShift(i)) }

// loadKey and loadHold are the readers' atomic forms.
func (t *table) loadKey(i int) uint64 { return atomic.LoadUint64(&t.w[keyWord(i)]) }
func (t *table) loadHold(i int) uint32 {
	return uint32(atomic.LoadUint64(&t.w[holdWord(i)]) >> holdShift(i))
}

// put fills slot i, the holder word last; setHold changes the holder word
// (the pair's word is rewritten whole: only the locked writer writes it).
func (t *table) put(i int, k uint64, h uint32) {
	atomic.StoreUint64(&t.w[keyWord(i)], k)
	t.setHold(i, h)
}

func (t *table) setHold(i int, h uint32) {
	p := &t.w[holdWord(i)]
	sh := holdShift(i)
	atomic.StoreUint64(p, *p&^(0xffffffff<<sh)|uint64(h)<<sh)
}

// shard is a slice of the forward map with a seqlock: writers serialise on
// mu and make ver odd while they write; readers take no lock, read with
// atomic loads (plain MOVs on amd64 and arm64, so independent probes overlap
// their cache misses) and retry when ver moved. Every word readers may read
// is written atomically, which keeps the race detector meaningful.
type shard struct {
	mu       sync.Mutex
	ver      atomic.Uint64
	tab      atomic.Pointer[table]
	n        int // occupied slots (entries); guarded by mu
	mem      int // memberships (worker, entry); guarded by mu
	setsUsed int // bitsets handed out (high water); guarded by mu
	setsFree []uint32

	_ [64]byte // keep neighbouring shards' versions off one cache line
}

const shardMinSlots = 64

func newTable(slots, words int, slab []uint64, stamped bool) *table {
	w := fullAlloc[uint64](3 * ((slots + 1) / 2))
	n := 2 * (len(w) / 3)
	var stamp []uint32
	if stamped {
		stamp = make([]uint32, n)
	}
	return &table{
		w:     w[:3*n/2],
		n:     n,
		stamp: stamp,
		slab:  slab,
		words: words,
	}
}

func (s *shard) init(stamped bool) { s.tab.Store(newTable(shardMinSlots, 1, nil, stamped)) }

func (t *table) getStamp(i int) uint32 {
	if t.stamp == nil {
		return 0
	}
	return atomic.LoadUint32(&t.stamp[i])
}

func (t *table) setStamp(i int, v uint32) {
	if t.stamp != nil {
		atomic.StoreUint32(&t.stamp[i], v)
	}
}

// home is k's first slot. Prefix hashes are XXH3 outputs, uniform: the bits
// below the shard-selection bits pick the slot directly.
func (t *table) home(k uint64, sb uint8) int {
	hi, _ := bits.Mul64(k<<sb, uint64(t.n))
	return int(hi)
}

// find returns the slot of k, or -1. Writers only (they own the table).
func (t *table) find(k uint64, sb uint8) int {
	n := t.n
	for i := t.home(k, sb); ; {
		if t.hold(i) == 0 {
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

// writeBegin and writeEnd bracket every change readers could observe.
func (s *shard) writeBegin() *table {
	s.mu.Lock()
	s.ver.Add(1)
	return s.tab.Load()
}

func (s *shard) writeEnd() {
	s.ver.Add(1)
	s.mu.Unlock()
}

// insertSlot adds k (absent) and may publish a grown table; it returns the
// table now current.
func (s *shard) insertSlot(t *table, k uint64, hold uint32, stamp uint32, sb uint8) *table {
	if (s.n+1)*5 > t.n*4 { // keep load ≤ 0.8: linear probing degrades fast above
		nt := newTable(t.n+t.n/4, t.words, t.slab, t.stamp != nil)
		for i := range t.n {
			if h := t.hold(i); h != 0 {
				placeNew(nt, t.key(i), h, t.getStamp(i), sb)
			}
		}
		s.tab.Store(nt)
		t = nt
	}
	n := t.n
	i := t.home(k, sb)
	for t.hold(i) != 0 {
		if i++; i == n {
			i = 0
		}
	}
	t.setStamp(i, stamp)
	t.put(i, k, hold)
	s.n++
	return t
}

// fullAlloc returns a zeroed slice of at least n elements that uses all of
// its allocation: the allocator rounds a request up to its size class (or
// to whole pages), and the rounded-up tail would otherwise be paid for and
// left empty. Tables are not powers of two, so any length serves.
func fullAlloc[T any](n int) []T {
	s := slices.Grow([]T(nil), n)
	return s[:cap(s)]
}

// placeNew fills an unpublished table: plain stores suffice.
func placeNew(t *table, k uint64, hold uint32, stamp uint32, sb uint8) {
	n := t.n
	i := t.home(k, sb)
	for t.hold(i) != 0 {
		if i++; i == n {
			i = 0
		}
	}
	t.w[keyWord(i)] = k
	t.w[holdWord(i)] |= uint64(hold) << holdShift(i)
	if t.stamp != nil {
		t.stamp[i] = stamp
	}
}

// delSlot frees slot i by backward shift (no tombstones) and its bitset.
func (s *shard) delSlot(t *table, i int, sb uint8) {
	if h := t.hold(i); h&1 == 0 {
		s.setsFree = append(s.setsFree, h>>1-1)
	}
	n := t.n
	j := i
	for {
		if j++; j == n {
			j = 0
		}
		if t.hold(j) == 0 {
			break
		}
		kj := t.key(j)
		h := t.home(kj, sb)
		// Move j back into the hole at i unless its home lies cyclically in (i, j].
		if (j > i && (h <= i || h > j)) || (j < i && (h <= i && h > j)) {
			t.setStamp(i, t.getStamp(j))
			t.put(i, kj, t.hold(j))
			i = j
		}
	}
	t.setHold(i, 0)
	s.n--
}

// newSet hands out a zeroed bitset at least need words wide, publishing a
// wider or longer slab when required; it returns the set and current table.
func (s *shard) newSet(t *table, need int) (int, *table) {
	if need > t.words {
		_, t = s.widen(t, need)
	}
	var b int
	if k := len(s.setsFree); k > 0 {
		b = int(s.setsFree[k-1])
		s.setsFree = s.setsFree[:k-1]
	} else {
		b = s.setsUsed
		s.setsUsed++
	}
	if (b+1)*t.words > len(t.slab) {
		sets := max(2*len(t.slab)/t.words, 4)
		slab := make([]uint64, sets*t.words)
		copy(slab, t.slab)
		nt := *t
		nt.slab = slab
		s.tab.Store(&nt)
		t = &nt
	}
	for w := range t.words {
		atomic.StoreUint64(&t.slab[b*t.words+w], 0)
	}
	return b, t
}

func setBitAtomic(t *table, b int, id uint32) {
	p := &t.slab[b*t.words+int(id>>6)]
	atomic.StoreUint64(p, *p|1<<(id&63))
}

// addHolder makes worker id a holder of k and stamps the entry. It reports
// whether id already held k.
func (s *shard) addHolder(k uint64, id uint32, stamp uint32, sb uint8) bool {
	s.writeBegin()
	defer s.writeEnd()
	return s.addHolderLocked(k, id, stamp, sb)
}

// addHolderLocked is addHolder inside writeBegin/writeEnd.
func (s *shard) addHolderLocked(k uint64, id uint32, stamp uint32, sb uint8) bool {
	t := s.tab.Load()
	i := t.find(k, sb)
	if i < 0 {
		s.insertSlot(t, k, id<<1|1, stamp, sb)
		s.mem++
		return false
	}
	t.setStamp(i, stamp)
	h := t.hold(i)
	if h&1 == 1 {
		other := h >> 1
		if other == id {
			return true
		}
		b, nt := s.newSet(t, int(max(id, other)>>6)+1)
		setBitAtomic(nt, b, other)
		setBitAtomic(nt, b, id)
		nt.setHold(i, uint32(b+1)<<1)
		s.mem++
		return false
	}
	b := int(h>>1) - 1
	if int(id>>6) >= t.words {
		_, t = s.widen(t, int(id>>6)+1)
	}
	if t.slab[b*t.words+int(id>>6)]&(1<<(id&63)) != 0 {
		return true
	}
	setBitAtomic(t, b, id)
	s.mem++
	return false
}

// widen publishes a slab whose sets are at least need words wide.
func (s *shard) widen(t *table, need int) (int, *table) {
	words := max(need, 2*t.words)
	sets := max(len(t.slab)/t.words, 4)
	slab := make([]uint64, sets*words)
	for x := range len(t.slab) / t.words {
		copy(slab[x*words:], t.slab[x*t.words:(x+1)*t.words])
	}
	nt := *t
	nt.slab, nt.words = slab, words
	s.tab.Store(&nt)
	return words, &nt
}

// removeHolder drops worker id from k's holders, and the entry with its last
// holder. It reports whether id held k.
func (s *shard) removeHolder(k uint64, id uint32, sb uint8) bool {
	s.writeBegin()
	defer s.writeEnd()
	return s.removeHolderLocked(k, id, sb)
}

// removeHolderLocked is removeHolder inside writeBegin/writeEnd.
func (s *shard) removeHolderLocked(k uint64, id uint32, sb uint8) bool {
	t := s.tab.Load()
	i := t.find(k, sb)
	if i < 0 {
		return false
	}
	h := t.hold(i)
	if h&1 == 1 {
		if h>>1 != id {
			return false
		}
		s.delSlot(t, i, sb)
		s.mem--
		return true
	}
	b := int(h>>1) - 1
	w := int(id >> 6)
	if w >= t.words || t.slab[b*t.words+w]&(1<<(id&63)) == 0 {
		return false
	}
	p := &t.slab[b*t.words+w]
	atomic.StoreUint64(p, *p&^(1<<(id&63)))
	s.mem--
	// Back to the inline form when one holder is left, so a shared prefix that
	// shrinks to one worker costs no bitset.
	var count int
	var last uint32
	for wi, x := range t.slab[b*t.words : (b+1)*t.words] {
		if x != 0 {
			count += bits.OnesCount64(x)
			last = uint32(wi<<6 + 63 - bits.LeadingZeros64(x))
		}
	}
	switch count {
	case 0:
		s.delSlot(t, i, sb)
	case 1:
		s.setsFree = append(s.setsFree, uint32(b))
		t.setHold(i, last<<1|1)
	}
	return true
}

// holders is a consistent read of one entry's holder set.
type holders struct {
	found  bool
	single bool
	id     uint32   // the holder, when single
	set    []uint64 // a copy of the bitset, otherwise
}

// lookup reads k's holders without locking; buf backs the copied bitset.
// With touch, it refreshes the entry's stamp (one store a second at most).
func (s *shard) lookup(k uint64, sb uint8, touch bool, now uint32, buf []uint64) holders {
	for spins := 0; ; spins++ {
		v := s.ver.Load()
		if v&1 == 1 {
			if spins > 64 {
				runtime.Gosched() // the writer may have been preempted mid-write
			}
			continue
		}
		if r, ok := s.tryLookup(k, sb, touch, now, buf); ok && s.ver.Load() == v {
			return r
		}
	}
}

// tryLookup probes one snapshot; ok is false when what it read cannot be
// trusted (a torn read sent it somewhere impossible).
func (s *shard) tryLookup(k uint64, sb uint8, touch bool, now uint32, buf []uint64) (holders, bool) {
	t := s.tab.Load()
	n := t.n
	i := t.home(k, sb)
	for probes := 0; probes < n; probes++ {
		if probes > 0 {
			if i++; i == n {
				i = 0
			}
		}
		h := t.loadHold(i)
		if h == 0 {
			return holders{}, true
		}
		if t.loadKey(i) != k {
			continue
		}
		if touch && t.stamp != nil && atomic.LoadUint32(&t.stamp[i]) != now {
			atomic.StoreUint32(&t.stamp[i], now)
		}
		if h&1 == 1 {
			return holders{found: true, single: true, id: h >> 1}, true
		}
		b := int(h>>1) - 1
		if (b+1)*t.words > len(t.slab) {
			return holders{}, false
		}
		set := buf[:0]
		for w := range t.words {
			set = append(set, atomic.LoadUint64(&t.slab[b*t.words+w]))
		}
		return holders{found: true, set: set}, true
	}
	return holders{}, false
}

// stats returns entries, memberships and an estimate of the shard's bytes.
func (s *shard) stats() (n, mem, bytes int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	t := s.tab.Load()
	return s.n, s.mem, len(t.w)*8 + len(t.stamp)*4 + len(t.slab)*8 + cap(s.setsFree)*4
}

func holderCount(t *table, h uint32) int {
	if h&1 == 1 {
		return 1
	}
	b := int(h>>1) - 1
	n := 0
	for _, x := range t.slab[b*t.words : (b+1)*t.words] {
		n += bits.OnesCount64(x)
	}
	return n
}
