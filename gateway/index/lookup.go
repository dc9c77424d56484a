package index

// Lookups: a request's blocks walked along the forward map's runs, every
// holder's leading blocks counted from its coverage of each run.

import (
	"math"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
)

// Match is one worker's overlap with a request.
type Match struct {
	Worker WorkerID
	// Blocks is the number of leading request blocks the worker holds
	// consecutively from block 0.
	Blocks int
}

// Matches is the result of a lookup.
type Matches struct {
	// RequestBlocks is the number of full blocks in the request.
	RequestBlocks int
	// Workers holds every worker with at least one leading block, deepest
	// first, then by name.
	Workers []Match
}

// Blocks returns w's matched blocks (0 if none).
func (m Matches) Blocks(w WorkerID) int {
	for _, x := range m.Workers {
		if x.Worker == w {
			return x.Blocks
		}
	}
	return 0
}

// Best returns the deepest overlap (0 if none).
func (m Matches) Best() int {
	if len(m.Workers) == 0 {
		return 0
	}
	return m.Workers[0].Blocks
}

// FindMatches cuts tokens into full blocks of the index's block size, hashes
// them under ns, and returns each worker's longest consecutive prefix overlap.
// Blocks are hashed lazily, so the walk stops at the first block no candidate
// holds. Lookups write nothing but (with pruning on) an entry's stamp.
//
// It allocates the result's Workers slice; FindMatchesInto reuses one.
func (ix *Index) FindMatches(tokens []uint32, ns Namespace) Matches {
	var m Matches
	ix.FindMatchesInto(&m, tokens, ns)
	return m
}

// FindMatchesHashes is FindMatches for prefix hashes already computed with
// PrefixHashes.
func (ix *Index) FindMatchesHashes(prefix []uint64) Matches {
	var m Matches
	ix.FindMatchesHashesInto(&m, prefix)
	return m
}

// FindMatchesContent is FindMatches for a request's content hashes (as
// ContentHashes computes them under the request's namespace seed): the input
// SMG's and Dynamo's indexes take, for callers that keep a conversation's
// block hashes. The prefix chain is computed here, lazily.
func (ix *Index) FindMatchesContent(content []uint64) Matches {
	var m Matches
	ix.FindMatchesContentInto(&m, content)
	return m
}

// FindMatchesInto is FindMatches writing its answer into dst, overwriting
// what dst held and reusing dst.Workers' array. A caller that keeps one
// Matches per goroutine (or per request, pooled) looks up without
// allocating once that array has grown to the overlaps it sees: a lookup's
// own working memory is pooled inside the index. dst.Workers is valid until
// dst is passed to the next lookup.
func (ix *Index) FindMatchesInto(dst *Matches, tokens []uint32, ns Namespace) {
	bs := ix.BlockSize()
	ix.walk(dst, hashCursor{tokens: tokens, bs: bs, seed: ns.Seed(), n: len(tokens) / bs})
}

// FindMatchesHashesInto is FindMatchesHashes into dst (see FindMatchesInto).
func (ix *Index) FindMatchesHashesInto(dst *Matches, prefix []uint64) {
	ix.walk(dst, hashCursor{prefix: prefix, n: len(prefix)})
}

// FindMatchesContentInto is FindMatchesContent into dst (see
// FindMatchesInto).
func (ix *Index) FindMatchesContentInto(dst *Matches, content []uint64) {
	ix.walk(dst, hashCursor{content: content, n: len(content)})
}

// A lookup's answer is kept as sort keys: (max − blocks) << 32 | the
// worker's position by name (its rank − 1 in the name order the lookup
// read under), so that sorting them orders the answer by depth, then name.
func matchKey(blocks int32, rank uint32) uint64 {
	return uint64(math.MaxInt32-blocks)<<32 | uint64(rank-1)
}

// keyBlocks is a key's blocks.
func keyBlocks(k uint64) int32 { return math.MaxInt32 - int32(k>>32) }

// hashCursor gives a request's hashes from whichever input the caller has:
// prefix hashes (compared along a run by chaining the run's content), or
// content hashes, given or computed from the tokens lazily in order and
// kept (a lookup that is redone reads them again, and one whose overlap
// ends early hashes no further).
type hashCursor struct {
	n       int // blocks
	prefix  []uint64
	content []uint64
	tokens  []uint32
	bs      int
	seed    uint64
	hs      []uint64
}

