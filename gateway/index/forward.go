package index

import (
	"math/bits"
	"slices"
	"sync"
	"sync/atomic"
	"unsafe"
)

// The forward map says which workers hold which block prefixes. A
// position's identity is its path from the root: it is stored as runs, a
// run being a stretch of consecutive positions of one chain (block i+1
// extends block i) that hangs after a position of its parent run, or off
// the root. A run keeps its positions' CONTENT hashes (ContentHash), so a
// lookup by content hashes compares them in place, and a store chains no
// hash: the prefix hash of a position is implied by its path (the run's
// head prefix hash, kept for the prefix-hash lookups, then ChainHash along
// the run's content).
//
// Two tables find runs: the child table, (parent run, parent offset,
// first content hash) → run, the root's children included (parent 0); and
// the heads table, head prefix hash → run, for the runs that have a parent
// (a root child's head prefix hash is its content hash, which the child
// table answers). A store looks for an existing position only where its
// chain leaves a run (a branch inside it, or after a full run): appending at
// a run's end needs no look, since a run hanging after a run's last
// position is made only when that run is full, and a live run never
// shrinks. So every path has at most one position.
//
// Coverage is kept per (run, worker): the number of positions the worker
// holds consecutively from the run's offset 0 (lead), which is what a
// lookup reads, plus, for a worker that has a hole in the run, a bitmap of
// the offsets it holds past its lead, so that refilling the hole restores
// the lead exactly. A worker holds a position (the holder bit of the old
// forward map) exactly when its coverage includes it.
//
// Concurrency: one writer at a time (forward.mu, held over an event's
// forward pass; the reverse tables are changed outside it, under the
// worker's lock). Readers take no lock. Each run has a seqlock version the
// writer makes odd the first time it changes the run and even again when it
// settles (at an event's end, or every settleEvery blocks); a run's arrays
// are published through an atomic pointer and replaced, never resized in
// place; run headers sit in fixed chunks that never move; the two tables
// carry one version each. A reader trusts what it read of a run only if
// the run's version was even and unchanged around the reads, and checks
// that a run found through a table is still that child (parent, offset,
// first hash), which covers a run freed and reused meanwhile; a lookup that
// saw a change is redone.
//
// A position is named in 32 bits (loc, the reverse tables' position
// field): run id (24 bits) and offset (8 bits, maxRunLen 256); a chain
// longer than a run continues in a child run hanging after offset 255. A
// run counts the reverse entries naming its positions (refs) and its live
// children (kids), and is freed when neither is left, so a loc never
// dangles and a run's parent outlives it.

// maxRunLen bounds a run; a longer chain continues in a child run.
const maxRunLen = 256

const (
	posOffBits = 8
	// noPos marks a reverse entry whose block is not filed (yet): between
	// a store's two passes, and for a block left out at the run cap.
	noPos = ^uint32(0)
	// maxRunID is the highest run id: its offset 255 would be noPos.
	maxRunID  = 1<<(32-posOffBits) - 2
	chunkBits = 8
	// settleEvery bounds how long a lookup meeting a run that an event is
	// changing waits for it: an event's forward pass settles its changes
	// every settleEvery blocks, so a 2,000-block snapshot chunk does not keep
	// a run's version odd, and its lookups retrying, for the whole chunk.
	settleEvery = 64
)

// loc names one position: run id << 8 | offset.
type loc uint32

func makeLoc(run uint32, off int) loc { return loc(run<<posOffBits | uint32(off)) }
func (l loc) run() uint32             { return uint32(l) >> posOffBits }
func (l loc) off() int                { return int(l & (1<<posOffBits - 1)) }

// run is a run's header (40 bytes): its arrays are in body, n and ncov
// are their lengths in use.
type run struct {
	ver  atomic.Uint32
	n    uint32 // positions (store32; readers load atomically)
	ncov uint32 // coverage entries (idem)
	from loc    // the parent position this run hangs after; 0: the root (idem)
	kids uint32 // live child runs (writer only)
	refs uint32 // reverse entries naming a position of this run (writer only)
	head uint64 // position 0's prefix hash (store64; readers load atomically)
	body atomic.Pointer[runBody]
}

