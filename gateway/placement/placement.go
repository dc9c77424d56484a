// Package placement keeps the gateway's placements: the blocks of a request
// it has just routed, recorded on the chosen worker as *inferred* before the
// engine has prefilled them and said so on its event stream.
//
// The engine reports a block only after its prefill, seconds after the
// routing decision under load. Until then the event index does not know
// where a prefix is going, and a burst of requests sharing a new prefix
// would be spread over the fleet, each prefilling it again. A placement
// closes that window: the next request with the prefix finds it on the
// worker the first one went to. While a model's index has no data at all
// (engines without events, or before the first event) placements are the
// only prefix knowledge, which gives SMG's approximate mode.
//
// A Store holds one model's placements, prefix hash (index.PrefixHashes, so
// the same identity as the event index) × worker → expiry. An entry ends:
//
//   - confirmed: a lookup finds the event index holding the block on that
//     worker (at the block before the worker's index overlap, and the
//     placements chained before it); the index is then the record, and the
//     engine's later removal of the block drops it there. A confirmed
//     placement no lookup meets that way waits for its TTL;
//   - expired: its TTL passed (checked on lookup, and by Sweep, which one
//     goroutine of the gateway calls periodically);
//   - evicted: the store is at MaxEntries and a newer entry needs the room:
//     the least recently recorded entry of the largest source goes (below);
//   - removed: its worker left the gateway.
//
// Every entry belongs to a source: the gateway's own routing decisions
// (Record) or one peer replica (RecordFrom, the placements package
// placementsync receives). Eviction takes from the source holding the most
// entries, so a peer flooding placements evicts its own and nobody else's
// until it holds no more than they do (issue 29: one peer's million
// placements evicted the real ones). Each source keeps its entries in a
// list ordered by their last recording, so with one TTL for all the oldest
// is also the first to expire: expiry and eviction pop a list's front,
// O(1) each, after a scan of the sources (at most MaxSources+2) to find the
// largest.
package placement

import (
	"cmp"
	"fmt"
	"math"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/kvrelay/kvrelay/gateway/index"
)

// Defaults.
const (
	// DefaultTTL is SMG's default for inferred placements in its shared
	// index. It covers a prefill behind a deep queue by far, and in the
	// approximate mode (no events) a prefix that is routed again is
	// recorded again, so a hot prefix stays while a cold one leaves about
	// when an engine's LRU cache would have evicted it under load.
	DefaultTTL = 180 * time.Second
	// DefaultMaxEntries bounds a model's placements: 262,144 blocks
	// (about 46 MB at EntryBytes an entry), 4 million tokens at block size
	// 16 recorded within one TTL.
	DefaultMaxEntries = 1 << 18
	// DefaultWeight scores an inferred block like a stored one.
	DefaultWeight = 1.0
)

// MaxSources bounds the peer replicas whose placements are kept apart. A
// peer seen while MaxSources others hold entries shares the overflow
// source with every other such peer (a forger rotating its replica id
// lands there after its first MaxSources ids, and is evicted as one
// source); a peer whose entries are all gone is forgotten, freeing its
// place. Ids longer than MaxSourceID bytes go to the overflow too, so the
// ids kept cost at most MaxSources × MaxSourceID bytes.
const (
	MaxSources  = 64
	MaxSourceID = 128
)

// EntryBytes is the memory of one entry, rounded up from what a full
// store holds: the entry (hash, worker name header, expiry, its source,
// two list links, two chain links: 80 bytes in Go's size classes), its
// holder slice (8), and its share of the hash map, whose slots (a key and
// a slice header, 32 bytes) run between half and seven eighths full: 168
// bytes an entry at DefaultMaxEntries (TestEntryBytesCoversAFullStore).
const EntryBytes = 176

