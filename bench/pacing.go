package bench

import (
	"context"
	"fmt"
	"io"
	"slices"
)

// PacingResults is issue 31 item 4: the relay's own CPU where it matters on
// a GPU host, at an engine's pacing (8 DP ranks, each publishing 20 batches
// a second of 64-block stores) and at 1,000 batches/s, kvrelay beside SMG's
// Python relay. At these rates a relay is mostly idle, so what it costs is
// waking up for each batch, not decoding it: the figures are CPU-seconds
// per hour and context switches per batch. The relays take turns in rounds
// whose order rotates, so that a change of load on the shared machine hits
// all of them alike; the ratio that counts is per round.
type PacingResults struct {
	Rounds    int               `json:"rounds"`
	Workloads []PacingWorkload  `json:"workloads"`
	Runs      []PacingRun       `json:"runs"`
	Ratios    []PacingRatioSeen `json:"ratios"`
}

// PacingWorkload is one stream shape of the pacing part.
type PacingWorkload struct {
	Name    string  `json:"name"`
	Ranks   int     `json:"ranks"`
	Rate    float64 `json:"batches_per_s"` // all ranks together
	Seconds float64 `json:"seconds"`
}

// PacingRun is one relay's step in one round.
type PacingRun struct {
	Round    int    `json:"round"`
	Workload string `json:"workload"`
	Relay    string `json:"relay"`
	Reason   string `json:"reason,omitempty"`
	Load     string `json:"load"` // /proc/loadavg when the run started
	Step     *Step  `json:"step,omitempty"`
	// CPUSecondsPerHour is the step's CPU per wall second times 3,600.
	CPUSecondsPerHour float64 `json:"cpu_seconds_per_hour"`
}

// PacingRatioSeen is, for one kvrelay build and workload, its CPU per
// block over the Python relay's, one figure per round.
type PacingRatioSeen struct {
	Relay    string    `json:"relay"`
	Workload string    `json:"workload"`
	Ratios   []float64 `json:"ratios"`
}

const pythonRelayName = "python (smg_grpc_servicer.kv_relay)"

// pacingWorkloads: the engine's pacing first (the new goal), then the
// 1,000 batches/s of the older goal, on the side-by-side's 2 ranks.
func pacingWorkloads(quick bool) []PacingWorkload {
	if quick {
		return []PacingWorkload{{"engine pacing: 8 ranks x 20 batches/s", 8, 160, 1}}
	}
	return []PacingWorkload{
		{"engine pacing: 8 ranks x 20 batches/s", 8, 160, 30},
		{"1,000 batches/s: 2 ranks x 500", dpSize, 1000, 10},
	}
}

func runPacing(ctx context.Context, env *environment) (*PacingResults, error) {
	res := &PacingResults{Rounds: 3, Workloads: pacingWorkloads(env.quick)}
	if env.quick {
		res.Rounds = 1
	}
	if env.python == "" {
		return nil, fmt.Errorf("bench: pacing: the publisher needs Python: %v", env.pythonErr)
	}
	if env.serveCommand == nil {
		return nil, fmt.Errorf("bench: pacing: kvrelay must run as its own process to have its CPU measured (not --in-process)")
	}
	type contender struct {
		name  string
		start func(context.Context, *publisher) (relayProc, error)
	}
	contenders := []contender{
		{"kvrelay", func(ctx context.Context, pub *publisher) (relayProc, error) { return startKvrelay(ctx, env, pub) }},
		{pythonRelayName, func(ctx context.Context, pub *publisher) (relayProc, error) { return startPyRelay(ctx, env, pub) }},
	}
	if env.compareCommand != nil {
		other := *env
		other.serveCommand = env.compareCommand
		contenders = append(contenders, contender{"kvrelay (compared build)", func(ctx context.Context, pub *publisher) (relayProc, error) {
			return startKvrelay(ctx, &other, pub)
		}})
	}
	for round := 1; round <= res.Rounds; round++ {
		for _, w := range res.Workloads {
			for i := range contenders {
				c := contenders[(i+round-1)%len(contenders)]
				if err := ctx.Err(); err != nil {
					return nil, err
				}
				run := RelayRun{Name: c.name, Measured: true}
				load := loadAverage()
				rampRelayRanks(ctx, env, &run, w.Ranks, []rampStep{{rate: w.Rate, seconds: w.Seconds, mandatory: true}}, c.start)
				pr := PacingRun{Round: round, Workload: w.Name, Relay: c.name, Reason: run.Reason, Load: load}
				if n := len(run.Steps); n > 0 {
					st := run.Steps[n-1]
					pr.Step = &st
					pr.CPUSecondsPerHour = st.CPUUtil * 3600
				}
				res.Runs = append(res.Runs, pr)
				env.log.Info("pacing round", "round", round, "workload", w.Name, "relay", c.name, "cpu_s_per_hour", pr.CPUSecondsPerHour)
			}
		}
	}
	res.Ratios = pacingRatios(res.Runs)
	return res, nil
}

