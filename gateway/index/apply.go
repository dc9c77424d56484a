package index

// Applying a worker's events: stores (reverse table, then forward map),
// removals, and the reference counts that tie the two.

import (
	"slices"

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
	if ix.opts.ReportModeFull && !snapshot && s.ParentBlockHash == nil {
		ix.fw.mu.Lock()
		re := ix.reannounced(rt, s, tier, content, seed)
		ix.fw.unlock()
		if re {
			ws.c.ReannouncedStores++
			ws.c.ReannouncedBlocks += uint64(len(s.Blocks))
			return
		}
	}
	var prevLoc loc
	chained := false
	if s.ParentBlockHash != nil {
		if i := rt.find(uint64(*s.ParentBlockHash)); i >= 0 && rt.slots[i].pos != noPos {
			prevLoc, chained = loc(rt.slots[i].pos), true
		} else {
			ws.c.ParentlessStores++
			ws.c.ParentlessBlocks += uint64(len(s.Blocks))
		}
	}
	ix.fileBlocks(ws, rt, s.Blocks, content, seed, tier, stamp, prevLoc, chained)
}

// fileBlocks does applyStored's work on the event's blocks, from their
// content hashes (content; nil: hash them under seed), chained after
// prevLoc when chained. It is applyStored's tail, apart so that its two
// deferred calls are open-coded (a function with more returns than
// deferred calls allow runs its defers through the runtime: 294
// instructions a store in the corpus replay).
func (ix *Index) fileBlocks(ws *workerState, rt *revTable, blocks []*kvpb.KvBlock, content []uint64, seed uint64, tier Tier, stamp uint32, prevLoc loc, chained bool) {
	// The event is applied in two passes. The first does each block's own
	// work: its content hash and its reverse entry (a random probe into the
	// worker's table, the costly part), under the worker's lock only, so
	// that workers do it in parallel. The second files the blocks in the
	// forward map, which has one writer at a time. The passes give the same
	// result as one loop would: the first pass's reverse changes (new
	// entries and copy counts, in block order) depend on nothing in the
	// forward map, and the second reads a new entry's position only after
	// filing it.
	defer ws.dropLargeScratch()
	if content == nil {
		content = slices.Grow(ws.evContent[:0], len(blocks))[:len(blocks)]
		ws.evContent = content
		for j, blk := range blocks {
			if blk != nil {
				content[j] = ContentHash(blk.TokenIds, seed)
			}
		}
	}
	slots := slices.Grow(ws.evSlots[:0], len(blocks))[:len(blocks)]
	ws.evSlots = slots
	resizes := rt.resizes
	stored := uint64(len(blocks))
	for j, blk := range blocks {
		if blk == nil {
			slots[j] = nilSlot
			stored--
			continue
		}
		i, found := rt.upsert(uint64(blk.BlockHash), noPos, withTierCount(0, tier, 1))
		if found {
			c := rt.counts(i)
			if n := tierCount(c, tier); n >= copiesCap {
				ws.c.CappedCopies++
			} else {
				rt.setCounts(i, withTierCount(c, tier, n+1))
			}
		}
		if found {
			i = ^i
		}
		slots[j] = evSlot(i)
	}
	ws.c.StoredBlocks += stored
	// A table that grew during the first pass moved its entries: find them again.
	moved := rt.resizes != resizes
	f := &ix.fw
	f.mu.Lock()
	defer f.unlock()
	for j := 0; j < len(blocks); j++ {
		if j%settleEvery == settleEvery-1 {
			f.settle()
		}
		if slots[j] == nilSlot {
			continue
		}
		c := content[j]
		i, found := int(slots[j]), slots[j] < 0
		if found {
			i = ^i
		}
		if moved {
			i = rt.find(uint64(blocks[j].BlockHash))
		}
		var l loc
		if found && rt.slots[i].pos != noPos {
			// Keep the block's first filing, so later children chain from where
			// the earlier ones did; re-assert the holder in case a prune evicted it.
			l = loc(rt.slots[i].pos)
			if want, ok := f.follow(prevLoc, chained, c); !ok || want != l {
				ws.c.EngineConflicts++
			}
			ix.addRef(ws, l, stamp, false)
		} else {
			var ok bool
			if l, ok = f.place(prevLoc, chained, c, len(blocks)-j); !ok {
				ix.warnRunCap()
				ws.leaveOut(rt, blocks[j:])
				return
			}
			rt.slots[i].pos = uint32(l)
			ix.addRef(ws, l, stamp, true)
			if k := ix.extendRun(ws, rt, blocks, content, slots, j+1, l, stamp, moved); k > j+1 {
				l = makeLoc(l.run(), l.off()+k-1-j) // the last block filed
				j = k - 1
			}
		}
		chained = true
		prevLoc = l
	}
}

