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
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"sort"
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
func (p *Picker) Pick(req Request, m index.Matches, loads Loads) (Decision, error) {
	eligible := uniqueSorted(req.Eligible)
	if len(eligible) == 0 {
		return Decision{}, ErrNoWorkers
	}
	ok := make(map[string]bool, len(eligible))
	total := 0
	for _, w := range eligible {
		ok[w] = true
		total += max(loads[w], 0)
	}
	mean := float64(total) / float64(len(eligible))
	d := Decision{Matched: map[string]int{}, RequestBlocks: m.RequestBlocks, MeanLoad: mean}
	var cands []index.Match // eligible, deepest first, then by name (as Matches orders them)
	for _, x := range m.Workers {
		if ok[x.Worker] && x.Blocks > 0 {
			d.Matched[x.Worker] = x.Blocks
			cands = append(cands, x)
		}
	}
	sort.SliceStable(cands, func(i, j int) bool {
		if cands[i].Blocks != cands[j].Blocks {
			return cands[i].Blocks > cands[j].Blocks
		}
		return cands[i].Worker < cands[j].Worker
	})
	trips := func(w string) bool {
		l := float64(max(loads[w], 0))
		return l > mean*p.cfg.RelThreshold && l > mean+p.cfg.AbsThreshold
	}
	if len(cands) == 0 {
		d.Worker, d.Reason = leastLoaded(eligible, loads), ReasonNoOverlap
		return d, nil
	}
	d.Best = cands[0].Blocks
	score := p.groupScore(cands)
	var group []string
	for _, c := range cands {
		if c.Blocks == score && !trips(c.Worker) {
			group = append(group, c.Worker)
		}
	}
	if len(group) > 0 {
		d.Worker = leastLoaded(group, loads)
	} else {
		// Every holder at that depth is over the gate: let expected wait choose
		// among the workers that are not (everyone, if all are).
		var pool []string
		for _, w := range eligible {
			if !trips(w) {
				pool = append(pool, w)
			}
		}
		if len(pool) == 0 {
			pool = eligible
		}
		d.Worker = leastLoaded(pool, loads)
	}
	d.Blocks = d.Matched[d.Worker]
	d.Reason = ReasonHit
	if d.Blocks == 0 {
		d.Reason = ReasonSpill
	}
	return d, nil
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
	for _, w := range ws[1:] {
		if max(loads[w], 0) < max(loads[best], 0) {
			best = w
		}
	}
	return best
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
