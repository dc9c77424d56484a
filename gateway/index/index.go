package index

import (
	"cmp"
	"context"
	"log/slog"
	"math"
	"math/bits"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

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
	MaxEntries int
	// PruneEvery is Run's period; 0 = 30 s.
	PruneEvery time.Duration
	// Now is the clock (tests inject one); nil = time.Now.
	Now func() time.Time
	// ShardBits sets 2^ShardBits forward shards; 0 = 64 shards.
	ShardBits int
	// Logger receives prune summaries; nil = slog.Default().
	Logger *slog.Logger
}

// Index is one model's prefix index: which workers hold which block prefixes.
// All methods are safe for concurrent use. Writers for one worker serialise
// on that worker; lookups take one shard read lock per probed block.
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
	// refs counts, for a prefix hash held through two or more reverse entries
	// (the same block on two DP ranks, or two engine hashes naming the same
	// content), how many. One reference is implied by the forward bit, so the
	// common case costs nothing here.
	refs    map[uint64]uint32
	nonMain map[uint32]struct{} // cache groups seen with a non-main-attention kind
	learned bool
	c       WorkerCounters

	// scr holds the forward changes queued for flush; taken from a pool by
	// the first change and returned by flush, so an idle worker holds none.
	scr *flushScratch
}

// flushScratch is flush's working memory (a few KB with 64 shards).
type flushScratch struct {
	pending     []fwdOp
	order       []int32
	bucketStart []int32
}

var scratchPool = sync.Pool{New: func() any { return new(flushScratch) }}

