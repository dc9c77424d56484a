// Package gateway is kvrelay's routing module: it subscribes to every
// worker's KV-event stream (package monitor), keeps one prefix index per
// model (package index), and picks the worker for a request by its cached
// prefix and in-flight load (package picker). A Go router or an endpoint
// picker embeds it; `kvrelay gateway` serves it over HTTP.
//
// Embedding, in about twenty lines (Example compiles it):
//
//	reg := prometheus.NewRegistry()
//	gw, err := gateway.New(gateway.Config{
//		Workers: []gateway.Worker{
//			{Addr: "10.0.0.1:50051", Service: monitor.ServiceVLLM, Model: "llama"},
//			{Addr: "10.0.0.2:50051", Service: monitor.ServiceVLLM, Model: "llama"},
//		},
//		Index:      index.Options{TTL: 30 * time.Minute},
//		Registerer: reg,
//	})
//	if err != nil {
//		return err
//	}
//	go gw.Run(ctx) // one subscription per worker, index pruning
//
//	// per request:
//	d, err := gw.Route(gateway.RouteRequest{Model: "llama", TokenIDs: promptTokens, Track: true})
//	if err != nil {
//		return err // ErrUnknownModel, ErrNoWorkers
//	}
//	defer d.Done()         // the worker's in-flight count drops when the request ends
//	forward(req, d.Worker) // d.Reason: event_hit, placement_hit, event_spill, no_overlap or kv_pressure
//
// Route answers from the index, the gateway's placements and the load it
// knows (load.go). A placement is a request's blocks recorded on the worker
// it was routed to, until the engine reports them stored (package
// placement): a burst of requests sharing a new prefix goes where the first
// went, and while a model's index is empty (engines without events, before
// the first event, after a resync) routing still follows prefix affinity
// from the gateway's own decisions, SMG's approximate mode. Requests with
// no affinity anywhere are no_overlap and go to the least loaded worker.
//
// Workers can also come and go at run time (AddWorker, DrainWorker,
// RemoveWorker; package membership drives them from its sources); a
// removed worker's blocks leave its model's index before RemoveWorker
// returns.
package gateway

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrelay/kvrelay/gateway/index"
	"github.com/kvrelay/kvrelay/gateway/monitor"
	"github.com/kvrelay/kvrelay/gateway/picker"
	"github.com/kvrelay/kvrelay/gateway/placement"
	"github.com/kvrelay/kvrelay/internal/logthrottle"
)

// DefaultModel is the model of a worker or request that names none.
const DefaultModel = "default"

// Worker is one engine the gateway routes to and subscribes to. Its ID (the
// address when empty) is the name Route answers with.
type Worker = monitor.Worker

// Config configures a Gateway.
type Config struct {
	Workers []Worker
	// Monitor tunes the subscriptions; its Registerer, Logger, OnLoad and
	// OnBlockSize are set by the gateway.
	Monitor monitor.Options
	// Index is the options every model's index is built with.
	Index index.Options
	// Picker tunes the choice (spill gate, temperature, overlap decay,
	// KV-pressure thresholds).
	Picker picker.Config
	// InflightTimeout ends a tracked request nobody completed; 0 =
	// DefaultInflightTimeout.
	InflightTimeout time.Duration
	// ReportedLoadTTL is how long a client-reported in-flight count
	// (ReportLoads, POST /v1/load) counts without being reported again;
	// then it is dropped: unknown, not zero, so the worker's count is its
	// tracked requests alone. 0 = DefaultReportedLoadTTL.
	ReportedLoadTTL time.Duration
	// Placements tunes the blocks the gateway records on the worker it
	// routed a request to, before the engine reports them (package
	// placement); zero values take its defaults.
	Placements placement.Options
	// NoPlacements turns placements off: routing then knows only what the
	// engines reported.
	NoPlacements bool
	// LoadPollInterval is how often a worker whose stream pushes no load
	// records is asked with GetLoads (0: DefaultLoadPollInterval; floored
	// at MinLoadPollInterval; negative: never).
	LoadPollInterval time.Duration
	// Partitions > 1 makes this replica one of a partitioned tier's
	// (partition.go): it subscribes only to the workers PartitionOf
	// assigns to Partition (0..Partitions-1) and asks the other partitions
	// for the rest through the Scatterer set with SetScatterer. 0 or 1:
	// unpartitioned, every worker subscribed.
	Partitions, Partition int
	// Registerer receives all kvrelay_gateway_* metrics; nil = unregistered.
	Registerer prometheus.Registerer
	Logger     *slog.Logger
}

