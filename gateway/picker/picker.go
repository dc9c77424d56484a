// Package picker chooses a worker for a request from the prefix index's
// overlaps and the workers' in-flight load, as SMG's cache_aware policy does
// in its event-driven branch:
//
//   - candidates are the eligible workers holding at least the request's first
//     block; the deepest overlap wins (or, with a selection temperature, a
//     score group drawn with weight exp(((s−min)/range − 1)/T));
//   - a spill gate keeps a hot prefix from queueing on its holders: a worker
//     trips it when its in-flight requests exceed both the fleet mean × Rel
//     and the fleet mean + Abs;
//   - inside the chosen group, and whenever nobody overlaps, the least-loaded
//     worker wins (expected wait with in-flight requests as the only signal);
//     ties go to the lexically smallest worker name, so decisions are
//     reproducible.
//
// Two signals from the engines' own load records (Request.Engine) refine it,
// both off by default as in SMG:
//
//   - overlap decay (SMG --overlap-decay): a candidate's overlap counts as
//     raw ÷ (1 + decay·x), x = ((backlog − least backlog) ÷ block size) ÷
//     request blocks, where backlog is the prompt tokens waiting for prefill
//     that the worker's cache does not hold. A holder with a deep prefill
//     queue loses to a slightly shallower one that can start now;
//   - KV pressure (SMG --overload-token-usage-threshold and
//     --balance-token-usage-threshold): when the hottest eligible engine's KV
//     token usage is above the overload level, or hottest − coldest is above
//     the balance level, cache affinity is suspended for the request and the
//     least-loaded worker wins (reason kv_pressure): routing more prefixes to
//     a full cache only evicts what it holds.
//
// Overlaps come in as index.Matches whatever produced them, so another
// source of overlaps (an approximate tree of the gateway's own decisions)
// feeds the same choice.
//
// Every Decision carries its reason: event_hit, event_spill, no_overlap or
// kv_pressure.
//
// A router keeps its workers' in-flight counts in a Fleet, updated as they
// change, and calls PickFleet: a decision then costs the overlapping
// candidates plus O(log workers). Pick takes the counts as a map instead and
// walks the eligible list once per request.
package picker

import (
	"cmp"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"sort"
	"strings"
	"sync"

	"github.com/kvrelay/kvrelay/gateway/index"
)

// Reason says why a worker was chosen (SMG's branch metric values).
type Reason string

const (
	// ReasonHit: the chosen worker holds a prefix of the request.
	ReasonHit Reason = "event_hit"
	// ReasonSpill: some worker held a prefix, but every holder tripped the
	// spill gate and the chosen worker holds none.
	ReasonSpill Reason = "event_spill"
	// ReasonNoOverlap: no eligible worker holds the request's first block.
	ReasonNoOverlap Reason = "no_overlap"
	// ReasonKVPressure: a KV token-usage threshold suspended cache affinity
	// and the least-loaded worker was chosen.
	ReasonKVPressure Reason = "kv_pressure"
	// ReasonPlacementHit: the chosen worker's overlap includes blocks the
	// gateway placed there itself and the engine has not reported yet
	// (package placement). The picker never returns it: the gateway
	// relabels the event_hit it decided with placements.
	ReasonPlacementHit Reason = "placement_hit"
)

// SMG CLI defaults (--balance-abs-threshold, --balance-rel-threshold).
const (
	DefaultAbsThreshold = 64
	DefaultRelThreshold = 1.5
)

// DefaultBlockSize is the block size overlap decay assumes when the request
// does not say (SMG's --block-size default).
const DefaultBlockSize = 16