// Options configures a Store. Zero values take the defaults.
type Options struct {
	// TTL is how long a placement lives without being recorded again.
	TTL time.Duration
	// MaxEntries caps the entries (one per block and worker).
	MaxEntries int
	// MaxPerRecord caps the blocks one Record places (one request, or one
	// peer replica's message), from the prefix's start: past it a prompt
	// is rarely shared, and one huge request must not take a large part
	// of MaxEntries (issue 29: an 11 MiB "text" placed 180,224 blocks,
	// 69 % of the cap). 0 = MaxEntries/16 (16,384 blocks by default, a
	// 262,144-token prefix at block size 16), but at least
	// min(MaxEntries, 4096) for small stores.
	MaxPerRecord int
	// Weight scales the inferred blocks of a worker's overlap: a worker
	// whose index overlap is k blocks and whose placements extend it by j
	// scores k + round(Weight·j). In (0, 1].
	Weight float64
}

func (o *Options) fill() error {
	if o.TTL == 0 {
		o.TTL = DefaultTTL
	}
	if o.MaxEntries == 0 {
		o.MaxEntries = DefaultMaxEntries
	}
	if o.Weight == 0 {
		o.Weight = DefaultWeight
	}
	if o.MaxPerRecord == 0 {
		o.MaxPerRecord = max(o.MaxEntries/16, min(o.MaxEntries, 4096))
	}
	switch {
	case o.MaxPerRecord < 0:
		return fmt.Errorf("placement: max blocks per record must be > 0, got %d", o.MaxPerRecord)
	case o.TTL < 0:
		return fmt.Errorf("placement: TTL must be > 0, got %v", o.TTL)
	case o.MaxEntries < 0:
		return fmt.Errorf("placement: max entries must be > 0, got %d", o.MaxEntries)
	case math.IsNaN(o.Weight) || o.Weight < 0 || o.Weight > 1:
		return fmt.Errorf("placement: weight must be in (0, 1], got %v", o.Weight)
	}
	return nil
}

// entry is one block placed on one worker.
type entry struct {
	hash       uint64
	worker     string
	expires    int64   // unix nanoseconds
	src        *source // whose list it is in
	prev, next *entry  // its source's list
	// chainPrev and chainNext link the entries one Record placed on
	// consecutive blocks for this worker, so a lookup or a refresh that
	// follows a placed prefix reads the next entry through a pointer and
	// compares its hash with the request's next one instead of probing the
	// map for every block. Both ends are cleared when an entry is dropped.
	chainPrev, chainNext *entry
}

// source is the entries one recorder placed: the gateway itself, one peer
// replica, or the peers past MaxSources together.
type source struct {
	peer string // "" for the local and the overflow source
	// head is the list's sentinel: head.next is the least recently
	// recorded entry, head.prev the most recent.
	head entry
	n    int
}

func (src *source) init() *source {
	src.head.prev, src.head.next = &src.head, &src.head
	return src
}

// Stats counts a store's entries and how they ended.
type Stats struct {
	Entries int
	// Local is the entries of the gateway's own decisions; Sources the
	// peer sources holding entries (the overflow counts as one).
	Local     int
	Sources   int
	Confirmed uint64
	Expired   uint64
	Evicted   uint64
	Removed   uint64
}

// Store is one model's placements. Safe for concurrent use.
type Store struct {
	opts Options

	mu       sync.Mutex
	byHash   map[uint64][]*entry
	local    source
	peers    map[string]*source // at most MaxSources, each with entries
	overflow source             // the peers past MaxSources
	n        int
	stats    Stats
}

// New returns an empty Store.
func New(opts Options) (*Store, error) {
	if err := opts.fill(); err != nil {
		return nil, err
	}
	s := &Store{opts: opts, byHash: map[uint64][]*entry{}, peers: map[string]*source{}}
	s.local.init()
	s.overflow.init()
	return s, nil
}

// Options returns the store's options with defaults filled in.
func (s *Store) Options() Options { return s.opts }

func (s *Store) unlink(e *entry) {
	e.prev.next, e.next.prev = e.next, e.prev
	e.prev, e.next = nil, nil
}

// pushBack appends e to src's list as its most recent entry.
func (s *Store) pushBack(src *source, e *entry) {
	e.src = src
	e.prev, e.next = src.head.prev, &src.head
	src.head.prev.next = e
	src.head.prev = e
}

// peerSource is peer's source, made if need be (s.mu held).
func (s *Store) peerSource(peer string) *source {
	if src := s.peers[peer]; src != nil {
		return src
	}
	if len(s.peers) >= MaxSources || len(peer) > MaxSourceID {
		return &s.overflow
	}
	src := (&source{peer: peer}).init()
	s.peers[peer] = src
	return src
}

