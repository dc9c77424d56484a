package index

import (
	"math/bits"
	"runtime"
	"sync/atomic"
	"unsafe"
)

// pathIndex is a PROTOTYPE of the forward map in the shape of SMG's chain
// index (issue 31.1), measured against Index on the indexer corpus
// (KVRELAY_CORPUS_IMPL=path, corpus_indexerbench_test.go) and checked
// against it by a differential test (pathindex_test.go). Nothing in the
// gateway uses it; see docs/bench/log/2026-12-06-index-path.md.
//
// What differs from Index's forward map:
//
//   - A position's identity is its path: (run, offset), a run hanging off a
//     position of its parent run (or off the root). A position stores its
//     block's content hash only; a lookup compares the request's content
//     hashes with a run's, so no prefix hash (ChainHash) is computed or
//     stored, and a store checks uniqueness only where its chain leaves a
//     run (the parent's child table), never against a global heads table.
//   - Coverage is per run and worker, not per position: the number of
//     consecutive positions the worker holds from the run's offset 0
//     (lead), which is all a lookup needs (a worker stops at its first
//     hole). Positions held past a hole are kept in a bitmap that only a
//     worker with a hole in that run has, so that refilling the hole
//     restores the lead exactly.
//   - A run's content hashes and run headers are recycled through free
//     lists, so a steady replay faults in no fresh memory.
//
// One writer at a time; lookups take no lock and may run during a write.
// Each run has a seqlock version the writer makes odd the first time it
// changes the run in an event and even again when the event is done; a
// reader reads a run's arrays (content and coverage, published in its
// header: pointer and capacity of each; the writer's stores into them are
// store64/store32) and trusts them only if the version was even and
// unchanged around the reads: once before it indexes them (the pointers
// and capacities agree), once after. The child table has a version per
// group of slots. Run headers sit in fixed chunks that never move, and a
// reader that reached a run through the child table checks that the run
// is still that child (its parent, offset and first hash), which covers a
// run freed and reused meanwhile. A lookup that saw a change is redone.
// One model, one rank, one tier; copies are counted as in Index (a removal
// takes one; twins, two engine hashes of a worker naming one position,
// hold it until the last goes).
type pathIndex struct {
	dir      [pxDirLen]atomic.Pointer[pxChunk] // run id → header; id 0 is the root, never a run
	nruns    uint32                            // ids handed out
	freeRuns []uint32                          // dead run ids
	touched  []uint32                          // runs whose version the current event made odd
	onSettle func(touched int)                 // a test's hook: runs the event changed
	kids     pxKids                            // (parent run, offset, content hash) → child run
	arrays   [pxClasses][]*uint64              // free content arrays by class (pxClass), each by its first position
	content  int                               // positions in the runs' content arrays (their capacities)
	pooled   int                               // positions in the free lists
	holes    [][]uint64                        // hole bitmaps, pxCov.holes-1 indexes it
	freeHole []int32
	workers  []pxWorker
}

// pxReader is one reader's lookup scratch: per worker, the stamp of the
// last run it was alive in (matched to the end of the match in it) and,
// while it is, its slot in the result.
type pxReader struct {
	scratch    []pxScratch
	stamp      uint32
	retries    int // attempts redone
	kidRetries int // of which because the child table changed under a probe
}

func (px *pathIndex) newReader() *pxReader {
	return &pxReader{scratch: make([]pxScratch, len(px.workers))}
}

const (
	pxChunkBits = 10
	pxDirLen    = 1 << 14             // 16 M runs
	pxClasses   = 4*(pxOffBits-3) + 1 // pxClass(pxMaxRunLen) + 1
	pxMinCap    = 8
	// The free lists keep at most 1/pxPoolShare as many positions as the
	// runs' arrays (and pxPoolMin positions whatever that is).
	pxPoolShare = 4
	pxPoolMin   = 1024
	// An array is taken from up to pxPoolUp classes above the one asked
	// for when that class's free list is empty.
	pxPoolUp = 4
	// A reverse slot packs a position in 31 bits (pxRev.vals): a run id
	// below pxMaxRuns and an offset below 1<<pxOffBits. A chain longer
	// than a run can hold goes on in a child of the full run.
	pxOffBits   = 10
	pxMaxRunLen = 1<<pxOffBits - 1
	pxRunBits   = 31 - pxOffBits
	pxMaxRuns   = 1 << pxRunBits // 2 M
)

type pxChunk [1 << pxChunkBits]pxRun

// pxRun is a run's header. h and cov are the writer's views of the arrays
// that hp, hcap, covp and covcap publish to readers (changed only while
// the run is touched); n and ncov are their lengths as readers see them.
type pxRun struct {
	ver    atomic.Uint32
	n      uint32
	ncov   uint32
	parent uint32 // 0: hangs off the root
	poff   uint32 // the parent's offset this run continues after
	kids   uint32 // live child runs; readers skip the child table when 0
	hcap   uint32
	covcap uint32
	hp     atomic.Pointer[uint64]
	covp   atomic.Pointer[pxCov]
	h      []uint64 // content hash per position
	cov    []pxCov  // one entry per worker holding any position
}

