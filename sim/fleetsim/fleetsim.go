package fleetsim

import (
	"container/heap"
	"fmt"
	"math"
	"slices"
	"time"

	"github.com/kvrelay/kvrelay/gateway/index"
	"github.com/kvrelay/kvrelay/gateway/picker"
	"github.com/kvrelay/kvrelay/gateway/placement"
	"github.com/kvrelay/kvrelay/proto/kvpb"
	"github.com/kvrelay/kvrelay/sim/prefixcache"
)

// Fleet sizes the simulated engines and their speed.
type Fleet struct {
	Workers   int
	BlockSize int
	// CapacityBlocks is each engine's KV cache.
	CapacityBlocks int
	// PrefillTokensPerSec is one engine's prefill rate.
	PrefillTokensPerSec float64
	// OverheadSeconds is added to every prefill (scheduling, the first
	// decode step).
	OverheadSeconds float64
	// DecodeSeconds is how long a request stays in flight after its first
	// token.
	DecodeSeconds float64
}

func (f Fleet) validate() error {
	if f.Workers <= 0 || f.BlockSize <= 0 || f.CapacityBlocks <= 0 {
		return fmt.Errorf("fleetsim: workers, block size and capacity must be positive, got %d, %d, %d", f.Workers, f.BlockSize, f.CapacityBlocks)
	}
	if !(f.PrefillTokensPerSec > 0) || !(f.OverheadSeconds >= 0) || !(f.DecodeSeconds >= 0) {
		return fmt.Errorf("fleetsim: prefill rate must be positive and overhead, decode time ≥ 0, got %v, %v, %v", f.PrefillTokensPerSec, f.OverheadSeconds, f.DecodeSeconds)
	}
	return nil
}

// Kind is a routing policy family.
type Kind int

const (
	// RoundRobin cycles through the workers.
	RoundRobin Kind = iota
	// LeastLoad picks the worker with the fewest requests in flight (as the
	// gateway counts them), ties to the first.
	LeastLoad
	// CacheAware is the gateway's picker on the event index.
	CacheAware
)

// Policy is one routing policy under test.
type Policy struct {
	Name string
	Kind Kind
	// Picker configures a CacheAware policy.
	Picker picker.Config
	// Inflight: the picker sees the gateway's own in-flight counts. Without
	// it, it sees none, as the gateway does when no client reports loads.
	Inflight bool
	// EngineLoad: the picker sees the engines' load records (waiting
	// uncached tokens, KV token usage).
	EngineLoad bool
	// Placements: the gateway records each request's blocks on the worker
	// it chose until the engine reports them (gateway/placement), with
	// PlacementWeight (0 = placement.DefaultWeight).
	Placements      bool
	PlacementWeight float64
	// NoEvents: the engines publish no KV events, so the index stays empty
	// (with Placements, the gateway's approximate mode).
	NoEvents bool
	// EventsAfterPrefill: an engine's events for a request reach the index
	// when its prefill ends instead of when it starts, as an engine that
	// publishes the blocks once it has computed them does. Either way, a
	// request queued behind others is unknown to the index until then.
	EventsAfterPrefill bool
	// Replicas is the number of gateway replicas behind a round-robin
	// front (0 = 1): each has its own in-flight counts (the requests it
	// routed) and its own placements; the index, fed by the same engines'
	// events, is the same on all and shared. SharePlacements makes every
	// placement visible on every replica at once (what placementsync does
	// over NATS in tens of microseconds, against milliseconds between
	// requests).
	Replicas        int
	SharePlacements bool
	// ShareInflight: every replica sees every replica's in-flight counts
	// (not built in the gateway: what sharing them would buy).
	ShareInflight bool
}

// Result is one policy's run of one trace.
type Result struct {
	Trace, Policy string
	Requests      int
	// PromptTokens is the traffic; CachedTokens what prefix caches served;
	// PrefillTokens what the engines computed (their difference).
	PromptTokens, CachedTokens, PrefillTokens int64
	// TTFT percentiles and mean, in seconds.
	TTFTp50, TTFTp99, TTFTMean float64
	// Reasons counts the picker's branches (cache-aware policies only).
	Reasons map[picker.Reason]int
	// PeakTokenUsage is the highest KV token usage an engine reported at a
	// routing decision.
	PeakTokenUsage float64
}

