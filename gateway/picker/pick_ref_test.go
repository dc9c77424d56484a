package picker

import (
	"fmt"
	"math/rand/v2"
	"sort"
	"testing"

	"github.com/google/go-cmp/cmp"
	"github.com/kvrelay/kvrelay/gateway/index"
)

// refPick is the picker before it was made allocation-light (maps for every
// eligible worker): the specification the fast Pick must still meet.
func refPick(p *Picker, req Request, m index.Matches, loads Loads) (Decision, error) {
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
	var cands []index.Match
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
	depths := make([]float64, len(cands))
	for i, c := range cands {
		depths[i] = float64(c.Blocks)
	}
	score := p.groupScore(depths)
	var group []string
	for _, c := range cands {
		if float64(c.Blocks) == score && !trips(c.Worker) {
			group = append(group, c.Worker)
		}
	}
	if len(group) > 0 {
		d.Worker = leastLoaded(group, loads)
	} else {
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
	d.Score = float64(d.Blocks)
	d.Reason = ReasonHit
	if d.Blocks == 0 {
		d.Reason = ReasonSpill
	}
	return d, nil
}

// TestPickMatchesReference draws fleets, overlaps (in index order or not)
// and loads, with the eligible list sorted or shuffled with duplicates and
// empty names, and checks Pick against refPick, temperature draws included
// (two pickers on identically seeded generators).
func TestPickMatchesReference(t *testing.T) {
	rng := rand.New(rand.NewPCG(7, 7))
	for iter := range 3000 {
		n := 1 + rng.IntN(40)
		var names []string
		for i := range n {
			names = append(names, fmt.Sprintf("w%02d", i))
		}
		var eligible []string
		for _, w := range names {
			if rng.IntN(5) > 0 {
				eligible = append(eligible, w)
			}
		}
		if rng.IntN(2) == 0 {
			rng.Shuffle(len(eligible), func(i, j int) { eligible[i], eligible[j] = eligible[j], eligible[i] })
			if len(eligible) > 0 {
				eligible = append(eligible, eligible[0], "")
			}
		}
		var m index.Matches
		m.RequestBlocks = 16
		for _, w := range names {
			if rng.IntN(3) == 0 {
				m.Workers = append(m.Workers, index.Match{Worker: w, Blocks: rng.IntN(17)})
			}
		}
		if rng.IntN(2) == 0 { // the index's order: deepest first, then name
			sort.SliceStable(m.Workers, func(i, j int) bool { return m.Workers[i].Blocks > m.Workers[j].Blocks })
		}
		var loads Loads
		if rng.IntN(4) > 0 {
			loads = Loads{}
			for _, w := range names {
				if rng.IntN(2) == 0 {
					loads[w] = rng.IntN(200) - 10
				}
			}
		}
		cfg := Config{AbsThreshold: float64(rng.IntN(40)), RelThreshold: 1 + rng.Float64()}
		if rng.IntN(3) == 0 {
			cfg.Temperature = rng.Float64() * 2
		}
		seed := rng.Uint64()
		cfg.Rand = rand.New(rand.NewPCG(seed, 1))
		fast, err := New(cfg)
		if err != nil {
			t.Fatal(err)
		}
		cfg.Rand = rand.New(rand.NewPCG(seed, 1))
		ref, _ := New(cfg)
		got, gerr := fast.Pick(Request{Eligible: eligible}, m, loads)
		want, werr := refPick(ref, Request{Eligible: eligible}, m, loads)
		if gerr != werr {
			t.Fatalf("iter %d: err %v, reference %v", iter, gerr, werr)
		}
		if diff := cmp.Diff(want, got); diff != "" {
			t.Fatalf("iter %d: eligible %q, matches %+v, loads %v (-reference +got):\n%s", iter, eligible, m, loads, diff)
		}
	}
}
