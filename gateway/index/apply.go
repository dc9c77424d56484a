package index

// Applying a worker's events: stores (reverse table, then forward map),
// removals, and the reference counts that tie the two.

import (
	"slices"
	"sync/atomic"

	"github.com/kvrelay/kvrelay/proto/kvpb"
)

// Apply applies one admitted batch from worker w. Its events run in order:
//
//   - Stored: each block is re-hashed from its token ids under the event's
//     namespace (lora_name, cache_salt) and filed under its prefix hash,
//     chained from the parent's prefix hash; a parent the worker's rank does
//     not hold starts a new chain from the root (SMG's parentless fallback,
//     counted). A block already held gains a copy on the event's tier.
//   - Removed: each named engine hash releases one copy on the event's tier;
//     the worker stops holding the prefix when no copy is left on any tier.
//   - Cleared: drops every block of the batch's rank.
//
// Events owned by a residency agent ("kvcr"), remote events, non-main
// attention groups and disk/external tiers are skipped and counted.
func (ix *Index) Apply(w WorkerID, b *kvpb.KvEventBatch) {
	ix.apply(w, b, nil)
}

// Prepared is a batch whose stored blocks already carry their content hashes,
// computed by Prepare. Hashing the tokens is the largest part of applying a
// store (a 128-token block takes longer to hash than to index), and it needs
// nothing from the index, so a caller can do it before taking any lock, on
// any goroutine; ApplyPrepared then does only the index's own work.
type Prepared struct {
	batch   *kvpb.KvEventBatch
	content [][]uint64 // per event: one content hash per block; nil for other events
}

// Prepare hashes b's stored blocks under their events' namespaces.
func Prepare(b *kvpb.KvEventBatch) *Prepared {
	p := &Prepared{batch: b}
	if b == nil {
		return p
	}
	p.content = make([][]uint64, len(b.Events))
	for i, ev := range b.Events {
		s := ev.GetStored()
		if s == nil || len(s.Blocks) == 0 {
			continue
		}
		seed := NamespaceSeed(s.GetLoraName(), s.GetCacheSalt())
		hs := make([]uint64, len(s.Blocks))
		for j, blk := range s.Blocks {
			if blk != nil {
				hs[j] = ContentHash(blk.TokenIds, seed)
			}
		}
		p.content[i] = hs
	}
	return p
}

// ApplyPrepared is Apply for a batch hashed by Prepare.
func (ix *Index) ApplyPrepared(w WorkerID, p *Prepared) {
	if p != nil {
		ix.apply(w, p.batch, p.content)
	}
}

func (ix *Index) apply(w WorkerID, b *kvpb.KvEventBatch, content [][]uint64) {
	if b == nil || len(b.Events) == 0 {
		return
	}
	rank := b.GetDpRank()
	ws := ix.lockWorker(w)
	defer ws.mu.Unlock()
	var stamp uint32
	if ix.pruning {
		stamp = ix.stampAt(ix.now())
	}
	for i, ev := range b.Events {
		switch e := ev.GetData().(type) {
		case *kvpb.KvCacheEvent_Stored:
			var hs []uint64
			if i < len(content) {
				hs = content[i]
			}
			ix.applyStored(ws, rank, e.Stored, hs, stamp, b.Snapshot != nil)
		case *kvpb.KvCacheEvent_Removed:
			ix.applyRemoved(ws, rank, e.Removed)
		case *kvpb.KvCacheEvent_Cleared:
			if e.Cleared == nil || foreignOwner(e.Cleared.Ownership) {
				ws.c.SkippedForeign++
				continue
			}
			ix.clearRankLocked(ws, rank)
			ws.c.Cleared++
		}
	}
}

