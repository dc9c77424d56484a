package index

// Lookups: a request's blocks walked through the shards, every holder's
// leading run counted.

import (
	"math"
	"math/bits"
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

type slotMatch struct {
	id     uint32
	blocks int32
}

// hashCursor gives a request's prefix hashes, from whichever input the
// caller has (prefix hashes, content hashes, or tokens), computed lazily in
// order and kept: a lookup that retries a run reads them again, and one
// whose overlap ends early hashes no further.
type hashCursor struct {
	n       int // blocks
	prefix  []uint64
	content []uint64
	tokens  []uint32
	bs      int
	seed    uint64
	hs      []uint64
}

func (c *hashCursor) get(i int) uint64 {
	if c.prefix != nil {
		return c.prefix[i]
	}
	for j := len(c.hs); j <= i; j++ {
		var h uint64
		if c.content != nil {
			h = c.content[j]
		} else {
			h = ContentHash(c.tokens[j*c.bs:(j+1)*c.bs], c.seed)
		}
		if j > 0 {
			h = ChainHash(c.hs[j-1], h)
		}
		c.hs = append(c.hs, h)
	}
	return c.hs[i]
}

// candidates is a lookup's set of workers still matching, and those that
// dropped out with their depth.
//
// A multi-worker set is kept sparse: only the words of the slot bitset that
// still have a candidate, with their word index, in ascending order. A holder
// bitset is as wide as the shard's widest worker slot, so ANDing it whole at
// every block would cost O(fleet) per block; ANDing only the live words costs
// O(overlapping candidates). The first step reads the whole bitset once.
type candidates struct {
	active   []liveWord // the non-zero words, when !isSingle
	single   uint32
	isSingle bool
	started  bool
	done     []slotMatch
}

// liveWord is one non-zero word of the candidates' slot bitset: slots
// idx*64 .. idx*64+63.
type liveWord struct {
	idx  uint32
	bits uint64
}

// step applies position pos's holder word: workers not holding it drop out
// with depth pos. It returns false when no candidate is left, and ok false
// when the word names a bitset the slab does not have (a torn read); then it
// has changed nothing.
func (c *candidates) step(pos int, h uint32, sl *slab) (more, ok bool) {
	if h == 0 {
		return false, true
	}
	var set []uint64
	if h&1 == 0 {
		b := int(h>>1) - 1
		if (b+1)*sl.words > len(sl.w) {
			return false, false
		}
		set = sl.w[b*sl.words : (b+1)*sl.words]
	}
	if !c.started {
		c.started = true
		if set == nil {
			c.single, c.isSingle = h>>1, true
			return true, true
		}
		for i := range set {
			if x := atomic.LoadUint64(&set[i]); x != 0 {
				c.active = append(c.active, liveWord{idx: uint32(i), bits: x})
			}
		}
		return len(c.active) > 0, true
	}
	if c.isSingle {
		if set == nil {
			return h>>1 == c.single, true
		}
		w := int(c.single >> 6)
		return w < len(set) && atomic.LoadUint64(&set[w])&(1<<(c.single&63)) != 0, true
	}
	if set == nil {
		id := h >> 1
		keep := false
		for _, lw := range c.active {
			if lw.idx == id>>6 {
				keep = lw.bits&(1<<(id&63)) != 0
				break
			}
		}
		c.done = dropAll(c.active, c.done, pos, id, keep)
		c.active = c.active[:0]
		if !keep {
			return false, true
		}
		c.single, c.isSingle = id, true
		return true, true
	}
	// AND the live words only, compacting in place as words go to zero. A
	// word whose candidates all hold the block (the common case) is left
	// untouched unless an earlier word was dropped.
	active := c.active
	kept := 0
	for k := range active {
		lw := &active[k]
		var x uint64
		if int(lw.idx) < len(set) {
			x = atomic.LoadUint64(&set[lw.idx])
		}
		gone := lw.bits &^ x
		if gone == 0 {
			if kept != k {
				active[kept] = *lw
			}
			kept++
			continue
		}
		for g := gone; g != 0; g &= g - 1 {
			c.done = append(c.done, slotMatch{id: lw.idx<<6 + uint32(bits.TrailingZeros64(g)), blocks: int32(pos)})
		}
		if lw.bits &^= gone; lw.bits != 0 {
			active[kept] = *lw
			kept++
		}
	}
	c.active = active[:kept]
	return kept > 0, true
}

// walkState is a lookup's working memory, pooled. Its buffers are kept
// across lookups (up to walkKeepCap entries each, so that one huge request
// does not pin its memory), so that a lookup allocates nothing once they
// have grown to the fleet's overlaps.
type walkState struct {
	hc     hashCursor
	c      candidates
	saved  savedCandidates
	hashes []uint64 // the request's prefix chain
	active []liveWord
	done   []slotMatch
	keys   []uint64 // the sort keys of the answer
}

// walkKeepCap bounds what a pooled walkState keeps of each buffer.
const walkKeepCap = 1 << 14

var walkPool = sync.Pool{New: func() any {
	return &walkState{active: make([]liveWord, 0, 16), done: make([]slotMatch, 0, 32)}
}}

func (w *walkState) put() {
	w.hashes = keepBuf(w.hashes, w.hc.hs)
	w.active = keepBuf(w.active, w.c.active)
	w.done = keepBuf(w.done, w.c.done)
	w.hc = hashCursor{}
	w.c = candidates{}
	if cap(w.saved.active) > 512 {
		w.saved.active = nil
	}
	if cap(w.keys) > walkKeepCap {
		w.keys = nil
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

// savedCandidates is what a lookup rolls back to when a run it read changed.
type savedCandidates struct {
	active   []liveWord
	single   uint32
	isSingle bool
	started  bool
	nDone    int
}

func (c *candidates) save(s *savedCandidates) {
	s.active = append(s.active[:0], c.active...)
	s.single, s.isSingle, s.started, s.nDone = c.single, c.isSingle, c.started, len(c.done)
}

func (c *candidates) restore(s *savedCandidates) {
	c.active = append(c.active[:0], s.active...)
	c.single, c.isSingle, c.started, c.done = s.single, s.isSingle, s.started, c.done[:s.nDone]
}

// walk matches a request's prefix hashes (from cur, asked in order) against
// the forward map. It reads run by run: the request's block 0, and every
// block where it leaves a run, is found through the heads table; the blocks
// that follow in the same run are compared in place. The heads table is read
// under its shard's seqlock and a run under its own, and read again, from
// the same state, if it changed.
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
	defer ws.put()
	ws.hc = cur
	ws.hc.hs = ws.hashes[:0]
	ws.c = candidates{active: ws.active[:0], done: ws.done[:0]}
	hc, c, saved := &ws.hc, &ws.c, &ws.saved
	sb := ix.shardBits
	pos := 0
	for pos < n {
		h := hc.get(pos)
		sh := &ix.shards[ix.shardIndex(h)]
		c.save(saved)
		start := pos
		var more bool
		for tries := 0; ; tries++ {
			if tries > 64 {
				runtime.Gosched() // a writer may have been preempted mid-change
			}
			p, stop, ok := ix.readRun(sh, hc, c, start, n, h, sb, stamp)
			if ok {
				pos, more = p, !stop
				break
			}
			c.restore(saved)
		}
		if !more {
			break
		}
	}
	if c.isSingle {
		c.done = append(c.done, slotMatch{id: c.single, blocks: int32(pos)})
	} else {
		for _, lw := range c.active {
			for x := lw.bits; x != 0; x &= x - 1 {
				c.done = append(c.done, slotMatch{id: lw.idx<<6 + uint32(bits.TrailingZeros64(x)), blocks: int32(pos)})
			}
		}
	}
	done := c.done
	if len(done) == 0 {
		return
	}
	// Sort by depth, then name, on packed integer keys: (max − blocks, rank).
	keys := ws.keys[:0]
	ix.wmu.RLock()
	for _, d := range done {
		if d.blocks > 0 && int(d.id) < len(ix.slots) && ix.slots[d.id] != nil {
			keys = append(keys, uint64(math.MaxInt32-d.blocks)<<32|uint64(ix.rankOf[d.id]))
		}
	}
	slices.Sort(keys)
	ws.keys = keys
	// Grow once, to the exact size when res had no array (the allocating
	// wrappers), so that the loop below appends without reallocating.
	res.Workers = slices.Grow(res.Workers, len(keys))
	for _, k := range keys {
		res.Workers = append(res.Workers, Match{Worker: ix.slots[ix.byRank[uint32(k)]].name, Blocks: int(math.MaxInt32 - int32(k>>32))})
	}
	ix.wmu.RUnlock()
}

// readRun finds request block pos (prefix hash h) through sh's heads table
// and applies the holders of it and of the blocks after it that continue in
// the same run. It returns the first position not applied, and stop when no
// candidate is left (or nobody holds h); ok is false when what it read
// cannot be trusted (the shard's heads or the run changed meanwhile), and the
// caller rolls back and reads again.
func (ix *Index) readRun(sh *shard, hc *hashCursor, c *candidates, pos, n int, h uint64, sb uint8, stamp uint32) (next int, stop, ok bool) {
	v := sh.ver.Load()
	if v&1 == 1 {
		return pos, false, false
	}
	val, good := sh.tab.Load().tryFind(h, sb)
	if !good {
		return pos, false, false
	}
	if val == 0 {
		if sh.ver.Load() != v {
			return pos, false, false
		}
		// Nobody holds block pos: every candidate ends there.
		c.step(pos, 0, nil)
		return pos, true, true
	}
	d := sh.dir.Load()
	idx := int(val - 1)
	if idx >= len(d.r) {
		return pos, false, false
	}
	r := d.r[idx].Load()
	if r == nil || sh.ver.Load() != v {
		return pos, false, false
	}
	// r is h's run; from here on only r's own version matters.
	rv := r.ver.Load()
	if rv&1 == 1 {
		return pos, false, false
	}
	b := r.body.Load()
	rn := min(int(atomic.LoadUint32(&r.n)), b.size())
	sl := sh.sets.Load()
	touch := ix.pruning && b.stamped()
	next, stop, ok = pos, false, true
	for o := 0; ; {
		if o >= rn || b.loadHash(o) != h {
			ok = o > 0 // the head is always position 0
			break
		}
		if touch {
			if b.loadStamp(o) != stamp {
				b.setStamp(o, stamp)
			}
		}
		more, good := c.step(next, b.loadHold(o), sl)
		if !good {
			ok = false
			break
		}
		if !more {
			stop = true
			break
		}
		next++
		o++
		if next == n {
			break
		}
		h = hc.get(next)
	}
	if !ok || r.ver.Load() != rv {
		return pos, false, false
	}
	return next, stop, true
}

// dropAll records every active worker except keep-id as ending at pos.
func dropAll(active []liveWord, done []slotMatch, pos int, id uint32, keep bool) []slotMatch {
	for _, lw := range active {
		for x := lw.bits; x != 0; x &= x - 1 {
			if s := lw.idx<<6 + uint32(bits.TrailingZeros64(x)); !keep || s != id {
				done = append(done, slotMatch{id: s, blocks: int32(pos)})
			}
		}
	}
	return done
}