// run is run id's header.
func (px *pathIndex) run(id uint32) *pxRun {
	return &px.dir[id>>pxChunkBits].Load()[id&(1<<pxChunkBits-1)]
}

// touch makes run id's version odd for the rest of the event, unless it is.
func (px *pathIndex) touch(id uint32) {
	r := px.run(id)
	if r.ver.Load()&1 == 0 {
		r.ver.Add(1)
		px.touched = append(px.touched, id)
	}
}

// settle ends an event: every run it changed gets an even version again.
func (px *pathIndex) settle() {
	if px.onSettle != nil {
		px.onSettle(len(px.touched))
	}
	for _, id := range px.touched {
		px.run(id).ver.Add(1)
	}
	px.touched = px.touched[:0]
}

// publish makes r's arrays the ones readers read (r touched).
func publish(r *pxRun) {
	r.hp.Store(unsafe.SliceData(r.h))
	store32(&r.hcap, uint32(cap(r.h)))
	r.covp.Store(unsafe.SliceData(r.cov))
	store32(&r.covcap, uint32(cap(r.cov)))
}

// appendHash appends c to r's content (r touched), in a larger array from
// the pool, room positions more, when r's is full.
func (px *pathIndex) appendHash(r *pxRun, c uint64, room int) {
	n := len(r.h)
	if n == cap(r.h) {
		a := px.getArray(n + room)[:n]
		copy64(a, r.h)
		px.putArray(r.h)
		r.h = a
		r.h = r.h[:n+1]
		store64(&r.h[n], c)
		publish(r)
	} else {
		r.h = r.h[:n+1]
		store64(&r.h[n], c)
	}
	store32(&r.n, uint32(n+1))
}

type pxCov struct {
	w     uint32
	lead  uint32 // positions held consecutively from offset 0
	held  uint32 // positions held in all
	holes int32  // 1 + index in pathIndex.holes of the bitmap of held offsets past lead; 0: none
}

type pxWorker struct {
	rev   pxRev
	twins map[uint64]uint32 // run<<32|off → reverse entries past the first naming it
}

type pxScratch struct {
	alive uint32
	idx   uint32
}

// pathMatch is one worker's matched leading blocks.
type pathMatch struct {
	w      uint32
	blocks uint32
}

func newPathIndex(workers int) *pathIndex {
	px := &pathIndex{workers: make([]pxWorker, workers), nruns: 1}
	px.dir[0].Store(new(pxChunk))
	return px
}

// Content arrays come in capacity classes four an octave (8, 10, 12, 14,
// 16, 20, 24, 28, 32, 40, ...), so an array is at most a quarter larger
// than what it was asked for (doubling classes left a run of 20 positions,
// this workload's commonest, in an array of 32). pxClass is the class of an
// array of at least n positions, pxClassCap a class's capacity.
func pxClass(n int) int {
	if n <= pxMinCap {
		return 0
	}
	b := bits.Len(uint(n-1)) - 1 // 2^b < n <= 2^(b+1), b >= 3
	step := b - 2                // a quarter of 2^b is 2^(b-2)
	q := (n - 1<<b + 1<<step - 1) >> step
	return 4*(b-3) + q
}

func pxClassCap(c int) int {
	if c == 0 {
		return pxMinCap
	}
	b := 3 + (c-1)/4
	return 1<<b + ((c-1)%4+1)<<(b-2)
}

// getArray takes an empty array of at least n positions from the free
// lists, else makes one.
func (px *pathIndex) getArray(n int) []uint64 {
	c := pxClass(min(n, pxMaxRunLen))
	for k := c; k < min(c+pxPoolUp+1, pxClasses); k++ {
		if l := len(px.arrays[k]); l > 0 {
			a := unsafe.Slice(px.arrays[k][l-1], pxClassCap(k))[:0]
			px.arrays[k][l-1] = nil
			px.arrays[k] = px.arrays[k][:l-1]
			px.pooled -= cap(a)
			px.content += cap(a)
			return a
		}
	}
	px.content += pxClassCap(c)
	return make([]uint64, 0, pxClassCap(c))
}

// putArray gives a run's array back: to its class's free list while the
// free lists hold less than pxPoolShare of the positions in use (and at
// least pxPoolMin), else to the garbage collector.
func (px *pathIndex) putArray(a []uint64) {
	if cap(a) == 0 {
		return
	}
	px.content -= cap(a)
	if px.pooled+cap(a) > max(pxPoolMin, px.content/pxPoolShare) {
		return
	}
	c := pxClass(cap(a))
	px.arrays[c] = append(px.arrays[c], unsafe.SliceData(a)) // (8 bytes a free array, not a slice's 24)
	px.pooled += cap(a)
}

