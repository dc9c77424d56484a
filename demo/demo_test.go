package demo

import (
	"bytes"
	"context"
	"regexp"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m,
		// zmq4 v0.17.0's PUB writer goroutine never exits, even after Close
		// (go-ecosystem.md §1.3 #5); the simulated engines are Go PUBs.
		goleak.IgnoreAnyFunction("github.com/go-zeromq/zmq4.(*pubMWriter).run"),
		// zmq4's inproc transport leaves connection readers blocked after
		// both ends are closed; the round-robin twins publish over inproc.
		goleak.IgnoreAnyFunction("github.com/go-zeromq/zmq4/internal/inproc.(*conn).read"),
	)
}

// TestShortDemo runs the whole demo on a short request sequence: every fault
// must leave the gateway's index exactly equal to the engines' live sets, and
// cache-aware routing must serve more prompt blocks from cache than
// round-robin on the same sequence (a functional property of routing by
// cached prefix, not a timing one).
func TestShortDemo(t *testing.T) {
	// A bound, not a goal: three engines, the load checks' bursts and the
	// faults under -race on a loaded 2-core machine.
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	var progress bytes.Buffer
	rep, err := Run(ctx, Options{Requests: 240, Seed: 7, Progress: &progress})
	if err != nil {
		t.Fatalf("%v; progress:\n%s", err, progress.String())
	}
	var table bytes.Buffer
	rep.WriteTable(&table)
	t.Log("\n" + table.String())

	if rep.KVRelay.Requests != 240 || rep.RoundRobin.Requests != 240 {
		t.Errorf("requests served: kvrelay %d, round-robin %d, want 240 each", rep.KVRelay.Requests, rep.RoundRobin.Requests)
	}
	if rep.KVRelay.PromptBlocks != rep.RoundRobin.PromptBlocks {
		t.Errorf("the arms saw different sequences: %d vs %d prompt blocks", rep.KVRelay.PromptBlocks, rep.RoundRobin.PromptBlocks)
	}
	if kv, rr := rep.KVRelay.HitRate(), rep.RoundRobin.HitRate(); kv <= rr {
		t.Errorf("kvrelay hit rate %.3f is not above round-robin's %.3f", kv, rr)
	}
	wantChecks := []string{"baseline (no fault)", "dropped live batches", "publisher restart", "pause/resume",
		"truncated replay", "relay restart", "gateway stream drop", "gateway restart", "drain and rejoin"}
	if len(rep.Checks) != len(wantChecks) {
		t.Fatalf("%d checks, want %d", len(rep.Checks), len(wantChecks))
	}
	for i, c := range rep.Checks {
		if c.Name != wantChecks[i] {
			t.Errorf("check %d is %q, want %q", i, c.Name, wantChecks[i])
		}
		if !c.Exact() || !c.Quiescent {
			t.Errorf("check %q: exact %v, quiescent %v, workers %+v, err %q", c.Name, c.Exact(), c.Quiescent, c.Workers, c.Err)
		}
		for _, w := range c.Workers {
			if w.EngineRows == 0 {
				t.Errorf("check %q: worker %s has an empty engine; the comparison proves nothing", c.Name, w.Worker)
			}
		}
	}
	// The drained worker got no route while out, and routes again once
	// added back (its index exact after the resubscription, checked above).
	if c := rep.Checks[len(rep.Checks)-1]; !regexp.MustCompile(`while out: [1-9]\d* routes to \S+, 0 to \S+; added back: .* took [1-9]\d* of`).MatchString(c.Detail) {
		t.Errorf("check %q: %s", c.Name, c.Detail)
	}
	// Routing on engine load that came through the relays: the same prompt
	// went elsewhere, or lost affinity, once the load was on.
	wantLoads := map[string]string{"overlap decay": "/event_hit", "balance threshold": "/kv_pressure", "overload threshold": "/kv_pressure"}
	if len(rep.Loads) != len(wantLoads) {
		t.Errorf("%d load checks, want %d", len(rep.Loads), len(wantLoads))
	}
	for _, c := range rep.Loads {
		if !c.Pass() || !strings.HasSuffix(c.Loaded, wantLoads[c.Name]) || c.Idle == c.Loaded {
			t.Errorf("load check %q: idle %s, loaded %s, want %s: %s", c.Name, c.Idle, c.Loaded, c.Want, c.Detail)
		}
	}
	// While the engine was paused its cache moved on without events: the
	// comparison must have seen the index off then, or "exact" means nothing.
	if c := rep.Checks[3]; c.StaleRows == 0 {
		t.Errorf("check %q: the index was never off during the pause", c.Name)
	}
	// The faults must have exercised the recovery paths they are named for.
	var total RelayCounters
	for _, r := range rep.Relays {
		total = total.plus(r.RelayCounters)
	}
	for name, n := range map[string]uint64{
		"live gaps": total.Gaps, "recovered batches": total.Recovered, "truncated replays": total.ReplaysTrunc,
		"publisher restarts": total.Restarts, "snapshots": total.Snapshots, "history resumes": total.HistoryResumes,
	} {
		if n == 0 {
			t.Errorf("no %s counted: the fault that should cause them did not", name)
		}
	}
	if total.Lost != 0 {
		t.Errorf("%d batches lost", total.Lost)
	}
	if !rep.OK() {
		t.Error("report is not OK")
	}
	if !strings.Contains(table.String(), "PASS") {
		t.Error("table does not say PASS")
	}
	if !strings.Contains(progress.String(), "comparing") {
		t.Errorf("no progress line for the comparison: %q", progress.String())
	}
}

