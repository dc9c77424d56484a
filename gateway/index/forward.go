package index

import (
	"math/bits"
	"slices"
	"sync"
	"sync/atomic"
)

// The forward map says, for every prefix hash the fleet holds, which workers
// hold it. It is stored as runs: a run is a stretch of consecutive positions
// of one chain (block i+1 extends block i), kept in two parallel arrays, the
// positions' prefix hashes and their holder words. A lookup walks a request
// along a run by comparing its next prefix hash with the run's next one,
// which is a sequential read, and needs a hash-table probe only where the
// request leaves a run: at block 0 and where chains branch. Storing a
// conversation's next turn appends to its run. With one table entry per
// block (the flat layout this replaced), every block of a lookup, a store
// and a removal cost a cache miss.
//
// Holders stay per position, so a worker that lost a block in the middle of
// a run (a hole) stops there exactly, and nothing is split when holder sets
// differ along a run.
//
// Every prefix hash has at most one position: block 0 of a chain, and a
// block whose predecessor's run continues differently or is full, begin a
// run of their own, found by the heads table (prefix hash → run); any other
// block lives right after its predecessor. Writers keep this by looking in
// both places, under both shards' locks, before they append or start a run.
//
// A run belongs to the shard of its first prefix hash. Writers serialise on
// the shard's mutex and make its version odd around each change; readers
// take no lock, read with atomic loads and retry a run when the version
// moved (a seqlock). Arrays are replaced, never resized in place, so a
// reader holding an old one reads memory that stays valid.
//
// A position is named by a loc (shard, run, offset), which the workers'
// reverse tables keep. A run counts the reverse entries that name it and is
// freed when none is left, so a loc never dangles (pruning clears holders,
// not reverse entries, so the count is not the holders').

// maxRunLen bounds a run; the next block starts a run of its own. Long runs
// keep lookups sequential; the bound keeps one run's arrays (and a writer's
// copy when they grow) small.
const maxRunLen = 256

// loc names one position: run index << 20 | shard << 8 | offset (the
// offset below maxRunLen, the shard below 2^12). Its low bits are laid out
// as a reverse entry's packed form (packLoc), so packing and unpacking only
// move the run number.
type loc uint64

const locRunShift = 20

func makeLoc(sh int, run uint32, off int) loc {
	return loc(uint64(run)<<locRunShift | uint64(sh)<<posOffBits | uint64(off))
}
func (l loc) shard() int  { return int(l>>posOffBits) & 0xfff }
func (l loc) run() uint32 { return uint32(l >> locRunShift) }
func (l loc) off() int    { return int(l & (1<<posOffBits - 1)) }

// A reverse entry keeps its position in 32 bits, the reverse tables being
// the index's largest part (a slot per block a worker holds): the offset in
// the low 8 bits (maxRunLen is 256), the shard in the next shardBits, the
// run number in the 24-shardBits above. So a shard has at most
// 2^(24-shardBits)-1 live runs (maxRunsFor; the all-ones word is noPos),
// 16.7 M runs in all whatever the shard count; a store that needs a run
// beyond that is not indexed from there on and is counted (see
// WorkerCounters.UnindexedBlocks).
const (
	posOffBits = 8
	posBits    = 32
	// noPos marks a reverse entry whose block is not filed (yet): between
	// a store's two passes, and for a block a full shard could not take.
	noPos = ^uint32(0)
)

// maxRunsFor is the most live runs a shard can have with sb shard bits.
func maxRunsFor(sb uint8) int { return 1<<(posBits-posOffBits-int(sb)) - 1 }

// packLoc is l in a reverse entry's 32 bits (l's run below maxRunsFor(sb)):
// l's offset and shard bits stay, its run number moves down next to them.
// Both are on every block's path: the shift count is masked (sb is 12 at
// most) so that the compiler drops its handling of over-wide shifts.
func packLoc(l loc, sb uint8) uint32 {
	s := posOffBits + uint(sb)&15
	return uint32(l)&(1<<s-1) | uint32(l>>locRunShift)<<s
}

// unpackLoc is the loc packed in p by packLoc.
func unpackLoc(p uint32, sb uint8) loc {
	s := posOffBits + uint(sb)&15
	return loc(p&(1<<s-1)) | loc(p>>s)<<locRunShift
}