// runBody is a run's arrays, at full capacity: a content hash per position
// (size of them) followed, only in a pruning index, by a 32-bit stamp per
// position, two to a word (size/2 words more; see stampAt); one coverage
// entry per worker holding any position. It is replaced, never changed in
// place but for the stores of positions and entries past the lengths
// readers read, and stamps.
type runBody struct {
	h   []uint64
	cov []cover
}

// runBodyBytes is a body's own bytes (two slices).
const runBodyBytes = 48

// hsize is the positions an array h has room for.
func hsize(h []uint64, stamped bool) int {
	if stamped {
		return len(h) / 3 * 2
	}
	return len(h)
}

// stampAt is position o's stamp in a stamped array h of size positions.
func stampAt(h []uint64, size, o int) *uint32 {
	return &(*[2]uint32)(unsafe.Pointer(&h[size+o>>1]))[o&1]
}

// freeCovCap bounds the coverage arrays kept for reuse.
const freeCovCap = 256

// The writer's views of a live run's arrays.
func (r *run) hs() []uint64  { return r.body.Load().h[:r.n] }
func (r *run) covs() []cover { return r.body.Load().cov[:r.ncov] }

// stampOf is position o's stamp in r; nil when the index does not prune.
func (f *forward) stampOf(r *run, o int) *uint32 {
	if !f.stamped {
		return nil
	}
	h := r.body.Load().h
	return stampAt(h, hsize(h, true), o)
}

// cover is one worker's coverage of a run. Readers read w and lead
// (atomically); held and holes are the writer's.
type cover struct {
	w     uint32
	lead  uint32 // positions held consecutively from offset 0
	held  uint32 // positions held in all
	holes int32  // 1 + index in forward.holes of the bitmap of held offsets past lead; 0: none
}

type runChunk [1 << chunkBits]run

// runDir is the chunks of run headers, by id >> chunkBits. A chunk never
// moves; the directory is copied when it grows, and the copy published.
type runDir struct{ c []*runChunk }

// forward is an index's forward map.
type forward struct {
	mu       sync.Mutex
	dir      atomic.Pointer[runDir] // run id → header; id 0 is the root, never a run
	nruns    uint32                 // ids handed out, the root's included
	chunks   int
	freeRuns []uint32
	maxRuns  uint32   // the highest run id a store may take (maxRunID; tests lower it)
	touched  []uint32 // runs whose version the writer made odd
	kids     keyTable // (parent position, content hash) → child run
	heads    keyTable // (0, head prefix hash) → run, runs with a parent only
	holes    [][]uint64
	freeHole []int32
	// freeCov keeps freed runs' coverage arrays for new runs (at most
	// freeCovCap): a run's first holder would otherwise allocate one.
	freeCov [][]cover
	pool    *arrayPool
	stamped bool
	// ci is the writer's hint of the coverage entry it used last.
	ci int
	// Counted by the writer (mu held, store64), read without locking.
	mem   uint64 // memberships (worker, position)
	bytes int    // content and stamp arrays in use, in bytes (mu held)
	// capWarned: the run cap's warning was logged.
	capWarned bool
	// onSettle, when set (tests), is told how many runs each settle ends.
	onSettle func(touched int)
}

func (f *forward) init(pool *arrayPool, stamped bool) {
	f.pool, f.stamped, f.maxRuns, f.nruns = pool, stamped, maxRunID, 1
	f.dir.Store(&runDir{c: []*runChunk{new(runChunk)}})
	f.chunks = 1
}

// run is run id's header.
func (f *forward) run(id uint32) *run {
	return &f.dir.Load().c[id>>chunkBits][id&(1<<chunkBits-1)]
}

// touch makes run id's version odd until the next settle, unless it is.
func (f *forward) touch(id uint32) *run {
	r := f.run(id)
	if r.ver.Load()&1 == 0 {
		r.ver.Add(1)
		f.touched = append(f.touched, id)
	}
	return r
}

// settle ends the changes made so far: every run touched gets an even
// version again, and lookups waiting on them go ahead.
func (f *forward) settle() {
	if f.onSettle != nil {
		f.onSettle(len(f.touched))
	}
	for _, id := range f.touched {
		f.run(id).ver.Add(1)
	}
	f.touched = f.touched[:0]
}

// unlock settles and lets the next writer in.
func (f *forward) unlock() {
	f.settle()
	f.mu.Unlock()
}