// RouteRequest is a request to place.
type RouteRequest struct {
	Model    string
	TokenIDs []uint32
	// Text is the prompt of a request without token ids (TokenIDs empty):
	// it is cut into TextBlockBytes pseudo-blocks that only the
	// placements know (the engines' events carry tokens), so such
	// requests get prefix affinity among themselves, from the gateway's
	// own decisions, and never from the engines' caches.
	Text string
	// LoraName and CacheSalt select the cache namespace the engine hashed
	// the request's blocks under.
	LoraName  string
	CacheSalt string
	// Loads, if set, are in-flight reports (worker → requests) recorded
	// before the choice, as ReportLoads would; an unknown worker fails the
	// request with ErrUnknownWorker.
	Loads map[string]int
	// Track counts the request in its worker's in-flight load until
	// Decision.Done or Complete(Decision.RequestID) is called, or
	// Config.InflightTimeout passes.
	Track bool
}

// Decision is where a request goes and why.
type Decision struct {
	Worker string
	Model  string
	// Reason is event_hit, placement_hit, event_spill, no_overlap or
	// kv_pressure.
	Reason picker.Reason
	// MatchedBlocks holds each worker's leading blocks of the request that
	// its cache holds or, by the gateway's placements, is about to hold
	// (weighted by the placement weight; workers with none are absent).
	MatchedBlocks map[string]int
	// BlockSize is the block size the request was cut with; RequestBlocks
	// the number of full blocks.
	BlockSize     int
	RequestBlocks int
	// RequestID names a tracked request (RouteRequest.Track) for Complete;
	// 0 when untracked.
	RequestID uint64
	// Done completes a tracked request; calling it again, or on an
	// untracked decision, does nothing. Never nil.
	Done func()
}

// WorkerStatus is a worker's stream state plus what routing knows of it.
type WorkerStatus struct {
	monitor.WorkerStatus
	// Inflight is the in-flight count the picker uses: the larger of
	// Reported and Routed+PeerRouted.
	Inflight int `json:"inflight"`
	// Reported is the last count a client reported (within
	// Config.ReportedLoadTTL; 0 when none); Routed the tracked
	// requests routed to the worker and not completed, by this replica;
	// PeerRouted those of the other replicas sharing load over NATS.
	Reported   int `json:"reported_inflight"`
	Routed     int `json:"routed_inflight"`
	PeerRouted int `json:"peer_routed_inflight,omitempty"`
	// IndexBlocks is the number of engine blocks the index holds for it.
	IndexBlocks int `json:"index_blocks"`
	// EngineLoad is the latest load record of any rank; EngineRanks the
	// latest of each, by rank.
	EngineLoad  *EngineLoad  `json:"engine_load,omitempty"`
	EngineRanks []EngineLoad `json:"engine_ranks,omitempty"`
	// Draining: no new request goes to it (DrainWorker).
	Draining bool `json:"draining,omitempty"`
	// Partition is, in a partitioned tier, the partition applying the
	// worker's events when it is not this replica's (State StateRemote).
	Partition *int `json:"partition,omitempty"`
}

// StateRemote is the state of a worker whose events another partition of
// the tier applies.
const StateRemote monitor.State = "remote"

// Errors Route and ReportLoad return.
var (
	ErrUnknownModel  = errors.New("unknown model")
	ErrNoWorkers     = errors.New("no workers for the model")
	ErrUnknownWorker = errors.New("unknown worker")
	// ErrUnknownRequest: Complete was given an id that is not in flight.
	ErrUnknownRequest = errors.New("unknown or completed request")
)

