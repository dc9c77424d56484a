// Package record keeps the relay's live-block record: for every data-parallel rank, every live
// (tier, block hash) with the fields of the store that created it and its physical copy count, so
// that a subscriber without a usable cursor can be served a state snapshot instead of the history.
//
// The record is built for size and for a cheap cut. Entries are 32-byte structs in fixed-size
// segments of 64, each segment carrying its own arena of the entries' token ids, packed as the
// wire packs them (varints); a per-rank open-addressing table of 32-bit slot numbers indexes
// them; the store tails (tier, medium, group, namespace, …) are interned to small ids and extra
// keys live out of line, in their wire form. A Cut copies only the segment pointers and marks the
// segments shared; the next mutation of a shared segment copies that segment first (copy on
// write), so taking the state under the relay's lock costs O(segments), not O(blocks), and the
// ordering and encoding run off the lock.
//
// Concurrency: Apply, ClearRank, Reset, Stats and Cut must be serialized by the caller (the relay
// calls them under its admission lock). Cut.Chunks and Cut.Release may run on any goroutine,
// concurrently with those calls.
package record

import (
	"slices"
	"sync/atomic"

	"github.com/kvrelay/kvrelay/proto/kvpb"
)

// CopiesCap bounds the physical copies recorded per (rank, tier, hash); the gateway counts them the
// same way, so more copies would only make the snapshot longer.
const CopiesCap = 8

// NoRank is the rank of batches whose dp_rank is absent. Snapshot chunks of this rank carry no
// dp_rank.
const NoRank int32 = -1

// Stats describes the record and counts what Apply did.
type Stats struct {
	Entries uint64 // live (rank, tier, hash) entries
	Blocks  uint64 // live physical copies
	Ranks   []RankStats

	Stored         uint64 // stored blocks applied, capped ones included
	Removed        uint64 // removals that took a copy
	RemovedUnknown uint64 // removals of a hash the record does not hold
	Capped         uint64 // stores that found the entry already at CopiesCap
	Cleared        uint64 // AllBlocksCleared events applied
	// Evicted counts entries dropped to keep a rank within MaxEntries.
	Evicted uint64
	// DuplicateStores are stored events whose every block the record
	// already held: a second physical copy, or a batch delivered twice.
	DuplicateStores uint64
	// Reannounced are stored events taken for vLLM's report-mode "full"
	// re-announcement of prefix-cache hits (see IsReannouncement) and
	// applied as no change; ReannouncedBlocks the blocks they listed.
	Reannounced, ReannouncedBlocks uint64
}

// RankStats is one non-empty rank's share of Stats.
type RankStats struct {
	Rank    int32
	Entries uint64
	Blocks  uint64
}

type counters struct {
	stored, removed, removedUnknown, capped, cleared uint64
	duplicateStores, evicted                         uint64
	reannounced, reannouncedBlocks                   uint64
}

// Record is the live-block record of all ranks. The zero value is not usable; call New.
type Record struct {
	ranks  map[int32]*rankState
	tails  *tailTable
	extras *extraTable
	// epoch advances at every Cut: a segment whose epoch is older may be shared with a Cut.
	epoch    uint64
	liveCuts atomic.Int64
	// reportModeFull turns on IsReannouncement's rule (DetectReannouncements).
	reportModeFull bool
	// maxEntries caps each rank's entries (0: no cap); see SetMaxEntries.
	maxEntries uint64
	// touched sinks slotIndex.touchHome's reads.
	touched uint32
	counters
}

// SetMaxEntries caps the live (tier, hash) entries of each rank at n (0: no cap).
//
// Policy: when a store takes a rank past n, its oldest-stored entries are evicted until it holds
// nine tenths of n, in one pass (so the cost is amortized over a tenth of the cap). Oldest first
// because an engine evicts its least recently used blocks, so the oldest stores are the likeliest
// to be gone already, and because blocks whose removal the relay never saw (a leak) then age out
// instead of crowding out every new store for ever. The snapshot no longer knows every live block
// of the rank: the caller should mark it incomplete (EvictedFrom tells it when).
func (r *Record) SetMaxEntries(n uint64) { r.maxEntries = n }

// EvictedFrom counts the entries of rank evicted at the cap since the rank last started empty.
func (r *Record) EvictedFrom(rank int32) uint64 {
	if rs := r.ranks[rank]; rs != nil {
		return rs.evicted
	}
	return 0
}