// applyStored files s's blocks; content holds their content hashes when the
// batch was prepared (nil: hash the tokens here).
// A snapshot chunk's stores are one per physical copy, synthesized by the
// relay: never re-announcements, whatever their shape.
func (ix *Index) applyStored(ws *workerState, rank int32, s *kvpb.KvBlocksStored, content []uint64, stamp uint32, snapshot bool) {
	if s == nil || len(s.Blocks) == 0 {
		return
	}
	switch {
	case foreignOwner(s.Ownership):
		ws.c.SkippedForeign++
		return
	case remote(s.Locality):
		ws.c.SkippedRemote++
		return
	}
	if s.GroupIdx != nil {
		if s.KvCacheSpecKind != nil && !mainAttentionKinds[*s.KvCacheSpecKind] {
			if ws.nonMain == nil {
				ws.nonMain = make(map[uint32]struct{})
			}
			ws.nonMain[*s.GroupIdx] = struct{}{}
		}
		if _, skip := ws.nonMain[*s.GroupIdx]; skip {
			ws.c.SkippedGroup++
			return
		}
	} else if s.KvCacheSpecKind != nil && !mainAttentionKinds[*s.KvCacheSpecKind] {
		ws.c.SkippedGroup++
		return
	}
	first := s.Blocks[0]
	for _, b := range s.Blocks {
		if b != nil {
			first = b
			break
		}
	}
	tier, ok := resolveTier(s.Tier, first.GetCacheLevel())
	if !ok {
		ws.c.SkippedTier++
		return
	}
	if !ws.learned && ix.opts.BlockSize == 0 && first.GetBlockSize() > 0 {
		ix.blockSize.Store(int64(first.GetBlockSize()))
		ws.learned = true
	}
	rt := ws.ranks[rank]
	if rt == nil {
		rt = newRevTable(&ix.pool)
		ws.ranks[rank] = rt
	}
	var seed uint64
	if len(content) != len(s.Blocks) {
		content = nil
		seed = NamespaceSeed(s.GetLoraName(), s.GetCacheSalt())
	}
	var prev uint64
	var prevLoc loc
	chained := false
	lk := newShardLocks(ix, &ws.lkRuns)
	defer lk.release()
	if ix.opts.ReportModeFull && !snapshot && s.ParentBlockHash == nil && ix.reannounced(&lk, rt, s, tier, content, seed) {
		ws.c.ReannouncedStores++
		ws.c.ReannouncedBlocks += uint64(len(s.Blocks))
		return
	}
	if s.ParentBlockHash != nil {
		if i := rt.find(uint64(*s.ParentBlockHash)); i >= 0 {
			prevLoc, chained = unpackLoc(rt.slots[i].pos, ix.shardBits), true
			prev = ix.hashAt(&lk, prevLoc)
		} else {
			ws.c.ParentlessStores++
			ws.c.ParentlessBlocks += uint64(len(s.Blocks))
		}
	}
	// The event is applied in two passes. The first does each block's own
	// work: its content hash and its reverse entry (a random probe into the
	// worker's table, the costly part), before any forward shard is changed.
	// The second files the blocks in the forward map in one go: they are
	// mostly consecutive positions of one run, so the run found for one
	// block serves the next (shardLocks.last) and its version goes odd once
	// for the event, not once a block. The passes give the same result as
	// one loop would: the first pass's reverse changes (new entries and
	// copy counts, in block order) depend on nothing in the forward map,
	// and the second reads a new entry's position only after filing it.
	defer ws.dropLargeScratch()
	if content == nil {
		content = slices.Grow(ws.evContent[:0], len(s.Blocks))[:len(s.Blocks)]
		ws.evContent = content
		for j, blk := range s.Blocks {
			if blk != nil {
				content[j] = ContentHash(blk.TokenIds, seed)
			}
		}
	}
	slots := slices.Grow(ws.evSlots[:0], len(s.Blocks))[:len(s.Blocks)]
	ws.evSlots = slots
	resizes := rt.resizes
	for j, blk := range s.Blocks {
		if blk == nil {
			slots[j] = evSlot{slot: -1}
			continue
		}
		ws.c.StoredBlocks++
		i, found := rt.upsert(uint64(blk.BlockHash), noPos, withTierCount(0, tier, 1))
		if found {
			c := rt.counts(i)
			if n := tierCount(c, tier); n >= copiesCap {
				ws.c.CappedCopies++
			} else {
				rt.setCounts(i, withTierCount(c, tier, n+1))
			}
		}
		slots[j] = evSlot{slot: int32(i), found: found}
	}
	// A table that grew during the first pass moved its entries: find them again.
	moved := rt.resizes != resizes
	for j := 0; j < len(s.Blocks); j++ {
		if j%settleEvery == settleEvery-1 {
			lk.settle()
		}
		if slots[j].slot < 0 {
			continue
		}
		if chained && !slots[j].found {
			if k := ix.extendRun(&lk, ws, rt, s.Blocks, content, slots, j, &prev, &prevLoc, stamp, moved); k > j {
				j = k - 1
				continue
			}
		}
		blk := s.Blocks[j]
		p := content[j]
		if chained {
			p = ChainHash(prev, p)
		}
		i := int(slots[j].slot)
		if moved {
			i = rt.find(uint64(blk.BlockHash))
		}
		var l loc
		if slots[j].found {
			// Keep the block's first filing, so later children chain from where
			// the earlier ones did; re-assert the holder in case a prune evicted it.
			// (Its position is set: an entry new in this event was filed, or
			// the event ended in leaveOut, before a repeat of it comes here.)
			l = unpackLoc(rt.slots[i].pos, ix.shardBits)
			if known := ix.hashAt(&lk, l); known != p {
				ws.c.EngineConflicts++
				p = known
			}
			ix.addRef(&lk, ws, l, stamp, false)
		} else {
			var ok bool
			if l, ok = ix.place(&lk, prevLoc, chained, p, len(s.Blocks)-j); !ok {
				ws.leaveOut(rt, s.Blocks[j:])
				return
			}
			rt.slots[i].pos = packLoc(l, ix.shardBits)
			ix.addRef(&lk, ws, l, stamp, true)
		}
		chained = true
		prev, prevLoc = p, l
	}
}

