package picker

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"sort"
	"testing"

	"github.com/google/go-cmp/cmp"
	"github.com/kvrelay/kvrelay/gateway/index"
)

// TestFleetModel applies random adds, removes and load changes to a Fleet
// and to a plain map, and checks after each that the Fleet's members, loads,
// mean and least-loaded worker are the map's.
func TestFleetModel(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 5))
	f := NewFleet()
	model := map[string]int{}
	for step := range 20000 {
		w := fmt.Sprintf("w%02d", rng.IntN(40))
		switch op := rng.IntN(10); {
		case op < 2:
			f.Add(w)
			if _, ok := model[w]; !ok {
				model[w] = 0
			}
		case op < 3:
			f.Remove(w)
			delete(model, w)
		default:
			n := rng.IntN(12) - 2
			_, member := model[w]
			if got := f.Set(w, n); got != member {
				t.Fatalf("step %d: Set(%s) = %v, member %v", step, w, got, member)
			}
			if member {
				model[w] = max(n, 0)
			}
		}
		names := make([]string, 0, len(model))
		total := 0
		for n, l := range model {
			names = append(names, n)
			total += l
		}
		sort.Strings(names)
		if f.Len() != len(names) {
			t.Fatalf("step %d: Len %d, want %d", step, f.Len(), len(names))
		}
		wantLeast, wantMean := "", 0.0
		if len(names) > 0 {
			wantLeast = leastLoaded(names, model)
			wantMean = float64(total) / float64(len(names))
		}
		if got := f.LeastLoaded(); got != wantLeast {
			t.Fatalf("step %d: LeastLoaded %q, want %q (loads %v)", step, got, wantLeast, model)
		}
		if got := f.Mean(); got != wantMean {
			t.Fatalf("step %d: Mean %v, want %v", step, got, wantMean)
		}
		if got, want := f.Load(w), model[w]; got != want || f.Has(w) != slices.Contains(names, w) {
			t.Fatalf("step %d: Load(%s) %d has %v, want %d", step, w, got, f.Has(w), want)
		}
	}
}

// TestPickFleetMatchesPick checks that picking from a Fleet decides exactly
// as Pick does from the same workers and loads map, through the spill gate,
// temperature draws, overlap decay and KV pressure.
func TestPickFleetMatchesPick(t *testing.T) {
	rng := rand.New(rand.NewPCG(9, 9))
	f := NewFleet()
	for iter := range 3000 {
		// The Fleet carries over between iterations, as in the gateway:
		// members come and go and loads change in place.
		loads := Loads{}
		for i := range 1 + rng.IntN(40) {
			w := fmt.Sprintf("w%02d", i)
			switch rng.IntN(6) {
			case 0:
				f.Remove(w)
			default:
				f.Add(w)
				f.Set(w, rng.IntN(200)-10)
			}
		}
		var eligible []string
		for i := range 40 {
			w := fmt.Sprintf("w%02d", i)
			if f.Has(w) {
				eligible = append(eligible, w)
				loads[w] = f.Load(w)
			}
		}
		var m index.Matches
		m.RequestBlocks = 16
		engine := map[string]EngineSignal{}
		for i := range 45 {
			w := fmt.Sprintf("w%02d", i)
			if rng.IntN(3) == 0 {
				m.Workers = append(m.Workers, index.Match{Worker: w, Blocks: rng.IntN(17)})
			}
			if rng.IntN(2) == 0 {
				engine[w] = EngineSignal{Backlog: rng.IntN(4096), HasBacklog: rng.IntN(3) > 0, TokenUsage: rng.Float64(), HasTokenUsage: rng.IntN(3) > 0}
			}
		}
		if rng.IntN(2) == 0 {
			sort.SliceStable(m.Workers, func(i, j int) bool { return m.Workers[i].Blocks > m.Workers[j].Blocks })
		}
		cfg := Config{AbsThreshold: float64(rng.IntN(40)), RelThreshold: 1 + rng.Float64()}
		if rng.IntN(3) == 0 {
			cfg.Temperature = rng.Float64() * 2
		}
		if rng.IntN(3) == 0 {
			cfg.OverlapDecay = rng.Float64() * 4
		}
		if rng.IntN(4) == 0 {
			cfg.OverloadTokenUsage = 0.5 + rng.Float64()/2
			cfg.BalanceTokenUsage = 0.3 + rng.Float64()*0.7
		}
		seed := rng.Uint64()
		cfg.Rand = rand.New(rand.NewPCG(seed, 1))
		byFleet, err := New(cfg)
		if err != nil {
			t.Fatal(err)
		}
		cfg.Rand = rand.New(rand.NewPCG(seed, 1))
		byList, _ := New(cfg)
		req := Request{Eligible: eligible, BlockSize: 16, Engine: engine}
		got, gerr := byFleet.PickFleet(f, req, m)
		want, werr := byList.Pick(req, m, loads)
		if gerr != werr {
			t.Fatalf("iter %d: err %v, Pick %v", iter, gerr, werr)
		}
		if diff := cmp.Diff(want, got); diff != "" {
			t.Fatalf("iter %d: eligible %q, matches %+v, loads %v (-Pick +PickFleet):\n%s", iter, eligible, m, loads, diff)
		}
	}
}