// queue appends op to ws's pending forward changes.
func (ws *workerState) queue(op fwdOp) {
	if ws.scr == nil {
		ws.scr = scratchPool.Get().(*flushScratch)
	}
	ws.scr.pending = append(ws.scr.pending, op)
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
		ix.shards[i].init(ix.pruning)
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
			ix.applyStored(ws, rank, e.Stored, hs)
			ix.flush(ws, stamp)
		case *kvpb.KvCacheEvent_Removed:
			ix.applyRemoved(ws, rank, e.Removed)
			ix.flush(ws, stamp)
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
func (ix *Index) applyStored(ws *workerState, rank int32, s *kvpb.KvBlocksStored, content []uint64) {
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
	chained := false
	if s.ParentBlockHash != nil {
		if i := rt.find(uint64(*s.ParentBlockHash)); i >= 0 {
			prev, chained = rt.slots[i].pref, true
		} else {
			ws.c.ParentlessStores++
			ws.c.ParentlessBlocks += uint64(len(s.Blocks))
		}
	}
	for j, blk := range s.Blocks {
		if blk == nil {
			continue
		}
		var p uint64
		if content != nil {
			p = content[j]
		} else {
			p = ContentHash(blk.TokenIds, seed)
		}
		if chained {
			p = ChainHash(prev, p)
		}
		chained = true
		eh := uint64(blk.BlockHash)
		ws.c.StoredBlocks++
		if i, found := rt.upsert(eh, p, withTierCount(0, tier, 1)); found {
			c := rt.counts(i)
			if n := tierCount(c, tier); n >= copiesCap {
				ws.c.CappedCopies++
			} else {
				rt.setCounts(i, withTierCount(c, tier, n+1))
			}
			if rt.slots[i].pref != p {
				ws.c.EngineConflicts++
			}
			// Keep the block's first filing, so later children chain from where
			// the earlier ones did; re-assert the holder in case a prune evicted it.
			p = rt.slots[i].pref
			ix.addRef(ws, p, false)
		} else {
			ix.addRef(ws, p, true)
		}
		prev = p
	}
}

// fwdOp is one pending change of the forward map for the locked worker.
type fwdOp struct {
	p       uint64
	add     bool
	counted bool // an add for a new reverse entry (vs. a copy of a known one)
}

// addRef records that ws holds p. counted says a new reverse entry refers to
// p (rather than an existing one gaining a copy). The change is queued until
// flush.
func (ix *Index) addRef(ws *workerState, p uint64, counted bool) {
	ws.queue(fwdOp{p: p, add: true, counted: counted})
}

// dropRef records that one reverse entry of ws referring to p is gone.
func (ix *Index) dropRef(ws *workerState, p uint64) {
	if n := ws.refs[p]; n > 0 {
		if n <= 2 {
			delete(ws.refs, p)
		} else {
			ws.refs[p] = n - 1
		}
		return
	}
	ws.queue(fwdOp{p: p})
}

// flush applies ws's pending forward changes, taking each shard's write lock
// once for all of its changes: per-block locking was a third of the apply
// cost. Changes to one prefix keep their order (a stable bucket sort).
func (ix *Index) flush(ws *workerState, stamp uint32) {
	scr := ws.scr
	if scr == nil {
		return
	}
	ops := scr.pending
	defer func() {
		scr.pending = scr.pending[:0]
		ws.scr = nil
		scratchPool.Put(scr)
	}()
	sb := ix.shardBits
	apply := func(sh *shard, op fwdOp) {
		if !op.add {
			sh.removeHolderLocked(op.p, ws.id, sb)
			return
		}
		if held := sh.addHolderLocked(op.p, ws.id, stamp, sb); held && op.counted {
			if ws.refs == nil {
				ws.refs = make(map[uint64]uint32)
			}
			ws.refs[op.p] = max(ws.refs[op.p], 1) + 1
		}
	}
	if len(ops) < 4 {
		for _, op := range ops {
			sh := ix.shardOf(op.p)
			sh.writeBegin()
			apply(sh, op)
			sh.writeEnd()
		}
		return
	}
	nsh := len(ix.shards)
	if len(scr.bucketStart) != nsh+1 {
		scr.bucketStart = make([]int32, nsh+1)
	}
	start := scr.bucketStart
	clear(start)
	for _, op := range ops {
		start[ix.shardIndex(op.p)+1]++
	}
	for i := 1; i <= nsh; i++ {
		start[i] += start[i-1]
	}
	scr.order = slices.Grow(scr.order[:0], len(ops))[:len(ops)]
	for i, op := range ops {
		si := ix.shardIndex(op.p)
		scr.order[start[si]] = int32(i)
		start[si]++
	}
	// start[si] is now the end of bucket si; bucket si begins at start[si-1].
	begin := int32(0)
	for si := range nsh {
		end := start[si]
		if end > begin {
			sh := &ix.shards[si]
			sh.writeBegin()
			for _, oi := range scr.order[begin:end] {
				apply(sh, ops[oi])
			}
			sh.writeEnd()
		}
		begin = end
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
	for _, h := range r.BlockHashes {
		i := -1
		if rt != nil {
			i = rt.find(uint64(h))
		}
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
		p := rt.slots[i].pref
		rt.del(i)
		ix.dropRef(ws, p)
	}
}

func (ix *Index) clearRankLocked(ws *workerState, rank int32) {
	rt := ws.ranks[rank]
	if rt == nil {
		return
	}
	delete(ws.ranks, rank)
	for i := range rt.slots {
		if rt.counts(i) != 0 {
			ix.dropRef(ws, rt.slots[i].pref)
		}
	}
	ix.flush(ws, 0)
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
		if n, _, _ := ix.shards[i].stats(); n > 0 {
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
					out = append(out, LiveBlock{Rank: r, Tier: t, EngineHash: rt.slots[i].key, Copies: int(n)})
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
func (ix *Index) FindMatches(tokens []uint32, ns Namespace) Matches {
	bs := ix.BlockSize()
	n := len(tokens) / bs
	seed := ns.Seed()
	var prev uint64
	return ix.walk(n, func(i int) uint64 {
		c := ContentHash(tokens[i*bs:(i+1)*bs], seed)
		if i > 0 {
			c = ChainHash(prev, c)
		}
		prev = c
		return c
	})
}

// FindMatchesHashes is FindMatches for prefix hashes already computed with
// PrefixHashes.
func (ix *Index) FindMatchesHashes(prefix []uint64) Matches {
	return ix.walk(len(prefix), func(i int) uint64 { return prefix[i] })
}

// FindMatchesContent is FindMatches for a request's content hashes (as
// ContentHashes computes them under the request's namespace seed): the input
// SMG's and Dynamo's indexes take, for callers that keep a conversation's
// block hashes. The prefix chain is computed here, lazily.
func (ix *Index) FindMatchesContent(content []uint64) Matches {
	var prev uint64
	return ix.walk(len(content), func(i int) uint64 {
		c := content[i]
		if i > 0 {
			c = ChainHash(prev, c)
		}
		prev = c
		return c
	})
}

type slotMatch struct {
	id     uint32
	blocks int32
}

// lookAhead is how many blocks a lookup hashes and prefetches at a time; a
// request whose overlap ends early wastes at most this many hashes.
const lookAhead = 16

var prefetchSink atomic.Uint64

// prefetch loads the home slot of each hash so the probes that follow hit
// the cache; the loads are independent, so their misses overlap.
func (ix *Index) prefetch(hs []uint64) {
	var x uint64
	for _, p := range hs {
		t := ix.shardOf(p).tab.Load()
		x += uint64(t.loadHold(t.home(p, ix.shardBits)))
	}
	if x == 1 { // practically never; keeps the loads from being eliminated
		prefetchSink.Store(x)
	}
}

func (ix *Index) walk(n int, hashAt func(int) uint64) Matches {
	res := Matches{RequestBlocks: n}
	if n == 0 {
		return res
	}
	var stamp uint32
	if ix.pruning {
		stamp = ix.stampAt(ix.now())
	}
	var activeBuf, setBuf [16]uint64
	active := activeBuf[:0]
	var single uint32 // the one active worker, when active is not a bitset
	isSingle := false
	var doneBuf [32]slotMatch
	done := doneBuf[:0]
	sb := ix.shardBits
	pos := 0
	// Hashes are computed a chunk ahead and their home slots touched first,
	// so the chunk's cache misses overlap instead of queueing one by one.
	var chunk [lookAhead]uint64
	chunkEnd := 0
	for ; pos < n; pos++ {
		if pos == chunkEnd {
			chunkEnd = min(n, pos+lookAhead)
			for j := pos; j < chunkEnd; j++ {
				chunk[j-pos] = hashAt(j)
			}
			ix.prefetch(chunk[:chunkEnd-pos])
		}
		p := chunk[pos%lookAhead]
		h := ix.shardOf(p).lookup(p, sb, ix.pruning, stamp, setBuf[:0])
		if !h.found {
			break
		}
		if pos == 0 {
			if h.single {
				single, isSingle = h.id, true
			} else {
				active = append(active, h.set...)
			}
			continue
		}
		if isSingle {
			held := false
			if h.single {
				held = h.id == single
			} else if int(single>>6) < len(h.set) {
				held = h.set[single>>6]&(1<<(single&63)) != 0
			}
			if !held {
				break
			}
			continue
		}
		// Bitset of candidates: intersect, and give each dropped worker its depth.
		if h.single {
			id := h.id
			keep := int(id>>6) < len(active) && active[id>>6]&(1<<(id&63)) != 0
			done = dropAll(active, done, pos, id, keep)
			active = active[:0]
			if !keep {
				break
			}
			single, isSingle = id, true
			continue
		}
		alive := uint64(0)
		for wi := range active {
			var x uint64
			if wi < len(h.set) {
				x = h.set[wi]
			}
			gone := active[wi] &^ x
			for gone != 0 {
				b := bits.TrailingZeros64(gone)
				gone &= gone - 1
				done = append(done, slotMatch{id: uint32(wi<<6 + b), blocks: int32(pos)})
			}
			active[wi] &= x
			alive |= active[wi]
		}
		if alive == 0 {
			active = active[:0]
			break
		}
	}
	if isSingle {
		done = append(done, slotMatch{id: single, blocks: int32(pos)})
	} else {
		for wi, x := range active {
			for x != 0 {
				b := bits.TrailingZeros64(x)
				x &= x - 1
				done = append(done, slotMatch{id: uint32(wi<<6 + b), blocks: int32(pos)})
			}
		}
	}
	if len(done) == 0 {
		return res
	}
	// Sort by depth, then name, on packed integer keys: (max − blocks, rank).
	keys := make([]uint64, 0, len(done))
	ix.wmu.RLock()
	for _, d := range done {
		if d.blocks > 0 && int(d.id) < len(ix.slots) && ix.slots[d.id] != nil {
			keys = append(keys, uint64(math.MaxInt32-d.blocks)<<32|uint64(ix.rankOf[d.id]))
		}
	}
	slices.Sort(keys)
	res.Workers = make([]Match, len(keys))
	for i, k := range keys {
		res.Workers[i] = Match{Worker: ix.slots[ix.byRank[uint32(k)]].name, Blocks: int(math.MaxInt32 - int32(k>>32))}
	}
	ix.wmu.RUnlock()
	return res
}

// dropAll records every active worker except keep-id as ending at pos.
func dropAll(active []uint64, done []slotMatch, pos int, id uint32, keep bool) []slotMatch {
	for wi, x := range active {
		for x != 0 {
			b := bits.TrailingZeros64(x)
			x &= x - 1
			if s := uint32(wi<<6 + b); !keep || s != id {
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
	// Entries is the number of distinct prefix hashes; Memberships counts an
	// entry once per holder.
	Entries     int
	Memberships int
	Workers     map[WorkerID]WorkerStats
	// MemoryBytes estimates the index's own tables (forward shards, bitsets,
	// reverse maps), not Go map overheads of per-worker bookkeeping.
	MemoryBytes int64
}

// Stats returns a snapshot; it costs one pass over the workers' rank tables.
func (ix *Index) Stats() Stats {
	st := Stats{BlockSize: ix.BlockSize(), Workers: make(map[WorkerID]WorkerStats)}
	for i := range ix.shards {
		n, mem, bytes := ix.shards[i].stats()
		st.Entries += n
		st.Memberships += mem
		st.MemoryBytes += int64(bytes)
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