func TestRunRejectsNegativeRequests(t *testing.T) {
	if _, err := Run(context.Background(), Options{Requests: -1}); err == nil {
		t.Fatal("no error for negative requests")
	}
}

func TestReportOK(t *testing.T) {
	exact := Check{Name: "x", Quiescent: true, Workers: []WorkerCheck{{Worker: "A", EngineRows: 3, IndexRows: 3}}}
	off := Check{Name: "y", Quiescent: true, Workers: []WorkerCheck{{Worker: "A", EngineRows: 3, IndexRows: 2, Missing: 1}}}
	failed := Check{Name: "z", Err: "fault not carried out"}
	better := ArmResult{PromptBlocks: 100, HitBlocks: 80}
	worse := ArmResult{PromptBlocks: 100, HitBlocks: 70}
	for _, tc := range []struct {
		name   string
		kv, rr ArmResult
		checks []Check
		want   bool
	}{
		{"all exact, kvrelay better", better, worse, []Check{exact, exact}, true},
		{"one check off", better, worse, []Check{exact, off}, false},
		{"fault not carried out", better, worse, []Check{exact, failed}, false},
		{"no checks", better, worse, nil, false},
		{"kvrelay not better", worse, better, []Check{exact}, false},
		{"tie", better, better, []Check{exact}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := Report{KVRelay: tc.kv, RoundRobin: tc.rr, Checks: tc.checks}
			if got := r.OK(); got != tc.want {
				t.Errorf("OK() = %v, want %v", got, tc.want)
			}
		})
	}
}

// TestTablePrefillTokens: the table prints the prefill work beside the hit
// rates: tokens served from cache and tokens computed, per arm, and the
// difference.
func TestTablePrefillTokens(t *testing.T) {
	r := Report{
		Workers:    []string{"A", "B"},
		KVRelay:    ArmResult{Policy: "kvrelay", Requests: 10, PerWorker: []int{5, 5}, PromptBlocks: 100, HitBlocks: 80},
		RoundRobin: ArmResult{Policy: "round-robin", Requests: 10, PerWorker: []int{5, 5}, PromptBlocks: 100, HitBlocks: 70},
	}
	var b bytes.Buffer
	r.WriteTable(&b)
	out := b.String()
	for _, want := range []string{
		"prefill tokens saved", "prefill tokens computed",
		"160 fewer prefill tokens (67% of round-robin's prefill work)",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("table lacks %q:\n%s", want, out)
		}
	}
	// Per arm: hit rate, tokens saved (hit blocks × 16), tokens computed.
	rows := map[string]string{"kvrelay": "80.0% 1280 320", "round-robin": "70.0% 1120 480"}
	for _, line := range strings.Split(out, "\n") {
		f := strings.Fields(line)
		if len(f) < 8 || !strings.HasSuffix(f[len(f)-5], "%") {
			continue
		}
		if want, ok := rows[f[0]]; ok {
			if got := strings.Join(f[len(f)-5:len(f)-2], " "); got != want {
				t.Errorf("%s row %q: want %q", f[0], got, want)
			}
			delete(rows, f[0])
		}
	}
	if len(rows) > 0 {
		t.Errorf("rows missing: %v\n%s", rows, out)
	}
}
