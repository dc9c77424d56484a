// Package sim is an inference-engine simulator for KV-cache events: per DP
// rank it runs a real prefix cache (sim/prefixcache) driven by a chat
// workload (sim/workload), and publishes the cache's events exactly as the
// engine's ZmqEventPublisher does — same sockets and bind rules, 3-frame
// live messages, sequences from 0, a replay ROUTER over a buffer_steps ring
// with the engine's reply framing, the engine's msgpack field orders per wire
// generation, and SGLang's startup clear. Fault knobs (drop, restart, pause,
// truncated replay, cache reset) and the cache's true live set make it the
// reference that relay and gateway exactness tests compare against.
package sim

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"sync"
	"time"

	"github.com/kvrelay/kvrelay/engines"
	"github.com/kvrelay/kvrelay/sim/prefixcache"
	"github.com/kvrelay/kvrelay/sim/workload"
)

// Options configures a simulated engine.
type Options struct {
	// Engine is "vllm", "sglang" or "tokenspeed".
	Engine string
	// KVEventsConfig is the engine's --kv-events-config JSON, read with the
	// engine's own defaults and rules; events must be enabled.
	KVEventsConfig string
	// DPSize is the number of data-parallel ranks (default 1).
	DPSize int
	// Wire picks the wire generation; empty means the engine's newest
	// (WireGenerations lists them).
	Wire string
	// BlockSize is tokens per block (default 16).
	BlockSize int
	// CapacityBlocks is each rank's device cache size (default 1024).
	CapacityBlocks int
	// HostCapacityBlocks enables a host tier of that size per rank; the
	// wire generation must have a medium field.
	HostCapacityBlocks int
	// Workload shapes the built-in traffic (Step without requests and
	// RunWorkload); its Seed makes runs reproducible.
	Workload workload.Config
	// RequestsPerStep is how many built-in requests one Step schedules
	// (default 4). Requests of one step are concurrent: under vLLM two of
	// them missing the same block each store a copy.
	RequestsPerStep int
	// DropEvery drops every Nth batch of each rank from the live stream
	// (0: none); see FaultDropEvery.
	DropEvery int
	// ControlAddr, when set, serves the control endpoint there (":0" picks
	// a port; see ControlAddr).
	ControlAddr string
	// Clock stamps batches (default time.Now); a fixed clock makes the
	// payload bytes reproducible too. It also runs the simulated scheduler
	// whose load the engine exports (load.go).
	Clock func() time.Time
	// Load shapes that scheduler; ModelName labels its series (default
	// "sim").
	Load      LoadModel
	ModelName string
	// Logger receives the simulator's and ZeroMQ's logs (default: discard).
	Logger *slog.Logger
}

// Request is one prompt sent to one rank.
type Request struct {
	Rank   int
	Tokens []uint32
}

// StepResult reports one step.
type StepResult struct {
	// Results has one entry per request, in order.
	Results []prefixcache.Result
	// Batches is how many ranks produced a batch this step.
	Batches int
}

// Stats accumulates what the cache did for the requests it served.
type Stats struct {
	Requests   int `json:"requests"`
	Blocks     int `json:"blocks"`      // full prompt blocks requested
	DeviceHits int `json:"device_hits"` // blocks served from the device prefix cache
	HostHits   int `json:"host_hits"`   // blocks reloaded from the host tier
}

// HitRate is DeviceHits / Blocks.
func (s Stats) HitRate() float64 {
	if s.Blocks == 0 {
		return 0
	}
	return float64(s.DeviceHits) / float64(s.Blocks)
}

func (s *Stats) add(r prefixcache.Result) {
	s.Requests++
	s.Blocks += r.TotalBlocks
	s.DeviceHits += r.DeviceHits
	s.HostHits += r.HostHits
}

// RankEndpoints is where a subscriber on this host reaches one rank.
type RankEndpoints struct {
	Rank int
	// Live is the PUB's connect endpoint.
	Live string
	// Replay is the ROUTER's connect endpoint; empty without replay.
	Replay string
}

// Engine is a running simulated engine. Its methods are safe for concurrent
// use.
type Engine struct {
	prof  *profile
	wire  *wireFormat
	cfg   engines.Config
	opts  Options
	log   *slog.Logger
	clock func() time.Time

	mu     sync.Mutex // serializes steps and faults; guards caches, gen, stats
	caches []*prefixcache.Cache
	gen    *workload.Generator
	stats  Stats
	ranks  []*rankPublisher
	// loads is each rank's simulated scheduler (load.go), under its own
	// lock (taken inside mu, never around it) so that a load read does not
	// wait for a long step.
	loadMu    sync.Mutex
	loads     []*rankLoad
	loadModel LoadModel
	closed    bool

	stopAfter func() bool
	ctlLn     net.Listener
	ctlSrv    *http.Server
	ctlDone   chan struct{}
}