// newRun makes a run of one position, content c, hanging after (parent,
// poff), with room for room positions.
func (px *pathIndex) newRun(parent, poff uint32, c uint64, room int) uint32 {
	var id uint32
	if n := len(px.freeRuns); n > 0 {
		id = px.freeRuns[n-1]
		px.freeRuns = px.freeRuns[:n-1]
	} else {
		id = px.nruns
		if id >= pxMaxRuns {
			panic("pathIndex: more runs than a reverse slot can name")
		}
		px.nruns++
		if id&(1<<pxChunkBits-1) == 0 {
			px.dir[id>>pxChunkBits].Store(new(pxChunk))
		}
	}
	px.touch(id)
	r := px.run(id)
	r.h = px.getArray(room)[:1]
	store64(&r.h[0], c)
	store32(&r.n, 1)
	store32(&r.ncov, 0)
	r.cov = r.cov[:0]
	store32(&r.parent, parent)
	store32(&r.poff, poff)
	store32(&r.kids, 0)
	publish(r)
	// Into the child table before the parent's count moves: a reader that
	// sees no child counted may skip the table (tryLookup).
	px.kids.put(parent, poff, c, id)
	if parent != 0 {
		p := px.run(parent)
		store32(&p.kids, p.kids+1)
	}
	return id
}

// freeRun frees run id (no holder, no child), then each parent up the
// chain whose last child it was and which no worker holds.
func (px *pathIndex) freeRun(id uint32) {
	for {
		px.touch(id)
		r := px.run(id)
		px.kids.del(r.parent, r.poff, r.h[0])
		px.putArray(r.h)
		parent := r.parent
		r.h, r.cov = nil, nil // a dead run's header keeps no coverage array
		store32(&r.n, 0)
		store32(&r.ncov, 0)
		publish(r)
		px.freeRuns = append(px.freeRuns, id)
		if parent == 0 {
			return
		}
		p := px.run(parent)
		store32(&p.kids, p.kids-1) // after the child left the table
		if p.kids != 0 || len(p.cov) != 0 {
			return
		}
		id = parent
	}
}

// covOf is the index of w's coverage entry in r, appended if absent.
// r is touched.
func covOf(r *pxRun, w uint32) int {
	for i := range r.cov {
		if r.cov[i].w == w {
			return i
		}
	}
	n := len(r.cov)
	if n == cap(r.cov) {
		a := make([]pxCov, n, max(1, 2*n))
		copy(a, r.cov)
		r.cov = a[:n+1]
		r.cov[n] = pxCov{w: w}
		publish(r)
	} else {
		r.cov = r.cov[:n+1]
		e := &r.cov[n]
		store32(&e.w, w)
		store32(&e.lead, 0)
		e.held, e.holes = 0, 0
	}
	store32(&r.ncov, uint32(n+1))
	return n
}

func (px *pathIndex) holeBits(e *pxCov, words int) []uint64 {
	if e.holes == 0 {
		var b []uint64
		if n := len(px.freeHole); n > 0 {
			e.holes = px.freeHole[n-1]
			px.freeHole = px.freeHole[:n-1]
			b = px.holes[e.holes-1][:0]
		} else {
			px.holes = append(px.holes, nil)
			e.holes = int32(len(px.holes))
		}
		px.holes[e.holes-1] = b
	}
	b := px.holes[e.holes-1]
	if len(b) < words {
		b = append(b, make([]uint64, words-len(b))...)
		px.holes[e.holes-1] = b
	}
	return b
}

// hold records that worker w, whose coverage entry in run is e, holds
// (run, off) through a new reverse entry: the cases other than the common
// one (off at e's lead, no hole), which the store does itself.
func (px *pathIndex) hold(wk *pxWorker, e *pxCov, run, off uint32) {
	switch {
	case off < e.lead:
		px.twin(wk, run, off)
		return
	case off == e.lead:
		lead := e.lead + 1
		e.held++
		b := px.holes[e.holes-1]
		for int(lead>>6) < len(b) && b[lead>>6]&(1<<(lead&63)) != 0 {
			b[lead>>6] &^= 1 << (lead & 63)
			lead++
		}
		store32(&e.lead, lead)
	default:
		b := px.holeBits(e, int(off>>6)+1)
		if b[off>>6]&(1<<(off&63)) != 0 {
			px.twin(wk, run, off)
			return
		}
		b[off>>6] |= 1 << (off & 63)
		e.held++
	}
}

func (px *pathIndex) twin(wk *pxWorker, run, off uint32) {
	if wk.twins == nil {
		wk.twins = make(map[uint64]uint32)
	}
	wk.twins[uint64(run)<<32|uint64(off)]++
}

// release drops a reverse entry of w naming (run, off).
func (px *pathIndex) release(wk *pxWorker, w, run, off uint32, ci *int) {
	if wk.twins != nil {
		k := uint64(run)<<32 | uint64(off)
		if n := wk.twins[k]; n > 0 {
			if n == 1 {
				delete(wk.twins, k)
			} else {
				wk.twins[k] = n - 1
			}
			return
		}
	}
	px.touch(run)
	r := px.run(run)
	if *ci < 0 || *ci >= len(r.cov) || r.cov[*ci].w != w {
		*ci = covOf(r, w)
	}
	e := &r.cov[*ci]
	e.held--
	switch {
	case off+1 == e.lead:
		store32(&e.lead, off)
	case off < e.lead:
		// A hole inside the lead: the positions after it are held past the lead now.
		b := px.holeBits(e, int((e.lead-1)>>6)+1)
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
		b := px.holes[e.holes-1]
		b[off>>6] &^= 1 << (off & 63)
	}
	if e.held != 0 {
		return
	}
	if e.holes != 0 {
		px.freeHole = append(px.freeHole, e.holes)
	}
	last := len(r.cov) - 1
	x, l := &r.cov[*ci], r.cov[last]
	store32(&x.w, l.w)
	store32(&x.lead, l.lead)
	x.held, x.holes = l.held, l.holes
	r.cov = r.cov[:last]
	store32(&r.ncov, uint32(last))
	*ci = -1
	if last == 0 && r.kids == 0 {
		px.freeRun(run)
	}
}