// forget drops a peer's source once it holds nothing (s.mu held).
func (s *Store) forget(src *source) {
	if src.n == 0 && src != &s.local && src != &s.overflow {
		delete(s.peers, src.peer)
	}
}

// largest is the source holding the most entries, and how many more it
// holds than the next largest; on a tie a peer's goes before the local
// one (s.mu held).
func (s *Store) largest() (*source, int) {
	big, second := &s.overflow, -1
	consider := func(src *source) {
		switch {
		case src.n > big.n:
			second, big = big.n, src
		case src.n > second:
			second = src.n
		}
	}
	for _, src := range s.peers {
		consider(src)
	}
	consider(&s.local)
	return big, big.n - max(second, 0)
}

// evict drops the oldest entries of the largest source until the store
// is within MaxEntries (s.mu held). It takes from one source up to the
// lead it has over the next, so a flood costs a scan of the sources per
// run of evictions, not per entry.
func (s *Store) evict() {
	for s.n > s.opts.MaxEntries {
		src, lead := s.largest()
		for k := max(lead, 1); k > 0 && s.n > s.opts.MaxEntries && src.n > 0; k-- {
			s.dropEntry(src.head.next)
			s.stats.Evicted++
		}
	}
}

// drop removes e from the list and from its hash's holders at position i.
func (s *Store) drop(hs []*entry, i int) []*entry {
	e := hs[i]
	s.unlink(e)
	if e.chainPrev != nil {
		e.chainPrev.chainNext = nil
	}
	if e.chainNext != nil {
		e.chainNext.chainPrev = nil
	}
	e.chainPrev, e.chainNext = nil, nil
	last := len(hs) - 1
	hs[i] = hs[last]
	hs[last] = nil
	hs = hs[:last]
	if len(hs) == 0 {
		delete(s.byHash, e.hash)
	} else {
		s.byHash[e.hash] = hs
	}
	s.n--
	e.src.n--
	s.forget(e.src)
	e.src = nil
	return hs
}

// dropEntry removes e wherever it is in its hash's holders.
func (s *Store) dropEntry(e *entry) {
	hs := s.byHash[e.hash]
	for i, x := range hs {
		if x == e {
			s.drop(hs, i)
			return
		}
	}
}

// Record places prefix[from:] on worker at now, as the gateway's own
// decision: blocks the event index already holds for it (the first from)
// need no placement. An existing placement is refreshed. Consecutive blocks
// are chained, so recording a prefix placed before costs one map probe,
// then a pointer walk. Blocks past the first MaxPerRecord of the prefix are
// not placed.
func (s *Store) Record(worker string, prefix []uint64, from int, now time.Time) {
	if s.recordable(worker, prefix, from) {
		s.mu.Lock()
		defer s.mu.Unlock()
		s.record(&s.local, worker, prefix, from, now)
	}
}

// RecordFrom is Record for a placement peer replica peer made: its new
// entries are peer's, evicted before another source's while peer holds
// the most. A placement the gateway itself holds stays its own; one a
// peer holds already stays that peer's (refreshed), so a peer replaying
// another's placements cannot make them its own to evict.
func (s *Store) RecordFrom(peer, worker string, prefix []uint64, from int, now time.Time) {
	if s.recordable(worker, prefix, from) {
		s.mu.Lock()
		defer s.mu.Unlock()
		src := s.peerSource(peer)
		s.record(src, worker, prefix, from, now)
		s.forget(src) // it only refreshed others' entries
	}
}

func (s *Store) recordable(worker string, prefix []uint64, from int) bool {
	return from >= 0 && from < min(len(prefix), s.opts.MaxPerRecord) && worker != ""
}