// get is block i's content hash (not for a prefix cursor).
func (c *hashCursor) get(i int) uint64 {
	if c.content != nil {
		return c.content[i]
	}
	for j := len(c.hs); j <= i; j++ {
		c.hs = append(c.hs, ContentHash(c.tokens[j*c.bs:(j+1)*c.bs], c.seed))
	}
	return c.hs[i]
}

// walkState is a lookup's working memory, pooled. Its buffers are kept
// across lookups (up to walkKeepCap entries each, so that one huge request
// does not pin its memory), so that a lookup allocates nothing once they
// have grown to the fleet's overlaps.
type walkState struct {
	hc      hashCursor
	hashes  []uint64 // the request's content hashes
	scratch []walkScratch
	stamp   uint32
	done    []uint64 // the answer's sort keys (matchKey)
}

// walkScratch is one worker slot's state in a lookup that goes past its
// first run: the stamp of the last run it was alive through (held every
// position the request matched in it) and, while it is, its result's index
// in done. Stamps only grow (until cleared), so an entry left by an
// earlier attempt or lookup never matches.
type walkScratch struct {
	alive, idx uint32
}

// walkKeepCap bounds what a pooled walkState keeps of each buffer.
const walkKeepCap = 1 << 14

var walkPool = sync.Pool{New: func() any {
	return &walkState{done: make([]uint64, 0, 32)}
}}

func (w *walkState) put() {
	w.hashes = keepBuf(w.hashes, w.hc.hs)
	w.hc = hashCursor{}
	if cap(w.done) > walkKeepCap {
		w.done = nil
	}
	if len(w.scratch) > walkKeepCap {
		w.scratch, w.stamp = nil, 0
	}
	walkPool.Put(w)
}

// keepBuf returns the buffer a pooled walkState keeps: used, emptied, if a
// lookup grew it (and it is not too large), else the one it had.
func keepBuf[T any](had, used []T) []T {
	if cap(used) > cap(had) && cap(used) <= walkKeepCap {
		return used[:0]
	}
	return had[:0]
}

// walk matches a request (from cur) against the forward map, redoing the
// attempt when it saw a change, then sorts the answer.
func (ix *Index) walk(res *Matches, cur hashCursor) {
	n := cur.n
	res.RequestBlocks, res.Workers = n, res.Workers[:0]
	if n == 0 {
		return
	}
	var stamp uint32
	if ix.pruning {
		stamp = ix.stampAt(ix.now())
	}
	ws := walkPool.Get().(*walkState)
	ws.hc = cur
	ws.hc.hs = ws.hashes[:0]
	// The answer is keyed by the workers' name order read before the
	// walk; when workers came or went during it, it is redone under the
	// new order (a slot may have changed hands).
	for tries := 0; ; tries++ {
		o := ix.order.Load()
		if o == nil {
			break // no worker yet
		}
		if ix.tryWalk(ws, stamp, o) && ix.order.Load() == o {
			done := ws.done
			if !slices.IsSorted(done) {
				slices.Sort(done)
			}
			// Grow once, to the exact size when res had no array (the
			// allocating wrappers).
			out := slices.Grow(res.Workers, len(done))[:len(done)]
			for k, key := range done {
				out[k] = Match{Worker: o.names[uint32(key)], Blocks: int(keyBlocks(key))}
			}
			res.Workers = out
			break
		}
		if tries > 4 {
			runtime.Gosched() // a writer may have been preempted mid-change
		}
	}
	ws.put()
}