// New returns an empty record.
func New() *Record {
	return &Record{ranks: map[int32]*rankState{}, tails: newTailTable(), extras: &extraTable{}, epoch: 1}
}

// DetectReannouncements makes Apply take stores that match
// IsReannouncement for vLLM's report-mode "full" re-announcements and apply
// them as no change. Off (the default), every store adds copies: the rule
// would take a genuine second copy of a whole chain from block 0 for a
// re-announcement, so it is for engines whose requests may ask for report
// mode "full".
func (r *Record) DetectReannouncements() { r.reportModeFull = true }

// shared reports whether a Cut may still read segments of older epochs.
func (r *Record) shared() bool { return r.liveCuts.Load() > 0 }

// Apply folds one normalized batch into the record. It returns the indexes
// of the batch's stored events it took for report-mode re-announcements
// (nil almost always), so that a caller can leave them out of what it
// forwards.
func (r *Record) Apply(b *kvpb.KvEventBatch) (reannounced []int) {
	if b == nil {
		return nil
	}
	if !r.shared() {
		r.tails.settle()
		r.extras.settle()
	}
	rank := NoRank
	if b.DpRank != nil {
		rank = *b.DpRank
	}
	for i, ev := range b.GetEvents() {
		switch d := ev.GetData().(type) {
		case *kvpb.KvCacheEvent_Stored:
			if r.reportModeFull && r.IsReannouncement(rank, d.Stored) {
				r.reannounced++
				r.reannouncedBlocks += uint64(len(d.Stored.GetBlocks()))
				reannounced = append(reannounced, i)
				continue
			}
			r.store(rank, d.Stored)
		case *kvpb.KvCacheEvent_Removed:
			r.remove(rank, d.Removed)
		case *kvpb.KvCacheEvent_Cleared:
			r.dropRank(rank)
			r.cleared++
		}
	}
	return reannounced
}

// IsReannouncement reports whether a store is, by the rule read from vLLM's
// code, a re-announcement of prefix-cache hits rather than new physical
// copies. With a request's kv_cache_report_mode "full", vLLM's
// BlockPool.emit_cached_block_events publishes the request's hit chain as a
// BlockStored: parent None, the blocks from block 0 on, each one cached at
// that moment, and no state change (so no removal will ever match it). A
// genuine store has parent None only when it starts at a request's block 0
// (cache_full_blocks with nothing cached before), and is a second copy of
// every block only when that whole prefix was computed again while cached.
//
// The rule: no parent, and every block already live on the rank and tier,
// in the same chain (the first without a parent, each next one with the
// previous as its parent). A store carries no physical block id, so this is
// a rule, not a proof: a genuine second copy of a whole chain from block 0
// (a block-aligned prompt of one block recomputed while cached) is taken
// for a re-announcement, and the record then holds one copy fewer than the
// engine: the block leaves the record at its first removal while the engine
// still holds it (a missing block, never a phantom).
func (r *Record) IsReannouncement(rank int32, s *kvpb.KvBlocksStored) bool {
	blocks := s.GetBlocks()
	if s.ParentBlockHash != nil || len(blocks) == 0 {
		return false
	}
	rs := r.ranks[rank]
	if rs == nil {
		return false
	}
	var prev int64
	for i, blk := range blocks {
		if blk == nil {
			return false
		}
		slot, ok := rs.index.find(rs, blk.BlockHash, tierOf(s.Tier, blocks[0].CacheLevel))
		if !ok {
			return false
		}
		e := rs.entry(slot)
		hasParent := e.flags&flagParent != 0
		if (i == 0 && hasParent) || (i > 0 && (!hasParent || e.parent != prev)) {
			return false
		}
		prev = blk.BlockHash
	}
	return true
}

// ClearRank forgets one rank (its publisher restarted). Counters are kept and nothing is counted.
func (r *Record) ClearRank(rank int32) { r.dropRank(rank) }

// Reset forgets every rank, keeping the counters.
func (r *Record) Reset() {
	r.ranks = map[int32]*rankState{}
	r.tails = newTailTable()
	r.extras = &extraTable{}
}

