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
// Every Decision carries its reason: event_hit, event_spill or no_overlap.
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
)

// SMG CLI defaults (--balance-abs-threshold, --balance-rel-threshold).
const (
	DefaultAbsThreshold = 64
	DefaultRelThreshold = 1.5
)

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
}

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
	for name, v := range map[string]float64{"abs threshold": cfg.AbsThreshold, "rel threshold": cfg.RelThreshold} {
		if math.IsNaN(v) || v < 0 {
			return nil, fmt.Errorf("picker: %s must be ≥ 0, got %v", name, v)
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

// Request is what the picker needs to know about a request beyond its overlaps.
type Request struct {
	// Eligible lists the workers that may serve it (healthy, serving the
	// model). Overlaps of other workers are ignored.
	Eligible []string
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
}

// Pick chooses a worker. It fails only when req has no eligible worker.
//
// Its cost is proportional to the matched workers, not to the fleet, when
// req.Eligible is already sorted and unique (the gateway's list is): the
// eligible list is then used as is, membership is a binary search, and
// only the Matched map is allocated. Loads are summed over the smaller of
// the loads map and the eligible list.
func (p *Picker) Pick(req Request, m index.Matches, loads Loads) (Decision, error) {
	eligible := req.Eligible
	if !isUniqueSorted(eligible) {
		eligible = uniqueSorted(eligible)
	}
	if len(eligible) == 0 {
		return Decision{}, ErrNoWorkers
	}
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
	mean := float64(total) / float64(len(eligible))
	d := Decision{RequestBlocks: m.RequestBlocks, MeanLoad: mean}
	// cands: eligible matched workers, deepest first, then by name (the order
	// index.Matches already has; other orders are sorted below).
	var candBuf [16]index.Match
	cands := candBuf[:0]
	for _, x := range m.Workers {
		if x.Blocks > 0 && contains(eligible, x.Worker) {
			cands = append(cands, x)
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
		d.Worker, d.Reason = leastLoaded(eligible, loads), ReasonNoOverlap
		return d, nil
	}
	trips := func(w string) bool {
		l := float64(max(loads[w], 0))
		return l > mean*p.cfg.RelThreshold && l > mean+p.cfg.AbsThreshold
	}
	d.Best = cands[0].Blocks
	score := p.groupScore(cands)
	// The least-loaded untripped holder at the chosen depth, ties to the
	// first name; cands at one depth are in name order.
	found := false
	for _, c := range cands {
		if c.Blocks != score || trips(c.Worker) {
			continue
		}
		if !found || max(loads[c.Worker], 0) < max(loads[d.Worker], 0) {
			d.Worker, found = c.Worker, true
		}
	}
	if !found {
		// Every holder at that depth is over the gate: let expected wait choose
		// among the workers that are not (everyone, if all are).
		for _, w := range eligible {
			if trips(w) {
				continue
			}
			if !found || max(loads[w], 0) < max(loads[d.Worker], 0) {
				d.Worker, found = w, true
			}
		}
		if !found {
			d.Worker = leastLoaded(eligible, loads)
		}
	}
	d.Blocks = d.Matched[d.Worker]
	d.Reason = ReasonHit
	if d.Blocks == 0 {
		d.Reason = ReasonSpill
	}
	return d, nil
}

func byDepthThenName(a, b index.Match) int {
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

// groupScore is the overlap depth whose holders compete: the deepest at
// temperature 0, else a draw weighting each candidate by
// exp(((s − min)/range − 1)/T), uniform when all scores are equal.
func (p *Picker) groupScore(cands []index.Match) int {
	best, worst := cands[0].Blocks, cands[len(cands)-1].Blocks
	if p.cfg.Temperature == 0 || best == worst {
		return best
	}
	span := float64(best - worst)
	weights := make([]float64, len(cands))
	var sum float64
	for i, c := range cands {
		weights[i] = math.Exp((float64(c.Blocks-worst)/span - 1) / p.cfg.Temperature)
		sum += weights[i]
	}
	p.mu.Lock()
	u := p.cfg.Rand.Float64() * sum
	p.mu.Unlock()
	for i, w := range weights {
		if u < w {
			return cands[i].Blocks
		}
		u -= w
	}
	return cands[len(cands)-1].Blocks
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