// pacingRatios pairs every kvrelay run with the Python relay's of the same
// round and workload, where both kept up: a relay that falls behind on a
// loaded host spends its CPU on a backlog, which is no figure per block.
func pacingRatios(runs []PacingRun) []PacingRatioSeen {
	type key struct {
		round    int
		workload string
	}
	py := map[key]*Step{}
	for _, r := range runs {
		if r.Relay == pythonRelayName && r.Step != nil && r.Step.Pass && r.Step.CPUPerMBlocks > 0 {
			py[key{r.Round, r.Workload}] = r.Step
		}
	}
	var out []PacingRatioSeen
	for _, r := range runs {
		p, ok := py[key{r.Round, r.Workload}]
		if r.Relay == pythonRelayName || r.Step == nil || !r.Step.Pass || !ok {
			continue
		}
		i := slices.IndexFunc(out, func(s PacingRatioSeen) bool { return s.Relay == r.Relay && s.Workload == r.Workload })
		if i < 0 {
			out = append(out, PacingRatioSeen{Relay: r.Relay, Workload: r.Workload})
			i = len(out) - 1
		}
		out[i].Ratios = append(out[i].Ratios, r.Step.CPUPerMBlocks/p.CPUPerMBlocks)
	}
	return out
}

func writePacing(w io.Writer, pr *PacingResults) {
	fmt.Fprintf(w, "\n## Relay CPU at realistic pacing (issue 31.4)\n\n")
	fmt.Fprintf(w, "%d rounds; in each, every relay gets the same step in turn (order rotating by round). CPU is the relay process's own (/proc utime+stime), over the step's wall time.\n\n", pr.Rounds)
	fmt.Fprintf(w, "| round | workload | relay | load | delivered/s | CPU s per hour | CPU s per M blocks | vol. ctx sw per batch | invol. per batch | p50 ms | p99 ms | verdict |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n")
	for _, r := range pr.Runs {
		if r.Step == nil {
			fmt.Fprintf(w, "| %d | %s | %s | %s | — | — | — | — | — | — | — | %s |\n", r.Round, r.Workload, r.Relay, r.Load, r.Reason)
			continue
		}
		s := r.Step
		fmt.Fprintf(w, "| %d | %s | %s | %s | %.0f | %.1f | %.2f | %.2f | %.2f | %.3f | %.3f | %s |\n", r.Round, r.Workload, r.Relay, r.Load,
			s.DeliveredRate, r.CPUSecondsPerHour, s.CPUPerMBlocks, s.VoluntaryCtxPerBatch, s.NonvoluntaryCtxPerBatch, s.P50ms, s.P99ms, s.Verdict)
	}
	fmt.Fprintf(w, "\n| relay | workload | CPU per block / Python's, per round where both kept up | median |\n|---|---|---|---|\n")
	for _, r := range pr.Ratios {
		sorted := slices.Clone(r.Ratios)
		slices.Sort(sorted)
		cells := make([]string, len(r.Ratios))
		for i, x := range r.Ratios {
			cells[i] = fmt.Sprintf("%.3f", x)
		}
		fmt.Fprintf(w, "| %s | %s | %v | %.3f |\n", r.Relay, r.Workload, cells, sorted[len(sorted)/2])
	}
}
