package picker

import (
	"errors"
	"math"
	"math/rand/v2"
	"testing"

	"github.com/google/go-cmp/cmp"
	"github.com/kvrelay/kvrelay/gateway/index"
)

func matches(reqBlocks int, ms ...index.Match) index.Matches {
	return index.Matches{RequestBlocks: reqBlocks, Workers: ms}
}

func TestPick(t *testing.T) {
	all := []string{"a", "b", "c", "d"}
	tests := []struct {
		name       string
		cfg        Config
		eligible   []string
		m          index.Matches
		loads      Loads
		want       string
		wantReason Reason
		wantBlocks int
	}{
		{
			name: "no overlap: least loaded", eligible: all, m: matches(8),
			loads: Loads{"a": 3, "b": 1, "c": 2, "d": 1}, want: "b", wantReason: ReasonNoOverlap,
		},
		{
			name: "no overlap: ties go to the first name", eligible: []string{"d", "c", "b"}, m: matches(8),
			want: "b", wantReason: ReasonNoOverlap,
		},
		{
			name: "deepest overlap wins over lower load", eligible: all,
			m:     matches(8, index.Match{Worker: "c", Blocks: 6}, index.Match{Worker: "a", Blocks: 2}),
			loads: Loads{"a": 0, "b": 0, "c": 5, "d": 0}, want: "c", wantReason: ReasonHit, wantBlocks: 6,
		},
		{
			name: "tied deepest: least loaded, then name", eligible: all,
			m:     matches(8, index.Match{Worker: "b", Blocks: 4}, index.Match{Worker: "c", Blocks: 4}, index.Match{Worker: "d", Blocks: 4}),
			loads: Loads{"b": 2, "c": 1, "d": 1}, want: "c", wantReason: ReasonHit, wantBlocks: 4,
		},
		{
			name: "holder over both thresholds spills to the least loaded", eligible: all,
			m:     matches(8, index.Match{Worker: "a", Blocks: 8}),
			loads: Loads{"a": 200, "b": 3, "c": 1, "d": 2}, // mean 51.5: 200 > 77.25 and > 115.5
			want:  "c", wantReason: ReasonSpill,
		},
		{
			name: "over the relative threshold only: no spill", eligible: all,
			m:     matches(8, index.Match{Worker: "a", Blocks: 8}),
			loads: Loads{"a": 60, "b": 0, "c": 0, "d": 0}, // mean 15: 60 > 22.5 but not > 79
			want:  "a", wantReason: ReasonHit, wantBlocks: 8,
		},
		{
			name: "over the absolute threshold only: no spill", eligible: all,
			m:     matches(8, index.Match{Worker: "a", Blocks: 8}),
			loads: Loads{"a": 300, "b": 200, "c": 200, "d": 200}, // mean 225: 300 > 289 but not > 337.5
			want:  "a", wantReason: ReasonHit, wantBlocks: 8,
		},
		{
			name: "exactly at both thresholds: no spill", cfg: Config{AbsThreshold: 3, RelThreshold: 2}, eligible: []string{"a", "b"},
			m:     matches(8, index.Match{Worker: "a", Blocks: 8}),
			loads: Loads{"a": 6, "b": 0}, // mean 3: 6 = 3×2 = 3+3
			want:  "a", wantReason: ReasonHit, wantBlocks: 8,
		},
		{
			name: "one past both thresholds: spill", cfg: Config{AbsThreshold: 3, RelThreshold: 2}, eligible: []string{"a", "b", "c"},
			m:     matches(8, index.Match{Worker: "a", Blocks: 8}),
			loads: Loads{"a": 7, "b": 1, "c": 0}, // mean 8/3: 7 > 5.33 and > 5.67
			want:  "c", wantReason: ReasonSpill,
		},
		{
			name: "tripped holder skipped for a co-holder at the same depth", cfg: Config{AbsThreshold: 3, RelThreshold: 1.5}, eligible: all,
			m:     matches(8, index.Match{Worker: "a", Blocks: 5}, index.Match{Worker: "b", Blocks: 5}),
			loads: Loads{"a": 10, "b": 2, "c": 0, "d": 0}, // mean 3: a trips, b does not
			want:  "b", wantReason: ReasonHit, wantBlocks: 5,
		},
		{
			name: "deepest tripped, shallower holder least loaded among the rest", cfg: Config{AbsThreshold: 3, RelThreshold: 1.5}, eligible: all,
			m:     matches(8, index.Match{Worker: "a", Blocks: 7}, index.Match{Worker: "b", Blocks: 2}),
			loads: Loads{"a": 12, "b": 0, "c": 1, "d": 1}, // mean 3.5: a trips
			want:  "b", wantReason: ReasonHit, wantBlocks: 2,
		},
		{
			name: "ineligible holder ignored", eligible: []string{"b", "c"},
			m:     matches(8, index.Match{Worker: "a", Blocks: 8}),
			loads: Loads{"b": 1}, want: "c", wantReason: ReasonNoOverlap,
		},
		{
			name: "gate off with +Inf", cfg: Config{AbsThreshold: math.Inf(1)}, eligible: all,
			m:     matches(8, index.Match{Worker: "a", Blocks: 1}),
			loads: Loads{"a": 10000}, want: "a", wantReason: ReasonHit, wantBlocks: 1,
		},
		{
			name: "negative loads count as zero", eligible: []string{"a", "b"}, m: matches(8),
			loads: Loads{"a": -5, "b": 0}, want: "a", wantReason: ReasonNoOverlap,
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			p, err := New(tc.cfg)
			if err != nil {
				t.Fatal(err)
			}
			d, err := p.Pick(Request{Eligible: tc.eligible}, tc.m, tc.loads)
			if err != nil {
				t.Fatal(err)
			}
			if d.Worker != tc.want || d.Reason != tc.wantReason || d.Blocks != tc.wantBlocks {
				t.Errorf("got %s/%s/%d, want %s/%s/%d", d.Worker, d.Reason, d.Blocks, tc.want, tc.wantReason, tc.wantBlocks)
			}
			want := map[string]int{}
			el := map[string]bool{}
			for _, w := range tc.eligible {
				el[w] = true
			}
			for _, x := range tc.m.Workers {
				if el[x.Worker] {
					want[x.Worker] = x.Blocks
				}
			}
			if diff := cmp.Diff(want, d.Matched); diff != "" {
				t.Errorf("Matched (-want +got):\n%s", diff)
			}
			if d.RequestBlocks != tc.m.RequestBlocks {
				t.Errorf("RequestBlocks %d", d.RequestBlocks)
			}
		})
	}
}