// store applies a stored event of worker w: blocks with engine hashes
// engine and content hashes content, chained after the block w holds under
// parent when hasParent and w holds it, else from the root.
func (px *pathIndex) store(w uint32, hasParent bool, parent uint64, engine, content []uint64) {
	wk := &px.workers[w]
	var cr, co uint32 // the position the next block follows; cr 0: the root
	if hasParent {
		if i := wk.rev.find(parent); i >= 0 {
			cr, co = wk.rev.pos(i)
		}
	}
	var e *pxCov // w's coverage entry in run eRun
	eRun := uint32(0)
	for j := 0; j < len(engine); j++ {
		i, found := wk.rev.upsert(engine[j])
		if found {
			wk.rev.addCopy(i, engine[j])
			cr, co = wk.rev.pos(i)
			continue
		}
		c := content[j]
		var nr, no uint32
		switch {
		case cr == 0:
			if nr = px.kids.find(0, 0, c); nr == 0 {
				nr = px.newRun(0, 0, c, len(engine)-j)
			}
		default:
			r := px.run(cr)
			switch n := uint32(len(r.h)); {
			case co+1 < n && r.h[co+1] == c:
				nr, no = cr, co+1
			case co+1 == n && n < pxMaxRunLen:
				// At the run's end: no child can hang here (one is made
				// only inside a run or after a full one, and a live run
				// never shrinks), so the block is appended.
				px.touch(cr)
				px.appendHash(r, c, len(engine)-j)
				nr, no = cr, co+1
			default:
				if nr = px.kids.find(cr, co, c); nr == 0 {
					nr = px.newRun(cr, co, c, len(engine)-j)
				}
			}
		}
		wk.rev.setPos(i, nr, no)
		cr, co = nr, no
		if nr != eRun {
			px.touch(nr)
			r := px.run(nr)
			e, eRun = &r.cov[covOf(r, w)], nr
		}
		if no != e.lead || e.holes != 0 {
			px.hold(wk, e, nr, no)
			continue
		}
		r := px.run(nr)
		h := r.h
		if no+1 != uint32(len(h)) {
			store32(&e.lead, no+1)
			e.held++
			continue
		}
		// The block went at the run's end and w holds the run up to it: the
		// blocks after it that are new to w go at the end too, in one loop
		// (the event's hashes copied into the run). The run is touched, so
		// readers take none of it until the event ends: its length and w's
		// lead are stored once, after the loop.
		for j+1 < len(engine) && len(h) < pxMaxRunLen {
			j++
			i, found := wk.rev.upsert(engine[j])
			if found {
				wk.rev.addCopy(i, engine[j])
				cr, co = wk.rev.pos(i)
				break
			}
			if n := len(h); n < cap(h) {
				h = h[:n+1]
				store64(&h[n], content[j])
			} else {
				r.h = h
				px.appendHash(r, content[j], len(engine)-j)
				h = r.h
			}
			co = uint32(len(h) - 1)
			wk.rev.setPos(i, nr, co)
		}
		r.h = h
		store32(&r.n, uint32(len(h)))
		e.held += uint32(len(h)) - no
		store32(&e.lead, uint32(len(h)))
	}
	px.settle()
}

// remove applies a removed event of worker w.
func (px *pathIndex) remove(w uint32, engine []uint64) {
	wk := &px.workers[w]
	ci, last := -1, uint32(0)
	var le *pxCov // &run(last).cov[ci] when ci >= 0
	for _, h := range engine {
		i := wk.rev.find(h)
		if i < 0 {
			continue
		}
		if wk.rev.dropCopy(i, h) {
			continue
		}
		run, off := wk.rev.pos(i)
		wk.rev.del(i)
		if run != last {
			ci, last, le = -1, run, nil
		} else if le != nil && wk.twins == nil {
			// The common case: the run's last held position of w's lead, the
			// entry staying.
			if off+1 == le.lead && le.held > 1 {
				store32(&le.lead, off)
				le.held--
				continue
			}
		}
		px.release(wk, w, run, off, &ci)
		if ci < 0 {
			last, le = 0, nil
		} else {
			le = &px.run(last).cov[ci]
		}
	}
	px.settle()
}

// lookup writes into dst (reused) every worker's leading blocks of the
// request whose content hashes are content, in no order. It takes no lock:
// an attempt that saw a change is redone.
func (px *pathIndex) lookup(rd *pxReader, dst []pathMatch, content []uint64) []pathMatch {
	for tries := 0; ; tries++ {
		var ok bool
		if dst, ok = px.tryLookup(rd, dst[:0], content); ok {
			return dst
		}
		rd.retries++
		if tries > 4 {
			runtime.Gosched()
		}
	}
}

