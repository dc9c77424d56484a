package fleetsim

import (
	"math"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/kvrelay/kvrelay/gateway/picker"
)

func seq(base, n int) []uint32 {
	out := make([]uint32, n)
	for i := range out {
		out[i] = uint32(base + i)
	}
	return out
}

// TestQueueModel checks the modeled TTFT by hand: one engine, 16-token
// blocks, 160 tokens/s, 0.5 s overhead.
func TestQueueModel(t *testing.T) {
	fleet := Fleet{Workers: 1, BlockSize: 16, CapacityBlocks: 64, PrefillTokensPerSec: 160, OverheadSeconds: 0.5, DecodeSeconds: 1}
	tests := []struct {
		name       string
		arrivals   []Arrival
		wantCached int64
		wantTTFTs  [2]float64 // p50, p99
	}{
		{
			// 1.5 s each, the second waits for the first.
			name:     "two distinct prompts queue",
			arrivals: []Arrival{{At: 0, Tokens: seq(0, 160)}, {At: 0, Tokens: seq(1000, 160)}},
			// p50 = first (1.5 s), p99 = second (3 s).
			wantTTFTs: [2]float64{1.5, 3},
		},
		{
			// The second finds the first's 10 blocks cached when its
			// prefill starts at 1.5 s: overhead only.
			name:       "a repeat queued behind its prefix finds it cached",
			arrivals:   []Arrival{{At: 0, Tokens: seq(0, 160)}, {At: 0, Tokens: seq(0, 160)}},
			wantCached: 160, wantTTFTs: [2]float64{1.5, 2},
		},
		{
			name:       "an idle engine starts at arrival",
			arrivals:   []Arrival{{At: 0, Tokens: seq(0, 160)}, {At: 10, Tokens: seq(0, 168)}},
			wantCached: 160, wantTTFTs: [2]float64{0.55, 1.5},
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			for _, p := range []Policy{{Name: "rr", Kind: RoundRobin}, {Name: "ca", Kind: CacheAware, Inflight: true}} {
				r, err := Run(fleet, Trace{Name: "t", Arrivals: tc.arrivals}, p)
				if err != nil {
					t.Fatal(err)
				}
				if r.CachedTokens != tc.wantCached || r.PromptTokens != r.CachedTokens+r.PrefillTokens {
					t.Errorf("%s: prompt %d cached %d prefill %d", p.Name, r.PromptTokens, r.CachedTokens, r.PrefillTokens)
				}
				if math.Abs(r.TTFTp50-tc.wantTTFTs[0]) > 1e-9 || math.Abs(r.TTFTp99-tc.wantTTFTs[1]) > 1e-9 {
					t.Errorf("%s: TTFT p50 %v p99 %v, want %v", p.Name, r.TTFTp50, r.TTFTp99, tc.wantTTFTs)
				}
			}
		})
	}
}

// TestEngineLoadSeen: the cache-aware policies read the modeled engines'
// load: a burst on a prefix's only holder queues, and with a low spill gate
// and decay the burst spreads. Functional, not a timing assertion.
func TestEngineLoadSeen(t *testing.T) {
	fleet := Fleet{Workers: 2, BlockSize: 16, CapacityBlocks: 4096, PrefillTokensPerSec: 1000, OverheadSeconds: 0.01, DecodeSeconds: 1}
	shared := seq(0, 1024)
	arr := []Arrival{{At: 0, Tokens: shared}}
	for i := range 8 {
		// 0.5 s of own prefill each: the 8th waits 3.5 s behind the others on
		// the holder, a spilled one recomputes the prefix in 1.5 s.
		arr = append(arr, Arrival{At: 5, Tokens: append(append([]uint32(nil), shared...), seq(10000+1000*i, 512)...)})
	}
	tr := Trace{Name: "burst", Arrivals: arr}
	base, err := Run(fleet, tr, Policy{Name: "base", Kind: CacheAware, Inflight: true})
	if err != nil {
		t.Fatal(err)
	}
	if base.Reasons[picker.ReasonHit] != 8 {
		t.Errorf("base: every burst request should follow the prefix: %v", base.Reasons)
	}
	spread, err := Run(fleet, tr, Policy{Name: "spread", Kind: CacheAware, Inflight: true, EngineLoad: true, Picker: picker.Config{AbsThreshold: 1, RelThreshold: 1, OverlapDecay: 4}})
	if err != nil {
		t.Fatal(err)
	}
	if spread.Reasons[picker.ReasonSpill] == 0 || spread.TTFTp99 >= base.TTFTp99 {
		t.Errorf("spread: %v, p99 %v vs %v", spread.Reasons, spread.TTFTp99, base.TTFTp99)
	}
	if spread.PeakTokenUsage <= 0 {
		t.Errorf("no KV usage seen")
	}
}