// model is one model's index and workers.
type model struct {
	name    string
	ix      *index.Index
	workers map[string]bool
	list    []string // workers, sorted; rebuilt on change so Route copies a slice
	// fleet holds the workers' in-flight counts for the picker, updated
	// whenever one changes, so a route does not walk every worker.
	fleet *picker.Fleet
	// reachable counts the workers of list neither draining nor down, as
	// of the last sync of the fleet (under g.mu); a flip another
	// partition's answer makes moves it by one (partition.go).
	reachable int
	places    *placement.Store // nil when placements are off
	started   bool             // its index's Run is going
	// learnedBlock is the largest block size learned for the model, from
	// this replica's workers or (partitioned) another partition's answer.
	// It is written under blockMu together with the index's block size, so
	// that two learners cannot leave the index at the smaller one.
	blockMu      sync.Mutex
	learnedBlock atomic.Int64
	// parts counts the model's workers per partition (partitioned only;
	// under g.mu): a block size is adopted only from a partition that owns
	// one of them.
	parts map[int]int
}

func (m *model) relist() {
	m.list = m.list[:0:0]
	for w := range m.workers {
		m.list = append(m.list, w)
	}
	sort.Strings(m.list)
}

// Gateway routes requests by cached prefix. Its methods are safe for
// concurrent use.
type Gateway struct {
	cfg     Config
	log     *slog.Logger
	peerLog *slog.Logger // log, throttled: lines a peer's answers can drive
	mon     *monitor.Monitor
	picker  *picker.Picker
	metrics *gatewayMetrics

	mu       sync.Mutex
	models   map[string]*model
	workerOf map[string]string // worker ID → model
	inflight map[string]int    // reported by clients
	// reportedAt is when each count of inflight was reported; a count
	// older than ReportedLoadTTL is dropped (expireReported).
	reportedAt map[string]time.Time
	routed     map[string]int // tracked and not completed
	// routedVersion changes with every change of routed (RoutedCounts).
	routedVersion uint64
	routedSignal  chan struct{} // RoutedChanged
	// peerRouted is the other replicas' tracked requests (SetPeerRouted).
	peerRouted map[string]int
	pending    map[uint64]tracked
	nextID     uint64
	engine     map[string]map[int32]EngineLoad // worker → rank → last record
	lastRank   map[string]int32                // worker → rank of its latest record
	lastPush   map[string]time.Time            // worker → when its stream last pushed a record
	runCtx     context.Context
	wg         sync.WaitGroup
	// publisher shares placements with other replicas; nil = none.
	publisher atomic.Pointer[PlacementPublisher]
	// now is the clock load records are stamped and aged with, and tracked
	// requests expired by; tests replace it.
	now func() time.Time
	// unreachable holds the workers whose last subscribe attempt failed
	// (in backoff until a stream opens again). Its own lock: the monitor
	// reports states from its goroutines, some while g.mu is held.
	reachMu     sync.Mutex
	unreachable map[string]bool
	reachDirty  atomic.Bool // unreachable changed since the fleets last followed it
	// draining holds the draining workers (drain.go), each with the
	// channel closed when its tracked requests are all done.
	draining map[string]chan struct{}
	// Partitioned (partition.go): scatter asks the other partitions;
	// remote holds the workers whose events another partition applies
	// (not in the monitor); remoteDown, under reachMu, the workers each
	// partition last reported unreachable, per model.
	scatter    atomic.Pointer[Scatterer]
	remote     map[string]Worker
	remoteDown map[remoteKey]map[string]bool
	// partOf caches each worker's PartitionOf (merges check every
	// answered overlap against it); under g.mu.
	partOf map[string]int
}