// Config tunes the picker. Zero thresholds take SMG's CLI defaults; to turn
// the spill gate off, set either to +Inf.
type Config struct {
	// AbsThreshold: a worker spills only with more than mean + Abs in flight.
	AbsThreshold float64
	// RelThreshold: and more than mean × Rel in flight.
	RelThreshold float64
	// Temperature > 0 draws the score group at random instead of taking the
	// deepest (SMG --selection-temperature); 0 = argmax.
	Temperature float64
	// Rand drives the temperature draw; nil = a generator seeded from the
	// runtime. Inject a seeded one for reproducible tests.
	Rand *rand.Rand
	// OverlapDecay de-ranks a candidate by its waiting-prefill backlog
	// (SMG --overlap-decay); 0 = off. Finite, ≥ 0.
	OverlapDecay float64
	// OverloadTokenUsage suspends affinity when the hottest eligible
	// engine's KV token usage is above it (SMG
	// --overload-token-usage-threshold); 0 takes SMG's default, 1.0, which
	// never fires (usage is at most 1).
	OverloadTokenUsage float64
	// BalanceTokenUsage suspends affinity when the eligible engines' KV
	// token usages spread by more than it, hottest − coldest (SMG
	// --balance-token-usage-threshold); 0 takes 1.0, off.
	BalanceTokenUsage float64
}

// DefaultTokenUsageThreshold is SMG's default for both KV-pressure
// thresholds: 1.0, which usage never exceeds, so the gate is off.
const DefaultTokenUsageThreshold = 1.0

// Picker is safe for concurrent use.
type Picker struct {
	cfg Config
	mu  sync.Mutex // guards cfg.Rand
}

// ErrNoWorkers is returned when a request has no eligible worker.
var ErrNoWorkers = errors.New("picker: no eligible worker")

// New validates cfg and returns a Picker.
func New(cfg Config) (*Picker, error) {
	if cfg.AbsThreshold == 0 {
		cfg.AbsThreshold = DefaultAbsThreshold
	}
	if cfg.RelThreshold == 0 {
		cfg.RelThreshold = DefaultRelThreshold
	}
	if cfg.OverloadTokenUsage == 0 {
		cfg.OverloadTokenUsage = DefaultTokenUsageThreshold
	}
	if cfg.BalanceTokenUsage == 0 {
		cfg.BalanceTokenUsage = DefaultTokenUsageThreshold
	}
	for name, v := range map[string]float64{"abs threshold": cfg.AbsThreshold, "rel threshold": cfg.RelThreshold} {
		if math.IsNaN(v) || v < 0 {
			return nil, fmt.Errorf("picker: %s must be ≥ 0, got %v", name, v)
		}
	}
	if math.IsNaN(cfg.OverlapDecay) || math.IsInf(cfg.OverlapDecay, 0) || cfg.OverlapDecay < 0 {
		return nil, fmt.Errorf("picker: overlap decay must be finite and ≥ 0, got %v", cfg.OverlapDecay)
	}
	for name, v := range map[string]float64{"overload token usage threshold": cfg.OverloadTokenUsage, "balance token usage threshold": cfg.BalanceTokenUsage} {
		if math.IsNaN(v) || v < 0 || v > 1 {
			return nil, fmt.Errorf("picker: %s must be in (0, 1], got %v", name, v)
		}
	}
	if math.IsNaN(cfg.Temperature) || math.IsInf(cfg.Temperature, 0) || cfg.Temperature < 0 {
		return nil, fmt.Errorf("picker: temperature must be finite and ≥ 0, got %v", cfg.Temperature)
	}
	if cfg.Rand == nil {
		cfg.Rand = rand.New(rand.NewPCG(rand.Uint64(), rand.Uint64()))
	}
	return &Picker{cfg: cfg}, nil
}

// UsesEngineLoad reports whether any knob reads Request.Engine (overlap
// decay or a KV-pressure threshold below 1), so a caller may skip building
// it when none does.
func (p *Picker) UsesEngineLoad() bool {
	return p.cfg.OverlapDecay > 0 || p.cfg.OverloadTokenUsage < 1 || p.cfg.BalanceTokenUsage < 1
}

// Request is what the picker needs to know about a request beyond its overlaps.
type Request struct {
	// Eligible lists the workers that may serve it (healthy, serving the
	// model). Overlaps of other workers are ignored.
	Eligible []string
	// BlockSize is the token count of one block of the request (overlap
	// decay converts token backlogs into blocks); 0 = DefaultBlockSize.
	BlockSize int
	// Engine holds what the workers' engines last reported about
	// themselves; a worker without an entry is never decayed and does not
	// count towards the KV-pressure gate.
	Engine map[string]EngineSignal
}

