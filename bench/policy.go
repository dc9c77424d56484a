package bench

import (
	"context"
	"fmt"
	"io"
	"slices"

	"github.com/kvrelay/kvrelay/sim/fleetsim"
)

// PolicyResults compares routing policies on the simulated fleet
// (sim/fleetsim): one row per workload and policy, each figure the median
// over the seeds with the range beside it.
type PolicyResults struct {
	Fleet    fleetsim.Fleet `json:"fleet"`
	Requests int            `json:"requests_per_trace"`
	Seeds    []uint64       `json:"seeds"`
	// Runs holds every seed's results, in Seeds order.
	Runs [][]fleetsim.Result `json:"runs"`
	// PlacementRuns are the same traces under fleetsim.PlacementPolicies,
	// in Seeds order.
	PlacementRuns [][]fleetsim.Result `json:"placement_runs"`
	// ReplicaRuns are the same traces under fleetsim.ReplicaPolicies
	// (gateway replicas behind a round-robin front), in Seeds order.
	ReplicaRuns [][]fleetsim.Result `json:"replica_runs"`
}

// policyRequests and policySeeds size the full run (a few minutes on one
// core); quick mode runs a token amount to prove the part works.
const policyRequests = 4000

var policySeeds = []uint64{1, 2, 3}

func runPolicy(ctx context.Context, env *environment) (*PolicyResults, error) {
	res := &PolicyResults{Fleet: fleetsim.StandardFleet(), Requests: policyRequests, Seeds: policySeeds}
	if env.quick {
		res.Requests, res.Seeds = 40, policySeeds[:1]
	}
	for _, seed := range res.Seeds {
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		env.log.Info("policy: simulating", "seed", seed, "requests", res.Requests)
		traces, err := fleetsim.StandardTraces(fleetsim.Scale{Requests: res.Requests, Seed: seed})
		if err != nil {
			return nil, fmt.Errorf("policy: %w", err)
		}
		rs, err := fleetsim.Suite{Fleet: res.Fleet, Traces: traces, Policies: fleetsim.StandardPolicies()}.Run()
		if err != nil {
			return nil, fmt.Errorf("policy: %w", err)
		}
		res.Runs = append(res.Runs, rs)
		ps, err := fleetsim.Suite{Fleet: res.Fleet, Traces: traces, Policies: fleetsim.PlacementPolicies()}.Run()
		if err != nil {
			return nil, fmt.Errorf("policy: placements: %w", err)
		}
		res.PlacementRuns = append(res.PlacementRuns, ps)
		rs, err = fleetsim.Suite{Fleet: res.Fleet, Traces: traces, Policies: fleetsim.ReplicaPolicies()}.Run()
		if err != nil {
			return nil, fmt.Errorf("policy: replicas: %w", err)
		}
		res.ReplicaRuns = append(res.ReplicaRuns, rs)
	}
	return res, nil
}

// spread is the median and range of one figure over the seeds.
type spread struct{ med, lo, hi float64 }

func spreadOf(xs []float64) spread {
	s := slices.Clone(xs)
	slices.Sort(s)
	return spread{med: s[len(s)/2], lo: s[0], hi: s[len(s)-1]}
}

func (s spread) format(scale float64, unit string, digits int) string {
	if s.lo == s.hi {
		return fmt.Sprintf("%.*f%s", digits, s.med*scale, unit)
	}
	return fmt.Sprintf("%.*f%s (%.*f–%.*f)", digits, s.med*scale, unit, digits, s.lo*scale, digits, s.hi*scale)
}

func writePolicy(w io.Writer, p *PolicyResults) {
	if len(p.Runs) == 0 {
		return
	}
	f := p.Fleet
	fmt.Fprintf(w, "### Routing policies on the simulated fleet\n\n")
	fmt.Fprintf(w, "sim/fleetsim: %d engines of %d %d-token blocks, FIFO prefill at %.0f tokens/s + %.0f ms per request, %.0f s of decode in flight; %d requests per workload (chat at %.0f/s, agentic at %.0f/s), seeds %v. Median over the seeds (range).\n\n",
		f.Workers, f.CapacityBlocks, f.BlockSize, f.PrefillTokensPerSec, 1000*f.OverheadSeconds, f.DecodeSeconds,
		p.Requests, fleetsim.ChatRate, fleetsim.AgenticRate, p.Seeds)
	writePolicyRows(w, p.Runs)
	if len(p.PlacementRuns) > 0 {
		fmt.Fprintf(w, "### Placements (the gateway's own routing decisions, gateway/placement)\n\n")
		writePolicyRows(w, p.PlacementRuns)
	}
	if len(p.ReplicaRuns) > 0 {
		fmt.Fprintf(w, "### Gateway replicas behind a round-robin front (events after prefill)\n\n")
		writePolicyRows(w, p.ReplicaRuns)
	}
}

// writePolicyRows writes one table row per policy and workload: each
// figure's median over the seeds' runs, with its range.
func writePolicyRows(w io.Writer, runs [][]fleetsim.Result) {
	fmt.Fprintf(w, "| workload | policy | hit rate | prefill tokens (M) | TTFT p50 (ms) | TTFT p99 (ms) | peak KV usage |\n|---|---|---:|---:|---:|---:|---:|\n")
	for i, r := range runs[0] {
		var hit, prefill, p50, p99, kv []float64
		for _, run := range runs {
			x := run[i]
			hit = append(hit, x.HitRate())
			prefill = append(prefill, float64(x.PrefillTokens))
			p50 = append(p50, x.TTFTp50)
			p99 = append(p99, x.TTFTp99)
			kv = append(kv, x.PeakTokenUsage)
		}
		fmt.Fprintf(w, "| %s | %s | %s | %s | %s | %s | %s |\n", r.Trace, r.Policy,
			spreadOf(hit).format(100, "%", 1), spreadOf(prefill).format(1e-6, "", 2),
			spreadOf(p50).format(1000, "", 0), spreadOf(p99).format(1000, "", 0), spreadOf(kv).format(100, "%", 0))
	}
	fmt.Fprintln(w)
}