// HitRate is CachedTokens ÷ PromptTokens.
func (r Result) HitRate() float64 {
	if r.PromptTokens == 0 {
		return 0
	}
	return float64(r.CachedTokens) / float64(r.PromptTokens)
}

// queued is a request waiting for or in its prefill.
type queued struct {
	arrival float64
	tokens  []uint32
	// uncached is what the engine counts as waiting uncached tokens for it:
	// its prompt past the prefix its cache held at enqueue time.
	uncached int
	// replica routed it.
	replica int
}

// decoding is a request past its first token, holding KV until end.
type decoding struct {
	end     float64
	blocks  int
	replica int
}

type decodeHeap []decoding

func (h decodeHeap) Len() int           { return len(h) }
func (h decodeHeap) Less(i, j int) bool { return h[i].end < h[j].end }
func (h decodeHeap) Swap(i, j int)      { h[i], h[j] = h[j], h[i] }
func (h *decodeHeap) Push(x any)        { *h = append(*h, x.(decoding)) }
func (h *decodeHeap) Pop() any {
	old := *h
	x := old[len(old)-1]
	*h = old[:len(old)-1]
	return x
}

type worker struct {
	name  string
	cache *prefixcache.Cache
	queue []queued
	// freeAt is when the running prefill ends.
	freeAt float64
	// waitingUncached sums queue[i].uncached.
	waitingUncached int
	// held counts the blocks of requests prefilling or decoding.
	held int
	// inflight counts requests routed and not done decoding; routedBy the
	// same per gateway replica.
	inflight int
	routedBy []int
	decodes  decodeHeap
	// pending are events not yet published (EventsAfterPrefill), in
	// publication order.
	pending []pendingBatch
}

type pendingBatch struct {
	at float64
	b  *kvpb.KvEventBatch
}

// sim is one policy's run.
type sim struct {
	fleet   Fleet
	policy  Policy
	pick    *picker.Picker
	ix      *index.Index
	places  []*placement.Store // per replica
	workers []*worker
	names   []string
	next    int // round-robin position
	res     Result
	ttfts   []float64
}

// Run replays tr on a fresh fleet under p.
func Run(f Fleet, tr Trace, p Policy) (Result, error) {
	if err := f.validate(); err != nil {
		return Result{}, err
	}
	s := &sim{fleet: f, policy: p, res: Result{Trace: tr.Name, Policy: p.Name, Reasons: map[picker.Reason]int{}}}
	if p.Kind == CacheAware {
		pk, err := picker.New(p.Picker)
		if err != nil {
			return Result{}, fmt.Errorf("fleetsim: policy %s: %w", p.Name, err)
		}
		s.pick = pk
		s.ix = index.New(index.Options{BlockSize: f.BlockSize})
		for range s.replicas() {
			if p.Placements {
				ps, err := placement.New(placement.Options{Weight: p.PlacementWeight})
				if err != nil {
					return Result{}, fmt.Errorf("fleetsim: policy %s: %w", p.Name, err)
				}
				s.places = append(s.places, ps)
			}
		}
	}
	for i := range f.Workers {
		c, err := prefixcache.New(prefixcache.Config{BlockSize: f.BlockSize, CapacityBlocks: f.CapacityBlocks, Hasher: prefixcache.TokenSpeedFNV{}})
		if err != nil {
			return Result{}, fmt.Errorf("fleetsim: %w", err)
		}
		name := fmt.Sprintf("w%02d", i)
		s.workers = append(s.workers, &worker{name: name, cache: c, routedBy: make([]int, s.replicas())})
		s.names = append(s.names, name)
	}
	for _, a := range tr.Arrivals {
		for _, w := range s.workers {
			s.advance(w, a.At)
		}
		if err := s.route(a); err != nil {
			return Result{}, err
		}
	}
	for _, w := range s.workers {
		s.advance(w, math.Inf(1))
	}
	s.finish()
	return s.res, nil
}