func (px *pathIndex) tryLookup(rd *pxReader, dst []pathMatch, content []uint64) ([]pathMatch, bool) {
	if len(content) == 0 {
		return dst, true
	}
	r, ok := px.kids.get(0, 0, content[0])
	if !ok {
		rd.kidRetries++
		return dst, false
	}
	if r == 0 {
		return dst, true
	}
	var prev uint32 // the stamp of the run before; 0: r is the first
	base, i := uint32(0), 0
	parent, poff := uint32(0), uint32(0)
	for {
		if int(r>>pxChunkBits) >= pxDirLen {
			return dst, false
		}
		ch := px.dir[r>>pxChunkBits].Load()
		if ch == nil {
			return dst, false
		}
		run := &ch[r&(1<<pxChunkBits-1)]
		rv := run.ver.Load()
		hp, hc := run.hp.Load(), atomic.LoadUint32(&run.hcap)
		cp, cc := run.covp.Load(), atomic.LoadUint32(&run.covcap)
		n, nc := atomic.LoadUint32(&run.n), atomic.LoadUint32(&run.ncov)
		// Each array with its own capacity (they change together, while
		// the run is touched), before either is indexed.
		if rv&1 != 0 || hp == nil || run.ver.Load() != rv {
			return dst, false
		}
		h := unsafe.Slice(hp, hc)[:min(n, hc)]
		var cov []pxCov
		if cp != nil {
			cov = unsafe.Slice(cp, cc)[:min(nc, cc)]
		}
		// Still the child it was found as (not freed and reused since).
		if len(h) == 0 || atomic.LoadUint64(&h[0]) != content[i] ||
			atomic.LoadUint32(&run.parent) != parent || atomic.LoadUint32(&run.poff) != poff {
			return dst, false
		}
		h = h[:min(len(h), len(content)-i)]
		rest := content[i : i+len(h)]
		m := 1
		for m < len(h) {
			if atomic.LoadUint64(&h[m]) != rest[m] {
				break
			}
			m++
		}
		var st uint32
		if prev == 0 {
			// The first run: every worker in it is new to the answer and
			// none is checked against a run before, so no scratch is
			// read or written unless the lookup goes on into a child.
			// dst is empty: each entry is written to its end and kept if
			// the worker matched, without a branch.
			if cap(dst) < len(cov) {
				dst = make([]pathMatch, 0, len(cov)+len(cov)/2)
			}
			dst = dst[:pxFirst(dst[:len(cov)], cov, uint32(m))]
		} else {
			rd.stamp++
			st = rd.stamp
			for k := range cov {
				e := &cov[k]
				w := atomic.LoadUint32(&e.w)
				if int(w) >= len(rd.scratch) {
					return dst, false
				}
				sc := &rd.scratch[w]
				if sc.alive != prev {
					continue
				}
				// Alive through the runs before, so answered already:
				// its result only grows.
				d := min(atomic.LoadUint32(&e.lead), uint32(m))
				if d == 0 {
					continue
				}
				dst[sc.idx].blocks = base + d
				if d == uint32(m) {
					sc.alive = st
				}
			}
		}
		if i+m == len(content) {
			return dst, run.ver.Load() == rv
		}
		// No child run hangs anywhere off r (the writer counts them, a
		// child entering the child table before the count moves and
		// leaving it after): no probe.
		nk := atomic.LoadUint32(&run.kids)
		if run.ver.Load() != rv {
			return dst, false
		}
		if nk == 0 {
			return dst, true
		}
		c, ok := px.kids.get(r, uint32(m-1), content[i+m])
		if !ok {
			rd.kidRetries++
			return dst, false
		}
		if c == 0 {
			return dst, true
		}
		if prev == 0 {
			// Going on into a child: the workers alive to r's end are
			// stamped with their result slots. Only they can score in
			// the runs after, and each is answered already.
			if rd.stamp > 1<<31 {
				clear(rd.scratch)
				rd.stamp = 0
			}
			rd.stamp++
			st = rd.stamp
			for k, x := range dst {
				if x.blocks != uint32(m) {
					continue
				}
				if int(x.w) >= len(rd.scratch) {
					return dst, false
				}
				sc := &rd.scratch[x.w]
				sc.alive, sc.idx = st, uint32(k)
			}
		}
		parent, poff = r, uint32(m-1)
		base += uint32(m)
		i += m
		r, prev = c, st
	}
}

// pxFirst writes into out (as long as cov) each coverage entry's worker
// and lead up to m, in order, keeping those above 0, and returns how many
// it kept. Out of line, its loop keeps its counters in registers.
//
//go:noinline
func pxFirst(out []pathMatch, cov []pxCov, m uint32) int {
	n := 0
	for k := range cov {
		e := &cov[k]
		d := min(atomic.LoadUint32(&e.lead), m)
		out[n] = pathMatch{w: atomic.LoadUint32(&e.w), blocks: d}
		if d != 0 {
			n++
		}
	}
	return n
}

