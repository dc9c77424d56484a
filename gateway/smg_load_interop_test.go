package gateway

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"google.golang.org/protobuf/proto"

	"github.com/kvrelay/kvrelay/gateway/monitor"
	"github.com/kvrelay/kvrelay/gateway/picker"
	"github.com/kvrelay/kvrelay/proto/kvpb"
)

// writeLoad replaces the Python relay's scripted load source: rank 0's
// EngineLoad fields. The rename makes the change atomic for the reader.
func writeLoad(t *testing.T, path string, fields map[string]any) {
	t.Helper()
	b, err := json.Marshal(map[string]any{"0": fields})
	if err != nil {
		t.Fatal(err)
	}
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, b, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, path); err != nil {
		t.Fatal(err)
	}
}

// TestLoadSignalsThroughSMGRelay: the load records SMG's own servicer relay
// puts on its stream (its LoadRecorder: a record on every batch, telemetry
// on the first and on the load-only heartbeats, a load-only batch when the
// record moves) reach the picker through the monitor: a waiting-prefill
// backlog moves the request to a shallower holder (overlap decay), a KV
// usage over the overload level suspends affinity, and the engine's cache
// hit rate is a gauge.
func TestLoadSignalsThroughSMGRelay(t *testing.T) {
	eng, endpoint, replay := startTCPEngine(t, 1)
	loadFile := filepath.Join(t.TempDir(), "load.json")
	writeLoad(t, loadFile, map[string]any{"running_requests": 1, "waiting_uncached_tokens": 0, "token_usage": 0.1, "cache_hit_rate": 0.42})
	py := startPyRelay(t, endpoint, replay, 1, 0, "--load-file", loadFile)

	// Q is a scripted engine holding the prompt's first 6 of 8 blocks, with
	// an empty prefill queue.
	q := startEngine(t)
	reg := prometheus.NewRegistry()
	g := runGateway(t, Config{
		Workers: []Worker{
			{ID: "P", Addr: fmt.Sprintf("127.0.0.1:%d", py.port), Service: monitor.ServiceVLLM},
			{ID: "Q", Addr: q.addr, Service: monitor.ServiceVLLM},
		},
		Picker:     picker.Config{OverlapDecay: 1, OverloadTokenUsage: 0.9},
		Registerer: reg,
		// The load signals alone: with placements, the requests routed to Q
		// would place the prompt's last blocks there, and Q would then hold
		// as much as P.
		NoPlacements: true,
	})
	// SMG's relay keeps no history: probe until a batch gets through.
	for i := 0; len(workerStatus(t, g, "P").Ranks) < 1; i++ {
		if i == 400 {
			t.Fatalf("nothing relayed; relay log:\n%s", py.log())
		}
		step(t, eng, 0, tokens(700_000+16*i, 16))
		time.Sleep(25 * time.Millisecond)
	}
	prompt := tokens(30_000, 16*8)
	step(t, eng, 0, prompt)
	q.batches <- storeBatch(1, 16, 900, prompt[:16*6])
	q.batches <- loadBatch(0, &kvpb.EngineLoad{WaitingUncachedTokens: proto.Uint32(0)})
	eventually(t, "both holders indexed", func() bool {
		d, err := g.Route(RouteRequest{TokenIDs: prompt})
		return err == nil && d.MatchedBlocks["P"] == 8 && d.MatchedBlocks["Q"] == 6
	})
	waitLoad(t, g, "Q", func(EngineLoad) bool { return true })
	if d, _ := g.Route(RouteRequest{TokenIDs: prompt}); d.Worker != "P" || d.Reason != picker.ReasonHit {
		t.Errorf("idle engines: %s/%s, want P/event_hit", d.Worker, d.Reason)
	}
	// The relay's first record keeps the telemetry: the hit rate gauge.
	eventually(t, "cache hit rate gauge", func() bool {
		n, err := testutil.GatherAndCount(reg, "kvrelay_gateway_engine_cache_hit_rate")
		return err == nil && n == 1
	})
	want := "# HELP kvrelay_gateway_engine_cache_hit_rate The engine's own prefix-cache hit rate, from its last load record that carried one.\n" +
		"# TYPE kvrelay_gateway_engine_cache_hit_rate gauge\n" +
		"kvrelay_gateway_engine_cache_hit_rate{model=\"default\",rank=\"0\",worker=\"P\"} 0.42\n"
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want), "kvrelay_gateway_engine_cache_hit_rate"); err != nil {
		t.Error(err)
	}

	// A backlog of 4,096 uncached tokens on P: the relay sends a load-only
	// batch, and P's 8 blocks count 8 / (1 + 32) against Q's 6.
	writeLoad(t, loadFile, map[string]any{"running_requests": 1, "waiting_uncached_tokens": 4096, "token_usage": 0.1})
	waitLoad(t, g, "P", func(l EngineLoad) bool { return l.WaitingUncachedTokens != nil && *l.WaitingUncachedTokens == 4096 })
	if d, _ := g.Route(RouteRequest{TokenIDs: prompt}); d.Worker != "Q" || d.Reason != picker.ReasonHit || d.MatchedBlocks["Q"] != 6 {
		t.Errorf("P backlogged: %s/%s, want Q/event_hit", d.Worker, d.Reason)
	}

	// KV usage over the overload level: affinity suspended, least loaded.
	writeLoad(t, loadFile, map[string]any{"running_requests": 1, "waiting_uncached_tokens": 0, "token_usage": 0.95})
	waitLoad(t, g, "P", func(l EngineLoad) bool { return l.TokenUsage == 0.95 })
	if err := g.ReportLoad("P", 3); err != nil {
		t.Fatal(err)
	}
	if d, _ := g.Route(RouteRequest{TokenIDs: prompt}); d.Worker != "Q" || d.Reason != picker.ReasonKVPressure {
		t.Errorf("P over 0.9 KV usage: %s/%s, want Q/kv_pressure", d.Worker, d.Reason)
	}
	// Back to normal: P again.
	writeLoad(t, loadFile, map[string]any{"running_requests": 1, "waiting_uncached_tokens": 0, "token_usage": 0.2})
	waitLoad(t, g, "P", func(l EngineLoad) bool { return l.TokenUsage == 0.2 })
	if d, _ := g.Route(RouteRequest{TokenIDs: prompt}); d.Worker != "P" || d.Reason != picker.ReasonHit {
		t.Errorf("P back to normal: %s/%s, want P/event_hit", d.Worker, d.Reason)
	}
}