// tryWalk is one attempt of a lookup, into ws.done; false when something
// it read changed meanwhile (ws.done is then to be dropped).
//
// It enters the run the request's block 0 starts (the root's child), reads
// how far the request follows the run (m positions), and takes from each
// coverage entry of a worker still alive the positions it holds of those
// (min(lead, m)); a worker holding all m stays alive into the next run, the
// child hanging after the run's position m-1 that the request's next block
// starts. Content hashes are compared directly and find the child in the
// child table; prefix hashes are compared by chaining the run's content
// hashes from the run's head prefix hash and find the child in the heads
// table. Runs are read under their seqlock versions, and a run found through
// a table is checked to be that child (parent, offset, head), which covers
// a run freed and reused since the table was read.
func (ix *Index) tryWalk(ws *walkState, stamp uint32, o *nameOrder) bool {
	f := &ix.fw
	hc := &ws.hc
	n := hc.n
	byPrefix := hc.prefix != nil
	stamped := f.stamped
	ws.done = ws.done[:0]
	rank := o.rank
	if len(ws.scratch) < len(o.names) {
		ws.scratch = append(ws.scratch, make([]walkScratch, len(o.names)-len(ws.scratch))...)
	}
	scratch := ws.scratch[:len(o.names)]
	if ws.stamp > 1<<31 {
		clear(ws.scratch)
		ws.stamp = 0
	}
	var first uint64
	if byPrefix {
		first = hc.prefix[0] // block 0's prefix hash is its content hash
	} else {
		first = hc.get(0)
	}
	id, tv, ok := f.kids.get(0, first)
	tab := &f.kids
	if !ok {
		return false
	}
	base, i := 0, 0
	parent, poff := uint32(0), uint32(0)
	prev := uint32(0) // the stamp of the run before; 0: the first run
	// The run the walk came from and its version when it was read: a child
	// found by (parent position, first hash) is the request's only if that
	// parent was not freed and its id reused meanwhile (a removal and a
	// store, one batch, can free a path and file another chain under the
	// same id, offset and first content hash); the child's own identity
	// check cannot tell.
	var pr *run
	var prv uint32
	for id != 0 {
		d := f.dir.Load().c
		if int(id>>chunkBits) >= len(d) {
			return false
		}
		ch := d[id>>chunkBits]
		r := &ch[id&(1<<chunkBits-1)]
		rv := r.ver.Load()
		b := r.body.Load()
		if rv&1 != 0 || b == nil {
			return false
		}
		size := hsize(b.h, stamped)
		h := b.h[:min(int(atomic.LoadUint32(&r.n)), size)]
		cov := b.cov[:min(int(atomic.LoadUint32(&r.ncov)), len(b.cov))]
		want := first
		if byPrefix {
			want = hc.prefix[i]
		}
		// Still the child it was found as (not freed and reused since)?
		if len(h) == 0 || atomic.LoadUint32((*uint32)(&r.from)) != uint32(makeLoc(parent, int(poff))) ||
			(byPrefix && atomic.LoadUint64(&r.head) != want) || (!byPrefix && atomic.LoadUint64(&h[0]) != want) {
			// Not a change if neither the run nor the table moved: a 64-bit
			// collision of head prefix hashes, and no match.
			return r.ver.Load() == rv && tab.ver.Load() == tv && (pr == nil || pr.ver.Load() == prv)
		}
		if pr != nil && pr.ver.Load() != prv {
			return false
		}
		lim := min(len(h), n-i)
		var m int
		switch {
		case byPrefix:
			m = chainLen(h[:lim], hc.prefix[i:i+lim])
		case hc.content != nil:
			m = 1 + matchLen(h[1:lim], hc.content[i+1:i+lim])
		default:
			m = 1
			for m < lim && atomic.LoadUint64(&h[m]) == hc.get(i+m) {
				m++
			}
		}
		var maxd int
		alive := false
		if prev == 0 {
			// The first run: every worker in it is new to the answer and
			// none is checked against a run before, so the answer is
			// written without the per-worker scratch (stamped below only
			// when the lookup goes on into a child).
			if cap(ws.done) < len(cov) {
				ws.done = make([]uint64, 0, len(cov)+len(cov)/2)
			}
			k, md := firstRun(ws.done[:len(cov)], cov, int32(m), rank)
			ws.done = ws.done[:k]
			maxd, alive = int(md), int(md) == m
		} else {
			ws.stamp++
			st := ws.stamp
			for k := range cov {
				e := &cov[k]
				w := atomic.LoadUint32(&e.w)
				if int(w) >= len(rank) || rank[w] == 0 {
					continue // not in the name order: not answered
				}
				rk := rank[w]
				if int(rk) > len(scratch) {
					return false // not this order's
				}
				sc := &scratch[rk-1]
				if sc.alive != prev {
					continue
				}
				// Alive through the runs before, so answered already: its
				// result only grows.
				d := min(int(atomic.LoadUint32(&e.lead)), m)
				if d == 0 {
					continue
				}
				maxd = max(maxd, d)
				if int(sc.idx) < len(ws.done) {
					ws.done[sc.idx] = matchKey(int32(base+d), rk)
				}
				if d == m {
					sc.alive, alive = st, true
				}
			}
			prev = st
		}
		if stamped && r.ver.Load() == rv {
			// Refresh the stamps of the positions the lookup reached while a
			// worker was still alive. The run can still change between the
			// check above and these stores: a stamp is then lost, or, if the
			// run was freed and its array handed to a growing run, written
			// onto that run's position, which is kept one TTL longer than
			// it should be. Either way no match changes.
			for o := range min(maxd+1, m) {
				if p := stampAt(b.h, size, o); atomic.LoadUint32(p) != stamp {
					atomic.StoreUint32(p, stamp)
				}
			}
		}
		if r.ver.Load() != rv {
			return false
		}
		if !alive || i+m == n {
			return true
		}
		if base == 0 {
			// Going on into a child from the first run: the workers alive
			// to its end get their result slots; only they can score in the
			// runs after.
			ws.stamp++
			st := ws.stamp
			for k, key := range ws.done {
				if keyBlocks(key) != int32(m) {
					continue
				}
				if int(uint32(key)) < len(scratch) {
					scratch[uint32(key)] = walkScratch{alive: st, idx: uint32(k)}
				}
			}
			prev = st
		}
		if lookupBetweenRuns != nil {
			lookupBetweenRuns()
		}
		parent, poff = id, uint32(m-1)
		pr, prv = r, rv
		base += m
		i += m
		if byPrefix {
			tab = &f.heads
			first = hc.prefix[i]
			id, tv, ok = tab.get(0, first)
		} else {
			tab = &f.kids
			first = hc.get(i)
			id, tv, ok = tab.get(uint32(makeLoc(parent, int(poff))), first)
		}
		if !ok {
			return false
		}
	}
	return true
}