// record is Record into src's entries (s.mu held).
func (s *Store) record(src *source, worker string, prefix []uint64, from int, now time.Time) {
	end := min(len(prefix), s.opts.MaxPerRecord)
	exp := now.Add(s.opts.TTL).UnixNano()
	slack := refreshSlack(s.opts.TTL)
	var last *entry // the entry placed on the block before, for the chain
	for _, h := range prefix[from:end] {
		var e *entry
		if last != nil && last.chainNext != nil && last.chainNext.hash == h && last.chainNext.worker == worker {
			e = last.chainNext
		} else {
			e = s.find(h, worker)
		}
		switch {
		case e == nil:
			e = &entry{hash: h, worker: worker, expires: exp}
			s.byHash[h] = append(s.byHash[h], e)
			s.n++
			src.n++
			s.pushBack(src, e)
		case src == &s.local && e.src != src:
			// The gateway's own decision takes the entry over.
			e.src.n--
			s.unlink(e)
			s.forget(e.src)
			e.expires = exp
			src.n++
			s.pushBack(src, e)
		case e.expires < exp-slack:
			// Not refreshed a moment ago (a hot prefix is left alone,
			// and so is the list's order).
			owner := e.src
			s.unlink(e)
			e.expires = exp
			s.pushBack(owner, e)
		}
		if last != nil && last.chainNext == nil && e.chainPrev == nil {
			last.chainNext, e.chainPrev = e, last
		}
		last = e
	}
	s.evict()
}

// find returns worker's entry on block hash h, or nil.
func (s *Store) find(h uint64, worker string) *entry {
	for _, x := range s.byHash[h] {
		if x.worker == worker {
			return x
		}
	}
	return nil
}

// refreshSlack is how recently a placement may have been recorded for
// Record to leave it alone: a sixteenth of the TTL, so a hot prefix's
// entries move in the list a few times per TTL instead of on every request,
// and expire at most that much early.
func refreshSlack(ttl time.Duration) int64 { return int64(ttl / 16) }

// Result is a lookup's answer: the index's overlaps extended by placements.
type Result struct {
	// Matches is what the picker weighs: each worker's index overlap plus
	// its weighted inferred blocks, deepest first, then by name.
	Matches index.Matches
	// Inferred holds, per worker, the blocks placements added past its
	// index overlap (before weighting); workers without any are absent.
	Inferred map[string]int
}

// Extend extends base, the event index's overlaps for prefix, by the
// placements: a worker's overlap continues past its index overlap for as
// long as it has a placement on each next block. A placement on a block the
// index already holds for its worker is confirmed and dropped when a lookup
// meets it; an expired one is dropped when a lookup meets it, else by Sweep.
//
// The cost grows with the placements that matter, not with the prompt: the
// map is probed once per distinct overlap depth (where a worker's overlap
// may continue, and the block before it, where confirmed placements end),
// and a worker's placed blocks are then followed along their chain, a map
// probe only where the chain breaks.
func (s *Store) Extend(prefix []uint64, base index.Matches, now time.Time) Result {
	n := len(prefix)
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.n == 0 || n == 0 {
		return Result{Matches: base}
	}
	x := extension{s: s, prefix: prefix, base: base.Workers, now: now.UnixNano()}
	// base.Workers is sorted deepest first: visit each distinct depth once,
	// and depth 0 for the workers the index has nothing of.
	for i := 0; i <= len(base.Workers); i++ {
		d := 0
		if i < len(base.Workers) {
			d = base.Workers[i].Blocks
			if i > 0 && base.Workers[i-1].Blocks == d {
				continue
			}
		} else if len(base.Workers) > 0 && base.Workers[i-1].Blocks == 0 {
			continue
		}
		if d > 0 {
			x.confirm(d - 1)
		}
		if d < n {
			x.extendAt(d)
		}
	}
	if x.inferred == nil {
		return Result{Matches: base}
	}
	out := index.Matches{RequestBlocks: base.RequestBlocks, Workers: make([]index.Match, 0, len(base.Workers)+len(x.inferred))}
	for _, m := range base.Workers {
		if _, ok := x.inferred[m.Worker]; !ok && m.Blocks > 0 {
			out.Workers = append(out.Workers, m)
		}
	}
	// out is sorted (base was); the few extended workers go in by binary
	// search instead of sorting every candidate again.
	order := func(a, b index.Match) int {
		return cmp.Or(cmp.Compare(b.Blocks, a.Blocks), strings.Compare(a.Worker, b.Worker))
	}
	for w, j := range x.inferred {
		if c := x.baseOf(w) + int(math.Round(s.opts.Weight*float64(j))); c > 0 {
			m := index.Match{Worker: w, Blocks: c}
			at, _ := slices.BinarySearchFunc(out.Workers, m, order)
			out.Workers = slices.Insert(out.Workers, at, m)
		}
	}
	return Result{Matches: out, Inferred: x.inferred}
}