// bytes estimates the prototype's memory from its arrays' capacities: run
// headers, content arrays, coverage entries, hole bitmaps, the child table,
// the reverse tables, and the arrays kept for reuse.
func (px *pathIndex) bytes() map[string]int {
	m := map[string]int{
		"headers": int(px.nruns+1<<pxChunkBits-1)>>pxChunkBits*int(unsafe.Sizeof(pxChunk{})) + cap(px.freeRuns)*4 + int(unsafe.Sizeof(px.dir)),
		"kids":    len(px.kids.s)*int(unsafe.Sizeof(pxKidSlot{})) + len(px.kids.ver)*4,
	}
	for i := uint32(1); i < px.nruns; i++ {
		r := px.run(i)
		m["content"] += cap(r.h) * 8
		m["coverage"] += cap(r.cov) * int(unsafe.Sizeof(pxCov{}))
	}
	for i := range px.workers {
		wk := &px.workers[i]
		m["reverse"] += len(wk.rev.keys)*8 + len(wk.rev.vals)*4
		// Go's maps, estimated at 32 B an entry (a swiss table's 16-byte
		// slot and control byte at its usual load).
		m["maps"] += (len(wk.rev.copies) + len(wk.twins)) * 32
	}
	for _, b := range px.holes {
		m["holes"] += cap(b) * 8
	}
	for c := range px.arrays {
		m["pooled"] += len(px.arrays[c]) * pxClassCap(c) * 8
	}
	// What holds the arrays: the free lists' and hole list's slice headers,
	// the workers' records. (A run's arrays are published in its header,
	// counted with the headers.)
	lists := cap(px.holes)*24 + cap(px.freeHole)*4 + cap(px.touched)*4
	for c := range px.arrays {
		lists += cap(px.arrays[c]) * 8
	}
	m["lists"] = lists
	m["workers"] = cap(px.workers) * int(unsafe.Sizeof(pxWorker{}))
	total := 0
	for _, v := range m {
		total += v
	}
	m["total"] = total
	return m
}

// pxRev is a worker's reverse table, engine hash → position (run, offset):
// open addressing, linear probing, backward-shift deletion, 12 bytes a
// slot in two arrays: keys, the engine hash k mixed (k*pxMul, a bijection:
// a probe compares it, a deletion's shifts take an entry's home from it
// with one multiply), 0 for an empty slot; vals, the position. The one key
// whose mixed form is 0 (k 0) has no slot: its position is vals[len(keys)].
// The size is not a power of two but every other class of pxClassCap from
// pxRevMinSlots (20, 28, 40, ..., 448, 640, 896, ...: half an octave a
// growth), so that a 512-block cache's table, which holds up to ~560
// entries while a store lands before its evictions, is 640 slots (7.5 KiB)
// rather than 1,024: a key's home is its mixed form's top 32 bits scaled
// to the size by a multiply (fastrange), and a probe wraps at the end by a
// compare. Copies past the first (stores of a block the worker holds) are
// counted in copies; a position's low bit says it has any.
type pxRev struct {
	keys   []uint64
	vals   []uint32 // run<<(pxOffBits+1) | offset<<1 | has copies; 0: none (the zero key's)
	n      int
	limit  int              // the entries at which the table grows (pxRevMaxLoad16)
	zero   int              // 1 + the zero key's slot (len(keys)) when it is in, else 0
	copies map[uint64]uint8 // engine hash → copies past the first, 1 to copiesCap-1
}

const (
	pxMul = 0x9E3779B97F4A7C15
	// pxRevMaxLoad16 (in 1/16) is the most a table is filled before it
	// grows. 14 (0.875) keeps the indexbytes replay's tables at 640 slots;
	// at 12 they were 768 (3 B a held block more) and the dup-4 replay
	// ran 5 % faster (the deletions' longer shifts; see the bench log).
	pxRevMaxLoad16 = 14
	pxRevMinSlots  = 20
)

// pos is slot i's position.
func (t *pxRev) pos(i int) (run, off uint32) {
	v := t.vals[i]
	return v >> (pxOffBits + 1), v >> 1 & pxMaxRunLen
}

// setPos gives the new entry in slot i its position (run >= 1, off <=
// pxMaxRunLen).
func (t *pxRev) setPos(i int, run, off uint32) { t.vals[i] = run<<(pxOffBits+1) | off<<1 }

// pxRevHome is the home slot, in a table of n slots, of the key whose
// mixed form is m.
func pxRevHome(m uint64, n int) int { return int(m >> 32 * uint64(n) >> 32) }

// find is k's slot, or -1. (Small enough to be inlined.)
func (t *pxRev) find(k uint64) int {
	m := k * pxMul
	if m == 0 {
		return t.zero - 1
	}
	keys := t.keys
	n := len(keys)
	for i := pxRevHome(m, n); i < n; { // i < n: false only in an empty table
		x := keys[i]
		if x == m {
			return i
		}
		if x == 0 {
			break
		}
		if i++; i == n {
			i = 0
		}
	}
	return -1
}

// upsert finds k or makes its slot (with a placeholder position the caller
// overwrites by setPos).
func (t *pxRev) upsert(k uint64) (int, bool) {
	if t.n >= t.limit {
		t.grow()
	}
	keys := t.keys
	n, m := len(keys), k*pxMul
	if m == 0 {
		if t.zero != 0 {
			return n, true
		}
		t.zero = n + 1
		t.n++
		return n, false
	}
	// i stays below n (a home is, and the probe wraps): the slots are
	// reached without bounds checks.
	kp := unsafe.Pointer(unsafe.SliceData(keys))
	for i := pxRevHome(m, n); ; {
		p := (*uint64)(unsafe.Add(kp, i*8))
		switch *p {
		case m:
			return i, true
		case 0:
			*p = m
			t.n++
			return i, false
		}
		if i++; i == n {
			i = 0
		}
	}
}