// Stats returns the sizes and counters; ranks are listed in ascending order, empty ones left out.
func (r *Record) Stats() Stats {
	s := Stats{
		Stored: r.stored, Removed: r.removed, RemovedUnknown: r.removedUnknown,
		Capped: r.capped, Cleared: r.cleared, DuplicateStores: r.duplicateStores, Evicted: r.evicted,
		Reannounced: r.reannounced, ReannouncedBlocks: r.reannouncedBlocks,
	}
	for rank, rs := range r.ranks {
		if rs.entries == 0 {
			continue
		}
		s.Ranks = append(s.Ranks, RankStats{Rank: rank, Entries: rs.entries, Blocks: rs.blocks})
		s.Entries += rs.entries
		s.Blocks += rs.blocks
	}
	slices.SortFunc(s.Ranks, func(a, b RankStats) int { return int(int64(a.Rank) - int64(b.Rank)) })
	return s
}

// LiveDigest is rank's anti-entropy digest (internal/livedigest) and the
// live copies it covers: what a gateway that applied the same batches holds.
func (r *Record) LiveDigest(rank int32) (digest, blocks uint64) {
	rs := r.ranks[rank]
	if rs == nil {
		return 0, 0
	}
	return rs.digest, rs.digestBlocks
}

// tierOf resolves the tier a store or removal applies to: its tier when set, else its cache level.
// Tier values the proto does not define count as external, like unknown cache levels.
func tierOf(t *kvpb.KvCacheTier, level *int32) uint8 {
	if t != nil && *t != kvpb.KvCacheTier_KV_CACHE_TIER_UNSPECIFIED {
		if *t >= kvpb.KvCacheTier_KV_CACHE_TIER_DEVICE && *t <= kvpb.KvCacheTier_KV_CACHE_TIER_EXTERNAL {
			return uint8(*t)
		}
		return uint8(kvpb.KvCacheTier_KV_CACHE_TIER_EXTERNAL)
	}
	if level == nil {
		return uint8(kvpb.KvCacheTier_KV_CACHE_TIER_DEVICE)
	}
	switch *level {
	case 0:
		return uint8(kvpb.KvCacheTier_KV_CACHE_TIER_DEVICE)
	case 1:
		return uint8(kvpb.KvCacheTier_KV_CACHE_TIER_HOST)
	case 2:
		return uint8(kvpb.KvCacheTier_KV_CACHE_TIER_DISK)
	default:
		return uint8(kvpb.KvCacheTier_KV_CACHE_TIER_EXTERNAL)
	}
}

func (r *Record) rankFor(rank int32) *rankState {
	rs := r.ranks[rank]
	if rs == nil {
		rs = &rankState{}
		r.ranks[rank] = rs
	}
	return rs
}

func (r *Record) store(rank int32, s *kvpb.KvBlocksStored) {
	blocks := s.GetBlocks()
	if len(blocks) == 0 {
		return
	}
	var first *kvpb.KvBlock
	for _, blk := range blocks {
		if blk != nil {
			first = blk
			break
		}
	}
	if first == nil {
		return
	}
	tier := tierOf(s.Tier, first.CacheLevel)
	rs := r.rankFor(rank)
	key := storeTail(s)
	var lastKey tailKey
	lastID := noTail
	var parent int64
	hasParent := false
	if s.ParentBlockHash != nil {
		parent, hasParent = *s.ParentBlockHash, true
	}
	for _, blk := range blocks {
		if blk != nil {
			r.touched += rs.index.touchHome(blk.BlockHash, tier)
		}
	}
	allHeld := true
	defer func() {
		if allHeld {
			r.duplicateStores++
		}
	}()
	for _, blk := range blocks {
		if blk == nil {
			continue
		}
		r.stored++
		h := blk.BlockHash
		slot, at, ok := rs.index.lookup(rs, h, tier)
		allHeld = allHeld && ok
		if ok {
			e := rs.entry(slot)
			if e.copies >= CopiesCap {
				r.capped++
			} else {
				r.writable(rs, slot).copies++
				rs.blocks++
				rs.count(h, tier, 1)
			}
		} else {
			key.setBlock(blk)
			id := lastID
			if id == noTail || !key.sameBlockFields(&lastKey) {
				id = r.tails.intern(&key)
				lastKey, lastID = key, id
			} else {
				r.tails.ref(id)
			}
			r.insert(rs, blk, tier, id, parent, hasParent, at)
			if r.maxEntries > 0 && rs.entries > r.maxEntries {
				r.evictOldest(rs, r.maxEntries-r.maxEntries/10)
			}
		}
		parent, hasParent = h, true
	}
}

