package fleetsim

import (
	"fmt"
	"io"
	"text/tabwriter"

	"github.com/kvrelay/kvrelay/gateway/picker"
	"github.com/kvrelay/kvrelay/sim/workload"
)

// Suite is the side-by-side run: every policy on every trace.
type Suite struct {
	Fleet    Fleet
	Traces   []Trace
	Policies []Policy
}

// Knob values of the suite's cache-aware variants. SMG's spill gate
// defaults (64 requests over the mean, 1.5 × the mean) suit fleets of dozens
// of engines with hundreds of requests in flight; on 8 engines it never
// trips, so the variants with the new signals run with a gate of 16, which
// lets a hot prefix gain replicas (overlap decay only re-ranks holders: a
// prefix on one worker has nothing to decay towards).
const (
	SmallFleetAbsThreshold = 16
	StandardOverlapDecay   = 4.0
	StandardOverloadKV     = 0.9
	StandardBalanceKV      = 0.5
)

// StandardPolicies are the baselines, the picker with no load at all (what
// it had before this change when no client reported loads), with the
// gateway's own in-flight counts, and with each engine signal on top.
func StandardPolicies() []Policy {
	gate := picker.Config{AbsThreshold: SmallFleetAbsThreshold}
	decay := gate
	decay.OverlapDecay = StandardOverlapDecay
	kv := gate
	kv.OverloadTokenUsage, kv.BalanceTokenUsage = StandardOverloadKV, StandardBalanceKV
	all := decay
	all.OverloadTokenUsage, all.BalanceTokenUsage = StandardOverloadKV, StandardBalanceKV
	return []Policy{
		{Name: "round_robin", Kind: RoundRobin},
		{Name: "least_load", Kind: LeastLoad},
		{Name: "cache_aware, no load", Kind: CacheAware},
		{Name: "+ in-flight (SMG gate 64)", Kind: CacheAware, Inflight: true},
		{Name: "+ in-flight, gate 16", Kind: CacheAware, Inflight: true, Picker: gate},
		{Name: "+ overlap decay 4", Kind: CacheAware, Inflight: true, EngineLoad: true, Picker: decay},
		{Name: "+ KV thresholds .9/.5", Kind: CacheAware, Inflight: true, EngineLoad: true, Picker: kv},
		{Name: "+ decay + KV", Kind: CacheAware, Inflight: true, EngineLoad: true, Picker: all},
	}
}

// PlacementPolicies measure the gateway's placements (gateway/placement):
// the default picker with its own in-flight counts, without and with
// placements, with the engines' events reaching the index when a prefill
// starts (the standard model) and when it ends (an engine that publishes
// blocks once computed); then engines publishing no events at all, where
// least load is what the gateway did before and placements give the
// approximate mode.
func PlacementPolicies() []Policy {
	return []Policy{
		{Name: "least_load", Kind: LeastLoad},
		{Name: "cache_aware + in-flight", Kind: CacheAware, Inflight: true},
		{Name: "+ placements", Kind: CacheAware, Inflight: true, Placements: true},
		{Name: "events after prefill: cache_aware + in-flight", Kind: CacheAware, Inflight: true, EventsAfterPrefill: true},
		{Name: "events after prefill: + placements", Kind: CacheAware, Inflight: true, EventsAfterPrefill: true, Placements: true},
		{Name: "no events: least load (before)", Kind: CacheAware, Inflight: true, NoEvents: true},
		{Name: "no events: placements (approximate mode)", Kind: CacheAware, Inflight: true, NoEvents: true, Placements: true},
	}
}

// ReplicaCounts are the gateway replica counts of ReplicaPolicies.
var ReplicaCounts = []int{1, 2, 4, 8}