func (t *pxRev) grow() {
	keys, vals := t.keys, t.vals
	n := pxRevMinSlots
	if len(keys) > 0 {
		n = pxClassCap(pxClass(len(keys)) + 2)
	}
	t.keys, t.vals = make([]uint64, n), make([]uint32, n+1)
	t.limit = n * pxRevMaxLoad16 / 16
	for j, m := range keys {
		if m == 0 {
			continue
		}
		i := pxRevHome(m, n)
		for t.keys[i] != 0 {
			if i++; i == n {
				i = 0
			}
		}
		t.keys[i], t.vals[i] = m, vals[j]
	}
	if t.zero != 0 {
		t.vals[n], t.zero = vals[len(keys)], n+1
	}
}

// del empties slot i, moving back the entries after it that may go nearer
// their homes.
func (t *pxRev) del(i int) {
	keys, vals := t.keys, t.vals
	n := len(keys)
	t.n--
	if uint(i) >= uint(n) {
		t.zero = 0
		return
	}
	// i and j stay below n = len(keys) < len(vals): the slots are reached
	// without bounds checks.
	kp, vp := unsafe.Pointer(unsafe.SliceData(keys)), unsafe.Pointer(unsafe.SliceData(vals))
	key := func(x int) *uint64 { return (*uint64)(unsafe.Add(kp, x*8)) }
	val := func(x int) *uint32 { return (*uint32)(unsafe.Add(vp, x*4)) }
	for j := i; ; {
		if j++; j >= n {
			j = 0
		}
		m := *key(j)
		if m == 0 {
			break
		}
		// The entry at j moves into the hole at i unless its home h lies
		// cyclically in (i, j]. It is copied either way (the hole is dead
		// until filled or cleared below) and the hole moves only if it
		// moved, which keeps a data-dependent branch out of the loop.
		h := pxRevHome(m, n)
		dh, di := j-h, j-i
		if dh < 0 {
			dh += n
		}
		if di < 0 {
			di += n
		}
		*key(i), *val(i) = m, *val(j)
		if dh >= di {
			i = j
		}
	}
	*key(i) = 0
}

// addCopy counts one more copy of the entry at slot i, whose key is k (at
// most copiesCap in all, as Index counts them).
func (t *pxRev) addCopy(i int, k uint64) {
	if t.vals[i]&1 == 0 {
		t.vals[i] |= 1
		if t.copies == nil {
			t.copies = make(map[uint64]uint8)
		}
		t.copies[k] = 1
		return
	}
	if c := t.copies[k]; c < copiesCap-1 {
		t.copies[k] = c + 1
	}
}

// dropCopy takes away one copy of the entry at slot i, whose key is k, if
// it has more than one, and reports whether it had.
func (t *pxRev) dropCopy(i int, k uint64) bool {
	if t.vals[i]&1 == 0 {
		return false
	}
	if c := t.copies[k]; c > 1 {
		t.copies[k] = c - 1
	} else {
		delete(t.copies, k)
		t.vals[i] &^= 1
	}
	return true
}

func bitsLen(x int) int {
	n := 0
	for ; x > 0; x >>= 1 {
		n++
	}
	return n
}

// pxKids is the child table of every run, the root's included: (parent run,
// offset, first content hash) → child run; open addressing as pxRev.
// Readers (get) read the table published in tab, the writer (find, put,
// del) its own view s of the same slots.
//
// A reader needs no version for a hit: the caller checks that the run it
// names is that child (its parent, offset and first hash, under the run's
// version), so a stale or torn slot is caught there. A miss must be
// checked: a deletion shifts entries back and could move the one sought
// behind the probe. Each group of 1<<pxKidGroupBits slots has a version
// the writer makes odd around its changes to the group's slots; a miss
// holds if every group the probe read was even and unchanged, and the
// table was not replaced by a larger one. A change elsewhere in the table
// fails no probe.
type pxKids struct {
	tab   atomic.Pointer[pxKidTab]
	s     []pxKidSlot
	ver   []atomic.Uint32 // tab's versions, the writer's view
	open  []int           // groups del made odd
	shift uint8
	n     int
}

const pxKidGroupBits = 4

type pxKidTab struct {
	s     []pxKidSlot
	ver   []atomic.Uint32 // per group of 1<<pxKidGroupBits slots
	shift uint8
}

type pxKidSlot struct {
	c     uint64
	po    uint64 // parent<<32 | offset
	child uint32 // 0: empty
}

func pxKidHash(po, c uint64) uint64 { return (c ^ po*0xff51afd7ed558ccd) * pxMul }

