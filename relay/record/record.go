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
// Batches come as messages (Apply) or as their protobuf wire bytes (ApplyEncoded, which takes a
// stored block's packed token ids into the arena as they are); both leave the record alike.
//
// Concurrency: Apply, ApplyEncoded, IsReannouncement (it shares their scratch), ClearRank, Reset,
// Stats and Cut must be serialized by the caller (the relay calls them under its admission lock).
// Cut.Chunks and Cut.Release may run on any goroutine, concurrently with those calls.
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
	// op is Apply's reused storeOp; wire is ApplyEncoded's reused parse of a batch.
	op   storeOp
	wire wireBatch
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
			if d.Stored == nil {
				continue // a hand-built event with no payload stores nothing
			}
			op := r.storeOpOf(d.Stored)
			if r.applyStore(rank, op) {
				reannounced = append(reannounced, i)
			}
			clear(op.blocks) // the scratch must not keep the batch's tokens alive
		case *kvpb.KvCacheEvent_Removed:
			rm := d.Removed
			if rm == nil {
				continue // as above: it removes nothing
			}
			r.remove(rank, tierOf(rm.Tier, rm.CacheLevel), rm.GetBlockHashes())
		case *kvpb.KvCacheEvent_Cleared:
			r.dropRank(rank)
			r.cleared++
		}
	}
	return reannounced
}

// storeOp is one stored event as the record applies it, read from a message (Apply) or from
// its wire bytes (ApplyEncoded), so that both paths share one store and one re-announcement rule.
type storeOp struct {
	tail      tailKey // the store's own fields; store sets the per-block ones block by block
	parent    int64
	hasParent bool
	// borrowed: tail's strings alias the caller's bytes, and are copied when interned.
	borrowed bool
	blocks   []blockOp
	listed   int  // blocks the event lists, nil ones included (ReannouncedBlocks counts them)
	hasNil   bool // a nil block (only a hand-built message has one): never a re-announcement
}

// blockOp is one stored block. Its tokens are either ids (toks, from a message) or the packed
// varints the wire carries (packed, from ApplyEncoded, checked to be exactly what packing the ids
// writes), which the arena takes as they are.
type blockOp struct {
	hash       int64
	loraID     int64
	cacheLevel int32
	blockSize  int32
	has        uint16 // hasLoraID, hasCacheLevel
	toks       []uint32
	packed     []byte
	extraKeys  []*kvpb.KvBlockExtraKey
}

// storeOpOf reads a stored event into the record's reused storeOp.
func (r *Record) storeOpOf(s *kvpb.KvBlocksStored) *storeOp {
	op := &r.op
	op.tail = storeTail(s)
	op.parent, op.hasParent = 0, false
	if s.ParentBlockHash != nil {
		op.parent, op.hasParent = *s.ParentBlockHash, true
	}
	op.borrowed = false
	op.listed, op.hasNil = len(s.Blocks), false
	op.blocks = op.blocks[:0]
	for _, blk := range s.Blocks {
		if blk == nil {
			op.hasNil = true
			continue
		}
		b := blockOp{hash: blk.BlockHash, blockSize: blk.BlockSize, toks: blk.TokenIds, extraKeys: blk.ExtraKeys}
		if blk.LoraId != nil {
			b.has |= hasLoraID
			b.loraID = *blk.LoraId
		}
		if blk.CacheLevel != nil {
			b.has |= hasCacheLevel
			b.cacheLevel = *blk.CacheLevel
		}
		op.blocks = append(op.blocks, b)
	}
	return op
}

// applyStore applies one stored event and reports whether it was taken for a re-announcement.
func (r *Record) applyStore(rank int32, op *storeOp) bool {
	if r.reportModeFull && r.reannouncement(rank, op) {
		r.reannounced++
		r.reannouncedBlocks += uint64(op.listed)
		return true
	}
	r.store(rank, op)
	return false
}