// extendRun files the store's blocks from j on while each is new to the
// rank and goes at the end of the run of the block before it (at l, just
// filed by ws, whose coverage of the run reaches it with no hole): the
// common case of a conversation's next turn, done in one loop (the content
// appended, the reverse entry set, the worker's lead moved along) instead
// of place and addRef per block. It stops at the first block that needs
// anything else (a nil block, one the rank held, a full run, a settle
// point) and returns its index.
func (ix *Index) extendRun(ws *workerState, rt *revTable, blocks []*kvpb.KvBlock, content []uint64, slots []evSlot, j int, l loc, stamp uint32, moved bool) int {
	f := &ix.fw
	id := l.run()
	r := f.run(id)
	o := l.off() + 1
	if o != int(r.n) {
		return j
	}
	ci := f.findCover(r, ws.id)
	if ci < 0 {
		return j
	}
	e := &r.covs()[ci]
	if e.lead != uint32(o) || e.holes != 0 {
		return j
	}
	// Stop before the next settle point (the caller settles there) and at
	// the run's end.
	end := min(len(slots), j|(settleEvery-1), j+maxRunLen-o)
	m := j
	stamped, pruning := f.stamped, ix.pruning
	b := r.body.Load()
	size := hsize(b.h, stamped)
	plain := !stamped && !pruning && !moved
loop:
	for ; m < end; m, o = m+1, o+1 {
		if plain && o < size {
			// The common case in one tight loop: up to the array's end,
			// each block's content stored and its reverse entry filed.
			lim := min(end, m+size-o)
			ss := slots[m:lim]
			cs, hs := content[m:lim][:len(ss)], b.h[o:size][:len(ss)]
			pl, k := makeLoc(id, o), 0
			for ; k < len(ss); k++ {
				i := ss[k]
				if i < 0 { // nil, or held by the rank already
					break
				}
				store64(&hs[k], cs[k])
				rt.slots[i].pos = uint32(pl + loc(k))
			}
			m, o = m+k, o+k
			if k < len(ss) {
				break loop
			}
			if m == end {
				break
			}
		}
		es := slots[m]
		if es < 0 {
			break
		}
		// o is the run's length: the block goes at its end. The run's
		// length, the worker's lead and the counts are stored once after
		// the loop (the run's version is odd: no reader uses them now).
		if o < size {
			store64(&b.h[o], content[m])
		} else {
			store32(&r.n, uint32(o))
			f.appendPos(id, r, content[m], len(slots)-m)
			b = r.body.Load()
			size = hsize(b.h, stamped)
		}
		i := int(es)
		if moved {
			i = rt.find(uint64(blocks[m].BlockHash))
		}
		pl := makeLoc(id, o)
		rt.slots[i].pos = uint32(pl)
		if stamped {
			store32(stampAt(b.h, size, o), stamp)
		}
		if pruning {
			ws.retain(pl, false, true)
		}
	}
	if m > j {
		store32(&r.n, uint32(o))
		store32(&e.lead, uint32(o))
		e.held += uint32(m - j)
		r.refs += uint32(m - j)
		store64(&f.mem, f.mem+uint64(m-j))
	}
	return m
}

// warnRunCap logs, once, that a store was left out for want of a run id.
func (ix *Index) warnRunCap() {
	if !ix.fw.capWarned {
		ix.fw.capWarned = true
		ix.log.Warn("index: no run id left; blocks that need a new run are not indexed (counted in UnindexedBlocks) until runs are freed",
			"max_runs", ix.fw.maxRuns)
	}
}