// Start validates opts, binds every rank's sockets and, for SGLang, publishes
// the startup clear. The engine stops when ctx is cancelled or Close is
// called.
func Start(ctx context.Context, opts Options) (*Engine, error) {
	prof, ok := profiles[opts.Engine]
	if !ok {
		_, err := lookupWire(opts.Engine, "")
		return nil, fmt.Errorf("sim: %w", err)
	}
	wf, err := lookupWire(opts.Engine, opts.Wire)
	if err != nil {
		return nil, fmt.Errorf("sim: %w", err)
	}
	cfg, err := prof.ParseConfig(opts.KVEventsConfig)
	if err != nil {
		return nil, fmt.Errorf("sim: %s kv-events config: %w", opts.Engine, err)
	}
	if !cfg.Enabled {
		return nil, fmt.Errorf("sim: %s kv-events config leaves events disabled (publisher %q)", opts.Engine, cfg.Publisher)
	}
	if opts.DPSize == 0 {
		opts.DPSize = 1
	}
	if opts.BlockSize == 0 {
		opts.BlockSize = 16
	}
	if opts.CapacityBlocks == 0 {
		opts.CapacityBlocks = 1024
	}
	if opts.RequestsPerStep == 0 {
		opts.RequestsPerStep = 4
	}
	if opts.ModelName == "" {
		opts.ModelName = "sim"
	}
	switch {
	case opts.DPSize < 0:
		return nil, fmt.Errorf("sim: dp size %d: must be positive", opts.DPSize)
	case opts.RequestsPerStep < 0:
		return nil, fmt.Errorf("sim: requests per step %d: must be positive", opts.RequestsPerStep)
	case cfg.BufferSteps < 0:
		return nil, fmt.Errorf("sim: buffer_steps %d: must not be negative", cfg.BufferSteps)
	case opts.DropEvery < 0:
		return nil, fmt.Errorf("sim: drop every %d: must not be negative", opts.DropEvery)
	case opts.HostCapacityBlocks > 0 && wf.hostMedium == "":
		return nil, fmt.Errorf("sim: %s wire %s has no medium field, so it cannot report a host tier", opts.Engine, wf.gen)
	}
	gen, err := workload.New(opts.Workload)
	if err != nil {
		return nil, fmt.Errorf("sim: %w", err)
	}
	e := &Engine{prof: prof, wire: wf, cfg: cfg, opts: opts, gen: gen, log: opts.Logger, clock: opts.Clock, loadModel: opts.Load.withDefaults()}
	if e.log == nil {
		e.log = slog.New(slog.DiscardHandler)
	}
	if e.clock == nil {
		e.clock = time.Now
	}
	for r := 0; r < opts.DPSize; r++ {
		c, err := prefixcache.New(prefixcache.Config{
			BlockSize: opts.BlockSize, CapacityBlocks: opts.CapacityBlocks, HostCapacityBlocks: opts.HostCapacityBlocks,
			Hasher: prof.hasher, OneBlockPerEvent: prof.oneBlockPerEvent, SecondCopies: prof.secondCopies,
		})
		if err != nil {
			return nil, fmt.Errorf("sim: %w", err)
		}
		e.caches = append(e.caches, c)
		e.loads = append(e.loads, &rankLoad{})
		p, err := e.newRankPublisher(r)
		if err != nil {
			e.closeRanks()
			return nil, fmt.Errorf("sim: %w", err)
		}
		e.ranks = append(e.ranks, p)
	}
	for _, p := range e.ranks {
		if err := p.open(); err != nil {
			e.closeRanks()
			return nil, fmt.Errorf("sim: %w", err)
		}
	}
	e.mu.Lock()
	for r := range e.ranks {
		if err := e.startupLocked(r); err != nil {
			e.mu.Unlock()
			e.closeRanks()
			return nil, fmt.Errorf("sim: %w", err)
		}
	}
	e.mu.Unlock()
	if opts.ControlAddr != "" {
		if err := e.serveControl(opts.ControlAddr); err != nil {
			e.closeRanks()
			return nil, fmt.Errorf("sim: %w", err)
		}
	}
	e.stopAfter = context.AfterFunc(ctx, func() { e.Close() })
	e.log.Info("simulated engine started", "engine", opts.Engine, "wire", wf.gen, "dp_size", opts.DPSize,
		"endpoint", cfg.Endpoint, "replay_endpoint", cfg.ReplayEndpoint)
	return e, nil
}