// New builds a Gateway with cfg's workers; nothing connects until Run.
func New(cfg Config) (*Gateway, error) {
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	if cfg.InflightTimeout < 0 {
		return nil, fmt.Errorf("gateway: in-flight timeout must be ≥ 0, got %v", cfg.InflightTimeout)
	}
	if cfg.InflightTimeout == 0 {
		cfg.InflightTimeout = DefaultInflightTimeout
	}
	if cfg.ReportedLoadTTL < 0 {
		return nil, fmt.Errorf("gateway: reported load TTL must be ≥ 0, got %v", cfg.ReportedLoadTTL)
	}
	if cfg.ReportedLoadTTL == 0 {
		cfg.ReportedLoadTTL = DefaultReportedLoadTTL
	}
	if err := checkPartitions(cfg.Partitions, cfg.Partition); err != nil {
		return nil, err
	}
	p, err := picker.New(cfg.Picker)
	if err != nil {
		return nil, fmt.Errorf("gateway: %w", err)
	}
	if !cfg.NoPlacements {
		// Validate once here, so AddWorker cannot fail on them later.
		if _, err := placement.New(cfg.Placements); err != nil {
			return nil, fmt.Errorf("gateway: %w", err)
		}
	}
	g := &Gateway{
		cfg:          cfg,
		log:          cfg.Logger,
		peerLog:      logthrottle.Wrap(cfg.Logger),
		picker:       p,
		models:       map[string]*model{},
		workerOf:     map[string]string{},
		inflight:     map[string]int{},
		reportedAt:   map[string]time.Time{},
		routed:       map[string]int{},
		routedSignal: make(chan struct{}, 1),
		pending:      map[uint64]tracked{},
		engine:       map[string]map[int32]EngineLoad{},
		lastRank:     map[string]int32{},
		lastPush:     map[string]time.Time{},
		now:          time.Now,
		unreachable:  map[string]bool{},
		draining:     map[string]chan struct{}{},
		remote:       map[string]Worker{},
		remoteDown:   map[remoteKey]map[string]bool{},
		partOf:       map[string]int{},
	}
	mopts := cfg.Monitor
	mopts.Registerer = cfg.Registerer
	mopts.Logger = cfg.Logger.With("component", "monitor")
	mopts.OnLoad = g.onEngineLoad
	mopts.OnBlockSize = g.onBlockSize
	mopts.OnState = g.onState
	if pollInterval(cfg.LoadPollInterval) > 0 {
		mopts.PollLoads = g.pollLoads
	}
	if g.mon, err = monitor.New(mopts); err != nil {
		return nil, fmt.Errorf("gateway: %w", err)
	}
	if g.metrics, err = newGatewayMetrics(cfg.Registerer, g); err != nil {
		return nil, fmt.Errorf("gateway: %w", err)
	}
	for _, w := range cfg.Workers {
		if err := g.AddWorker(w); err != nil {
			return nil, err
		}
	}
	return g, nil
}