// extendRun files the store's blocks from j on, while each is new to the
// rank and continues the run of the block before it (prevLoc, whose run is
// the writer's cached one, locked and changing): the next position of that
// run when it holds the block's prefix hash, or a position appended at the
// run's end (no run can be headed by it there: see place). These are place's first two
// cases and addRef's counted case, the same reads and writes in the same
// order, done in one loop for the event's consecutive blocks instead of a
// dispatch per block (the run's lookup through the lock bookkeeping, the
// position's packing and unpacking, the holder's run found again). It stops
// at the first block that needs anything else (a branch, a full run, a
// head, a block the rank held, a settle point after j) and returns the
// index of that block; prev and prevLoc then describe the last block filed.
func (ix *Index) extendRun(lk *shardLocks, ws *workerState, rt *revTable, blocks []*kvpb.KvBlock, content []uint64, slots []evSlot, j int, prev *uint64, prevLoc *loc, stamp uint32, moved bool) int {
	a, idx := prevLoc.shard(), prevLoc.run()
	r := lk.cached(a, idx)
	if r == nil {
		return j
	}
	sh := &ix.shards[a]
	o := prevLoc.off() + 1
	p := *prev
	m := j
fill:
	for ; m < len(slots); m, o = m+1, o+1 {
		if m > j && m%settleEvery == settleEvery-1 {
			break
		}
		es := slots[m]
		if es.slot < 0 || es.found {
			break
		}
		h := ChainHash(p, content[m])
		b := r.body.Load()
		switch n := int(r.n); {
		case o < n:
			if b.hash(o) != h {
				break fill
			}
		case o == n && o < maxRunLen: // no head can be p: see place
			sh.appendPosFor(r, h, len(slots)-m)
			b = r.body.Load()
		default:
			break fill
		}
		i := int(es.slot)
		if moved {
			i = rt.find(uint64(blocks[m].BlockHash))
		}
		l := makeLoc(a, idx, o)
		rt.slots[i].pos = packLoc(l, ix.shardBits)
		r.refs++
		held := sh.addHolder(b, o, ws.id, stamp)
		ws.retain(l, held, ix.pruning)
		p = h
	}
	if m > j {
		*prev, *prevLoc = p, makeLoc(a, idx, o-1)
	}
	return m
}