func (e *Engine) newRankPublisher(r int) (*rankPublisher, error) {
	p := &rankPublisher{rank: r, topic: []byte(e.cfg.Topic), topicFrame: e.prof.ReplayTopicFrame,
		bufferSteps: e.cfg.BufferSteps, dropEvery: e.opts.DropEvery, truncate: -1,
		log: e.log.With("rank", r)}
	var err error
	if p.liveBind, err = engines.OffsetEndpointPort(e.cfg.Endpoint, r); err != nil {
		return nil, err
	}
	if p.liveConnect, err = engines.ConnectEndpoint(e.cfg.Endpoint, r); err != nil {
		return nil, err
	}
	if e.cfg.ReplayEndpoint != "" {
		if p.replayBind, err = engines.OffsetEndpointPort(e.cfg.ReplayEndpoint, r); err != nil {
			return nil, err
		}
		if p.replayConnect, err = engines.ConnectEndpoint(e.cfg.ReplayEndpoint, r); err != nil {
			return nil, err
		}
	}
	return p, nil
}

// startupLocked publishes what a fresh engine process publishes first:
// SGLang's radix cache reports AllBlocksCleared on construction.
func (e *Engine) startupLocked(rank int) error {
	if !e.prof.StartupClear {
		return nil
	}
	return e.publishLocked(rank, []prefixcache.Event{prefixcache.AllBlocksCleared{}})
}

func (e *Engine) publishLocked(rank int, evs []prefixcache.Event) error {
	ts := float64(e.clock().UnixNano()) / 1e9
	payload, err := e.wire.encodeBatch(ts, evs, rank)
	if err != nil {
		return err
	}
	return e.ranks[rank].publish(payload)
}

// Step runs one scheduler step: the given requests (or, with none, the next
// RequestsPerStep requests of the built-in workload, each routed to rank
// session mod DPSize) go through their ranks' caches, and every rank whose
// cache changed publishes one batch.
func (e *Engine) Step(reqs ...Request) (StepResult, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closed {
		return StepResult{}, errors.New("sim: engine closed")
	}
	if len(reqs) == 0 {
		for i := 0; i < e.opts.RequestsPerStep; i++ {
			w := e.gen.Next()
			reqs = append(reqs, Request{Rank: w.Session % len(e.ranks), Tokens: w.Tokens})
		}
	}
	for _, r := range reqs {
		if r.Rank < 0 || r.Rank >= len(e.ranks) {
			return StepResult{}, fmt.Errorf("sim: request for rank %d, engine has ranks 0..%d", r.Rank, len(e.ranks)-1)
		}
	}
	for _, c := range e.caches {
		c.BeginStep()
	}
	res := StepResult{Results: make([]prefixcache.Result, len(reqs))}
	perRank := make([][]prefixcache.Event, len(e.ranks))
	now := e.clock()
	for i, r := range reqs {
		out, evs := e.caches[r.Rank].Insert(r.Tokens)
		res.Results[i] = out
		e.stats.add(out)
		e.admitLocked(r.Rank, len(r.Tokens), out.DeviceHits*e.opts.BlockSize, now)
		perRank[r.Rank] = append(perRank[r.Rank], evs...)
	}
	for r, evs := range perRank {
		// Engines publish only steps that produced events.
		if len(evs) == 0 {
			continue
		}
		if err := e.publishLocked(r, evs); err != nil {
			return res, fmt.Errorf("sim: %w", err)
		}
		res.Batches++
	}
	return res, nil
}

// RunWorkload serves n built-in requests in steps of RequestsPerStep and
// returns what the caches did for them.
func (e *Engine) RunWorkload(n int) (Stats, error) {
	var s Stats
	for n > 0 {
		k := min(n, e.opts.RequestsPerStep)
		reqs := make([]Request, 0, k)
		e.mu.Lock()
		for i := 0; i < k; i++ {
			w := e.gen.Next()
			reqs = append(reqs, Request{Rank: w.Session % len(e.ranks), Tokens: w.Tokens})
		}
		e.mu.Unlock()
		res, err := e.Step(reqs...)
		if err != nil {
			return s, err
		}
		for _, r := range res.Results {
			s.add(r)
		}
		n -= k
	}
	return s, nil
}

// NextRequest draws the next request from the built-in workload without
// serving it, for callers that route requests themselves (a gateway test).
func (e *Engine) NextRequest() workload.Request {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.gen.Next()
}

// Stats is the cumulative cache outcome of every request served.
func (e *Engine) Stats() Stats {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.stats
}