// AddWorker starts routing to w and, during Run, subscribing to it.
func (g *Gateway) AddWorker(w Worker) error {
	if w.Model == "" {
		w.Model = DefaultModel
	}
	if w.ID == "" {
		w.ID = w.Addr
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	if _, dup := g.workerOf[w.ID]; dup {
		return fmt.Errorf("gateway: worker %s: %w", w.ID, monitor.ErrDuplicateWorker)
	}
	m := g.models[w.Model]
	fresh := m == nil
	if fresh {
		opts := g.cfg.Index
		if opts.Logger == nil {
			opts.Logger = g.log.With("component", "index", "model", w.Model)
		}
		m = &model{name: w.Model, ix: index.New(opts), workers: map[string]bool{}, fleet: picker.NewFleet()}
		if !g.cfg.NoPlacements {
			m.places, _ = placement.New(g.cfg.Placements) // validated by New
		}
	}
	part := PartitionOf(w.ID, g.cfg.Partitions)
	if part == g.cfg.Partition {
		if err := g.mon.Add(w, m.ix); err != nil {
			return fmt.Errorf("gateway: %w", err)
		}
	} else {
		// Another partition applies its events; it is routed all the same,
		// and refused as its partition's replicas refuse it.
		checked, err := monitor.CheckWorker(w)
		if err != nil {
			return fmt.Errorf("gateway: %w", err)
		}
		g.remote[w.ID] = checked
	}
	if fresh {
		g.models[w.Model] = m
		if g.runCtx != nil {
			g.startIndex(m)
		}
	}
	m.workers[w.ID] = true
	// Inserted in place rather than m.relist(): a sort per worker made
	// New with 10,000 workers take seconds (quadratic).
	i, _ := slices.BinarySearch(m.list, w.ID)
	m.list = slices.Insert(m.list, i, w.ID)
	m.fleet.Add(w.ID)
	g.reachDirty.Store(true) // a worker that is alone reachable takes over from unreachable ones
	g.workerOf[w.ID] = w.Model
	if g.partitioned() {
		g.partOf[w.ID] = part
		if m.parts == nil {
			m.parts = map[int]int{}
		}
		m.parts[part]++
	}
	return nil
}

// RemoveWorker stops subscribing to the worker and routing to it; its blocks
// leave the index before it returns.
func (g *Gateway) RemoveWorker(id string) error {
	g.mu.Lock()
	name, ok := g.workerOf[id]
	if !ok {
		g.mu.Unlock()
		return fmt.Errorf("gateway: %s: %w", id, ErrUnknownWorker)
	}
	m := g.models[name]
	delete(m.workers, id)
	m.relist()
	m.fleet.Remove(id)
	g.reachDirty.Store(true) // the last reachable worker gone: the others come back
	delete(g.workerOf, id)
	delete(g.inflight, id)
	delete(g.reportedAt, id)
	delete(g.peerRouted, id)
	delete(g.engine, id)
	delete(g.lastPush, id)
	delete(g.lastRank, id)
	for rid, t := range g.pending {
		if t.worker == id {
			g.untrackLocked(rid)
		}
	}
	g.endDrainLocked(id)
	_, remote := g.remote[id]
	delete(g.remote, id)
	if part, ok := g.partOf[id]; ok {
		if m.parts[part]--; m.parts[part] <= 0 {
			delete(m.parts, part)
		}
		// Forget that its partition called it unreachable: added again, it
		// starts reachable, as an own worker does.
		g.reachMu.Lock()
		key := remoteKey{partition: part, model: name}
		if down := g.remoteDown[key]; down[id] {
			delete(down, id)
			if len(down) == 0 {
				delete(g.remoteDown, key)
			}
		}
		g.reachMu.Unlock()
	}
	delete(g.partOf, id)
	g.mu.Unlock()
	if !remote {
		if err := g.mon.Remove(id); err != nil {
			return fmt.Errorf("gateway: %w", err)
		}
	}
	m.ix.RemoveWorker(id)
	if m.places != nil {
		m.places.RemoveWorker(id)
	}
	g.publishRemoval(name, id)
	return nil
}

// startIndex runs a model's pruning; g.mu is held.
func (g *Gateway) startIndex(m *model) {
	if m.started {
		return
	}
	m.started = true
	g.wg.Add(1)
	go func() {
		defer g.wg.Done()
		m.ix.Run(g.runCtx)
	}()
}

// Run subscribes to every worker and prunes the indexes until ctx ends, then
// waits for all of it to stop.
func (g *Gateway) Run(ctx context.Context) error {
	g.mu.Lock()
	if g.runCtx != nil {
		g.mu.Unlock()
		return errors.New("gateway: Run called twice")
	}
	g.runCtx = ctx
	for _, m := range g.models {
		g.startIndex(m)
	}
	g.wg.Add(1)
	go func() {
		defer g.wg.Done()
		g.runExpiry(ctx)
	}()
	if !g.cfg.NoPlacements {
		g.wg.Add(1)
		go func() {
			defer g.wg.Done()
			g.runPlacementSweep(ctx)
		}()
	}
	g.mu.Unlock()
	err := g.mon.Run(ctx)
	g.wg.Wait()
	return err
}

// Route picks the worker for req. The prefix lookup runs outside the
// gateway's lock; the choice reads the model's Fleet under it, and a
// tracked request is counted in the same step, so a burst of concurrent
// tracked routes sees each other's load (as SMG selects and credits
// atomically). Apart from the lookup, a route costs O(candidates + log
// workers); with a knob that reads the engines' load records (overlap decay,
// KV-pressure thresholds) it also gathers those, one per worker.
func (g *Gateway) Route(req RouteRequest) (Decision, error) {
	start := time.Now()
	name := req.Model
	if name == "" {
		name = DefaultModel
	}
	g.mu.Lock()
	if err := g.reportLoadsLocked(req.Loads); err != nil {
		g.mu.Unlock()
		return Decision{}, err
	}
	if g.reachDirty.Swap(false) {
		g.syncFleetsLocked()
	}
	m := g.models[name]
	empty := m != nil && m.fleet.Len() == 0
	g.mu.Unlock()
	if m == nil {
		return Decision{}, fmt.Errorf("%w: %q", ErrUnknownModel, name)
	}
	if empty {
		return Decision{}, fmt.Errorf("%w: %q", ErrNoWorkers, name)
	}

	blockSize := m.ix.BlockSize()
	ns := index.Namespace{LoraName: req.LoraName, CacheSalt: req.CacheSalt}
	var prefix []uint64
	// The lookup writes into a pooled result, so that it allocates nothing;
	// nothing of it outlives this call (the picker copies the overlaps it
	// answers with).
	matches := getMatches()
	defer putMatches(matches)
	var remote scattered // partitioned: the other partitions' answers
	switch {
	case len(req.TokenIDs) == 0 && req.Text != "" && m.places != nil:
		if g.partitioned() {
			// The index has nothing to say about text, but the other
			// partitions' answers carry what a full replica learns from
			// their workers' streams: engine signals and reachability. A
			// query with no hashes asks for only those.
			remote = g.partitionLookup(m, PartitionQuery{Model: name, Loads: g.picker.UsesEngineLoad()}, matches)
			g.adoptBlockSize(m, remote)
		}
		prefix = textPrefixHashes(req.Text, ns)
		matches.RequestBlocks = len(prefix)
		blockSize = TextBlockBytes
	case g.partitioned():
		q := PartitionQuery{Model: name, Loads: g.picker.UsesEngineLoad()}
		q.Prefix = index.PrefixHashes(req.TokenIDs, blockSize, ns)
		remote = g.partitionLookup(m, q, matches)
		// Another partition's workers revealed a larger block size than
		// this replica knew (its own workers silent, or none of the model):
		// a full replica would have hashed with it; so, once, does this.
		if g.adoptBlockSize(m, remote) {
			blockSize = m.ix.BlockSize()
			q.Prefix = index.PrefixHashes(req.TokenIDs, blockSize, ns)
			remote = g.partitionLookup(m, q, matches)
		}
		prefix = q.Prefix
	case m.places != nil:
		// The placements are keyed by the same prefix hashes, so the
		// request is hashed once, in full, for both.
		prefix = index.PrefixHashes(req.TokenIDs, blockSize, ns)
		m.ix.FindMatchesHashesInto(matches, prefix)
	default:
		m.ix.FindMatchesInto(matches, req.TokenIDs, ns)
	}
	out := Decision{Model: name, BlockSize: blockSize, RequestBlocks: matches.RequestBlocks, Done: func() {}}
	// The picker weighs the index's overlaps extended by the placements,
	// and the request's blocks are placed on the chosen worker, under g.mu
	// like the in-flight counts: a burst of concurrent requests with a new
	// prefix sees the first one's placement as it sees its load.
	var inferred map[string]int
	newFrom := len(prefix) // the first block placed anew: none yet
	g.mu.Lock()
	var engine map[string]picker.EngineSignal
	if g.picker.UsesEngineLoad() {
		engine = g.engineSignalsLocked(m.list, g.now())
	}
	engine = remote.applyLocked(g, m, engine, g.picker.UsesEngineLoad())
	combined := *matches
	if m.places != nil {
		r := m.places.Extend(prefix, *matches, g.now())
		combined, inferred = r.Matches, r.Inferred
	}
	d, err := g.picker.PickFleet(m.fleet, picker.Request{BlockSize: blockSize, Engine: engine}, combined)
	inflight := m.fleet.Load(d.Worker)
	if err == nil && m.places != nil {
		// Every block past the index's overlap is placed (again: a hot
		// prefix stays), but only those not placed before are news to the
		// other replicas.
		m.places.Record(d.Worker, prefix, matches.Blocks(d.Worker), g.now())
		newFrom = matches.Blocks(d.Worker) + inferred[d.Worker]
		if d.Reason == picker.ReasonHit && inferred[d.Worker] > 0 {
			d.Reason = picker.ReasonPlacementHit
		}
	}
	// d.Worker is a member of the fleet read under this lock, so it is
	// still a worker of the model.
	if err == nil && req.Track {
		id := g.trackLocked(d.Worker, g.now())
		out.RequestID = id
		out.Done = func() { _ = g.Complete(id) }
	}
	g.mu.Unlock()
	if errors.Is(err, picker.ErrNoWorkers) {
		return Decision{}, fmt.Errorf("%w: %q", ErrNoWorkers, name)
	}
	if err != nil {
		return Decision{}, fmt.Errorf("gateway: %w", err)
	}
	out.Worker, out.Reason, out.MatchedBlocks = d.Worker, d.Reason, d.Matched
	if newFrom < len(prefix) {
		g.publishPlacement(name, d.Worker, prefix[newFrom:])
	}
	g.metrics.routes.WithLabelValues(name, string(d.Reason)).Inc()
	g.metrics.routeSeconds.Observe(time.Since(start).Seconds())
	g.logDecision(name, d, inferred[d.Worker], inflight, engine)
	return out, nil
}

// matchesPool holds the lookup results Route reuses, one per route in
// flight.
var matchesPool = sync.Pool{New: func() any { return new(index.Matches) }}

// maxPooledMatches bounds the overlaps a pooled result keeps room for, so
// that one lookup over a huge fleet does not pin its array.
const maxPooledMatches = 1 << 14

func getMatches() *index.Matches { return matchesPool.Get().(*index.Matches) }

func putMatches(m *index.Matches) {
	if cap(m.Workers) > maxPooledMatches {
		m.Workers = nil
	}
	// Emptied, so that a pooled result keeps no worker names reachable.
	clear(m.Workers)
	*m = index.Matches{Workers: m.Workers[:0]}
	matchesPool.Put(m)
}

// logDecision writes SMG's per-decision debug line: the branch and what
// decided it.
func (g *Gateway) logDecision(model string, d picker.Decision, inferred, inflight int, engine map[string]picker.EngineSignal) {
	if !g.log.Enabled(context.Background(), slog.LevelDebug) {
		return
	}
	attrs := []slog.Attr{
		slog.String("model", model),
		slog.String("worker", d.Worker),
		slog.String("branch", string(d.Reason)),
		slog.Int("matched_blocks", d.Blocks),
		slog.Int("inferred_blocks", inferred),
		slog.Int("best_blocks", d.Best),
		slog.Int("request_blocks", d.RequestBlocks),
		slog.Int("candidates", len(d.Matched)),
		slog.Float64("score", d.Score),
		slog.Int("inflight", inflight),
		slog.Float64("mean_inflight", d.MeanLoad),
	}
	if s, ok := engine[d.Worker]; ok {
		if s.HasBacklog {
			attrs = append(attrs, slog.Int("waiting_prefill_tokens", s.Backlog))
		}
		if s.HasTokenUsage {
			attrs = append(attrs, slog.Float64("token_usage", s.TokenUsage))
		}
	}
	if d.Reason == picker.ReasonKVPressure {
		attrs = append(attrs, slog.Float64("hottest_token_usage", d.HottestUsage), slog.Float64("coolest_token_usage", d.CoolestUsage))
	}
	g.log.LogAttrs(context.Background(), slog.LevelDebug, "route decision", attrs...)
}

// ReportLoad records the worker's in-flight requests (negative counts as 0).
func (g *Gateway) ReportLoad(worker string, inflight int) error {
	return g.ReportLoads(map[string]int{worker: inflight})
}

// ReportLoads records several workers' in-flight requests at once: all of
// them, or none if one names an unknown worker.
func (g *Gateway) ReportLoads(loads map[string]int) error {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.reportLoadsLocked(loads)
}

func (g *Gateway) reportLoadsLocked(loads map[string]int) error {
	for w := range loads {
		if _, ok := g.workerOf[w]; !ok {
			return fmt.Errorf("%w: %q", ErrUnknownWorker, w)
		}
	}
	now := g.now()
	for w, n := range loads {
		g.inflight[w] = max(n, 0)
		g.reportedAt[w] = now
		g.syncFleetLocked(w)
	}
	return nil
}

// Workers reports every worker, sorted by ID.
func (g *Gateway) Workers() []WorkerStatus {
	sts := g.mon.Workers()
	g.mu.Lock()
	stats := make(map[string]index.Stats, len(g.models))
	for name, m := range g.models {
		stats[name] = m.ix.Stats()
	}
	out := make([]WorkerStatus, 0, len(sts))
	for _, st := range sts {
		ws := WorkerStatus{
			WorkerStatus: st, Inflight: g.inflightLocked(st.ID),
			Reported: g.inflight[st.ID], Routed: g.routed[st.ID], PeerRouted: g.peerRouted[st.ID],
		}
		_, ws.Draining = g.draining[st.ID]
		ws.IndexBlocks = stats[st.Model].Workers[st.ID].Blocks
		if ranks := g.engine[st.ID]; len(ranks) > 0 {
			now := g.now()
			l := ranks[g.lastRank[st.ID]]
			l.AgeMs = now.Sub(l.At).Milliseconds()
			ws.EngineLoad = &l
			for _, r := range ranks {
				r.AgeMs = now.Sub(r.At).Milliseconds()
				ws.EngineRanks = append(ws.EngineRanks, r)
			}
			sort.Slice(ws.EngineRanks, func(i, j int) bool { return ws.EngineRanks[i].Rank < ws.EngineRanks[j].Rank })
		}
		out = append(out, ws)
	}
	for _, w := range g.remote {
		// Another partition applies its events: its stream state, index
		// blocks and engine load are on that partition's replicas.
		p := g.partOf[w.ID]
		out = append(out, WorkerStatus{
			WorkerStatus: monitor.WorkerStatus{ID: w.ID, Addr: w.Addr, Service: w.Service, Model: w.Model, State: StateRemote},
			Inflight:     g.inflightLocked(w.ID), Reported: g.inflight[w.ID], Routed: g.routed[w.ID], PeerRouted: g.peerRouted[w.ID],
			Partition: &p,
		})
		_, out[len(out)-1].Draining = g.draining[w.ID]
	}
	g.mu.Unlock()
	if g.partitioned() {
		sort.Slice(out, func(i, j int) bool { return out[i].ID < out[j].ID })
	}
	return out
}

// Models lists the models the gateway routes, sorted.
func (g *Gateway) Models() []string {
	g.mu.Lock()
	defer g.mu.Unlock()
	out := make([]string, 0, len(g.models))
	for name := range g.models {
		out = append(out, name)
	}
	sort.Strings(out)
	return out
}

// onState tracks which workers are unreachable: a failed subscribe puts the
// stream in backoff, and a worker whose relay cannot be reached is likely
// down for inference too. Connecting leaves the mark as it is (a retry has
// not succeeded yet); streaming clears it; a worker whose events are off
// (disabled) may serve requests all the same, so it is not marked.
func (g *Gateway) onState(worker string, st monitor.State) {
	g.reachMu.Lock()
	defer g.reachMu.Unlock()
	was := g.unreachable[worker]
	switch st {
	case monitor.StateBackoff:
		g.unreachable[worker] = true
	case monitor.StateStreaming, monitor.StateDisabled, monitor.StateStopped:
		delete(g.unreachable, worker)
	}
	if g.unreachable[worker] != was {
		// The fleets follow at the next Route, under g.mu, which this
		// callback may not take.
		g.reachDirty.Store(true)
	}
}

// syncFleetsLocked makes each model's fleet (what the picker chooses from)
// hold its reachable workers, or all of them when none is reachable:
// routing by cache then still beats refusing the request. A draining
// worker is never in it. A worker put back
// takes its current in-flight count with it.
func (g *Gateway) syncFleetsLocked() {
	g.metrics.fleetSyncsAll.Inc()
	g.reachMu.Lock()
	defer g.reachMu.Unlock()
	for _, m := range g.models {
		g.syncModelLocked(m)
	}
}

// syncModelLocked is syncFleetsLocked for one model; g.mu and g.reachMu
// are held.
func (g *Gateway) syncModelLocked(m *model) {
	m.reachable = 0
	for _, w := range m.list {
		if _, drained := g.draining[w]; !drained && !g.downLocked(m.name, w) {
			m.reachable++
		}
	}
	for _, w := range m.list {
		g.placeLocked(m, w)
	}
}

// downLocked reports whether w, of model, is unreachable, from this
// replica or (partitioned) by its partition's last answer; g.mu and
// g.reachMu are held.
func (g *Gateway) downLocked(model, w string) bool {
	return g.unreachable[w] || g.remoteUnreachableLocked(model, w)
}

// placeLocked puts w in m's fleet or takes it out, as m.reachable and its
// own state say; g.mu and g.reachMu are held.
func (g *Gateway) placeLocked(m *model, w string) {
	_, drained := g.draining[w]
	in := !drained && (m.reachable == 0 || !g.downLocked(m.name, w))
	switch {
	case in && !m.fleet.Has(w):
		m.fleet.Add(w)
		m.fleet.Set(w, g.inflightLocked(w))
	case !in && m.fleet.Has(w):
		m.fleet.Remove(w)
	}
}

func (g *Gateway) onBlockSize(name string, n int) {
	g.mu.Lock()
	m := g.models[name]
	g.mu.Unlock()
	if m != nil {
		g.learnBlockSize(m, n)
	}
}