// evictOldest drops the rank's oldest-stored entries, every copy, until it holds keep entries.
func (r *Record) evictOldest(rs *rankState, keep uint64) {
	if rs.entries <= keep {
		return
	}
	orders := make([]uint32, 0, rs.entries)
	for slot := uint32(0); slot < rs.used; slot++ {
		if e := rs.entry(slot); e.flags&flagLive != 0 {
			orders = append(orders, e.order)
		}
	}
	slices.Sort(orders)
	threshold := orders[rs.entries-keep] // entries stored before it go
	for slot := uint32(0); slot < rs.used; slot++ {
		if e := rs.entry(slot); e.flags&flagLive == 0 || e.order >= threshold {
			continue
		}
		seg := r.writableSeg(rs, slot>>segShift)
		e := &seg.entries[slot&segMask]
		rs.blocks -= uint64(e.copies)
		for range e.copies {
			rs.count(e.hash, e.tier, -1) // the digest describes what the record holds
		}
		rs.index.remove(rs, e.hash, e.tier)
		r.release(seg, e)
		rs.tiers[e.tier]--
		e.flags, e.copies = e.flags&flagsKept, 0
		rs.free = append(rs.free, slot)
		rs.entries--
		rs.evicted++
		r.evicted++
	}
}

// insert adds blk as a new entry; at is where the index lookup that did not find it ended.
func (r *Record) insert(rs *rankState, blk *kvpb.KvBlock, tier uint8, tail uint32, parent int64, hasParent bool, at probe) {
	slot := r.allocSlot(rs)
	seg := r.writableSeg(rs, slot>>segShift)
	e := &seg.entries[slot&segMask]
	oldFlags := e.flags & flagsKept
	e.hash = blk.BlockHash
	e.parent = parent
	e.tier = tier
	e.copies = 1
	flags := uint8(flagLive)
	if hasParent {
		flags |= flagParent
	}
	e.tail = tail
	var extra uint32
	if len(blk.ExtraKeys) > 0 {
		extra = r.extras.add(blk.ExtraKeys)
		flags |= flagExtra
	}
	seg.putRecord(e, oldFlags, flags, blk.TokenIds, extra, r.shared())
	if rs.nextOrder == maxOrder {
		r.renumber(rs)
	}
	e = &rs.segs[slot>>segShift].entries[slot&segMask]
	e.order = rs.nextOrder
	rs.nextOrder++
	rs.index.insertAt(rs, slot, at)
	rs.entries++
	rs.tiers[tier]++
	rs.blocks++
	rs.count(blk.BlockHash, tier, 1)
}

func (r *Record) remove(rank int32, rm *kvpb.KvBlocksRemoved) {
	hashes := rm.GetBlockHashes()
	rs := r.ranks[rank]
	if rs == nil {
		r.removedUnknown += uint64(len(hashes))
		return
	}
	tier := tierOf(rm.Tier, rm.CacheLevel)
	for _, h := range hashes {
		r.touched += rs.index.touchHome(h, tier)
	}
	for _, h := range hashes {
		slot, at, ok := rs.index.lookup(rs, h, tier)
		if !ok {
			r.removedUnknown++
			continue
		}
		r.removed++
		rs.blocks--
		rs.count(h, tier, -1)
		seg := r.writableSeg(rs, slot>>segShift)
		e := &seg.entries[slot&segMask]
		e.copies--
		if e.copies > 0 {
			continue
		}
		rs.index.removeAt(rs, at.cell)
		r.release(seg, e)
		e.flags &= flagsKept
		rs.free = append(rs.free, slot)
		rs.entries--
		rs.tiers[tier]--
	}
	if rs.entries == 0 && r.shared() {
		// Nothing live is left: start the rank afresh rather than copying its segments later.
		delete(r.ranks, rank)
	}
}

// release drops what a live entry of seg holds outside the segment.
func (r *Record) release(seg *segment, e *entry) {
	r.tails.unref(e.tail, r.shared())
	if e.flags&flagExtra != 0 {
		r.extras.drop(seg.extraOf(e), r.shared())
	}
}

func (r *Record) dropRank(rank int32) {
	rs := r.ranks[rank]
	if rs == nil {
		return
	}
	shared := r.shared()
	for si, seg := range rs.segs {
		n := rs.used - uint32(si)<<segShift
		if n > segSize {
			n = segSize
		}
		for i := range seg.entries[:n] {
			e := &seg.entries[i]
			if e.flags&flagLive == 0 {
				continue
			}
			r.tails.unref(e.tail, shared)
			if e.flags&flagExtra != 0 {
				r.extras.drop(seg.extraOf(e), shared)
			}
		}
	}
	delete(r.ranks, rank)
}