// A holder word (32 bits) is:
//
//	0              no holder
//	id<<1 | 1      exactly one holder, the worker in slot id (the common case:
//	               a conversation's own blocks are held by one worker)
//	(set+1)<<1     two or more holders: bitset number set in the shard's slab

type run struct {
	// ver is the run's own seqlock version: odd while a writer changes the
	// run's positions, holders or arrays. A lookup reading a run checks it,
	// so writes to other runs of the shard do not send it back.
	ver  atomic.Uint64
	n    uint32 // positions in use; written with store32, read atomically
	refs int32  // reverse entries naming a position of this run; guarded by the shard's mu
	body atomic.Pointer[runBody]
	// parent is, for a run started as the continuation of a position of
	// another run (a branch, or a full run), that run (packLoc of its
	// position 0), else noPos; kids counts the live runs whose parent this
	// run is. A run is freed only when no reverse entry names it and it has
	// no live kids, so a run's parent outlives it. Guarded by the run's
	// shard's mu; readers never look at them.
	parent uint32
	kids   int32
	// The run's head (the heads table's key) is its position 0's prefix
	// hash, body.hash(0): not kept twice.
}

// runOverhead is a live run's bytes besides its arrays: the run (24) and
// its runBody (48). The body has two slices, not three (hashes, holders,
// stamps: 72 bytes, 80 with the allocator's rounding), and the run no
// longer keeps its head twice: at block size 128 a run holds about 20
// positions, and the run's 112 bytes were 5.3 of the index's bytes a block.
// (One slice for all, holders packed two to a word, saved 24 bytes more a
// run but cost 9 % more instructions in the corpus replay: every holder
// change became a read-modify-write of a shared word.)
const runOverhead = 32 + 48

// runBody is a run's arrays for size positions: their prefix hashes, and
// their holder words (see above) followed, only in an index that prunes,
// by their stamps past len(holds): position o's at holds[:cap(holds)][size+o]
// (cap(holds) > len(holds) says a body has them). A stamp is the last store
// or lookup, seconds since the index's epoch. Lookups refresh stamps
// (setStamp) without the lock, so a refresh racing a run's growth or reuse
// can be lost or land on another run: it only ages an entry for pruning,
// never changes a match. Writers store stamps with storeStamp.
type runBody struct {
	hashes []uint64
	holds  []uint32
}

func newRunBody(size int, stamped bool) *runBody {
	b := &runBody{hashes: make([]uint64, size)}
	if stamped {
		b.holds = make([]uint32, size, 2*size)
	} else {
		b.holds = make([]uint32, size)
	}
	return b
}

// size is the number of positions b has room for.
func (b *runBody) size() int { return len(b.hashes) }

func (b *runBody) stamped() bool { return cap(b.holds) > len(b.holds) }

// hash is position o's prefix hash (writers, or a reader of a body it
// checks by version; see loadHash).
func (b *runBody) hash(o int) uint64       { return b.hashes[o] }
func (b *runBody) loadHash(o int) uint64   { return atomic.LoadUint64(&b.hashes[o]) }
func (b *runBody) setHash(o int, p uint64) { store64(&b.hashes[o], p) }

// hold is position o's holder word (writers: mu held); loadHold is the
// lock-free readers'.
func (b *runBody) hold(o int) uint32          { return b.holds[o] }
func (b *runBody) loadHold(o int) uint32      { return atomic.LoadUint32(&b.holds[o]) }
func (b *runBody) setHold(o int, h uint32)    { store32(&b.holds[o], h) }
func (b *runBody) stampAt(o int) *uint32      { return &b.holds[:cap(b.holds)][len(b.holds)+o] }
func (b *runBody) loadStamp(o int) uint32     { return atomic.LoadUint32(b.stampAt(o)) }
func (b *runBody) setStamp(o int, v uint32)   { atomic.StoreUint32(b.stampAt(o), v) }
func (b *runBody) storeStamp(o int, v uint32) { store32(b.stampAt(o), v) }

// runDir maps a shard's run numbers to runs; it is replaced when it grows.
type runDir struct {
	r []atomic.Pointer[run]
}

// slab holds a shard's holder bitsets, words uint64s each.
type slab struct {
	w     []uint64
	words int
}

