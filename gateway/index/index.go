package index

import (
	"cmp"
	"context"
	"log/slog"
	"math"
	"math/bits"
	"runtime"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvrelay/kvrelay/internal/livedigest"
	"github.com/kvrelay/kvrelay/proto/kvpb"
)

// WorkerID names a worker (its URL or any stable name). It is a plain string
// alias so that *Index satisfies consumers' interfaces written with string.
type WorkerID = string

// Tier is where a physical copy lives. Only the tiers a request can hit
// without an engine-side fetch are indexed.
type Tier uint8

const (
	TierDevice Tier = 0
	TierHost   Tier = 1
)

func (t Tier) String() string {
	if t == TierHost {
		return "host"
	}
	return "device"
}

// Defaults (SMG: --block-size 16, PRUNE_INTERVAL_SECS 30, 2 s capacity grace).
const (
	DefaultBlockSize  = 16
	DefaultPruneEvery = 30 * time.Second
	capacityGrace     = 2 // seconds an entry is safe from capacity eviction after a touch
	defaultShardBits  = 6
)

// Options configures an Index. The zero value is usable: block size learned
// from events (16 until then), no pruning.
type Options struct {
	// BlockSize fixes the request block size; 0 learns it from the first
	// stored block that reports one (the last worker to report wins, as in SMG).
	BlockSize int
	// TTL evicts entries neither stored nor read for this long; 0 = off.
	TTL time.Duration
	// MaxEntries bounds the number of distinct prefix entries: above it, a
	// prune evicts the least recently touched down to 90 %; 0 = off.
	// Pruning (TTL or MaxEntries) costs a map entry per indexed block: a
	// prune clears holders while the engines' blocks remain, so the index
	// counts each worker's references to a block explicitly.
	MaxEntries int
	// PruneEvery is Run's period; 0 = 30 s.
	PruneEvery time.Duration
	// Now is the clock (tests inject one); nil = time.Now.
	Now func() time.Time
	// ShardBits sets 2^ShardBits forward shards; 0 = 64 shards.
	ShardBits int
	// Logger receives prune summaries; nil = slog.Default().
	Logger *slog.Logger
	// ReportModeFull: the workers' requests may ask for vLLM's
	// kv_cache_report_mode "full", which re-announces prefix-cache hits as
	// stores that no removal ever matches. A store with no parent whose every
	// block the worker's rank already holds on that tier, in the same chain
	// (the prefix hashes its tokens give from the root are the ones filed),
	// is then applied as no change, the rule kvrelay's record uses (see the
	// README). Off: every store adds copies, capped at 8 as in SMG. The rule
	// takes a genuine second copy of a whole chain from block 0 for a
	// re-announcement; a relay with --suppress-reannounced-stores makes it
	// unnecessary.
	ReportModeFull bool
}

// Index is one model's prefix index: which workers hold which block prefixes.
// All methods are safe for concurrent use. Writers for one worker serialise
// on that worker, and on the shards they change; lookups take no lock.
type Index struct {
	opts      Options
	now       func() time.Time
	epoch     time.Time
	shardBits uint8
	shards    []shard
	pruning   bool
	blockSize atomic.Int64
	log       *slog.Logger

	wmu     sync.RWMutex
	workers map[WorkerID]*workerState
	slots   []*workerState // by slot id; nil = free
	free    []uint32
	// rankOf and byRank order the slots by worker name, so a lookup sorts its
	// result with integer keys; rebuilt when a worker comes or goes.
	rankOf []uint32
	byRank []uint32
}

// reorder rebuilds the name order; callers hold wmu for writing.
func (ix *Index) reorder() {
	ix.byRank = ix.byRank[:0]
	for id, ws := range ix.slots {
		if ws != nil {
			ix.byRank = append(ix.byRank, uint32(id))
		}
	}
	slices.SortFunc(ix.byRank, func(a, b uint32) int { return strings.Compare(ix.slots[a].name, ix.slots[b].name) })
	ix.rankOf = slices.Grow(ix.rankOf[:0], len(ix.slots))[:len(ix.slots)]
	for r, id := range ix.byRank {
		ix.rankOf[id] = uint32(r)
	}
}