// Run arrays come in a few sizes, up to maxRunLen, each half again the one
// before: most runs are a shared prompt plus a turn or two, and doubling
// left a third of the arrays empty.
var bodySizes = [...]int{4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, maxRunLen}

const (
	minBody     = 4
	bodyClasses = len(bodySizes)
)

// bodyClass is the class of the arrays for n positions.
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

// arrLen is the length of a run's array for size positions.
func arrLen(size int, stamped bool) int {
	if stamped {
		return size + size/2
	}
	return size
}

// getArrays returns a run's array for n positions (stamps zero).
func (f *forward) getArrays(n int) []uint64 {
	h := f.pool.getArrays(bodyClass(n), f.stamped)
	f.bytes += len(h) * 8
	return h
}

// putArrays gives a run's array back (its version odd).
func (f *forward) putArrays(h []uint64) {
	if len(h) == 0 {
		return
	}
	f.bytes -= len(h) * 8
	f.pool.putArrays(h, f.stamped)
}

// newRun makes a run of one position, content c and head prefix hash head,
// hanging after (parent, poff), with room for room positions; false when
// no run id is left (the caller leaves the store out).
func (f *forward) newRun(parent uint32, poff int, c, head uint64, room int) (uint32, bool) {
	var id uint32
	if n := len(f.freeRuns); n > 0 {
		id = f.freeRuns[n-1]
		f.freeRuns = f.freeRuns[:n-1]
	} else {
		if f.nruns > f.maxRuns {
			return 0, false
		}
		id = f.nruns
		f.nruns++
		if id&(1<<chunkBits-1) == 0 {
			d := f.dir.Load()
			c := make([]*runChunk, len(d.c)+1, max(2*len(d.c), 4))
			copy(c, d.c)
			c[len(d.c)] = new(runChunk)
			f.dir.Store(&runDir{c: c})
			f.chunks++
		}
	}
	r := f.touch(id)
	h := f.getArrays(max(minBody, min(room, maxRunLen)))
	store64(&h[0], c)
	b := &runBody{h: h}
	if k := len(f.freeCov); k > 0 {
		b.cov = f.freeCov[k-1]
		f.freeCov[k-1] = nil
		f.freeCov = f.freeCov[:k-1]
	}
	r.body.Store(b)
	store32(&r.n, 1)
	store32(&r.ncov, 0)
	store32((*uint32)(&r.from), uint32(makeLoc(parent, poff)))
	store64(&r.head, head)
	r.kids, r.refs = 0, 0
	f.kids.put(uint32(makeLoc(parent, poff)), c, id)
	if parent != 0 {
		f.heads.put(0, head, id)
		f.run(parent).kids++
	}
	return id, true
}

// appendPos adds content c at the end of run id (r, n < maxRunLen), in
// larger arrays, for room positions more, when r's are full.
func (f *forward) appendPos(id uint32, r *run, c uint64, room int) {
	f.touch(id)
	n := int(r.n)
	b := r.body.Load()
	if size := hsize(b.h, f.stamped); n == size {
		h := f.getArrays(max(nextBodySize(n), min(n+room, maxRunLen)))
		copy64(h[:n], b.h[:n])
		if f.stamped { // lookups refresh stamps without the lock
			ns := hsize(h, true)
			for i := range n {
				store32(stampAt(h, ns, i), atomic.LoadUint32(stampAt(b.h, size, i)))
			}
		}
		store64(&h[n], c)
		r.body.Store(&runBody{h: h, cov: b.cov})
		f.putArrays(b.h)
	} else {
		store64(&b.h[n], c)
		if f.stamped {
			store32(stampAt(b.h, size, n), 0)
		}
	}
	store32(&r.n, uint32(n+1))
}