// get is the readers' lookup: the child (0: none), and false when a miss
// cannot be trusted (the table changed where it probed). A child returned
// must be checked by the caller to be that child.
func (t *pxKids) get(parent, off uint32, c uint64) (uint32, bool) {
	tb := t.tab.Load()
	if tb == nil {
		return 0, true // no child was ever made
	}
	po := uint64(parent)<<32 | uint64(off)
	s := tb.s
	mask := len(s) - 1
	i := int(pxKidHash(po, c) >> tb.shift)
	g0 := i >> pxKidGroupBits
	sum := tb.ver[g0].Load()
	odd := sum
	groups := 1
	for k := 0; k < len(s); k++ {
		sl := &s[i]
		ch := atomic.LoadUint32(&sl.child)
		if ch == 0 {
			break
		}
		if atomic.LoadUint64(&sl.c) == c && atomic.LoadUint64(&sl.po) == po {
			return ch, true
		}
		if i = (i + 1) & mask; i&(1<<pxKidGroupBits-1) == 0 {
			v := tb.ver[i>>pxKidGroupBits].Load()
			sum += v
			odd |= v
			groups++
		}
	}
	if odd&1 != 0 {
		return 0, false
	}
	// Versions only grow: the sum is unchanged only if each is.
	gmask := len(tb.ver) - 1
	for g := g0; groups > 0; g, groups = (g+1)&gmask, groups-1 {
		sum -= tb.ver[g].Load()
	}
	return 0, sum == 0 && t.tab.Load() == tb
}

// find is the writer's lookup.
func (t *pxKids) find(parent, off uint32, c uint64) uint32 {
	if t.n == 0 {
		return 0
	}
	po := uint64(parent)<<32 | uint64(off)
	mask := len(t.s) - 1
	for i := int(pxKidHash(po, c) >> t.shift); ; i = (i + 1) & mask {
		s := &t.s[i]
		if s.child == 0 {
			return 0
		}
		if s.c == c && s.po == po {
			return s.child
		}
	}
}

func (t *pxKids) setSlot(i int, v pxKidSlot) {
	s := &t.s[i]
	store64(&s.c, v.c)
	store64(&s.po, v.po)
	store32(&s.child, v.child)
}

func (t *pxKids) put(parent, off uint32, c uint64, child uint32) {
	if (t.n+1)*16 > len(t.s)*13 {
		t.grow()
	}
	po := uint64(parent)<<32 | uint64(off)
	mask := len(t.s) - 1
	i := int(pxKidHash(po, c) >> t.shift)
	for t.s[i].child != 0 {
		i = (i + 1) & mask
	}
	v := &t.ver[i>>pxKidGroupBits]
	v.Add(1)
	t.setSlot(i, pxKidSlot{c: c, po: po, child: child})
	v.Add(1)
	t.n++
}

// grow moves the entries into a table twice as large and publishes it; the
// old one is never written again (a reader still in it finds what it held,
// and a miss there fails on the table's replacement).
func (t *pxKids) grow() {
	old := t.s
	n := max(1<<pxKidGroupBits, 2*len(old))
	t.s = make([]pxKidSlot, n)
	t.ver = make([]atomic.Uint32, n>>pxKidGroupBits)
	t.shift = uint8(64 - bitsLen(n-1))
	mask := n - 1
	for _, s := range old {
		if s.child == 0 {
			continue
		}
		i := int(pxKidHash(s.po, s.c) >> t.shift)
		for t.s[i].child != 0 {
			i = (i + 1) & mask
		}
		t.s[i] = s
	}
	t.tab.Store(&pxKidTab{s: t.s, ver: t.ver, shift: t.shift})
}

// openAt makes slot i's group odd before its first change in a del.
func (t *pxKids) openAt(i int) {
	g := i >> pxKidGroupBits
	if l := len(t.open); l == 0 || t.open[l-1] != g {
		t.ver[g].Add(1)
		t.open = append(t.open, g)
	}
}

func (t *pxKids) del(parent, off uint32, c uint64) {
	po := uint64(parent)<<32 | uint64(off)
	mask := len(t.s) - 1
	i := int(pxKidHash(po, c) >> t.shift)
	for t.s[i].c != c || t.s[i].po != po || t.s[i].child == 0 {
		if t.s[i].child == 0 {
			return
		}
		i = (i + 1) & mask
	}
	// Backward shift: the slots written go forward from i (wrapping), so
	// the groups opened are in order and each is opened once.
	t.openAt(i)
	for j := (i + 1) & mask; t.s[j].child != 0; j = (j + 1) & mask {
		h := int(pxKidHash(t.s[j].po, t.s[j].c) >> t.shift)
		if (j-h)&mask >= (j-i)&mask {
			t.setSlot(i, t.s[j])
			i = j
			t.openAt(i)
		}
	}
	t.setSlot(i, pxKidSlot{})
	t.n--
	for _, g := range t.open {
		t.ver[g].Add(1)
	}
	t.open = t.open[:0]
}

// counts returns the live positions and the (worker, position) pairs held.
func (px *pathIndex) counts() (positions, memberships int) {
	for i := uint32(1); i < px.nruns; i++ {
		r := px.run(i)
		positions += len(r.h)
		for _, e := range r.cov {
			memberships += int(e.held)
		}
	}
	return positions, memberships
}

// liveRuns counts the runs not on the free list.
func (px *pathIndex) liveRuns() int { return int(px.nruns) - 1 - len(px.freeRuns) }
