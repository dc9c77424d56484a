package index

import (
	"cmp"
	"context"
	"log/slog"
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
	// ShardBits is kept for compatibility and ignored: the forward map is
	// one structure with one writer at a time (see forward.go).
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
// on that worker; the forward map has one writer at a time (an event's
// reverse-table work runs outside it); lookups take no lock.
type Index struct {
	opts      Options
	now       func() time.Time
	epoch     time.Time
	fw        forward
	pool      arrayPool // run arrays and reverse tables given back
	pruning   bool
	blockSize atomic.Int64
	log       *slog.Logger

	wmu     sync.RWMutex
	workers map[WorkerID]*workerState
	slots   []*workerState // by slot id; nil = free
	free    []uint32
	// order is the slots' order by worker name, so a lookup sorts its
	// result with integer keys and names it without taking wmu: made anew
	// and published (wmu held) whenever a worker comes or goes.
	order atomic.Pointer[nameOrder]
}

// nameOrder is a snapshot of the workers by name: rank, by slot id, is
// 1 + the worker's position in name order (0: a free slot); names, by
// that position, the workers' names. Never changed once published.
type nameOrder struct {
	rank  []uint32
	names []WorkerID
}

// reorder publishes a new name order; callers hold wmu for writing.
func (ix *Index) reorder() {
	ids := make([]uint32, 0, len(ix.workers))
	for id, ws := range ix.slots {
		if ws != nil {
			ids = append(ids, uint32(id))
		}
	}
	slices.SortFunc(ids, func(a, b uint32) int { return strings.Compare(ix.slots[a].name, ix.slots[b].name) })
	o := &nameOrder{rank: make([]uint32, len(ix.slots)), names: make([]WorkerID, len(ids))}
	for r, id := range ids {
		o.rank[id] = uint32(r) + 1
		o.names[r] = ix.slots[id].name
	}
	ix.order.Store(o)
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
// of its blocks for the second (the forward map), in one word: i ≥ 0, the
// block is new to the rank, at reverse slot i; ^i (< 0), the rank held the
// engine hash already, at slot i; nilSlot, a nil block. The second pass's
// common case, a new block, is then one sign test.
type evSlot int32

// nilSlot marks a nil block (never ^i: a reverse table has fewer slots).
const nilSlot evSlot = -1 << 31

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
	// UnindexedBlocks counts stored blocks left out of the index because
	// they needed a new run and no run id was left (a reverse entry names a
	// run in 24 bits: 2^24-2 live runs), and the blocks new to the rank after
	// them in the same event. The
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
	ix := &Index{
		opts:    opts,
		now:     opts.Now,
		pruning: opts.TTL > 0 || opts.MaxEntries > 0,
		log:     opts.Logger,
		workers: make(map[WorkerID]*workerState),
	}
	ix.epoch = ix.now()
	ix.fw.init(&ix.pool, ix.pruning)
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

func (ix *Index) clearRankLocked(ws *workerState, rank int32) {
	rt := ws.ranks[rank]
	if rt == nil {
		return
	}
	delete(ws.ranks, rank)
	f := &ix.fw
	f.mu.Lock()
	k := 0
	for i := range rt.slots {
		if rt.counts(i) != 0 && rt.slots[i].pos != noPos {
			if k++; k%settleEvery == 0 {
				f.settle()
			}
			ix.dropRef(ws, loc(rt.slots[i].pos))
		}
	}
	f.unlock()
	rt.release()
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
	return atomic.LoadUint64(&ix.fw.mem) == 0
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
	// MemoryBytes estimates the index's own tables (runs, child and heads
	// tables, coverage, reverse maps), not Go map overheads of per-worker
	// bookkeeping.
	MemoryBytes int64
}

// Stats returns a snapshot; it costs one pass over the runs (taking the
// forward writer's lock a batch of runs at a time) and the workers' rank
// tables.
func (ix *Index) Stats() Stats {
	st := Stats{BlockSize: ix.BlockSize(), Workers: make(map[WorkerID]WorkerStats)}
	f := &ix.fw
	entries, bytes := f.statsPass()
	st.Entries = entries
	f.mu.Lock()
	st.Memberships = int(f.mem)
	f.mu.Unlock()
	st.MemoryBytes += int64(bytes)
	st.MemoryBytes += int64(ix.pool.heldBytes())
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