// fullAlloc returns a zeroed slice of at least n elements that uses all of
// its allocation: the allocator rounds a request up to its size class (or
// to whole pages), and the rounded-up tail would otherwise be paid for and
// left empty. Tables are not powers of two, so any length serves.
func fullAlloc[T any](n int) []T {
	s := slices.Grow([]T(nil), n)
	return s[:cap(s)]
}

// shard is one slice of the forward map: the runs whose first prefix hash
// falls in it, their heads table and their holder bitsets.
type shard struct {
	mu   sync.Mutex
	ver  atomic.Uint64
	tab  atomic.Pointer[table]
	dir  atomic.Pointer[runDir]
	sets atomic.Pointer[slab]
	// filter answers most "does this prefix hash head a run?" questions
	// without probing tab (see headFilter); filterStale counts the heads
	// deleted since it was built, whose bits it still has.
	filter      atomic.Pointer[headFilter]
	filterStale int

	heads    int // guarded by mu
	runsUsed int // run numbers handed out (high water); guarded by mu
	runsFree []uint32
	setsUsed int
	setsFree []uint32
	bytes    int // run arrays' capacity in bytes; guarded by mu
	// maxRuns is the most run numbers the shard may hand out (maxRunsFor:
	// a reverse entry names a run in the bits packLoc leaves it).
	maxRuns int
	// capWarned: the run cap's warning was logged for this shard.
	capWarned bool
	// pool recycles run arrays given back (the index's, shared by its
	// shards): runs come and go with conversations, and allocating their
	// arrays anew made the garbage collector a fifth of a replay's time.
	pool *arrayPool

	// Counted by the writers (mu held, plain stores), read without locking.
	entries uint64 // positions with at least one holder
	mem     uint64 // memberships (worker, position)

	_ [64]byte // keep neighbouring shards' versions off one cache line
}

const shardMinSlots = 64

func (s *shard) init(maxRuns int, pool *arrayPool) {
	s.maxRuns = maxRuns
	s.pool = pool
	s.filter.Store(newHeadFilter(shardMinSlots))
	s.tab.Store(newTable(shardMinSlots))
	s.dir.Store(&runDir{r: make([]atomic.Pointer[run], 16)})
	s.sets.Store(&slab{words: 1})
}

// begin and end bracket every change a reader could observe (mu held).
func (s *shard) begin() { s.ver.Add(1) }
func (s *shard) end()   { s.ver.Add(1) }

func (s *shard) runAt(idx uint32) *run { return s.dir.Load().r[idx].Load() }

// insertHead adds k → idx (k absent), growing the table by a quarter to keep
// its load at or below 0.8 (linear probing degrades fast above).
func (s *shard) insertHead(k uint64, idx uint32, sb uint8) {
	t := s.tab.Load()
	if (s.heads+1)*5 > t.n*4 {
		nt := newTable(t.n + t.n/4)
		for i := range t.n {
			if v := t.val(i); v != 0 {
				j := nt.home(t.key(i), sb)
				for nt.val(j) != 0 {
					if j++; j == nt.n {
						j = 0
					}
				}
				nt.w[keyWord(j)] = t.key(i)
				nt.w[valWord(j)] |= uint64(v) << valShift(j)
			}
		}
		s.tab.Store(nt)
		s.rebuildFilter(nt)
		t = nt
	}
	s.filter.Load().add(k)
	n := t.n
	i := t.home(k, sb)
	for t.val(i) != 0 {
		if i++; i == n {
			i = 0
		}
	}
	t.put(i, k, idx+1)
	s.heads++
}

// headFilter is a one-hash Bloom filter over a shard's heads, eight bits a
// heads-table slot: a head's bit is set when its run starts and cleared only
// when the filter is rebuilt (when the table grows, or once as many heads
// were deleted as are left, O(table) after as many deletions). A writer
// appending a block to a run first asks whether the block heads a run of
// its own (noHead): nearly always not, and a heads-table probe for a key it
// does not hold walks about 13 slots at the table's load of 0.8 — 7 % of
// the Mooncake corpus replay's instructions. A clear bit answers no
// without the probe; a set bit (about one in ten for a non-head) probes.
//
// A lock-free reader may hold a filter that a rebuild has replaced: it
// still has the bit of every head made before the reader took the lock of
// the run it appends to, which are the heads noHead must see (see place).
type headFilter struct{ w []uint64 }

func newHeadFilter(slots int) *headFilter {
	return &headFilter{w: make([]uint64, max(1, slots/8))}
}