// freeRun frees run id (no reverse entry names it, no live child), then
// each parent up the chain whose last child it was and which no reverse
// entry names.
func (f *forward) freeRun(id uint32) {
	for {
		r := f.touch(id)
		for ci := int(r.ncov) - 1; ci >= 0; ci-- { // only pruning leaves any, and it clears them
			f.dropCover(r, ci)
		}
		b := r.body.Load()
		f.kids.del(uint32(r.from), b.h[0], id)
		parent := r.from.run()
		if parent != 0 {
			f.heads.del(0, r.head, id)
		}
		f.putArrays(b.h)
		if len(f.freeCov) < freeCovCap && len(b.cov) > 0 && len(b.cov) <= 8 {
			f.freeCov = append(f.freeCov, b.cov)
		}
		store32(&r.n, 0)
		store32(&r.ncov, 0)
		r.body.Store(nil)
		f.freeRuns = append(f.freeRuns, id)
		if parent == 0 {
			return
		}
		p := f.run(parent)
		if p.kids--; p.kids != 0 || p.refs != 0 {
			return
		}
		id = parent
	}
}

// prefixAt is the prefix hash of position l (writer).
func (f *forward) prefixAt(l loc) uint64 {
	h := f.run(l.run()).hs()
	p := f.run(l.run()).head
	for o := 1; o <= l.off(); o++ {
		p = ChainHash(p, h[o])
	}
	return p
}

// follow is the position of content c after prev (after the root when
// !chained), if the forward map has it (writer).
func (f *forward) follow(prev loc, chained bool, c uint64) (loc, bool) {
	if !chained {
		id := f.kids.find(0, c)
		return makeLoc(id, 0), id != 0
	}
	r := f.run(prev.run())
	if o := prev.off() + 1; o < int(r.n) && r.hs()[o] == c {
		return makeLoc(prev.run(), o), true
	}
	id := f.kids.find(uint32(prev), c)
	return makeLoc(id, 0), id != 0
}

// place finds or makes the position of content c after prev (after the
// root when !chained). room counts the event's blocks from c on: a run that
// c starts or grows gets arrays for all of them at once. It returns false
// when c needs a new run and no run id is left.
func (f *forward) place(prev loc, chained bool, c uint64, room int) (loc, bool) {
	if !chained {
		if id := f.kids.find(0, c); id != 0 {
			return makeLoc(id, 0), true
		}
		id, ok := f.newRun(0, 0, c, c, room)
		return makeLoc(id, 0), ok
	}
	pid, o := prev.run(), prev.off()+1
	r := f.run(pid)
	n := int(r.n)
	if o < n && r.hs()[o] == c {
		return makeLoc(pid, o), true
	}
	if o == n && n < maxRunLen {
		// At the run's end no child can hang (one is made only inside a
		// run or after a full one, and a live run never shrinks).
		f.appendPos(pid, r, c, room)
		return makeLoc(pid, o), true
	}
	if id := f.kids.find(uint32(makeLoc(pid, o-1)), c); id != 0 {
		return makeLoc(id, 0), true
	}
	id, ok := f.newRun(pid, o-1, c, ChainHash(f.prefixAt(prev), c), room)
	return makeLoc(id, 0), ok
}

// coverOf is the index of w's coverage entry in r, appended if absent
// (r touched).
func (f *forward) coverOf(r *run, w uint32) int {
	b := r.body.Load()
	cov := b.cov[:r.ncov]
	if ci := f.ci; ci < len(cov) && cov[ci].w == w {
		return ci
	}
	for i := range cov {
		if cov[i].w == w {
			f.ci = i
			return i
		}
	}
	n := len(cov)
	if n == len(b.cov) {
		a := make([]cover, max(2, 2*n))
		copy(a, cov)
		a[n] = cover{w: w}
		r.body.Store(&runBody{h: b.h, cov: a})
	} else {
		e := &b.cov[n]
		store32(&e.w, w)
		store32(&e.lead, 0)
		e.held, e.holes = 0, 0
	}
	store32(&r.ncov, uint32(n+1))
	f.ci = n
	return n
}

// findCover is the index of w's coverage entry in r, or -1.
func (f *forward) findCover(r *run, w uint32) int {
	cov := r.covs()
	if ci := f.ci; ci < len(cov) && cov[ci].w == w {
		return ci
	}
	for i := range cov {
		if cov[i].w == w {
			return i
		}
	}
	return -1
}

// covers reports whether e includes offset o.
func (f *forward) covers(e *cover, o uint32) bool {
	if o < e.lead {
		return true
	}
	if e.holes == 0 {
		return false
	}
	b := f.holes[e.holes-1]
	return int(o>>6) < len(b) && b[o>>6]&(1<<(o&63)) != 0
}