// workerState is everything the index knows about one worker beyond the
// forward map: the reverse maps (per DP rank) that resolve parents and
// removals, the prefixes it holds through more than one engine block, and
// its counters.
type workerState struct {
	mu      sync.Mutex
	id      uint32
	name    WorkerID
	removed bool
	ranks   map[int32]*revTable
	// refs counts, for a position held through two or more reverse entries
	// (the same block on two DP ranks, or two engine hashes naming the same
	// content), how many. One reference is implied by the holder bit, so the
	// common case costs nothing here. With pruning on, the holder bit can be
	// cleared while entries remain, so refs then counts every entry.
	refs    map[loc]uint32
	nonMain map[uint32]struct{} // cache groups seen with a non-main-attention kind
	learned bool
	c       WorkerCounters
	// Scratch of one event's application (applyStored, applyRemoved), kept
	// between events so that applying one allocates nothing; guarded by mu.
	evSlots   []evSlot
	evContent []uint64
	evLocs    []loc
}

// evSlot is what a store's first pass (the reverse table) learned about one
// of its blocks for the second (the forward map): the block's reverse slot,
// and whether the rank held the engine hash already. slot < 0: a nil block.
type evSlot struct {
	slot  int32
	found bool
}

// scratchCap bounds the per-worker scratch kept after an event: a huge
// event's buffers are let go rather than kept for good.
const scratchCap = 4096

func (ws *workerState) dropLargeScratch() {
	if cap(ws.evSlots) > scratchCap {
		ws.evSlots = nil
	}
	if cap(ws.evContent) > scratchCap {
		ws.evContent = nil
	}
	if cap(ws.evLocs) > scratchCap {
		ws.evLocs = nil
	}
}

// WorkerCounters count what Apply did with one worker's events (SMG's
// WorkerIndexCounters). They are cumulative and survive ClearWorker.
type WorkerCounters struct {
	StoredBlocks     uint64 // blocks applied from Stored events
	RemovedBlocks    uint64 // copies released by Removed events
	Cleared          uint64 // Cleared events applied
	ParentlessStores uint64 // stores whose parent was unknown, re-applied as a new chain
	ParentlessBlocks uint64
	UnknownRemovals  uint64 // removals of a hash or tier copy the index does not hold
	CappedCopies     uint64 // stores beyond the per-tier copy cap
	EngineConflicts  uint64 // a known engine hash stored again under another prefix
	SkippedForeign   uint64 // events owned by a residency agent (kvcr)
	SkippedRemote    uint64 // remote-locality events
	SkippedGroup     uint64 // events of non-main-attention cache groups
	SkippedTier      uint64 // disk / external tier events
	// UnindexedBlocks counts stored blocks left out of the index because the
	// forward shard their run would start in had no run number left (its
	// cap, maxRunsFor: 2^(24-ShardBits)-1 live runs, 16.7 M runs in all),
	// and the blocks new to the rank after them in the same event. The
	// worker is not taken to hold them (lookups under-report it, never
	// over-report) and their later removals count as UnknownRemovals.
	UnindexedBlocks uint64
	// Stores taken for report-mode "full" re-announcements and applied as no
	// change (Options.ReportModeFull), and the blocks they listed.
	ReannouncedStores, ReannouncedBlocks uint64
}

// New returns an empty index.
func New(opts Options) *Index {
	if opts.PruneEvery <= 0 {
		opts.PruneEvery = DefaultPruneEvery
	}
	if opts.Now == nil {
		opts.Now = time.Now
	}
	if opts.Logger == nil {
		opts.Logger = slog.Default()
	}
	sb := opts.ShardBits
	if sb <= 0 {
		sb = defaultShardBits
	}
	sb = min(sb, 12)
	ix := &Index{
		opts:      opts,
		now:       opts.Now,
		shardBits: uint8(sb),
		shards:    make([]shard, 1<<sb),
		pruning:   opts.TTL > 0 || opts.MaxEntries > 0,
		log:       opts.Logger,
		workers:   make(map[WorkerID]*workerState),
	}
	ix.epoch = ix.now()
	for i := range ix.shards {
		ix.shards[i].init(maxRunsFor(uint8(sb)))
	}
	if opts.BlockSize > 0 {
		ix.blockSize.Store(int64(opts.BlockSize))
	}
	return ix
}