// bit locates k's bit: the low 32 bits of k (the heads table's home uses
// its top bits), mapped onto the filter by a multiply-high.
func (f *headFilter) bit(k uint64) (word int, mask uint64) {
	b := uint64(uint32(k)) * uint64(len(f.w)*64) >> 32
	return int(b >> 6), 1 << (b & 63)
}

// mayHave reports false when k surely heads no run (lock-free).
func (f *headFilter) mayHave(k uint64) bool {
	i, m := f.bit(k)
	return atomic.LoadUint64(&f.w[i])&m != 0
}

// add sets k's bit (mu held).
func (f *headFilter) add(k uint64) {
	i, m := f.bit(k)
	store64(&f.w[i], f.w[i]|m)
}

// rebuildFilter publishes a filter of t's heads, without stale bits (mu held).
func (s *shard) rebuildFilter(t *table) {
	f := newHeadFilter(t.n)
	for i := range t.n {
		if t.val(i) != 0 {
			f.add(t.key(i))
		}
	}
	s.filter.Store(f)
	s.filterStale = 0
}

// staleBound is how many deleted heads a filter may still have bits for
// before it is rebuilt: as many as the live heads, so that at most half its
// bits are stale, but never fewer than a quarter of the table's slots. A
// rebuild scans the whole table, which does not shrink when the heads drain,
// so a bound of the live heads alone would rebuild a peak-sized filter every
// few deletions in a drained shard; a quarter of the slots makes each
// rebuild's cost amortized over that many deletions.
func staleBound(heads, slots int) int {
	return max(heads+8, slots/4)
}

// deleteHead removes k by backward shift (no tombstones).
func (s *shard) deleteHead(k uint64, sb uint8) {
	t := s.tab.Load()
	i := t.find(k, sb)
	if i < 0 {
		return
	}
	n := t.n
	j := i
	for {
		if j++; j == n {
			j = 0
		}
		if t.val(j) == 0 {
			break
		}
		kj := t.key(j)
		h := t.home(kj, sb)
		if fillsHole(i, j, h) {
			t.put(i, kj, t.val(j))
			i = j
		}
	}
	t.setVal(i, 0)
	s.heads--
	if s.filterStale++; s.filterStale > staleBound(s.heads, t.n) {
		s.rebuildFilter(t)
	}
}

// newRunFor starts a run at prefix hash p and files it as a head, its
// arrays sized for room positions, the blocks of a stored event that will
// likely follow p into it (see appendPosFor). It returns false, changing
// nothing, when the shard has maxRuns live runs already: a reverse entry
// could not name another (see packLoc).
func (s *shard) newRunFor(p uint64, stamped bool, sb uint8, room int) (uint32, bool) {
	var idx uint32
	if k := len(s.runsFree); k > 0 {
		idx = s.runsFree[k-1]
		s.runsFree = s.runsFree[:k-1]
	} else {
		if s.runsUsed >= s.maxRuns {
			return 0, false
		}
		idx = uint32(s.runsUsed)
		s.runsUsed++
		if d := s.dir.Load(); int(idx) >= len(d.r) {
			nd := &runDir{r: make([]atomic.Pointer[run], 2*len(d.r))}
			for i := range d.r {
				nd.r[i].Store(d.r[i].Load())
			}
			s.dir.Store(nd)
		}
	}
	r := &run{parent: noPos}
	b := s.getBody(max(minBody, min(room, maxRunLen)), stamped)
	s.bytes += bodyBytes(b)
	b.setHash(0, p)
	r.body.Store(b)
	store32(&r.n, 1)
	s.dir.Load().r[idx].Store(r)
	s.insertHead(p, idx, sb)
	return idx, true
}

// Run arrays come in a few sizes, up to maxRunLen, each half again the one
// before: most runs are a shared prompt plus a turn or two, and doubling
// left a third of the arrays empty.
var bodySizes = [...]int{4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, maxRunLen}

const (
	minBody     = 4
	bodyClasses = len(bodySizes)
)

// bodyClass is the class of the arrays for n positions (n a size).
func bodyClass(n int) int {
	for k, c := range bodySizes {
		if n <= c {
			return k
		}
	}
	return bodyClasses - 1
}

// nextBodySize is the size after n.
func nextBodySize(n int) int { return bodySizes[min(bodyClass(n)+1, bodyClasses-1)] }