// EngineSignal is one worker's load as its engine reports it on the event
// stream (EngineLoad), summed or maxed over its DP ranks.
type EngineSignal struct {
	// Backlog is the prompt tokens waiting for prefill that the cache does
	// not hold; valid when HasBacklog (engines that do not report it leave
	// it unknown, which is not 0).
	Backlog    int
	HasBacklog bool
	// TokenUsage is the KV cache's token usage in [0, 1]; valid when
	// HasTokenUsage.
	TokenUsage    float64
	HasTokenUsage bool
}

// Loads maps a worker to its in-flight requests; a missing worker has none.
type Loads map[string]int

// Decision is the picker's answer.
type Decision struct {
	Worker string
	Reason Reason
	// Matched holds every eligible worker's leading matched blocks (> 0 only).
	Matched map[string]int
	// Blocks is the chosen worker's matched blocks; Best the deepest overlap;
	// RequestBlocks the request's full blocks.
	Blocks, Best, RequestBlocks int
	// MeanLoad is the fleet's mean in-flight requests the gate compared with.
	MeanLoad float64
	// Score is the chosen worker's overlap after decay (= Blocks without).
	Score float64
	// HottestUsage and CoolestUsage are the eligible engines' KV token
	// usage extremes, read when a request has overlaps (0 when no engine
	// reported its usage).
	HottestUsage, CoolestUsage float64
}

// Pick chooses a worker. It fails only when req has no eligible worker.
//
// It reads the fleet's load from the loads map, so it walks the eligible
// list once per request (sum and least-loaded worker); a caller that routes
// many requests keeps the loads in a Fleet and calls PickFleet, whose cost
// grows with the overlapping candidates only. When req.Eligible is already
// sorted and unique (the gateway's list is), it is used as is and
// membership is a binary search.
func (p *Picker) Pick(req Request, m index.Matches, loads Loads) (Decision, error) {
	eligible := req.Eligible
	if !isUniqueSorted(eligible) {
		eligible = uniqueSorted(eligible)
	}
	if len(eligible) == 0 {
		return Decision{}, ErrNoWorkers
	}
	return p.choose(newListView(eligible, loads), req, m), nil
}

// PickFleet chooses a worker among f's members, by their in-flight counts
// in f; req.Eligible is not read. It costs O(candidates + log n): the mean
// and the least-loaded worker come from f, not from a walk of the fleet.
// It fails only when f is empty. The caller holds whatever lock guards f.
func (p *Picker) PickFleet(f *Fleet, req Request, m index.Matches) (Decision, error) {
	if f.Len() == 0 {
		return Decision{}, ErrNoWorkers
	}
	return p.choose(f, req, m), nil
}

// loadView is what a choice reads of the eligible workers and their load:
// a Fleet, or a list and a loads map walked per request (listView).
type loadView interface {
	// lookup is w's in-flight count (≥ 0) and whether w is eligible, in
	// one map access.
	lookup(w string) (inflight int, eligible bool)
	Mean() float64
	LeastLoaded() string
}

// listView is a sorted, unique, non-empty eligible list with a loads map.
type listView struct {
	eligible []string
	loads    Loads
	mean     float64
}

func newListView(eligible []string, loads Loads) listView {
	total := 0
	if len(loads) < len(eligible) {
		for w, n := range loads {
			if n > 0 && contains(eligible, w) {
				total += n
			}
		}
	} else {
		for _, w := range eligible {
			total += max(loads[w], 0)
		}
	}
	return listView{eligible: eligible, loads: loads, mean: float64(total) / float64(len(eligible))}
}

func (v listView) lookup(w string) (int, bool) {
	return max(v.loads[w], 0), contains(v.eligible, w)
}
func (v listView) Mean() float64       { return v.mean }
func (v listView) LeastLoaded() string { return leastLoaded(v.eligible, v.loads) }