// BlockSize is the block size requests are cut with: the fixed one, else the
// learned one, else 16.
func (ix *Index) BlockSize() int {
	if n := ix.blockSize.Load(); n > 0 {
		return int(n)
	}
	return DefaultBlockSize
}

// SetBlockSize sets the request block size (e.g. from a monitor that learns
// it, or from the model's spec). It is ignored when Options.BlockSize fixes it.
func (ix *Index) SetBlockSize(n int) {
	if n > 0 && ix.opts.BlockSize == 0 {
		ix.blockSize.Store(int64(n))
	}
}

func (ix *Index) stampAt(t time.Time) uint32 {
	d := t.Sub(ix.epoch)
	if d < 0 {
		return 0
	}
	return uint32(min(d/time.Second, 1<<32-2))
}

func (ix *Index) shardIndex(p uint64) int {
	return int(p >> (64 - uint(ix.shardBits)) & (1<<ix.shardBits - 1))
}

func (ix *Index) shardOf(p uint64) *shard { return &ix.shards[ix.shardIndex(p)] }

// lockWorker returns w's state locked, creating it on first use.
func (ix *Index) lockWorker(w WorkerID) *workerState {
	for {
		ix.wmu.RLock()
		ws := ix.workers[w]
		ix.wmu.RUnlock()
		if ws == nil {
			ix.wmu.Lock()
			if ws = ix.workers[w]; ws == nil {
				ws = &workerState{name: w, ranks: make(map[int32]*revTable)}
				if k := len(ix.free); k > 0 {
					ws.id = ix.free[k-1]
					ix.free = ix.free[:k-1]
					ix.slots[ws.id] = ws
				} else {
					ws.id = uint32(len(ix.slots))
					ix.slots = append(ix.slots, ws)
				}
				ix.workers[w] = ws
				ix.reorder()
			}
			ix.wmu.Unlock()
		}
		ws.mu.Lock()
		if !ws.removed {
			return ws
		}
		ws.mu.Unlock()
	}
}

// existingWorker returns w's state locked, or nil if the index has none.
func (ix *Index) existingWorker(w WorkerID) *workerState {
	ix.wmu.RLock()
	ws := ix.workers[w]
	ix.wmu.RUnlock()
	if ws == nil {
		return nil
	}
	ws.mu.Lock()
	if ws.removed {
		ws.mu.Unlock()
		return nil
	}
	return ws
}

// mainAttentionKinds are the cache-group kinds whose blocks a prefix hit
// saves (SMG apply.rs); sliding-window and other groups are not indexed.
var mainAttentionKinds = map[string]bool{"full_attention": true, "mla_attention": true, "sink_full_attention": true}

func foreignOwner(o *string) bool { return o != nil && strings.EqualFold(*o, "kvcr") }

func remote(l *kvpb.KvCacheLocality) bool {
	return l != nil && *l == kvpb.KvCacheLocality_KV_CACHE_LOCALITY_REMOTE
}