func (f *forward) holeBits(e *cover, words int) []uint64 {
	if e.holes == 0 {
		var b []uint64
		if n := len(f.freeHole); n > 0 {
			e.holes = f.freeHole[n-1]
			f.freeHole = f.freeHole[:n-1]
			b = f.holes[e.holes-1][:0]
		} else {
			f.holes = append(f.holes, nil)
			e.holes = int32(len(f.holes))
		}
		f.holes[e.holes-1] = b
	}
	b := f.holes[e.holes-1]
	if len(b) < words {
		b = append(b, make([]uint64, words-len(b))...)
		f.holes[e.holes-1] = b
	}
	return b
}

// addHolder makes worker w a holder of position o of run r (touched); it
// reports whether w held it already.
func (f *forward) addHolder(r *run, w uint32, o int) bool {
	ci := f.coverOf(r, w)
	e := &r.covs()[ci]
	off := uint32(o)
	switch {
	case off < e.lead:
		return true
	case off == e.lead:
		lead := off + 1
		if e.holes != 0 {
			b := f.holes[e.holes-1]
			for int(lead>>6) < len(b) && b[lead>>6]&(1<<(lead&63)) != 0 {
				b[lead>>6] &^= 1 << (lead & 63)
				lead++
			}
		}
		store32(&e.lead, lead)
	default:
		b := f.holeBits(e, int(off>>6)+1)
		if b[off>>6]&(1<<(off&63)) != 0 {
			return true
		}
		b[off>>6] |= 1 << (off & 63)
	}
	e.held++
	store64(&f.mem, f.mem+1)
	return false
}

// removeHolder drops worker w from the holders of position o of run r
// (touched); it reports whether w held it.
func (f *forward) removeHolder(r *run, w uint32, o int) bool {
	ci := f.findCover(r, w)
	if ci < 0 || !f.covers(&r.covs()[ci], uint32(o)) {
		return false
	}
	f.uncover(r, ci, uint32(o))
	return true
}

// uncover drops offset off, which r's coverage entry ci includes.
func (f *forward) uncover(r *run, ci int, off uint32) {
	e := &r.covs()[ci]
	e.held--
	store64(&f.mem, f.mem-1)
	switch {
	case off+1 == e.lead:
		store32(&e.lead, off)
	case off < e.lead:
		// A hole inside the lead: the positions after it are held past the lead now.
		b := f.holeBits(e, int((e.lead-1)>>6)+1)
		for o := off + 1; o < e.lead; {
			if o&63 == 0 && o+64 <= e.lead {
				b[o>>6] = ^uint64(0)
				o += 64
				continue
			}
			b[o>>6] |= 1 << (o & 63)
			o++
		}
		store32(&e.lead, off)
	default:
		b := f.holes[e.holes-1]
		b[off>>6] &^= 1 << (off & 63)
	}
	if e.held == 0 {
		f.removeCover(r, ci)
	}
}

// dropCover removes r's coverage entry ci whatever it holds (r touched).
func (f *forward) dropCover(r *run, ci int) {
	store64(&f.mem, f.mem-uint64(r.covs()[ci].held))
	f.removeCover(r, ci)
}

func (f *forward) removeCover(r *run, ci int) {
	cov := r.covs()
	e := &cov[ci]
	if e.holes != 0 {
		clear(f.holes[e.holes-1])
		f.freeHole = append(f.freeHole, e.holes)
	}
	last := len(cov) - 1
	l := cov[last]
	store32(&e.w, l.w)
	store32(&e.lead, l.lead)
	e.held, e.holes = l.held, l.holes
	store32(&r.ncov, uint32(last))
}

// heldMask sets in m (len ≥ (r.n+63)/64, cleared) the offsets of r some
// worker holds, and returns how many there are (writer).
func (f *forward) heldMask(r *run, m []uint64) int {
	cov := r.covs()
	for i := range cov {
		e := &cov[i]
		setRange(m, 0, int(e.lead))
		if e.holes != 0 {
			for k, x := range f.holes[e.holes-1] {
				if k < len(m) {
					m[k] |= x
				}
			}
		}
	}
	n := 0
	for _, x := range m {
		n += bits.OnesCount64(x)
	}
	return n
}

