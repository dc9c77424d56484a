package index

import (
	"math/bits"
	"runtime"
	"sync"
	"sync/atomic"
)

// table is one shard's open-addressing map prefix hash → holders (16 bytes a
// slot, 20 with pruning on). A slot's holder word is:
//
//	0                  empty slot
//	id<<1 | 1          exactly one holder, the worker in slot id (the common case:
//	                   a conversation's unique tail is held by one worker)
//	(set+1)<<1         two or more holders: bitset number set in slab, words wide
//
// A table is replaced, never resized in place, so a reader holding an old
// one reads memory that stays valid; the shard's version tells it the
// snapshot went stale.
type table struct {
	slots []fslot
	stamp []uint32 // last store or lookup, seconds since the index's epoch; nil without pruning
	shift uint8
	slab  []uint64 // holder bitsets, words uint64s each
	words int
}

// fslot keeps a key beside its holder word, so a probe costs one cache line.
type fslot struct {
	key  uint64 // prefix hash
	hold uint64 // holder word, see table
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
	var stamp []uint32
	if stamped {
		stamp = make([]uint32, slots)
	}
	return &table{
		slots: make([]fslot, slots),
		stamp: stamp,
		// Prefix hashes are XXH3 outputs, uniform: the bits below the
		// shard-selection bits index the table directly.
		shift: uint8(64 - bits.TrailingZeros(uint(slots))),
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

func (t *table) home(k uint64, sb uint8) int { return int((k << sb) >> t.shift) }

// find returns the slot of k, or -1. Writers only (they own the table).
func (t *table) find(k uint64, sb uint8) int {
	m := len(t.slots) - 1
	for i := t.home(k, sb); ; i = (i + 1) & m {
		if t.slots[i].hold == 0 {
			return -1
		}
		if t.slots[i].key == k {
			return i
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
func (s *shard) insertSlot(t *table, k, hold uint64, stamp uint32, sb uint8) *table {
	if (s.n+1)*5 > len(t.slots)*4 { // keep load ≤ 0.8: linear probing degrades fast above
		nt := newTable(len(t.slots)*2, t.words, t.slab, t.stamp != nil)
		for i, sl := range t.slots {
			if sl.hold != 0 {
				placeNew(nt, sl.key, sl.hold, t.getStamp(i), sb)
			}
		}
		s.tab.Store(nt)
		t = nt
	}
	m := len(t.slots) - 1
	i := t.home(k, sb)
	for t.slots[i].hold != 0 {
		i = (i + 1) & m
	}
	atomic.StoreUint64(&t.slots[i].key, k)
	t.setStamp(i, stamp)
	atomic.StoreUint64(&t.slots[i].hold, hold)
	s.n++
	return t
}

// placeNew fills an unpublished table: plain stores suffice.
func placeNew(t *table, k, hold uint64, stamp uint32, sb uint8) {
	m := len(t.slots) - 1
	i := t.home(k, sb)
	for t.slots[i].hold != 0 {
		i = (i + 1) & m
	}
	t.slots[i] = fslot{key: k, hold: hold}
	if t.stamp != nil {
		t.stamp[i] = stamp
	}
}

// delSlot frees slot i by backward shift (no tombstones) and its bitset.
func (s *shard) delSlot(t *table, i int, sb uint8) {
	if h := t.slots[i].hold; h&1 == 0 {
		s.setsFree = append(s.setsFree, uint32(h>>1-1))
	}
	m := len(t.slots) - 1
	j := i
	for {
		j = (j + 1) & m
		if t.slots[j].hold == 0 {
			break
		}
		h := t.home(t.slots[j].key, sb)
		// Move j back into the hole at i unless its home lies cyclically in (i, j].
		if (j > i && (h <= i || h > j)) || (j < i && (h <= i && h > j)) {
			atomic.StoreUint64(&t.slots[i].key, t.slots[j].key)
			t.setStamp(i, t.getStamp(j))
			atomic.StoreUint64(&t.slots[i].hold, t.slots[j].hold)
			i = j
		}
	}
	atomic.StoreUint64(&t.slots[i].hold, 0)
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
		s.insertSlot(t, k, uint64(id)<<1|1, stamp, sb)
		s.mem++
		return false
	}
	t.setStamp(i, stamp)
	h := t.slots[i].hold
	if h&1 == 1 {
		other := uint32(h >> 1)
		if other == id {
			return true
		}
		b, nt := s.newSet(t, int(max(id, other)>>6)+1)
		setBitAtomic(nt, b, other)
		setBitAtomic(nt, b, id)
		atomic.StoreUint64(&nt.slots[i].hold, uint64(b+1)<<1)
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
	h := t.slots[i].hold
	if h&1 == 1 {
		if uint32(h>>1) != id {
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
		atomic.StoreUint64(&t.slots[i].hold, uint64(last)<<1|1)
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
	m := len(t.slots) - 1
	i := t.home(k, sb)
	for probes := 0; probes <= m; probes, i = probes+1, (i+1)&m {
		h := atomic.LoadUint64(&t.slots[i].hold)
		if h == 0 {
			return holders{}, true
		}
		if atomic.LoadUint64(&t.slots[i].key) != k {
			continue
		}
		if touch && t.stamp != nil && atomic.LoadUint32(&t.stamp[i]) != now {
			atomic.StoreUint32(&t.stamp[i], now)
		}
		if h&1 == 1 {
			return holders{found: true, single: true, id: uint32(h >> 1)}, true
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
	return s.n, s.mem, len(t.slots)*16 + len(t.stamp)*4 + len(t.slab)*8 + cap(s.setsFree)*4
}

func holderCount(t *table, h uint64) int {
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