// leaveOut ends a store whose block blocks[0] could not be filed: its run
// needed a new run and no run id was left (forward.maxRuns). That block, and every
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
// holds on tier, each filed at the position its tokens give along the
// store's chain from the root (the path its prefix hashes name): a
// report-mode "full" re-announcement of hits (Options.ReportModeFull).
// The forward map's lock is held.
func (ix *Index) reannounced(rt *revTable, s *kvpb.KvBlocksStored, tier Tier, content []uint64, seed uint64) bool {
	var prev loc
	for j, blk := range s.Blocks {
		if blk == nil {
			return false
		}
		i := rt.find(uint64(blk.BlockHash))
		if i < 0 || tierCount(rt.counts(i), tier) == 0 {
			return false
		}
		var h uint64
		if content != nil {
			h = content[j]
		} else {
			h = ContentHash(blk.TokenIds, seed)
		}
		l, ok := ix.fw.follow(prev, j > 0, h)
		if !ok || uint32(l) != rt.slots[i].pos {
			return false
		}
		prev = l
	}
	return true
}

// addRef makes ws a holder of l and stamps it (the forward map's lock
// held). counted says a new reverse entry of ws names l (rather than a
// known one gaining a copy).
func (ix *Index) addRef(ws *workerState, l loc, stamp uint32, counted bool) {
	f := &ix.fw
	r := f.touch(l.run())
	if counted {
		r.refs++
	}
	if p := f.stampOf(r, l.off()); p != nil {
		store32(p, stamp)
	}
	held := f.addHolder(r, ws.id, l.off())
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

// dropRef records that one reverse entry of ws naming l is gone (the
// forward map's lock held): ws stops holding l when it was the last, and
// l's run goes when no entry names it and it has no child.
func (ix *Index) dropRef(ws *workerState, l loc) {
	f := &ix.fw
	id := l.run()
	r := f.run(id)
	if ws.release(l, ix.pruning) {
		f.touch(id)
		f.removeHolder(r, ws.id, l.off())
	}
	if r.refs--; r.refs == 0 && r.kids == 0 {
		f.freeRun(id)
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
	// Two passes, as in applyStored: the reverse table first, under the
	// worker's lock only, collecting the positions whose last entry went;
	// then the forward map in one go, under its lock. Dropping the
	// references after all the reverse changes gives the same result: the
	// forward map's reference counts do not depend on the reverse table.
	defer ws.dropLargeScratch()
	// At most one position a hash: the scratch is grown once and written
	// by index (an append's capacity check per block was 11 instructions).
	locs := slices.Grow(ws.evLocs[:0], len(r.BlockHashes))[:len(r.BlockHashes)]
	nl := 0
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
		if p := rt.slots[i].pos; p != noPos {
			locs[nl] = loc(p)
			nl++
		}
		rt.del(i)
	}
	ws.evLocs = locs
	locs = locs[:nl]
	if len(locs) == 0 {
		return
	}
	f := &ix.fw
	f.mu.Lock()
	defer f.unlock()
	// The common case, a position at the end of the worker's lead in the run
	// of the position before, no other entry of the worker naming it, is
	// done here: the lead moves back, and the run (which the worker still
	// holds, so a reverse entry still names it) stays.
	for j := 0; j < len(locs); {
		if j&(settleEvery-1) == settleEvery-1 {
			f.settle()
		}
		l := locs[j]
		ix.dropRef(ws, l)
		j++
		if len(ws.refs) != 0 {
			continue
		}
		r := f.run(l.run())
		if r.n == 0 {
			continue
		}
		ci := f.findCover(r, ws.id)
		if ci < 0 {
			continue
		}
		// The positions that follow, each the one before the last in ws's
		// lead of the same run, up to the next settle point: the lead moves
		// back, and the run (which ws still holds, so a reverse entry still
		// names it) stays.
		// The stretch is bounded once: the next settle point, the entry
		// keeping one position (held > 1) and the lead's start; then each
		// position is one compare with the one expected.
		e := &r.covs()[ci]
		lead, held := e.lead, e.held
		end := min(len(locs), j|(settleEvery-1), j+int(held)-1, j+int(lead))
		k := j
		for want := makeLoc(l.run(), int(lead)-1); k < end && locs[k] == want; k++ {
			want--
		}
		if k > j {
			f.touch(l.run())
			store32(&e.lead, lead-uint32(k-j))
			e.held = held - uint32(k-j)
			r.refs -= uint32(k - j)
			store64(&f.mem, f.mem-uint64(k-j))
			j = k
		}
	}
}