func setRange(m []uint64, from, to int) {
	for o := from; o < to; {
		if o&63 == 0 && o+64 <= to {
			m[o>>6] = ^uint64(0)
			o += 64
			continue
		}
		m[o>>6] |= 1 << (o & 63)
		o++
	}
}

// eachRun calls fn for every live run (writer).
func (f *forward) eachRun(fn func(id uint32, r *run)) {
	for id := uint32(1); id < f.nruns; id++ {
		if r := f.run(id); r.n > 0 {
			fn(id, r)
		}
	}
}

// entries counts the positions some worker holds (writer).
func (f *forward) entries() int {
	var m [maxRunLen / 64]uint64
	n := 0
	f.eachRun(func(_ uint32, r *run) {
		if r.ncov > 0 {
			clear(m[:])
			n += f.heldMask(r, m[:])
		}
	})
	return n
}

// memBytes estimates the forward map's memory from its arrays' capacities
// (writer): run headers in their chunks and the directory, content and
// stamp arrays, coverage entries, hole bitmaps, the two tables, free lists.
func (f *forward) memBytes() int {
	n := f.fixedBytes()
	f.eachRun(func(_ uint32, r *run) { n += runBytes(r) })
	return n
}

// fixedBytes is memBytes but for the runs: the directory and chunks, the
// arrays' bytes, the tables, hole bitmaps and free lists (writer).
func (f *forward) fixedBytes() int {
	n := cap(f.dir.Load().c)*8 + f.chunks*int(unsafe.Sizeof(runChunk{})) + f.bytes +
		f.kids.bytes() + f.heads.bytes() + cap(f.freeRuns)*4 + cap(f.touched)*4 + cap(f.freeHole)*4 + cap(f.holes)*24
	for _, b := range f.holes {
		n += cap(b) * 8
	}
	n += cap(f.freeCov) * 24
	for _, c := range f.freeCov {
		n += len(c) * int(unsafe.Sizeof(cover{}))
	}
	return n
}

// runBytes is a live run's body and coverage entries (writer).
func runBytes(r *run) int { return runBodyBytes + len(r.body.Load().cov)*int(unsafe.Sizeof(cover{})) }

// statsPass counts the positions some worker holds and estimates the
// forward map's bytes (entries and memBytes) for Stats, taking the writer's
// lock for statsBatch run ids at a time: Stats is called on every metrics
// scrape, and one pass under the lock over millions of runs held every
// worker's events up for as long (95 ms at 2^20 runs). The figures are then
// a sum over batches seen at different moments, not one instant's, which is
// all a gauge needs.
func (f *forward) statsPass() (entries, bytes int) {
	f.mu.Lock()
	bytes = f.fixedBytes()
	f.mu.Unlock()
	var m [maxRunLen / 64]uint64
	for lo := uint32(1); ; lo += statsBatch {
		f.mu.Lock()
		if lo >= f.nruns {
			f.mu.Unlock()
			return entries, bytes
		}
		for id := lo; id < min(lo+statsBatch, f.nruns); id++ {
			r := f.run(id)
			if r.n == 0 {
				continue
			}
			bytes += runBytes(r)
			if r.ncov > 0 {
				clear(m[:])
				entries += f.heldMask(r, m[:])
			}
		}
		f.mu.Unlock()
	}
}

// statsBatch is how many run ids statsPass reads per hold of the lock.
const statsBatch = 4096

// liveRuns counts the runs in use.
func (f *forward) liveRuns() int { return int(f.nruns) - 1 - len(f.freeRuns) }

// keyTable maps a key pair (a position, po, and a 64-bit hash, a) to a run
// id: open addressing, linear probing, backward-shift deletion, one version
// for readers (odd while the writer changes it), 16-byte slots. A pair may
// map to several ids (the heads table on a 64-bit collision); find and get
// return the first.
type keyTable struct {
	ver   atomic.Uint32
	tab   atomic.Pointer[keyTab]
	s     []keySlot
	shift uint8
	n     int
}

type keyTab struct {
	s     []keySlot
	shift uint8
}

type keySlot struct {
	a  uint64
	po uint32
	v  uint32 // 0: empty
}

func keyHash(po uint32, a uint64) uint64 {
	return (a ^ uint64(po)*0xff51afd7ed558ccd) * 0x9E3779B97F4A7C15
}