// advance runs w's queue and decodes up to time t.
func (s *sim) advance(w *worker, t float64) {
	for {
		nextStart := math.Inf(1)
		if len(w.queue) > 0 {
			nextStart = max(w.freeAt, w.queue[0].arrival)
		}
		nextEnd := math.Inf(1)
		if len(w.decodes) > 0 {
			nextEnd = w.decodes[0].end
		}
		nextPublish := math.Inf(1)
		if len(w.pending) > 0 {
			nextPublish = w.pending[0].at
		}
		switch {
		case len(w.pending) > 0 && nextPublish <= t && nextPublish <= nextStart && nextPublish <= nextEnd:
			s.ix.Apply(w.name, w.pending[0].b)
			w.pending = w.pending[1:]
		case len(w.decodes) > 0 && nextEnd <= t && nextEnd <= nextStart:
			d := heap.Pop(&w.decodes).(decoding)
			w.held -= d.blocks
			w.inflight--
			w.routedBy[d.replica]--
		case len(w.queue) > 0 && nextStart <= t:
			s.startPrefill(w, nextStart)
		default:
			return
		}
	}
}

// startPrefill runs the head of w's queue through its cache at time start.
func (s *sim) startPrefill(w *worker, start float64) {
	r := w.queue[0]
	w.queue = w.queue[1:]
	w.waitingUncached -= r.uncached
	w.cache.BeginStep()
	res, evs := w.cache.Insert(r.tokens)
	cached := res.DeviceHits * s.fleet.BlockSize
	uncached := len(r.tokens) - cached
	w.freeAt = start + s.fleet.OverheadSeconds + float64(uncached)/s.fleet.PrefillTokensPerSec
	switch {
	case s.ix == nil || s.policy.NoEvents:
	case s.policy.EventsAfterPrefill:
		w.pending = append(w.pending, pendingBatch{at: w.freeAt, b: toBatch(evs)})
	default:
		s.ix.Apply(w.name, toBatch(evs))
	}
	s.ttfts = append(s.ttfts, w.freeAt-r.arrival)
	s.res.PromptTokens += int64(len(r.tokens))
	s.res.CachedTokens += int64(cached)
	s.res.PrefillTokens += int64(uncached)
	// It holds the blocks it allocated; the prefix it found cached is
	// shared, and counting it per request would fill a cache many times
	// over with one hot prefix.
	blocks := res.StoredBlocks
	w.held += blocks
	heap.Push(&w.decodes, decoding{end: w.freeAt + s.fleet.DecodeSeconds, blocks: blocks, replica: r.replica})
}

// route places one arrival by the policy.
func (s *sim) route(a Arrival) error {
	var w *worker
	var matched int
	replica := s.res.Requests % s.replicas() // the round-robin front
	switch s.policy.Kind {
	case RoundRobin:
		w = s.workers[s.next%len(s.workers)]
		s.next++
	case LeastLoad:
		w = s.workers[0]
		for _, c := range s.workers[1:] {
			if c.inflight < w.inflight {
				w = c
			}
		}
	case CacheAware:
		var prefix []uint64
		var m, combined index.Matches
		var inferred map[string]int
		now := simTime(a.At)
		if s.places != nil {
			prefix = index.PrefixHashes(a.Tokens, s.fleet.BlockSize, index.Namespace{})
			m = s.ix.FindMatchesHashes(prefix)
			r := s.places[replica].Extend(prefix, m, now)
			combined, inferred = r.Matches, r.Inferred
		} else {
			m = s.ix.FindMatches(a.Tokens, index.Namespace{})
			combined = m
		}
		req := picker.Request{Eligible: s.names, BlockSize: s.fleet.BlockSize}
		var loads picker.Loads
		if s.policy.Inflight {
			loads = make(picker.Loads, len(s.workers))
			for _, c := range s.workers {
				loads[c.name] = c.routedBy[replica]
				if s.policy.ShareInflight {
					loads[c.name] = c.inflight
				}
			}
		}
		if s.policy.EngineLoad {
			req.Engine = make(map[string]picker.EngineSignal, len(s.workers))
			for _, c := range s.workers {
				req.Engine[c.name] = picker.EngineSignal{
					Backlog: c.waitingUncached, HasBacklog: true,
					TokenUsage: s.usage(c), HasTokenUsage: true,
				}
			}
		}
		d, err := s.pick.Pick(req, combined, loads)
		if err != nil {
			return fmt.Errorf("fleetsim: policy %s: %w", s.policy.Name, err)
		}
		if s.places != nil {
			// As gateway.Route does.
			for i, ps := range s.places {
				if i == replica || s.policy.SharePlacements {
					ps.Record(d.Worker, prefix, m.Blocks(d.Worker), now)
				}
			}
			if d.Reason == picker.ReasonHit && inferred[d.Worker] > 0 {
				d.Reason = picker.ReasonPlacementHit
			}
		}
		s.res.Reasons[d.Reason]++
		w = s.workers[slices.Index(s.names, d.Worker)]
		// What the engine's cache holds, as the index knows it: inferred
		// blocks are not cached yet.
		matched = m.Blocks(d.Worker)
	default:
		return fmt.Errorf("fleetsim: policy %s: unknown kind %d", s.policy.Name, s.policy.Kind)
	}
	for _, c := range s.workers {
		s.res.PeakTokenUsage = max(s.res.PeakTokenUsage, s.usage(c))
	}
	uncached := len(a.Tokens) - matched*s.fleet.BlockSize
	w.queue = append(w.queue, queued{arrival: a.At, tokens: a.Tokens, uncached: uncached, replica: replica})
	w.waitingUncached += uncached
	w.inflight++
	w.routedBy[replica]++
	s.res.Requests++
	return nil
}