// getBody returns arrays for n positions (a size class), holders and stamps
// zero, from the index's pool (see arrayPool.getBody).
func (s *shard) getBody(n int, stamped bool) *runBody {
	return s.pool.getBody(bodyClass(n), stamped)
}

// putBody gives b back to the pool (mu held, and b's run's version odd, so
// that lookups reading b will read again).
func (s *shard) putBody(b *runBody) { s.pool.putBody(b) }

func bodyBytes(b *runBody) int { return len(b.hashes)*8 + cap(b.holds)*4 }

// appendPos adds p at the end of r (r.n < maxRunLen), growing its arrays.
func (s *shard) appendPos(r *run, p uint64) int { return s.appendPosFor(r, p, 1) }

// appendPosFor is appendPos for the first of room blocks that will likely
// follow it into r (the rest of a stored event): arrays that must grow grow
// at once to the size class that holds them all, not one class at a time,
// each growth copying the run.
func (s *shard) appendPosFor(r *run, p uint64, room int) int {
	o := int(r.n)
	b := r.body.Load()
	if o == b.size() {
		nb := s.getBody(max(nextBodySize(o), min(o+room, maxRunLen)), b.stamped())
		copy64(nb.hashes[:o], b.hashes[:o])
		copy32(nb.holds[:o], b.holds[:o])
		if b.stamped() { // lookups refresh stamps without the lock
			for i := range o {
				nb.storeStamp(i, b.loadStamp(i))
			}
		}
		s.bytes += bodyBytes(nb) - bodyBytes(b)
		r.body.Store(nb)
		s.putBody(b)
		b = nb
	}
	// Holder and stamp at o are zero already: arrays start zeroed, and
	// positions past n were never used.
	b.setHash(o, p)
	store32(&r.n, uint32(o+1))
	return o
}

// freeRun drops run idx, which no reverse entry names any more.
func (s *shard) freeRun(idx uint32, sb uint8) {
	r := s.runAt(idx)
	b := r.body.Load()
	head := b.hash(0)
	for o := range int(r.n) {
		if h := b.hold(o); h != 0 { // only pruned positions can be left, and prune clears them
			s.clearPos(b, o)
		}
	}
	s.bytes -= bodyBytes(b)
	s.putBody(b)
	// A lookup may still hold r, found through the heads table just before
	// this; r's version will not move again, so r must read as empty, not as
	// whatever the array's next owner writes into it.
	store32(&r.n, 0)
	s.deleteHead(head, sb)
	s.dir.Load().r[idx].Store(nil)
	s.runsFree = append(s.runsFree, idx)
}

// newSet hands out a zeroed bitset at least need words wide.
func (s *shard) newSet(need int) (int, *slab) {
	sl := s.sets.Load()
	if need > sl.words {
		sl = s.widen(need)
	}
	var b int
	if k := len(s.setsFree); k > 0 {
		b = int(s.setsFree[k-1])
		s.setsFree = s.setsFree[:k-1]
	} else {
		b = s.setsUsed
		s.setsUsed++
	}
	if (b+1)*sl.words > len(sl.w) {
		sets := max(2*len(sl.w)/sl.words, 4)
		w := make([]uint64, sets*sl.words)
		copy(w, sl.w)
		sl = &slab{w: w, words: sl.words}
		s.sets.Store(sl)
	}
	for w := range sl.words {
		store64(&sl.w[b*sl.words+w], 0)
	}
	return b, sl
}

// widen publishes a slab whose sets are at least need words wide.
func (s *shard) widen(need int) *slab {
	old := s.sets.Load()
	words := max(need, 2*old.words)
	sets := max(len(old.w)/old.words, 4)
	w := make([]uint64, sets*words)
	for x := range len(old.w) / old.words {
		copy(w[x*words:], old.w[x*old.words:(x+1)*old.words])
	}
	sl := &slab{w: w, words: words}
	s.sets.Store(sl)
	return sl
}

func setBit(sl *slab, b int, id uint32) {
	p := &sl.w[b*sl.words+int(id>>6)]
	store64(p, *p|1<<(id&63))
}