func (t *keyTable) bytes() int { return cap(t.s) * int(unsafe.Sizeof(keySlot{})) }

// get is the readers' lookup: the id (0: none) and false when the table
// changed during it; ver is the version it read under.
func (t *keyTable) get(po uint32, a uint64) (id, ver uint32, ok bool) {
	v := t.ver.Load()
	if v&1 != 0 {
		return 0, v, false
	}
	tb := t.tab.Load()
	if tb == nil {
		return 0, v, t.ver.Load() == v
	}
	s := tb.s
	mask := len(s) - 1
	for i, k := int(keyHash(po, a)>>tb.shift), 0; k < len(s); i, k = (i+1)&mask, k+1 {
		sl := &s[i]
		x := atomic.LoadUint32(&sl.v)
		if x == 0 {
			break
		}
		if atomic.LoadUint64(&sl.a) == a && atomic.LoadUint32(&sl.po) == po {
			id = x
			break
		}
	}
	return id, v, t.ver.Load() == v
}

// find is the writer's lookup.
func (t *keyTable) find(po uint32, a uint64) uint32 {
	if t.n == 0 {
		return 0
	}
	mask := len(t.s) - 1
	for i := int(keyHash(po, a) >> t.shift); ; i = (i + 1) & mask {
		s := &t.s[i]
		if s.v == 0 {
			return 0
		}
		if s.a == a && s.po == po {
			return s.v
		}
	}
}

func (t *keyTable) setSlot(i int, v keySlot) {
	s := &t.s[i]
	store64(&s.a, v.a)
	store32(&s.po, v.po)
	store32(&s.v, v.v)
}

// put adds (po, a) → id.
func (t *keyTable) put(po uint32, a uint64, id uint32) {
	t.ver.Add(1)
	if (t.n+1)*16 > len(t.s)*13 {
		t.grow()
	}
	mask := len(t.s) - 1
	i := int(keyHash(po, a) >> t.shift)
	for t.s[i].v != 0 {
		i = (i + 1) & mask
	}
	t.setSlot(i, keySlot{a: a, po: po, v: id})
	t.n++
	t.ver.Add(1)
}

func (t *keyTable) grow() { t.resize(max(16, 2*len(t.s))) }

// resize rehashes into n slots (a power of two) and publishes them; the
// version is odd.
func (t *keyTable) resize(n int) {
	old := t.s
	t.s = make([]keySlot, n)
	t.shift = uint8(64 - bits.Len(uint(n-1)))
	mask := n - 1
	for _, s := range old {
		if s.v == 0 {
			continue
		}
		i := int(keyHash(s.po, s.a) >> t.shift)
		for t.s[i].v != 0 {
			i = (i + 1) & mask
		}
		t.s[i] = s
	}
	t.tab.Store(&keyTab{s: t.s, shift: t.shift})
}

// del removes (po, a) → id.
func (t *keyTable) del(po uint32, a uint64, id uint32) {
	if t.n == 0 {
		return
	}
	mask := len(t.s) - 1
	i := int(keyHash(po, a) >> t.shift)
	for t.s[i].a != a || t.s[i].po != po || t.s[i].v != id {
		if t.s[i].v == 0 {
			return
		}
		i = (i + 1) & mask
	}
	t.ver.Add(1)
	for j := (i + 1) & mask; t.s[j].v != 0; j = (j + 1) & mask {
		h := int(keyHash(t.s[j].po, t.s[j].a) >> t.shift)
		if (j-h)&mask >= (j-i)&mask {
			t.setSlot(i, t.s[j])
			i = j
		}
	}
	t.setSlot(i, keySlot{})
	t.n--
	if len(t.s) > 16 && t.n*8 < len(t.s) {
		// Below an eighth full: half the size (a quarter full), so that a
		// table sized for a peak gives its bytes back, each halving paid for
		// by the deletions since the last resize.
		t.resize(len(t.s) / 2)
	}
	t.ver.Add(1)
}

// fullAlloc returns a zeroed slice of at least n elements that uses all of
// its allocation: the allocator rounds a request up to its size class (or
// to whole pages), and the rounded-up tail would otherwise be paid for and
// left empty. Tables are not powers of two, so any length serves.
func fullAlloc[T any](n int) []T {
	s := slices.Grow([]T(nil), n)
	return s[:cap(s)]
}