func TestPickNoWorkers(t *testing.T) {
	p, _ := New(Config{})
	for _, el := range [][]string{nil, {""}} {
		if _, err := p.Pick(Request{Eligible: el}, index.Matches{}, nil); !errors.Is(err, ErrNoWorkers) {
			t.Errorf("eligible %q: err %v", el, err)
		}
	}
}

func TestNewValidates(t *testing.T) {
	tests := []struct {
		name string
		cfg  Config
		ok   bool
	}{
		{"zero takes defaults", Config{}, true},
		{"negative abs", Config{AbsThreshold: -1}, false},
		{"NaN rel", Config{RelThreshold: math.NaN()}, false},
		{"negative temperature", Config{Temperature: -0.1}, false},
		{"infinite temperature", Config{Temperature: math.Inf(1)}, false},
		{"NaN temperature", Config{Temperature: math.NaN()}, false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			p, err := New(tc.cfg)
			if (err == nil) != tc.ok {
				t.Fatalf("err = %v", err)
			}
			if tc.ok && (p.cfg.AbsThreshold != DefaultAbsThreshold || p.cfg.RelThreshold != DefaultRelThreshold) {
				t.Errorf("defaults not applied: %+v", p.cfg)
			}
		})
	}
}

// With T = 1, a 4-block holder weighs exp(0) = 1 and a 1-block holder
// exp(−1) ≈ 0.368, so the deeper one wins ≈ 73 % of draws; a fixed seed makes
// the sequence reproducible.
func TestTemperature(t *testing.T) {
	m := matches(8, index.Match{Worker: "a", Blocks: 4}, index.Match{Worker: "b", Blocks: 1})
	run := func(seed uint64) []string {
		p, err := New(Config{Temperature: 1, Rand: rand.New(rand.NewPCG(seed, 0))})
		if err != nil {
			t.Fatal(err)
		}
		var out []string
		for range 4000 {
			d, err := p.Pick(Request{Eligible: []string{"a", "b", "c"}}, m, nil)
			if err != nil {
				t.Fatal(err)
			}
			if d.Reason != ReasonHit {
				t.Fatalf("reason %s", d.Reason)
			}
			out = append(out, d.Worker)
		}
		return out
	}
	first := run(42)
	if diff := cmp.Diff(first, run(42)); diff != "" {
		t.Errorf("same seed, different picks")
	}
	a := 0
	for _, w := range first {
		if w == "a" {
			a++
		}
	}
	if share := float64(a) / float64(len(first)); share < 0.69 || share > 0.77 {
		t.Errorf("deepest holder's share %.3f, want ≈ 0.731", share)
	}
	// Equal scores are a uniform draw of the group, which is then the
	// least-loaded choice: deterministic whatever the seed.
	p, _ := New(Config{Temperature: 5, Rand: rand.New(rand.NewPCG(1, 1))})
	d, _ := p.Pick(Request{Eligible: []string{"a", "b"}}, matches(4, index.Match{Worker: "a", Blocks: 2}, index.Match{Worker: "b", Blocks: 2}), Loads{"a": 3})
	if d.Worker != "b" {
		t.Errorf("equal scores: picked %s", d.Worker)
	}
}