// TestStandardSuiteReduced runs the benchmark's suite on a small part of
// its traffic: every part works and the accounting holds.
func TestStandardSuiteReduced(t *testing.T) {
	traces, err := StandardTraces(Scale{Requests: 100, Seed: 7})
	if err != nil {
		t.Fatal(err)
	}
	suite := Suite{Fleet: StandardFleet(), Traces: traces, Policies: StandardPolicies()}
	rs, err := suite.Run()
	if err != nil {
		t.Fatal(err)
	}
	if len(rs) != len(traces)*len(suite.Policies) {
		t.Fatalf("%d results", len(rs))
	}
	for _, r := range rs {
		if r.Requests != 100 || r.PromptTokens != r.CachedTokens+r.PrefillTokens || r.TTFTp50 > r.TTFTp99 || r.TTFTp50 <= 0 {
			t.Errorf("%s/%s: %+v", r.Trace, r.Policy, r)
		}
	}
	// Deterministic: the last policy (every signal) again on the traces.
	suite.Policies = suite.Policies[len(suite.Policies)-1:]
	again, err := suite.Run()
	if err != nil {
		t.Fatal(err)
	}
	last := len(StandardPolicies()) - 1
	if diff := cmp.Diff([]Result{rs[last], rs[len(rs)-1]}, again); diff != "" {
		t.Errorf("same traces, different results:\n%s", diff)
	}
	var b strings.Builder
	if err := WriteTable(&b, rs); err != nil {
		t.Fatal(err)
	}
	if n := strings.Count(b.String(), "\n"); n != len(rs)+2 {
		t.Errorf("table has %d lines:\n%s", n, b.String())
	}
}

func TestTraceValidation(t *testing.T) {
	if _, err := Chat(ChatConfig{Requests: 0, Rate: 1}); err == nil {
		t.Error("empty chat trace accepted")
	}
	if _, err := Agentic(AgenticConfig{Requests: 10, Rate: 1}); err == nil || !strings.Contains(err.Error(), "must be positive") {
		t.Errorf("zero agentic shape: %v", err)
	}
	if _, err := Run(Fleet{}, Trace{}, Policy{}); err == nil {
		t.Error("empty fleet accepted")
	}
}

// TestPlacementsKeepABurstTogether: a burst of requests with one new
// prefix, arriving together on an idle fleet whose engines report blocks
// only after their prefill (or never). Without placements the gateway knows
// nothing of the prefix until the first prefill ends and spreads the burst
// by load, each engine computing the prefix; with them the burst follows
// the first request and computes the prefix once.
func TestPlacementsKeepABurstTogether(t *testing.T) {
	fleet := Fleet{Workers: 4, BlockSize: 16, CapacityBlocks: 4096, PrefillTokensPerSec: 1000, OverheadSeconds: 0.01, DecodeSeconds: 1}
	shared := seq(0, 1024)
	var arr []Arrival
	for i := range 6 {
		arr = append(arr, Arrival{At: 1, Tokens: append(append([]uint32(nil), shared...), seq(10000+100*i, 32)...)})
	}
	tr := Trace{Name: "burst", Arrivals: arr}
	for _, tc := range []struct {
		name                  string
		after, none           bool
		wantWithout, wantWith int64 // cached tokens
	}{
		// Without placements the 6 requests spread over the 4 engines: only
		// the 2 that land on an engine after its first request find the
		// prefix. With them, the 5 behind the first find it.
		{name: "events after prefill", after: true, wantWithout: 2 * 1024, wantWith: 5 * 1024},
		{name: "no events", none: true, wantWithout: 2 * 1024, wantWith: 5 * 1024},
	} {
		t.Run(tc.name, func(t *testing.T) {
			base := Policy{Kind: CacheAware, Inflight: true, EventsAfterPrefill: tc.after, NoEvents: tc.none}
			with := base
			with.Placements = true
			rw, err := Run(fleet, tr, base)
			if err != nil {
				t.Fatal(err)
			}
			rp, err := Run(fleet, tr, with)
			if err != nil {
				t.Fatal(err)
			}
			if rw.CachedTokens != tc.wantWithout || rp.CachedTokens != tc.wantWith {
				t.Errorf("cached tokens without placements %d, with %d; want %d and %d", rw.CachedTokens, rp.CachedTokens, tc.wantWithout, tc.wantWith)
			}
			if rp.Reasons[picker.ReasonPlacementHit] != 5 {
				t.Errorf("branches with placements %v, want 5 placement_hit", rp.Reasons)
			}
		})
	}
}

// TestSharedPlacementsAcrossReplicas: two gateway replicas behind a
// round-robin front, each with its own in-flight view. A prefix routed by
// replica 0 is unknown to replica 1 until the engine reports it, unless
// the placements are shared.
func TestSharedPlacementsAcrossReplicas(t *testing.T) {
	fleet := Fleet{Workers: 4, BlockSize: 16, CapacityBlocks: 4096, PrefillTokensPerSec: 1000, OverheadSeconds: 0.01, DecodeSeconds: 1}
	p := seq(0, 1024)
	tr := Trace{Name: "two replicas", Arrivals: []Arrival{
		{At: 1, Tokens: p},                                            // replica 0 → w00
		{At: 1, Tokens: seq(5000, 64)},                                // replica 1 → w00 (its view: all idle)
		{At: 1, Tokens: seq(9000, 64)},                                // replica 0 → w01 (w00 busy in its view)
		{At: 1, Tokens: append(append([]uint32(nil), p...), 1, 2, 3)}, // replica 1: w00 only if it knows p is there
	}}
	for _, tc := range []struct {
		name       string
		placements bool
		shared     bool
		wantCached int64
	}{
		{"no placements", false, false, 0},
		{"own placements", true, false, 0},
		{"shared placements", true, true, 1024},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r, err := Run(fleet, tr, Policy{Kind: CacheAware, Inflight: true, EventsAfterPrefill: true, Replicas: 2, Placements: tc.placements, SharePlacements: tc.shared})
			if err != nil {
				t.Fatal(err)
			}
			if r.CachedTokens != tc.wantCached {
				t.Errorf("cached tokens %d, want %d (branches %v)", r.CachedTokens, tc.wantCached, r.Reasons)
			}
		})
	}
}