// firstRun writes into out (as long as cov) the key (matchKey) of each
// coverage entry's worker and lead up to m, in order, keeping those with a
// lead and a rank, and returns how many it kept and the largest lead. Out
// of line, its loop keeps its counters in registers.
//
//go:noinline
func firstRun(out []uint64, cov []cover, m int32, rank []uint32) (int, int32) {
	out = out[:len(cov)]
	n, maxd := 0, int32(0)
	for k := range cov {
		e := &cov[k]
		d := min(int32(atomic.LoadUint32(&e.lead)), m)
		w := atomic.LoadUint32(&e.w)
		var rk uint32
		if w < uint32(len(rank)) {
			rk = rank[w]
		}
		out[n] = matchKey(d, rk)
		maxd = max(maxd, d)
		if d != 0 && rk != 0 {
			n++
		}
	}
	return n, maxd
}

// matchLen is how many of h's content hashes (read atomically) equal
// want's, from the first.
func matchLen(h, want []uint64) int {
	want = want[:len(h)]
	for k := range h {
		if atomic.LoadUint64(&h[k]) != want[k] {
			return k
		}
	}
	return len(h)
}

// chainLen is how many of prefix's hashes the run's content hashes h
// (read atomically; prefix[0] is already compared, as the run's head)
// chain to, from the first.
func chainLen(h, prefix []uint64) int {
	prefix = prefix[:len(h)]
	if len(h) == 0 {
		return 0
	}
	p := prefix[0]
	for k := 1; k < len(h); k++ {
		if p = ChainHash(p, atomic.LoadUint64(&h[k])); p != prefix[k] {
			return k
		}
	}
	return len(h)
}

// lookupBetweenRuns, when not nil, runs in a lookup after it has read a
// run and before it looks for the child it goes on into: a test's seam for
// changing the index at that point (nil outside tests).
var lookupBetweenRuns func()