// choose is the decision itself, over a non-empty set of eligible workers.
func (p *Picker) choose(fleet loadView, req Request, m index.Matches) Decision {
	mean := fleet.Mean()
	d := Decision{RequestBlocks: m.RequestBlocks, MeanLoad: mean}
	// cands: eligible matched workers, deepest first, then by name (the order
	// index.Matches already has; other orders are sorted below).
	// Stack buffers for the usual candidate counts (up to an eighth of a
	// 512-worker fleet); more take pooled buffers, so that a pick over many
	// overlaps allocates nothing but its Matched map either.
	var candBuf [64]candidate
	var scoreBuf [64]float64
	cands, scoreDst := candBuf[:0], scoreBuf[:0]
	if len(m.Workers) > len(candBuf) {
		// Sized for every overlap up front: cands and scores never grow
		// past it, so nothing is written back (which would send the stack
		// buffers to the heap too).
		sc := scratchPool.Get().(*pickScratch)
		defer sc.put()
		sc.cands = slices.Grow(sc.cands[:0], len(m.Workers))
		sc.scores = slices.Grow(sc.scores[:0], len(m.Workers))
		cands, scoreDst = sc.cands[:0], sc.scores[:0]
	}
	for _, x := range m.Workers {
		if x.Blocks <= 0 {
			continue
		}
		if load, ok := fleet.lookup(x.Worker); ok {
			cands = append(cands, candidate{Match: x, load: load})
		}
	}
	d.Matched = make(map[string]int, len(cands))
	for _, c := range cands {
		d.Matched[c.Worker] = c.Blocks
	}
	if !slices.IsSortedFunc(cands, byDepthThenName) {
		slices.SortStableFunc(cands, byDepthThenName)
	}
	if len(cands) == 0 {
		d.Worker, d.Reason = fleet.LeastLoaded(), ReasonNoOverlap
		return d
	}
	d.Best = cands[0].Blocks
	if p.underPressure(req.Engine, fleet, &d) {
		d.Worker, d.Reason = fleet.LeastLoaded(), ReasonKVPressure
		d.Blocks = d.Matched[d.Worker]
		d.Score = float64(d.Blocks)
		return d
	}
	scores := p.decayed(scoreDst, cands, req, m.RequestBlocks)
	trips := func(load int) bool {
		l := float64(load)
		return l > mean*p.cfg.RelThreshold && l > mean+p.cfg.AbsThreshold
	}
	score := p.groupScore(scores)
	// The least-loaded untripped holder at the chosen score, ties to the
	// first name; cands at one depth are in name order, and decay only
	// reorders across depths if it changes scores.
	found, chosenLoad := false, 0
	for i, c := range cands {
		if scores[i] != score {
			continue
		}
		if trips(c.load) {
			continue
		}
		if !found || c.load < chosenLoad {
			d.Worker, chosenLoad, found = c.Worker, c.load, true
		}
	}
	if !found {
		// Every holder at that depth is over the gate: expected wait chooses
		// among the workers that are not, or among everyone if all are. The
		// gate trips above a load threshold, so the untripped workers are
		// those at or below it: if the least-loaded worker trips, everyone
		// does, and either way it is the choice (ties to the first name in
		// both cases).
		d.Worker = fleet.LeastLoaded()
	}
	d.Blocks = d.Matched[d.Worker]
	d.Score = float64(d.Blocks)
	for i, c := range cands {
		if c.Worker == d.Worker {
			d.Score = scores[i]
		}
	}
	d.Reason = ReasonHit
	if d.Blocks == 0 {
		d.Reason = ReasonSpill
	}
	return d
}

// candidate is an eligible worker holding a prefix of the request, with
// its in-flight count.
// pickScratch is a pick's candidate and score buffers past the stack's,
// pooled.
type pickScratch struct {
	cands  []candidate
	scores []float64
}

var scratchPool = sync.Pool{New: func() any { return new(pickScratch) }}

// maxPooledCandidates bounds what a pooled pickScratch keeps room for.
const maxPooledCandidates = 1 << 14

func (sc *pickScratch) put() {
	if cap(sc.cands) > maxPooledCandidates {
		sc.cands, sc.scores = nil, nil
	}
	clear(sc.cands[:cap(sc.cands)]) // no worker names kept reachable
	sc.cands, sc.scores = sc.cands[:0], sc.scores[:0]
	scratchPool.Put(sc)
}

type candidate struct {
	index.Match
	load int
}

func byDepthThenName(a, b candidate) int {
	if a.Blocks != b.Blocks {
		return cmp.Compare(b.Blocks, a.Blocks)
	}
	return strings.Compare(a.Worker, b.Worker)
}