// leaveOut ends a store whose block blocks[0] could not be filed: its run
// would start in a shard at its run cap (maxRunsFor). That block, and every
// block of the event after it that was new to the rank, are not indexed:
// their reverse entries (made by the store's first pass, not yet filed) go,
// so the worker is not taken to hold them, and they are counted. Blocks the
// rank held before the event keep their filing and the copy the first pass
// counted.
func (ws *workerState) leaveOut(rt *revTable, blocks []*kvpb.KvBlock) {
	for _, blk := range blocks {
		if blk == nil {
			continue
		}
		switch i := rt.find(uint64(blk.BlockHash)); {
		case i < 0: // a repeat of a block left out just now
			ws.c.UnindexedBlocks++
		case rt.slots[i].pos == noPos:
			ws.c.UnindexedBlocks++
			rt.del(i)
		}
	}
}

// reannounced reports whether a parent-less store lists blocks rt already
// holds on tier, each filed at the prefix hash its tokens give along the
// store's chain from the root: a report-mode "full" re-announcement of hits
// (Options.ReportModeFull).
func (ix *Index) reannounced(lk *shardLocks, rt *revTable, s *kvpb.KvBlocksStored, tier Tier, content []uint64, seed uint64) bool {
	var prev uint64
	for j, blk := range s.Blocks {
		if blk == nil {
			return false
		}
		i := rt.find(uint64(blk.BlockHash))
		if i < 0 || tierCount(rt.counts(i), tier) == 0 {
			return false
		}
		p := content
		var h uint64
		if p != nil {
			h = p[j]
		} else {
			h = ContentHash(blk.TokenIds, seed)
		}
		if j > 0 {
			h = ChainHash(prev, h)
		}
		if ix.hashAt(lk, unpackLoc(rt.slots[i].pos, ix.shardBits)) != h {
			return false
		}
		prev = h
	}
	return true
}

// hashAt is the prefix hash at l, read under l's shard lock (a run's
// arrays are recycled when it grows). l must be named by a reverse entry of
// the calling writer, which keeps its run in place.
func (ix *Index) hashAt(lk *shardLocks, l loc) uint64 {
	if r := lk.cached(l.shard(), l.run()); r != nil {
		return r.body.Load().hash(l.off())
	}
	lk.need(l.shard(), -1)
	r := ix.shards[l.shard()].runAt(l.run())
	return r.body.Load().hash(l.off())
}

// place finds or makes the position of prefix hash p: right after prev when
// chained, else as the first block of a chain. A position after prev is
// either the next one of prev's run or the first of a run of its own; both
// are looked at, under both shards' locks, before anything is added, so p
// never gets two positions. room counts the event's blocks from p on: a run
// that p starts or grows gets arrays for all of them at once.
//
// It returns false when p needs a run of its own in a shard at its run cap.
func (ix *Index) place(lk *shardLocks, prev loc, chained bool, p uint64, room int) (loc, bool) {
	ps := ix.shardIndex(p)
	if !chained {
		lk.need(ps, -1)
		if l, ok := ix.headLoc(ps, p); ok {
			return l, true
		}
		return ix.startRun(lk, ps, p, room)
	}
	a := prev.shard()
	sh := &ix.shards[a]
	o := prev.off() + 1
	// The common case, the block after the one just filed: its run is held
	// and changing already (see shardLocks.last).
	r := lk.cached(a, prev.run())
	if r == nil {
		r = sh.runAt(prev.run())
		lk.need(a, -1)
	}
	next := func() bool { return o < int(atomic.LoadUint32(&r.n)) && r.body.Load().hash(o) == p }
	atEnd := func() bool { return o == int(atomic.LoadUint32(&r.n)) && o < maxRunLen }
	appendHere := func() (loc, bool) {
		lk.writeRunAt(a, prev.run(), r)
		sh.appendPosFor(r, p, room)
		return makeLoc(a, prev.run(), o), true
	}
	if next() {
		return makeLoc(a, prev.run(), o), true
	}
	// Appending to prev's run is the common case (a conversation's next
	// turn). It only needs to know that p is not a head, which a lock-free
	// read of p's shard tells: a head p made while prev sat where it sits
	// now would have been made under a's lock, which we hold, and prev
	// cannot move while our reverse entry names it.
	// Appending to prev's run at its end needs no look at the heads: a run
	// headed by p would have been started from prev's position while prev's
	// run went on past it or was full (place's last case), and that run, its
	// parent, lives as long as it does (run.parent); prev's position has not
	// moved since, and a live run never shrinks, so prev would not be at its
	// run's end now. (A parent-less store's first block heads a run under its
	// bare content hash; p equalling one is a 64-bit collision, which a
	// parent-less store is not checked against in the other direction either.)
	if atEnd() {
		return appendHere()
	}
	if !lk.need(a, ps) && next() {
		return makeLoc(a, prev.run(), o), true
	}
	if l, ok := ix.headLoc(ps, p); ok {
		return l, true
	}
	if atEnd() {
		return appendHere()
	}
	l, ok := ix.startRun(lk, ps, p, room)
	if ok {
		// Both shards are held (need above): the new run's parent is prev's run.
		ix.shards[ps].runAt(l.run()).parent = packLoc(makeLoc(a, prev.run(), 0), ix.shardBits)
		r.kids++
	}
	return l, ok
}