// ReplicaPolicies are the multi-gateway runs: 1, 2, 4 and 8 replicas of the
// default picker with its own in-flight counts behind a round-robin front,
// each without placements, with its own, and with shared placements. The
// engines' events reach the index when a prefill ends (the case where
// placements matter, see PlacementPolicies).
func ReplicaPolicies() []Policy {
	var out []Policy
	for _, n := range ReplicaCounts {
		base := Policy{Kind: CacheAware, Inflight: true, EventsAfterPrefill: true, Replicas: n}
		local, shared := base, base
		local.Placements = true
		shared.Placements, shared.SharePlacements = true, true
		base.Name = fmt.Sprintf("%d replicas, no placements", n)
		local.Name = fmt.Sprintf("%d replicas, own placements", n)
		shared.Name = fmt.Sprintf("%d replicas, shared placements", n)
		out = append(out, base, local, shared)
	}
	// Each replica counts only the requests it routed, so at 4 and 8
	// replicas a holder looks idle to every replica but its own; the
	// engines' load records reach all of them. The same runs with overlap
	// decay and a gate of 16 (StandardPolicies' "+ overlap decay 4").
	for _, n := range ReplicaCounts[2:] {
		base := Policy{Kind: CacheAware, Inflight: true, EventsAfterPrefill: true, Replicas: n, EngineLoad: true,
			Picker: picker.Config{AbsThreshold: SmallFleetAbsThreshold, OverlapDecay: StandardOverlapDecay}}
		shared := base
		shared.Placements, shared.SharePlacements = true, true
		base.Name = fmt.Sprintf("%d replicas, no placements, engine load (decay 4, gate 16)", n)
		shared.Name = fmt.Sprintf("%d replicas, shared placements, engine load (decay 4, gate 16)", n)
		out = append(out, base, shared)
	}
	// And with every replica's in-flight counts visible to all.
	for _, n := range ReplicaCounts[2:] {
		out = append(out, Policy{
			Name: fmt.Sprintf("%d replicas, shared placements and in-flight counts", n),
			Kind: CacheAware, Inflight: true, EventsAfterPrefill: true, Replicas: n,
			Placements: true, SharePlacements: true, ShareInflight: true,
		})
	}
	return out
}

// Scale shrinks or grows the standard run: 1 is the benchmark's, a small
// fraction a test's.
type Scale struct {
	Requests int
	Seed     uint64
}

// StandardFleet: 8 engines of 8,192 16-token blocks (131k tokens of KV),
// prefilling 10,000 tokens/s with 20 ms per request on top, each request
// decoding for 3 s after its first token.
func StandardFleet() Fleet {
	return Fleet{Workers: 8, BlockSize: 16, CapacityBlocks: 8192, PrefillTokensPerSec: 10000, OverheadSeconds: 0.02, DecodeSeconds: 3}
}

// StandardTraces builds the chat and agentic traces at a rate that loads
// the standard fleet enough for queues to form.
func StandardTraces(sc Scale) ([]Trace, error) {
	chat, err := Chat(ChatConfig{
		Seed: sc.Seed, Requests: sc.Requests, Rate: ChatRate,
		Workload: workload.Config{SystemPrompts: 8, SystemPromptTokens: 2048, Sessions: 96, Turns: 10, TokensPerTurn: 384, Vocab: 32000},
	})
	if err != nil {
		return nil, err
	}
	agentic, err := Agentic(AgenticConfig{
		Seed: sc.Seed, Requests: sc.Requests, Rate: AgenticRate,
		Contexts: 4, ContextTokens: 12288, Tasks: 24, Steps: 8, StepTokens: 768,
		MaxFanout: 8, SubTokens: 256, Vocab: 32000,
	})
	if err != nil {
		return nil, err
	}
	return []Trace{chat, agentic}, nil
}

// Arrival rates of the standard traces (requests/s).
const (
	ChatRate    = 48.0
	AgenticRate = 24.0
)

// Run runs every policy on every trace.
func (s Suite) Run() ([]Result, error) {
	var out []Result
	for _, tr := range s.Traces {
		for _, p := range s.Policies {
			r, err := Run(s.Fleet, tr, p)
			if err != nil {
				return nil, err
			}
			out = append(out, r)
		}
	}
	return out, nil
}

// WriteTable writes results as a Markdown table.
func WriteTable(w io.Writer, rs []Result) error {
	tw := tabwriter.NewWriter(w, 0, 0, 1, ' ', tabwriter.Debug)
	fmt.Fprintln(tw, "| workload\t policy\t hit rate\t prefill tokens\t TTFT p50\t TTFT p99\t peak KV usage\t branches\t")
	fmt.Fprintln(tw, "|---\t---\t---\t---\t---\t---\t---\t---\t")
	for _, r := range rs {
		branches := "-"
		if len(r.Reasons) > 0 {
			branches = ""
			for _, k := range []picker.Reason{picker.ReasonHit, picker.ReasonPlacementHit, picker.ReasonSpill, picker.ReasonNoOverlap, picker.ReasonKVPressure} {
				if n := r.Reasons[k]; n > 0 {
					branches += fmt.Sprintf("%s %d ", k, n)
				}
			}
		}
		fmt.Fprintf(tw, "| %s\t %s\t %.1f%%\t %.2f M\t %s\t %s\t %.0f%%\t %s\t\n", r.Trace, r.Policy, 100*r.HitRate(),
			float64(r.PrefillTokens)/1e6, ms(r.TTFTp50), ms(r.TTFTp99), 100*r.PeakTokenUsage, branches)
	}
	return tw.Flush()
}

func ms(sec float64) string {
	if sec >= 10 {
		return fmt.Sprintf("%.1f s", sec)
	}
	return fmt.Sprintf("%.0f ms", sec*1000)
}