// tier is the tier the store applies to: its tier field when set, else its first block's cache
// level.
func (op *storeOp) tier() uint8 {
	b := &op.blocks[0]
	return tierFrom(op.tail.has&hasTier != 0, op.tail.tier, b.has&hasCacheLevel != 0, b.cacheLevel)
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
	op := r.storeOpOf(s)
	is := r.reannouncement(rank, op)
	clear(op.blocks)
	return is
}

// reannouncement is IsReannouncement's rule.
func (r *Record) reannouncement(rank int32, op *storeOp) bool {
	if op.hasParent || op.hasNil || len(op.blocks) == 0 {
		return false
	}
	rs := r.ranks[rank]
	if rs == nil {
		return false
	}
	tier := op.tier()
	var prev int64
	for i := range op.blocks {
		h := op.blocks[i].hash
		slot, ok := rs.index.find(rs, h, tier)
		if !ok {
			return false
		}
		e := rs.entry(slot)
		hasParent := e.flags&flagParent != 0
		if (i == 0 && hasParent) || (i > 0 && (!hasParent || e.parent != prev)) {
			return false
		}
		prev = h
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
	var tier kvpb.KvCacheTier
	var lvl int32
	if t != nil {
		tier = *t
	}
	if level != nil {
		lvl = *level
	}
	return tierFrom(t != nil, tier, level != nil, lvl)
}

// tierFrom is tierOf of fields given with their presence.
func tierFrom(hasTier bool, t kvpb.KvCacheTier, hasLevel bool, level int32) uint8 {
	if hasTier && t != kvpb.KvCacheTier_KV_CACHE_TIER_UNSPECIFIED {
		if t >= kvpb.KvCacheTier_KV_CACHE_TIER_DEVICE && t <= kvpb.KvCacheTier_KV_CACHE_TIER_EXTERNAL {
			return uint8(t)
		}
		return uint8(kvpb.KvCacheTier_KV_CACHE_TIER_EXTERNAL)
	}
	if !hasLevel {
		return uint8(kvpb.KvCacheTier_KV_CACHE_TIER_DEVICE)
	}
	switch level {
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

func (r *Record) store(rank int32, op *storeOp) {
	blocks := op.blocks
	if len(blocks) == 0 {
		return
	}
	tier := op.tier()
	rs := r.rankFor(rank)
	key := op.tail
	var lastKey tailKey
	lastID := noTail
	parent, hasParent := op.parent, op.hasParent
	for i := range blocks {
		r.touched += rs.index.touchHome(blocks[i].hash, tier)
	}
	allHeld := true
	defer func() {
		if allHeld {
			r.duplicateStores++
		}
	}()
	for i := range blocks {
		blk := &blocks[i]
		r.stored++
		h := blk.hash
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
				id = r.tails.intern(&key, op.borrowed)
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
func (r *Record) insert(rs *rankState, blk *blockOp, tier uint8, tail uint32, parent int64, hasParent bool, at probe) {
	slot := r.allocSlot(rs)
	seg := r.writableSeg(rs, slot>>segShift)
	e := &seg.entries[slot&segMask]
	oldFlags := e.flags & flagsKept
	e.hash = blk.hash
	e.parent = parent
	e.tier = tier
	e.copies = 1
	flags := uint8(flagLive)
	if hasParent {
		flags |= flagParent
	}
	e.tail = tail
	var extra uint32
	if len(blk.extraKeys) > 0 {
		extra = r.extras.add(blk.extraKeys)
		flags |= flagExtra
	}
	seg.putRecord(e, oldFlags, flags, blk.toks, blk.packed, extra, r.shared())
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
	rs.count(blk.hash, tier, 1)
}

// remove applies one removal of hashes on tier.
func (r *Record) remove(rank int32, tier uint8, hashes []int64) {
	rs := r.ranks[rank]
	if rs == nil {
		r.removedUnknown += uint64(len(hashes))
		return
	}
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