// addHolder makes worker id a holder of position o of b and stamps it; it
// reports whether id already held it.
func (s *shard) addHolder(b *runBody, o int, id uint32, stamp uint32) bool {
	if b.stamped() {
		b.storeStamp(o, stamp)
	}
	h := b.hold(o)
	switch {
	case h == 0:
		b.setHold(o, id<<1|1)
		s.count(&s.entries, 1)
	case h&1 == 1:
		other := h >> 1
		if other == id {
			return true
		}
		set, sl := s.newSet(int(max(id, other)>>6) + 1)
		setBit(sl, set, other)
		setBit(sl, set, id)
		b.setHold(o, uint32(set+1)<<1)
	default:
		set := int(h>>1) - 1
		sl := s.sets.Load()
		if int(id>>6) >= sl.words {
			sl = s.widen(int(id>>6) + 1)
		}
		if sl.w[set*sl.words+int(id>>6)]&(1<<(id&63)) != 0 {
			return true
		}
		setBit(sl, set, id)
	}
	s.count(&s.mem, 1)
	return false
}

// removeHolder drops worker id from position o's holders; it reports
// whether id held it.
func (s *shard) removeHolder(b *runBody, o int, id uint32) bool {
	h := b.hold(o)
	switch {
	case h == 0:
		return false
	case h&1 == 1:
		if h>>1 != id {
			return false
		}
		b.setHold(o, 0)
		s.count(&s.entries, -1)
		s.count(&s.mem, -1)
		return true
	}
	set := int(h>>1) - 1
	sl := s.sets.Load()
	w := int(id >> 6)
	if w >= sl.words || sl.w[set*sl.words+w]&(1<<(id&63)) == 0 {
		return false
	}
	p := &sl.w[set*sl.words+w]
	store64(p, *p&^(1<<(id&63)))
	s.count(&s.mem, -1)
	// Back to the inline form when one holder is left, so a shared prefix
	// that shrinks to one worker costs no bitset.
	var count int
	var last uint32
	for wi, x := range sl.w[set*sl.words : (set+1)*sl.words] {
		if x != 0 {
			count += bits.OnesCount64(x)
			last = uint32(wi<<6 + 63 - bits.LeadingZeros64(x))
		}
	}
	switch count {
	case 0:
		s.setsFree = append(s.setsFree, uint32(set))
		b.setHold(o, 0)
		s.count(&s.entries, -1)
	case 1:
		s.setsFree = append(s.setsFree, uint32(set))
		b.setHold(o, last<<1|1)
	}
	return true
}

// clearPos drops every holder of position o and returns how many there were.
func (s *shard) clearPos(b *runBody, o int) int {
	h := b.hold(o)
	if h == 0 {
		return 0
	}
	n := 1
	if h&1 == 0 {
		set := int(h>>1) - 1
		sl := s.sets.Load()
		n = 0
		for _, x := range sl.w[set*sl.words : (set+1)*sl.words] {
			n += bits.OnesCount64(x)
		}
		s.setsFree = append(s.setsFree, uint32(set))
	}
	b.setHold(o, 0)
	s.count(&s.entries, -1)
	s.count(&s.mem, -int64(n))
	return n
}

// count adds d to a counter of s (mu held).
func (s *shard) count(c *uint64, d int64) { store64(c, *c+uint64(d)) }

// load reads a counter of s without locking.
func load(c *uint64) int64 { return int64(atomic.LoadUint64(c)) }

// memBytes estimates the shard's own memory (mu held).
func (s *shard) memBytes() int {
	return len(s.tab.Load().w)*8 + len(s.dir.Load().r)*8 + (s.runsUsed-len(s.runsFree))*runOverhead +
		s.bytes + len(s.sets.Load().w)*8 + len(s.filter.Load().w)*8 + cap(s.setsFree)*4 + cap(s.runsFree)*4
}

// tryHasHead reports, without locking, whether k heads a run of s; ok is
// false when a writer was changing s. A writer must not wait for another
// one's version to turn even while its own is odd: two writers doing that
// to each other would wait forever. It takes the ordered locks instead.
func (s *shard) tryHasHead(k uint64, sb uint8) (has, ok bool) {
	if !s.filter.Load().mayHave(k) {
		return false, true
	}
	for range 4 {
		v := s.ver.Load()
		if v&1 == 1 {
			continue
		}
		val, good := s.tab.Load().tryFind(k, sb)
		if good && s.ver.Load() == v {
			return val != 0, true
		}
	}
	return false, false
}
