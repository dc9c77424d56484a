package bench

import (
	"context"
	"os"
	"runtime/trace"
	"strconv"
	"strings"
	"testing"
	"time"
)

// TestProbeSustained runs only kvrelay's side-by-side steps at the rates in
// $KVRELAY_PROBE_RATES (default 10000 three times), alternating between the
// `kvrelay serve` binaries in $KVRELAY_PROBE_BINS (comma-separated), each
// in its own publisher+relay setup, so that builds are compared in
// interleaved rounds. $KVRELAY_PROBE_ROUNDS repeats the alternation.
// $KVRELAY_PROBE_CLIENT_TRACE writes an execution trace of this process (the
// subscriber) over the steps. BENCHMARKS.md ("Why 10,000 batches/s falls
// behind with CPU to spare") has its use. Not a unit test: it logs figures and
// asserts only that every step ran.
func TestProbeSustained(t *testing.T) {
	bins := os.Getenv("KVRELAY_PROBE_BINS")
	if bins == "" {
		t.Skip("set KVRELAY_PROBE_BINS to run")
	}
	rates := []float64{10000, 10000, 10000}
	if s := os.Getenv("KVRELAY_PROBE_RATES"); s != "" {
		rates = nil
		for _, f := range strings.Split(s, ",") {
			r, err := strconv.ParseFloat(f, 64)
			if err != nil {
				t.Fatal(err)
			}
			rates = append(rates, r)
		}
	}
	rounds := 1
	if s := os.Getenv("KVRELAY_PROBE_ROUNDS"); s != "" {
		n, err := strconv.Atoi(s)
		if err != nil || n < 1 {
			t.Fatalf("KVRELAY_PROBE_ROUNDS=%q: want a positive integer", s)
		}
		rounds = n
	}
	if p := os.Getenv("KVRELAY_PROBE_CLIENT_TRACE"); p != "" {
		f, err := os.Create(p)
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		if err := trace.Start(f); err != nil {
			t.Fatal(err)
		}
		defer trace.Stop()
	}
	var plan []rampStep
	for _, r := range rates {
		plan = append(plan, rampStep{rate: r, seconds: 5, mandatory: true})
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Minute)
	defer cancel()
	for round := 0; round < rounds; round++ {
		for _, bin := range strings.Split(bins, ",") {
			env, err := Options{Out: t.TempDir(), ServeCommand: []string{bin, "serve"}}.resolve()
			if err != nil {
				t.Fatal(err)
			}
			run := RelayRun{Name: bin, Measured: true}
			rampRelayPlan(ctx, env, &run, plan, rampPlanStart(env))
			if len(run.Steps) < len(plan) {
				t.Fatalf("%s: %d of %d steps ran: %s", bin, len(run.Steps), len(plan), run.Reason)
			}
			for _, st := range run.Steps {
				t.Logf("round %d %s: target %.0f delivered %.0f missing %d p50 %.2f ms p99 %.2f ms tail-p50 %.2f ms cpu %.0f%% (%.2f s/M blocks) pub %.0f%% sub %.0f%% vcs/batch %.2f: %s",
					round, bin, st.Target, st.DeliveredRate, st.Missing, st.P50ms, st.P99ms, st.TailP50ms,
					100*st.CPUUtil, st.CPUPerMBlocks, 100*st.PublisherCPUUtil, 100*st.SubscriberCPUUtil, st.VoluntaryCtxPerBatch, st.Verdict)
			}
		}
	}
}

func rampPlanStart(env *environment) func(context.Context, *publisher) (relayProc, error) {
	return func(ctx context.Context, pub *publisher) (relayProc, error) { return startKvrelay(ctx, env, pub) }
}