// resolveTier maps an event's tier, else its cache level (absent/0 device,
// 1 host, 2 disk, other external), to an indexed tier; ok is false for disk
// and external, which the router cannot price.
func resolveTier(t *kvpb.KvCacheTier, level int32) (Tier, bool) {
	if t != nil && *t != kvpb.KvCacheTier_KV_CACHE_TIER_UNSPECIFIED {
		switch *t {
		case kvpb.KvCacheTier_KV_CACHE_TIER_DEVICE:
			return TierDevice, true
		case kvpb.KvCacheTier_KV_CACHE_TIER_HOST:
			return TierHost, true
		}
		return 0, false
	}
	switch {
	case level == 0:
		return TierDevice, true
	case level == 1:
		return TierHost, true
	}
	return 0, false
}

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
		rt = newRevTable()
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
	lk := newShardLocks(ix)
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
	for j, blk := range s.Blocks {
		if j%settleEvery == settleEvery-1 {
			lk.settle()
		}
		if slots[j].slot < 0 {
			continue
		}
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
	if atEnd() && ix.noHead(lk, ps, p) {
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
	return ix.startRun(lk, ps, p, room)
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
	n := ws.refs[l]
	if pruning && n <= 1 || !pruning && n == 0 {
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
	if r.refs--; r.refs == 0 {
		lk.write(s)
		lk.writeRunAt(s, l.run(), r)
		sh.freeRun(l.run(), ix.shardBits)
		lk.forget(s, l.run())
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
	lk := newShardLocks(ix)
	defer lk.release()
	for j, l := range locs {
		if j%settleEvery == settleEvery-1 {
			lk.settle()
		}
		ix.dropRef(&lk, ws, l)
	}
}

func (ix *Index) clearRankLocked(ws *workerState, rank int32) {
	rt := ws.ranks[rank]
	if rt == nil {
		return
	}
	delete(ws.ranks, rank)
	lk := newShardLocks(ix)
	defer lk.release()
	for i := range rt.slots {
		if rt.counts(i) != 0 {
			ix.dropRef(&lk, ws, unpackLoc(rt.slots[i].pos, ix.shardBits))
		}
	}
}

// ClearWorker drops every block w holds on every rank (snapshot chunk 0,
// OUT_OF_RANGE / DATA_LOSS resync). The worker stays known.
func (ix *Index) ClearWorker(w WorkerID) {
	ws := ix.existingWorker(w)
	if ws == nil {
		return
	}
	defer ws.mu.Unlock()
	ix.clearAllLocked(ws)
}

func (ix *Index) clearAllLocked(ws *workerState) {
	for r := range ws.ranks {
		ix.clearRankLocked(ws, r)
	}
	ws.refs = nil
}

// ClearWorkerRank drops every block w holds on one DP rank (a rank's
// publisher restarted or its gap was cleared).
func (ix *Index) ClearWorkerRank(w WorkerID, rank int32) {
	ws := ix.existingWorker(w)
	if ws == nil {
		return
	}
	defer ws.mu.Unlock()
	ix.clearRankLocked(ws, rank)
}

// RemoveWorker forgets w: its blocks leave the index before it returns, in
// time proportional to the blocks it held, and its slot is reused.
func (ix *Index) RemoveWorker(w WorkerID) {
	ws := ix.existingWorker(w)
	if ws == nil {
		return
	}
	ix.clearAllLocked(ws)
	ws.removed = true
	ws.mu.Unlock()
	ix.wmu.Lock()
	delete(ix.workers, w)
	ix.slots[ws.id] = nil
	ix.free = append(ix.free, ws.id)
	ix.reorder()
	ix.wmu.Unlock()
}

// Workers lists the workers the index knows, sorted.
func (ix *Index) Workers() []WorkerID {
	ix.wmu.RLock()
	out := make([]WorkerID, 0, len(ix.workers))
	for w := range ix.workers {
		out = append(out, w)
	}
	ix.wmu.RUnlock()
	slices.Sort(out)
	return out
}

// IsEmpty reports whether no worker holds any block (the policy then routes
// without events, as SMG does while an index warms up).
func (ix *Index) IsEmpty() bool {
	for i := range ix.shards {
		if load(&ix.shards[i].entries) > 0 {
			return false
		}
	}
	return true
}

// LiveBlock is one engine block a worker holds, as the index sees it.
type LiveBlock struct {
	Rank       int32
	Tier       Tier
	EngineHash uint64
	Copies     int
}

// LiveDigest is w's rank's anti-entropy digest (internal/livedigest) and
// the copies it covers, to compare with the relay's live digest. It is
// computed on demand from the rank's reverse table (which pruning does not
// touch), O(the rank's blocks) under the worker's lock without allocating,
// not kept incrementally: the monitor asks at most about once a second.
func (ix *Index) LiveDigest(w WorkerID, rank int32) (digest, blocks uint64) {
	ws := ix.existingWorker(w)
	if ws == nil {
		return 0, 0
	}
	defer ws.mu.Unlock()
	rt := ws.ranks[rank]
	if rt == nil {
		return 0, 0
	}
	for i := range rt.slots {
		c := rt.counts(i)
		if c == 0 {
			continue
		}
		for _, t := range []Tier{TierDevice, TierHost} {
			if n := uint64(tierCount(c, t)); n > 0 {
				tier := uint8(livedigest.TierDevice)
				if t == TierHost {
					tier = livedigest.TierHost
				}
				digest += n * livedigest.Block(rt.slots[i].key(), tier)
				blocks += n
			}
		}
	}
	return digest, blocks
}

// LiveSet returns what the index holds for w, one row per (rank, tier,
// engine hash) with its copies, sorted; exactness tests compare it with an
// engine's live set.
func (ix *Index) LiveSet(w WorkerID) []LiveBlock {
	ws := ix.existingWorker(w)
	if ws == nil {
		return nil
	}
	defer ws.mu.Unlock()
	var out []LiveBlock
	for r, rt := range ws.ranks {
		for i := range rt.slots {
			c := rt.counts(i)
			if c == 0 {
				continue
			}
			for _, t := range []Tier{TierDevice, TierHost} {
				if n := tierCount(c, t); n > 0 {
					out = append(out, LiveBlock{Rank: r, Tier: t, EngineHash: rt.slots[i].key(), Copies: int(n)})
				}
			}
		}
	}
	slices.SortFunc(out, func(a, b LiveBlock) int {
		return cmp.Or(cmp.Compare(a.Rank, b.Rank), cmp.Compare(a.Tier, b.Tier), cmp.Compare(a.EngineHash, b.EngineHash))
	})
	return out
}

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

// WorkerStats describes one worker.
type WorkerStats struct {
	// Blocks is the number of engine blocks held (rows of LiveSet, tiers merged).
	Blocks   int
	Counters WorkerCounters
}

// Stats is a snapshot of the index's size.
type Stats struct {
	BlockSize int
	// Entries is the number of distinct prefix hashes held; Memberships counts an
	// entry once per holder.
	Entries     int
	Memberships int
	Workers     map[WorkerID]WorkerStats
	// MemoryBytes estimates the index's own tables (runs, heads, bitsets,
	// reverse maps), not Go map overheads of per-worker bookkeeping.
	MemoryBytes int64
}

// Stats returns a snapshot; it costs one pass over the workers' rank tables.
func (ix *Index) Stats() Stats {
	st := Stats{BlockSize: ix.BlockSize(), Workers: make(map[WorkerID]WorkerStats)}
	for i := range ix.shards {
		sh := &ix.shards[i]
		sh.mu.Lock()
		st.Entries += int(load(&sh.entries))
		st.Memberships += int(load(&sh.mem))
		st.MemoryBytes += int64(sh.memBytes())
		sh.mu.Unlock()
	}
	ix.wmu.RLock()
	wss := make([]*workerState, 0, len(ix.workers))
	for _, ws := range ix.workers {
		wss = append(wss, ws)
	}
	ix.wmu.RUnlock()
	for _, ws := range wss {
		ws.mu.Lock()
		var n int
		for _, rt := range ws.ranks {
			n += rt.n
			st.MemoryBytes += int64(rt.bytes())
		}
		st.MemoryBytes += int64(len(ws.refs)) * 16
		if !ws.removed {
			st.Workers[ws.name] = WorkerStats{Blocks: n, Counters: ws.c}
		}
		ws.mu.Unlock()
	}
	return st
}

// Run prunes every Options.PruneEvery until ctx ends; it returns at once if
// neither TTL nor MaxEntries is set.
func (ix *Index) Run(ctx context.Context) {
	if !ix.pruning {
		return
	}
	t := time.NewTicker(ix.opts.PruneEvery)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			if r := ix.Prune(ix.now()); r.TTL+r.Capacity > 0 {
				ix.log.Info("kv index pruned", "ttl_evicted", r.TTL, "capacity_evicted", r.Capacity)
			}
		}
	}
}