// TestPickEngineSignals: overlap decay and the KV-pressure thresholds act on
// the engines' own load records.
func TestPickEngineSignals(t *testing.T) {
	all := []string{"a", "b", "c"}
	deepA := matches(8, index.Match{Worker: "a", Blocks: 8}, index.Match{Worker: "b", Blocks: 6})
	backlog := func(n int) EngineSignal { return EngineSignal{Backlog: n, HasBacklog: true} }
	usage := func(u float64) EngineSignal { return EngineSignal{TokenUsage: u, HasTokenUsage: true} }
	tests := []struct {
		name       string
		cfg        Config
		blockSize  int
		engine     map[string]EngineSignal
		m          index.Matches
		loads      Loads
		want       string
		wantReason Reason
		wantScore  float64
	}{
		{
			name: "decay off: the deepest holder wins whatever its backlog", m: deepA,
			engine: map[string]EngineSignal{"a": backlog(4096), "b": backlog(0)},
			want:   "a", wantReason: ReasonHit, wantScore: 8,
		},
		{
			// x = (4096/16)/8 = 32: 8/33 < 6.
			name: "a deep backlog loses to a shallower idle holder", cfg: Config{OverlapDecay: 1}, m: deepA,
			engine: map[string]EngineSignal{"a": backlog(4096), "b": backlog(0)},
			want:   "b", wantReason: ReasonHit, wantScore: 6,
		},
		{
			// x = (64/16)/8 = 0.5: 8/1.5 = 5.33 < 6.
			name: "half a request of backlog outweighs two blocks", cfg: Config{OverlapDecay: 1}, m: deepA,
			engine: map[string]EngineSignal{"a": backlog(64), "b": backlog(0)},
			want:   "b", wantReason: ReasonHit, wantScore: 6,
		},
		{
			// x = (16/16)/8 = 0.125: 8/1.125 = 7.11 > 6.
			name: "a small backlog keeps the deeper holder", cfg: Config{OverlapDecay: 1}, m: deepA,
			engine: map[string]EngineSignal{"a": backlog(16), "b": backlog(0)},
			want:   "a", wantReason: ReasonHit, wantScore: 8 / 1.125,
		},
		{
			// The same 64 tokens are one block of 64: x = 1/8 as above.
			name: "backlog counted in the request's block size", cfg: Config{OverlapDecay: 1}, m: deepA, blockSize: 64,
			engine: map[string]EngineSignal{"a": backlog(64), "b": backlog(0)},
			want:   "a", wantReason: ReasonHit, wantScore: 8 / 1.125,
		},
		{
			// Both queued: only the backlog above the least one counts.
			name: "backlog measured from the least candidate backlog", cfg: Config{OverlapDecay: 1}, m: deepA,
			engine: map[string]EngineSignal{"a": backlog(1016), "b": backlog(1000)},
			want:   "a", wantReason: ReasonHit, wantScore: 8 / 1.125,
		},
		{
			name: "a holder without a load record is never decayed", cfg: Config{OverlapDecay: 1}, m: deepA,
			engine: map[string]EngineSignal{"b": backlog(0)},
			want:   "a", wantReason: ReasonHit, wantScore: 8,
		},
		{
			name: "an unknown backlog is not a zero one", cfg: Config{OverlapDecay: 1}, m: deepA,
			engine: map[string]EngineSignal{"a": usage(0.5), "b": backlog(0)},
			want:   "a", wantReason: ReasonHit, wantScore: 8,
		},
		{
			name: "a non-candidate's backlog sets no floor", cfg: Config{OverlapDecay: 1}, m: deepA,
			engine: map[string]EngineSignal{"a": backlog(4096), "b": backlog(4096), "c": backlog(0)},
			want:   "a", wantReason: ReasonHit, wantScore: 8,
		},
		{
			name: "default thresholds never fire", m: deepA,
			engine: map[string]EngineSignal{"a": usage(1), "b": usage(0)},
			want:   "a", wantReason: ReasonHit, wantScore: 8,
		},
		{
			name: "hottest engine over the overload level: least loaded", cfg: Config{OverloadTokenUsage: 0.9}, m: deepA,
			engine: map[string]EngineSignal{"a": usage(0.95), "b": usage(0.2), "c": usage(0.2)},
			loads:  Loads{"a": 1, "b": 2}, want: "c", wantReason: ReasonKVPressure,
		},
		{
			name: "exactly at the overload level: affinity kept", cfg: Config{OverloadTokenUsage: 0.9}, m: deepA,
			engine: map[string]EngineSignal{"a": usage(0.9), "b": usage(0.9)},
			want:   "a", wantReason: ReasonHit, wantScore: 8,
		},
		{
			name: "spread over the balance level: least loaded (a holder may still win)", cfg: Config{BalanceTokenUsage: 0.3}, m: deepA,
			engine: map[string]EngineSignal{"a": usage(0.5), "b": usage(0.1)},
			loads:  Loads{"a": 3, "c": 1}, want: "b", wantReason: ReasonKVPressure, wantScore: 6,
		},
		{
			name: "spread within the balance level: affinity kept", cfg: Config{BalanceTokenUsage: 0.3}, m: deepA,
			engine: map[string]EngineSignal{"a": usage(0.5), "b": usage(0.25)},
			want:   "a", wantReason: ReasonHit, wantScore: 8,
		},
		{
			name: "an ineligible engine's usage does not count", cfg: Config{OverloadTokenUsage: 0.9}, m: deepA,
			engine: map[string]EngineSignal{"z": usage(1), "a": usage(0.1)},
			want:   "a", wantReason: ReasonHit, wantScore: 8,
		},
		{
			name: "no overlap stays no_overlap under pressure", cfg: Config{OverloadTokenUsage: 0.5}, m: matches(8),
			engine: map[string]EngineSignal{"a": usage(0.9)},
			loads:  Loads{"a": 1, "b": 1}, want: "c", wantReason: ReasonNoOverlap,
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			p, err := New(tc.cfg)
			if err != nil {
				t.Fatal(err)
			}
			d, err := p.Pick(Request{Eligible: all, BlockSize: tc.blockSize, Engine: tc.engine}, tc.m, tc.loads)
			if err != nil {
				t.Fatal(err)
			}
			if d.Worker != tc.want || d.Reason != tc.wantReason || math.Abs(d.Score-tc.wantScore) > 1e-9 {
				t.Errorf("got %s/%s score %v, want %s/%s score %v", d.Worker, d.Reason, d.Score, tc.want, tc.wantReason, tc.wantScore)
			}
		})
	}
}