func (s *sim) replicas() int { return max(s.policy.Replicas, 1) }

// simTime is the wall-clock time the placements see at t seconds into a
// trace.
func simTime(t float64) time.Time {
	return time.Unix(0, 0).Add(time.Duration(t * float64(time.Second)))
}

// usage is w's KV token usage as its engine would report it.
func (s *sim) usage(w *worker) float64 {
	return min(float64(w.held)/float64(s.fleet.CapacityBlocks), 1)
}

func (s *sim) finish() {
	if len(s.ttfts) == 0 {
		return
	}
	slices.Sort(s.ttfts)
	var sum float64
	for _, v := range s.ttfts {
		sum += v
	}
	s.res.TTFTMean = sum / float64(len(s.ttfts))
	s.res.TTFTp50 = quantile(s.ttfts, 0.50)
	s.res.TTFTp99 = quantile(s.ttfts, 0.99)
}

// quantile is the nearest-rank quantile of sorted xs.
func quantile(xs []float64, q float64) float64 {
	i := int(math.Ceil(q*float64(len(xs)))) - 1
	return xs[min(max(i, 0), len(xs)-1)]
}

// toBatch turns a cache's events into the batch the engine's stream would
// carry, for the index.
func toBatch(evs []prefixcache.Event) *kvpb.KvEventBatch {
	b := &kvpb.KvEventBatch{}
	for _, ev := range evs {
		switch e := ev.(type) {
		case prefixcache.BlockStored:
			st := &kvpb.KvBlocksStored{}
			if e.HasParent {
				p := int64(e.Parent)
				st.ParentBlockHash = &p
			}
			for i, h := range e.Hashes {
				st.Blocks = append(st.Blocks, &kvpb.KvBlock{
					BlockHash: int64(h), TokenIds: e.Tokens[i*e.BlockSize : (i+1)*e.BlockSize], BlockSize: int32(e.BlockSize),
				})
			}
			b.Events = append(b.Events, &kvpb.KvCacheEvent{Data: &kvpb.KvCacheEvent_Stored{Stored: st}})
		case prefixcache.BlockRemoved:
			rm := &kvpb.KvBlocksRemoved{}
			for _, h := range e.Hashes {
				rm.BlockHashes = append(rm.BlockHashes, int64(h))
			}
			b.Events = append(b.Events, &kvpb.KvCacheEvent{Data: &kvpb.KvCacheEvent_Removed{Removed: rm}})
		case prefixcache.AllBlocksCleared:
			b.Events = append(b.Events, &kvpb.KvCacheEvent{Data: &kvpb.KvCacheEvent_Cleared{Cleared: &kvpb.KvCacheCleared{}}})
		}
	}
	return b
}