// contains reports whether w is in the sorted list ws.
func contains(ws []string, w string) bool {
	_, ok := slices.BinarySearch(ws, w)
	return ok
}

// underPressure reports whether a KV-pressure threshold suspends affinity,
// recording the usage extremes in d. Only eligible workers whose engines
// reported a usage count.
func (p *Picker) underPressure(engine map[string]EngineSignal, fleet loadView, d *Decision) bool {
	seen := false
	for w, s := range engine {
		if !s.HasTokenUsage {
			continue
		}
		if _, ok := fleet.lookup(w); !ok {
			continue
		}
		if !seen || s.TokenUsage > d.HottestUsage {
			d.HottestUsage = s.TokenUsage
		}
		if !seen || s.TokenUsage < d.CoolestUsage {
			d.CoolestUsage = s.TokenUsage
		}
		seen = true
	}
	if !seen {
		return false
	}
	return d.HottestUsage > p.cfg.OverloadTokenUsage || d.HottestUsage-d.CoolestUsage > p.cfg.BalanceTokenUsage
}

// decayed appends to dst each candidate's effective score: its overlap, divided by
// 1 + decay·x where x is its backlog above the least candidate backlog, in
// request lengths (blocks of backlog ÷ request blocks). Without decay, or
// without backlog reports, the scores are the overlaps.
func (p *Picker) decayed(dst []float64, cands []candidate, req Request, requestBlocks int) []float64 {
	scores := dst
	for _, c := range cands {
		scores = append(scores, float64(c.Blocks))
	}
	if p.cfg.OverlapDecay == 0 || len(req.Engine) == 0 {
		return scores
	}
	floor := -1
	for _, c := range cands {
		if s, ok := req.Engine[c.Worker]; ok && s.HasBacklog {
			if b := max(s.Backlog, 0); floor < 0 || b < floor {
				floor = b
			}
		}
	}
	if floor < 0 {
		return scores
	}
	blockSize := req.BlockSize
	if blockSize <= 0 {
		blockSize = DefaultBlockSize
	}
	reqBlocks := float64(max(requestBlocks, 1))
	for i, c := range cands {
		s, ok := req.Engine[c.Worker]
		if !ok || !s.HasBacklog {
			continue
		}
		x := float64(max(s.Backlog, 0)-floor) / float64(blockSize) / reqBlocks
		scores[i] /= 1 + p.cfg.OverlapDecay*x
	}
	return scores
}

// groupScore is the effective score whose holders compete: the highest at
// temperature 0, else a draw weighting each candidate by
// exp(((s − min)/range − 1)/T), uniform when all scores are equal.
func (p *Picker) groupScore(scores []float64) float64 {
	best, worst := slices.Max(scores), slices.Min(scores)
	if p.cfg.Temperature == 0 || best == worst {
		return best
	}
	span := best - worst
	weights := make([]float64, len(scores))
	var sum float64
	for i, s := range scores {
		weights[i] = math.Exp(((s-worst)/span - 1) / p.cfg.Temperature)
		sum += weights[i]
	}
	p.mu.Lock()
	u := p.cfg.Rand.Float64() * sum
	p.mu.Unlock()
	for i, w := range weights {
		if u < w {
			return scores[i]
		}
		u -= w
	}
	return scores[len(scores)-1]
}

// leastLoaded is the expected-wait choice with in-flight requests as the only
// signal; ties go to the first name (ws is sorted).
func leastLoaded(ws []string, loads Loads) string {
	best := ws[0]
	if len(loads) == 0 {
		return best
	}
	for _, w := range ws[1:] {
		if max(loads[w], 0) < max(loads[best], 0) {
			best = w
		}
	}
	return best
}

// isUniqueSorted reports whether ws is strictly increasing with no empty
// name, i.e. what uniqueSorted would return unchanged.
func isUniqueSorted(ws []string) bool {
	for i, w := range ws {
		if w == "" || (i > 0 && ws[i-1] >= w) {
			return false
		}
	}
	return true
}

func uniqueSorted(ws []string) []string {
	out := make([]string, 0, len(ws))
	seen := make(map[string]bool, len(ws))
	for _, w := range ws {
		if w != "" && !seen[w] {
			seen[w] = true
			out = append(out, w)
		}
	}
	sort.Strings(out)
	return out
}