// RankLive is one rank's true state.
type RankLive struct {
	Rank int
	// NextSeq is the sequence the rank's next published batch will carry.
	NextSeq uint64
	// Blocks is the live set ordered by tier, then hash.
	Blocks []prefixcache.LiveBlock
}

// LiveSet reports every rank's true live set: the blocks its cache holds
// and their physical copy counts. While publishing is paused it includes
// changes not yet published.
func (e *Engine) LiveSet() []RankLive {
	e.mu.Lock()
	defer e.mu.Unlock()
	out := make([]RankLive, len(e.ranks))
	for r, p := range e.ranks {
		p.mu.Lock()
		out[r] = RankLive{Rank: r, NextSeq: p.nextSeq, Blocks: e.caches[r].SortedLiveSet()}
		p.mu.Unlock()
	}
	return out
}

// Endpoints lists each rank's connect endpoints.
func (e *Engine) Endpoints() []RankEndpoints {
	out := make([]RankEndpoints, len(e.ranks))
	for r, p := range e.ranks {
		out[r] = RankEndpoints{Rank: r, Live: p.liveConnect, Replay: p.replayConnect}
	}
	return out
}

// Config is the engine's KV-events configuration as parsed.
func (e *Engine) Config() engines.Config { return e.cfg }

// WireGeneration is the wire generation in use.
func (e *Engine) WireGeneration() string { return e.wire.gen }

// Medium is the wire medium string of tier ("" when the generation has no
// medium field).
func (e *Engine) Medium(t prefixcache.Tier) string { return e.wire.medium(t) }

// ControlAddr is the control endpoint's bound address, or "" without one.
func (e *Engine) ControlAddr() string {
	if e.ctlLn == nil {
		return ""
	}
	return e.ctlLn.Addr().String()
}

func (e *Engine) closeRanks() {
	for _, p := range e.ranks {
		p.close()
	}
}

// Close stops the control endpoint and closes every socket. It is
// idempotent.
func (e *Engine) Close() error {
	e.mu.Lock()
	if e.closed {
		e.mu.Unlock()
		return nil
	}
	e.closed = true
	e.mu.Unlock()
	if e.stopAfter != nil {
		e.stopAfter()
	}
	var err error
	if e.ctlSrv != nil {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		err = e.ctlSrv.Shutdown(ctx)
		cancel()
		<-e.ctlDone
	}
	e.closeRanks()
	return err
}

// ranksFor resolves a fault's rank selector.
func (e *Engine) ranksFor(rank *int) ([]int, error) {
	if rank == nil {
		out := make([]int, len(e.ranks))
		for i := range out {
			out[i] = i
		}
		return out, nil
	}
	if *rank < 0 || *rank >= len(e.ranks) {
		return nil, fmt.Errorf("rank %d: engine has ranks 0..%d", *rank, len(e.ranks)-1)
	}
	return []int{*rank}, nil
}

// Run serves the built-in workload at rate requests per second in steps of
// stepInterval until ctx ends (then it returns nil) or a step fails.
// Fractional requests carry over, so any rate is met on average while each
// step stays whole; the requests due in one interval share a step. A rate of
// 0 only waits, leaving the engine to Step callers and the control endpoint.
// Progress is logged every logEvery (0: never).
func (e *Engine) Run(ctx context.Context, rate float64, stepInterval, logEvery time.Duration) error {
	if rate < 0 || stepInterval <= 0 {
		return fmt.Errorf("sim: run: rate %v and step interval %v must be ≥ 0 and > 0", rate, stepInterval)
	}
	tick := time.NewTicker(stepInterval)
	defer tick.Stop()
	var report <-chan time.Time
	if logEvery > 0 {
		t := time.NewTicker(logEvery)
		defer t.Stop()
		report = t.C
	}
	credit := 0.0
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-report:
			s := e.Stats()
			e.log.Info("progress", "requests", s.Requests, "hit_rate", fmt.Sprintf("%.3f", s.HitRate()))
		case <-tick.C:
			credit += rate * stepInterval.Seconds()
			n := int(credit)
			if n == 0 {
				continue
			}
			credit -= float64(n)
			e.mu.Lock()
			reqs := make([]Request, 0, n)
			for i := 0; i < n; i++ {
				w := e.gen.Next()
				reqs = append(reqs, Request{Rank: w.Session % len(e.ranks), Tokens: w.Tokens})
			}
			e.mu.Unlock()
			if _, err := e.Step(reqs...); err != nil {
				if ctx.Err() != nil {
					return nil
				}
				return err
			}
		}
	}
}