// headLoc is the position of p when p heads a run of shard ps (ps locked).
func (ix *Index) headLoc(ps int, p uint64) (loc, bool) {
	if !ix.shards[ps].filter.Load().mayHave(p) {
		return 0, false
	}
	t := ix.shards[ps].tab.Load()
	if i := t.find(p, ix.shardBits); i >= 0 {
		return makeLoc(ps, t.val(i)-1, 0), true
	}
	return 0, false
}

// startRun makes p the head of a new run of shard ps (ps locked); false
// when the shard is at its run cap, which is logged once per shard.
func (ix *Index) startRun(lk *shardLocks, ps int, p uint64, room int) (loc, bool) {
	sh := &ix.shards[ps]
	lk.write(ps)
	idx, ok := sh.newRunFor(p, ix.pruning, ix.shardBits, room)
	if !ok {
		if !sh.capWarned {
			sh.capWarned = true
			ix.log.Warn("index: a forward shard has no run number left; blocks that need a new run there are not indexed (counted in UnindexedBlocks) until runs are freed",
				"shard", ps, "max_runs", sh.maxRuns)
		}
		return 0, false
	}
	return makeLoc(ps, idx, 0), true
}

// noHead reports that p surely heads no run of shard ps: read under the
// lock when this writer holds it (its version may be odd by our own hand),
// else without locking; false when that read could not be had, and the
// caller takes the locked path.
func (ix *Index) noHead(lk *shardLocks, ps int, p uint64) bool {
	if lk.has(ps) {
		_, has := ix.headLoc(ps, p)
		return !has
	}
	has, ok := ix.shards[ps].tryHasHead(p, ix.shardBits)
	return ok && !has
}

// addRef makes ws a holder of l and stamps it. counted says a new reverse
// entry of ws names l (rather than a known one gaining a copy).
func (ix *Index) addRef(lk *shardLocks, ws *workerState, l loc, stamp uint32, counted bool) {
	s := l.shard()
	sh := &ix.shards[s]
	r := lk.cached(s, l.run())
	if r == nil {
		lk.need(s, -1)
		r = sh.runAt(l.run())
		lk.writeRunAt(s, l.run(), r)
	}
	if counted {
		r.refs++
	}
	held := sh.addHolder(r.body.Load(), l.off(), ws.id, stamp)
	if counted {
		ws.retain(l, held, ix.pruning)
	}
}

// retain counts a new reverse entry of ws naming l; held says ws already
// held l. Without pruning one entry is implied by the holder bit, so only a
// second one is counted; with pruning (which clears holder bits) every one.
func (ws *workerState) retain(l loc, held, pruning bool) {
	if !pruning && !held {
		return
	}
	if ws.refs == nil {
		ws.refs = make(map[loc]uint32)
	}
	if pruning {
		ws.refs[l]++
	} else {
		ws.refs[l] = max(ws.refs[l], 1) + 1
	}
}

// release uncounts a reverse entry of ws naming l and reports whether it was
// the last, so that ws stops holding l.
func (ws *workerState) release(l loc, pruning bool) (last bool) {
	// Counts are never kept at 0, so an absent position had one entry. The
	// common case, no position named twice, takes no map call at all: a
	// lookup and a delete of an absent key were 2 % of the Mooncake corpus
	// replay's instructions, on every removed block.
	if len(ws.refs) == 0 {
		return true
	}
	n := ws.refs[l]
	if n == 0 {
		return true
	}
	if pruning && n <= 1 {
		delete(ws.refs, l)
		return true
	}
	if !pruning && n <= 2 {
		delete(ws.refs, l) // one left, implied by the holder bit again
	} else {
		ws.refs[l] = n - 1
	}
	return false
}