func TestNewValidatesSignals(t *testing.T) {
	for _, cfg := range []Config{
		{OverlapDecay: -1}, {OverlapDecay: math.Inf(1)}, {OverlapDecay: math.NaN()},
		{OverloadTokenUsage: 1.5}, {OverloadTokenUsage: -0.1}, {BalanceTokenUsage: math.NaN()},
	} {
		if _, err := New(cfg); err == nil {
			t.Errorf("%+v accepted", cfg)
		}
	}
	p, err := New(Config{})
	if err != nil {
		t.Fatal(err)
	}
	if p.cfg.OverloadTokenUsage != 1 || p.cfg.BalanceTokenUsage != 1 || p.cfg.OverlapDecay != 0 {
		t.Errorf("defaults %+v", p.cfg)
	}
}

func TestUsesEngineLoad(t *testing.T) {
	for _, tc := range []struct {
		cfg  Config
		want bool
	}{
		{Config{}, false},
		{Config{OverloadTokenUsage: 1, BalanceTokenUsage: 1}, false},
		{Config{OverlapDecay: 0.1}, true},
		{Config{OverloadTokenUsage: 0.9}, true},
		{Config{BalanceTokenUsage: 0.9}, true},
	} {
		p, err := New(tc.cfg)
		if err != nil {
			t.Fatal(err)
		}
		if got := p.UsesEngineLoad(); got != tc.want {
			t.Errorf("%+v: %v", tc.cfg, got)
		}
	}
}
