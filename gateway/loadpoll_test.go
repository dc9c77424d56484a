package gateway

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrelay/kvrelay/gateway/monitor"
	"github.com/kvrelay/kvrelay/sim"
)

// writeLoads scripts py_loads_servicer.py: whether its stream pushes load
// records, and rank 0's SchedulerLoad for both ways.
func writeLoads(t *testing.T, path string, push bool, rank0 map[string]any) {
	t.Helper()
	b, err := json.Marshal(map[string]any{"push": push, "ranks": map[string]any{"0": rank0}})
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path+".tmp", b, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(path+".tmp", path); err != nil {
		t.Fatal(err)
	}
}

func rank0Load(t *testing.T, g *Gateway) (EngineLoad, bool) {
	t.Helper()
	for _, r := range workerStatus(t, g, "P").EngineRanks {
		if r.Rank == 0 {
			return r, true
		}
	}
	return EngineLoad{}, false
}

// TestPollsGetLoadsWherePushesStop: against SMG's vLLM servicer code
// (smg_grpc_proto's GetLoads, SMG's relay pushing records mapped by its
// load_record), the gateway polls GetLoads while the stream pushes nothing
// (mode poll), makes no call while pushes are fresh (skipped_fresh_push),
// and polls again once they stop (fallback). /v1/workers shows the rank's
// record, where it came from and its age.
func TestPollsGetLoadsWherePushesStop(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	eng, endpoint, replay := startTCPEngine(t, 1)
	loads := filepath.Join(t.TempDir(), "loads.json")
	polled := map[string]any{"num_running_reqs": 5, "num_waiting_reqs": 2, "token_usage": 0.7, "num_waiting_uncached_tokens": 300, "cache_hit_rate": 0.25, "gen_throughput": 120.0}
	writeLoads(t, loads, false, polled)
	var calls atomic.Int64
	py := startPyScript(t, "py_loads_servicer.py", []string{
		"--endpoint", endpoint, "--replay-endpoint", replay,
		"--loads-file", loads,
	}, func(line []byte) {
		if strings.Contains(string(line), `"GetLoads"`) {
			calls.Add(1)
		}
	})
	reg := prometheus.NewRegistry()
	g := runGateway(t, Config{
		Workers:    []Worker{{ID: "P", Addr: fmt.Sprintf("127.0.0.1:%d", py.port), Service: monitor.ServiceVLLM}},
		Registerer: reg,
	})
	polls := func(mode string) float64 {
		return counter(t, reg, "kvrelay_gateway_load_polls_total", map[string]string{"worker": "P", "mode": mode})
	}
	// SMG's relay keeps no history: probe until a batch gets through, so
	// that its stream may push records once told to.
	for i := 0; len(workerStatus(t, g, "P").Ranks) < 1; i++ {
		if i == 400 {
			t.Fatalf("nothing relayed; servicer log:\n%s", py.log())
		}
		step(t, eng, 0, tokens(700_000+16*i, 16))
		time.Sleep(25 * time.Millisecond)
	}

	// No pushes: the rank's record comes from GetLoads.
	eventually(t, "a polled record", func() bool {
		l, ok := rank0Load(t, g)
		return ok && l.Source == LoadPolled
	})
	l, _ := rank0Load(t, g)
	if l.RunningRequests != 5 || l.WaitingRequests != 2 || l.TokenUsage != 0.7 || l.WaitingUncachedTokens == nil || *l.WaitingUncachedTokens != 300 ||
		l.CacheHitRate == nil || *l.CacheHitRate != 0.25 || l.AgeMs < 0 || l.AgeMs > 15_000 {
		t.Errorf("polled record: %+v", l)
	}
	// The servicer prints its GetLoads line before it answers, but the line
	// reaches this test through a pipe and a reader goroutine that a busy
	// machine may run after the gateway has taken the answer: wait for it.
	eventually(t, "a poll tick and the servicer's GetLoads call", func() bool {
		return polls("poll") >= 1 && calls.Load() >= 1
	})
	js, err := json.Marshal(workerStatus(t, g, "P"))
	if err != nil {
		t.Fatal(err)
	}
	for _, key := range []string{`"source":"poll"`, `"age_ms":`, `"engine_ranks":[{"rank":0`} {
		if !strings.Contains(string(js), key) {
			t.Errorf("/v1/workers' entry lacks %s: %s", key, js)
		}
	}

	// Pushes on: the stream's records replace the polls, and no GetLoads
	// call is made while they are fresh. The engine keeps working, so every
	// batch carries a record.
	pushed := map[string]any{"num_running_reqs": 6, "num_waiting_reqs": 2, "token_usage": 0.5, "num_waiting_uncached_tokens": 0}
	writeLoads(t, loads, true, pushed)
	working, stopWork := context.WithCancel(ctx)
	workDone := make(chan struct{})
	go func() {
		defer close(workDone)
		for i := 0; working.Err() == nil; i++ {
			if _, err := eng.Step(sim.Request{Tokens: tokens(900_000+16*i, 16)}); err != nil {
				return
			}
			time.Sleep(100 * time.Millisecond)
		}
	}()
	eventually(t, "a pushed record", func() bool {
		l, ok := rank0Load(t, g)
		return ok && l.Source == LoadPushed && l.RunningRequests == 6
	})
	eventually(t, "a skipped poll", func() bool { return polls("skipped_fresh_push") >= 1 })
	n, skipped := calls.Load(), polls("skipped_fresh_push")
	eventually(t, "two more skipped polls", func() bool { return polls("skipped_fresh_push") >= skipped+2 })
	if got := calls.Load(); got != n {
		t.Errorf("%d GetLoads calls while the pushes were fresh", got-n)
	}
	stopWork()
	<-workDone

	// Pushes off: past the freshness window the gateway falls back to
	// polling.
	polled["num_running_reqs"] = 7
	writeLoads(t, loads, false, polled)
	eventually(t, "a fallback poll", func() bool {
		l, ok := rank0Load(t, g)
		return polls("fallback") >= 1 && ok && l.Source == LoadPolled && l.RunningRequests == 7
	})
	// The record above can only have come from a GetLoads answer; its call's
	// line follows through the pipe (see above).
	eventually(t, "a GetLoads call after the pushes stopped", func() bool { return calls.Load() > n })
}

// TestLoadPollInterval: negative turns polling off; the default and the
// floor are SMG's 1 s.
func TestLoadPollInterval(t *testing.T) {
	for _, tc := range []struct{ in, want time.Duration }{
		{-1, 0},
		{0, DefaultLoadPollInterval},
		{10 * time.Millisecond, MinLoadPollInterval},
		{3 * time.Second, 3 * time.Second},
	} {
		if got := pollInterval(tc.in); got != tc.want {
			t.Errorf("pollInterval(%v) = %v, want %v", tc.in, got, tc.want)
		}
	}
}