// dropRef records that one reverse entry of ws naming l is gone: ws stops
// holding l when it was the last, and l's run goes when no entry names it.
func (ix *Index) dropRef(lk *shardLocks, ws *workerState, l loc) {
	s := l.shard()
	sh := &ix.shards[s]
	r := lk.cached(s, l.run())
	if r == nil {
		lk.need(s, -1)
		r = sh.runAt(l.run())
	}
	if ws.release(l, ix.pruning) {
		lk.writeRunAt(s, l.run(), r)
		sh.removeHolder(r.body.Load(), l.off(), ws.id)
	}
	if r.refs--; r.refs == 0 && r.kids == 0 {
		ix.freeRunChain(lk, s, l.run(), r)
	}
}

// freeRunChain frees run idx of shard s (held), which no reverse entry
// names and which has no live kids, then its parent if that was the
// parent's last kid and no reverse entry names the parent, and so on up.
// The parent cannot go meanwhile: it counts this run until the decrement.
func (ix *Index) freeRunChain(lk *shardLocks, s int, idx uint32, r *run) {
	for {
		parent := r.parent
		lk.write(s)
		lk.writeRunAt(s, idx, r)
		ix.shards[s].freeRun(idx, ix.shardBits)
		lk.forget(s, idx)
		if parent == noPos {
			return
		}
		pl := unpackLoc(parent, ix.shardBits)
		s, idx = pl.shard(), pl.run()
		lk.need(s, -1)
		r = ix.shards[s].runAt(idx)
		if r.kids--; r.kids != 0 || r.refs != 0 {
			return
		}
	}
}

func (ix *Index) applyRemoved(ws *workerState, rank int32, r *kvpb.KvBlocksRemoved) {
	if r == nil || len(r.BlockHashes) == 0 {
		return
	}
	switch {
	case foreignOwner(r.Ownership):
		ws.c.SkippedForeign++
		return
	case remote(r.Locality):
		ws.c.SkippedRemote++
		return
	}
	if r.GroupIdx != nil {
		if _, skip := ws.nonMain[*r.GroupIdx]; skip {
			ws.c.SkippedGroup++
			return
		}
	}
	tier, ok := resolveTier(r.Tier, r.GetCacheLevel())
	if !ok {
		ws.c.SkippedTier++
		return
	}
	rt := ws.ranks[rank]
	if rt == nil {
		ws.c.UnknownRemovals += uint64(len(r.BlockHashes))
		return
	}
	// Two passes, as in applyStored: the reverse table first, with no forward
	// shard locked, collecting the positions whose last entry went; then the
	// forward map in one go, where consecutive positions of one run share
	// the run's lookup and version change (shardLocks.last). Dropping the
	// references after all the reverse changes gives the same result: the
	// forward map's reference counts do not depend on the reverse table.
	defer ws.dropLargeScratch()
	locs := ws.evLocs[:0]
	for _, h := range r.BlockHashes {
		i := rt.find(uint64(h))
		if i < 0 {
			ws.c.UnknownRemovals++
			continue
		}
		c := rt.counts(i)
		n := tierCount(c, tier)
		if n == 0 {
			ws.c.UnknownRemovals++
			continue
		}
		ws.c.RemovedBlocks++
		if c = withTierCount(c, tier, n-1); c != 0 {
			rt.setCounts(i, c)
			continue
		}
		locs = append(locs, unpackLoc(rt.slots[i].pos, ix.shardBits))
		rt.del(i)
	}
	ws.evLocs = locs
	if len(locs) == 0 {
		return
	}
	lk := newShardLocks(ix, &ws.lkRuns)
	defer lk.release()
	for j, l := range locs {
		if j%settleEvery == settleEvery-1 {
			lk.settle()
		}
		ix.dropRef(&lk, ws, l)
	}
}