// extension is one Extend's working state (s.mu held).
type extension struct {
	s        *Store
	prefix   []uint64
	base     []index.Match // deepest first, then by name
	now      int64
	inferred map[string]int
}

// baseOf is w's index overlap: a scan of the candidates, which are few next
// to the prompt's blocks (a map would cost more to build than it saves).
func (x *extension) baseOf(w string) int {
	for _, m := range x.base {
		if m.Worker == w {
			return m.Blocks
		}
	}
	return 0
}

// live returns block i's entries with the expired ones dropped.
func (x *extension) live(i int) []*entry {
	hs := x.s.byHash[x.prefix[i]]
	for j := 0; j < len(hs); {
		if hs[j].expires <= x.now {
			hs = x.s.drop(hs, j)
			x.s.stats.Expired++
			continue
		}
		j++
	}
	return hs
}

// confirm drops the placements on block i whose worker's index overlap
// covers it, and those chained before them on the request's blocks.
func (x *extension) confirm(i int) {
	hs := x.live(i)
	for j := 0; j < len(hs); {
		e := hs[j]
		if x.baseOf(e.worker) <= i {
			j++
			continue
		}
		p := e.chainPrev
		for k := i - 1; k >= 0 && p != nil && p.hash == x.prefix[k]; k-- {
			// p's worker is e's (a chain is one worker's), whose overlap
			// covers block i and so block k.
			before := p.chainPrev
			x.s.dropEntry(p)
			x.s.stats.Confirmed++
			p = before
		}
		hs = x.s.drop(hs, j)
		x.s.stats.Confirmed++
	}
}

// extendAt extends every worker whose index overlap is d by its placements
// from block d on.
func (x *extension) extendAt(d int) {
	n := len(x.prefix)
	for _, e := range x.live(d) {
		w := e.worker
		if x.baseOf(w) != d {
			continue // confirmed (dropped by confirm) or not contiguous
		}
		k := d + 1
		for k < n {
			next := e.chainNext
			if next == nil || next.hash != x.prefix[k] || next.worker != w || next.expires <= x.now {
				next = nil
				for _, y := range x.live(k) {
					if y.worker == w {
						next = y
						break
					}
				}
				if next == nil {
					break
				}
			}
			e = next
			k++
		}
		if x.inferred == nil {
			x.inferred = map[string]int{}
		}
		x.inferred[w] = k - d
	}
}

// Sweep drops every placement expired at now and returns how many.
func (s *Store) Sweep(now time.Time) int {
	t := now.UnixNano()
	s.mu.Lock()
	defer s.mu.Unlock()
	n := 0
	for _, src := range s.sources() {
		for e := src.head.next; e != &src.head && e.expires <= t; e = src.head.next {
			s.dropEntry(e)
			n++
		}
	}
	s.stats.Expired += uint64(n)
	return n
}

// sources lists every source, so a caller may drop entries (and so
// forget sources) while walking them (s.mu held).
func (s *Store) sources() []*source {
	out := make([]*source, 0, len(s.peers)+2)
	out = append(out, &s.local, &s.overflow)
	for _, src := range s.peers {
		out = append(out, src)
	}
	return out
}

// RemoveWorker drops every placement on worker and returns how many.
func (s *Store) RemoveWorker(worker string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	n := 0
	for _, src := range s.sources() {
		for e := src.head.next; e != &src.head; {
			next := e.next
			if e.worker == worker {
				s.dropEntry(e)
				n++
			}
			e = next
		}
	}
	s.stats.Removed += uint64(n)
	return n
}

// Stats returns the store's counts.
func (s *Store) Stats() Stats {
	s.mu.Lock()
	defer s.mu.Unlock()
	st := s.stats
	st.Entries = s.n
	st.Local = s.local.n
	st.Sources = len(s.peers)
	if s.overflow.n > 0 {
		st.Sources++
	}
	return st
}
