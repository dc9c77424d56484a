package gateway

import (
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"google.golang.org/protobuf/proto"

	"github.com/kvrelay/kvrelay/gateway/monitor"
	"github.com/kvrelay/kvrelay/gateway/picker"
	"github.com/kvrelay/kvrelay/proto/kvpb"
	"github.com/kvrelay/kvrelay/testkit/logbuf"
)

// loadBatch is a load-only batch of rank carrying l.
func loadBatch(rank int32, l *kvpb.EngineLoad) *kvpb.KvEventBatch {
	l.LoadOnly = true
	return &kvpb.KvEventBatch{DpRank: &rank, Load: l}
}

// twoHolders starts engines A and B, both streaming; A caches all of
// prompt's 4 blocks and B its first 3. It returns once both are indexed.
func twoHolders(t *testing.T, cfg Config, prompt []uint32) (g *Gateway, a, b *engineServer) {
	t.Helper()
	a, b = startEngine(t), startEngine(t)
	cfg.Workers = []Worker{{ID: "A", Addr: a.addr, Service: monitor.ServiceVLLM}, {ID: "B", Addr: b.addr, Service: monitor.ServiceVLLM}}
	g = runGateway(t, cfg)
	a.batches <- storeBatch(1, 16, 100, prompt)
	b.batches <- storeBatch(1, 16, 200, prompt[:48])
	// Wait on the index, not by routing: every route places the prompt.
	eventually(t, "both indexed", func() bool {
		return workerStatus(t, g, "A").IndexBlocks == 4 && workerStatus(t, g, "B").IndexBlocks == 3
	})
	return g, a, b
}

// waitLoad waits until the gateway holds worker's record matching ok.
func waitLoad(t *testing.T, g *Gateway, worker string, ok func(EngineLoad) bool) {
	t.Helper()
	eventually(t, worker+"'s load record", func() bool {
		for _, w := range g.Workers() {
			if w.ID == worker && w.EngineLoad != nil && ok(*w.EngineLoad) {
				return true
			}
		}
		return false
	})
}

// TestOverlapDecayFromTheStream: a waiting-prefill backlog reported on A's
// event stream moves the request to B, which holds one block less.
func TestOverlapDecayFromTheStream(t *testing.T) {
	prompt := tokens(0, 64)
	tests := []struct {
		name   string
		decay  float64
		record *kvpb.EngineLoad
		want   string
	}{
		{"decay off", 0, &kvpb.EngineLoad{WaitingUncachedTokens: proto.Uint32(4096)}, "A"},
		{"waiting uncached tokens", 1, &kvpb.EngineLoad{WaitingUncachedTokens: proto.Uint32(4096)}, "B"},
		{"a small backlog", 1, &kvpb.EngineLoad{WaitingUncachedTokens: proto.Uint32(16)}, "A"},
		{"prefill pending tokens when uncached is unknown", 1, &kvpb.EngineLoad{PrefillPendingTokens: proto.Uint32(4096)}, "B"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			g, a, b := twoHolders(t, Config{Picker: picker.Config{OverlapDecay: tc.decay}}, prompt)
			if d, _ := g.Route(RouteRequest{TokenIDs: prompt}); d.Worker != "A" {
				t.Fatalf("before any load record: %s", d.Worker)
			}
			b.batches <- loadBatch(0, &kvpb.EngineLoad{WaitingUncachedTokens: proto.Uint32(0)})
			a.batches <- loadBatch(0, tc.record)
			waitLoad(t, g, "A", func(l EngineLoad) bool { return l.WaitingUncachedTokens != nil || l.PrefillPendingTokens != nil })
			waitLoad(t, g, "B", func(EngineLoad) bool { return true })
			d, err := g.Route(RouteRequest{TokenIDs: prompt})
			if err != nil || d.Worker != tc.want || d.Reason != picker.ReasonHit {
				t.Errorf("routed to %s (%s, %v), want %s", d.Worker, d.Reason, err, tc.want)
			}
		})
	}
}

// TestBacklogSumsRanks: a worker's backlog is its ranks' together.
func TestBacklogSumsRanks(t *testing.T) {
	prompt := tokens(0, 64)
	g, a, b := twoHolders(t, Config{Picker: picker.Config{OverlapDecay: 1}}, prompt)
	b.batches <- loadBatch(0, &kvpb.EngineLoad{WaitingUncachedTokens: proto.Uint32(0)})
	// 8 + 8 tokens: x = 1/4 → 4/1.25 = 3.2 > 3, A keeps it; 32 + 32 would not.
	a.batches <- loadBatch(0, &kvpb.EngineLoad{WaitingUncachedTokens: proto.Uint32(8)})
	a.batches <- loadBatch(1, &kvpb.EngineLoad{WaitingUncachedTokens: proto.Uint32(8)})
	waitLoad(t, g, "A", func(l EngineLoad) bool { return l.Rank == 1 })
	waitLoad(t, g, "B", func(EngineLoad) bool { return true })
	if d, _ := g.Route(RouteRequest{TokenIDs: prompt}); d.Worker != "A" {
		t.Errorf("16 tokens over two ranks: %s", d.Worker)
	}
	a.batches <- loadBatch(1, &kvpb.EngineLoad{WaitingUncachedTokens: proto.Uint32(56)})
	waitLoad(t, g, "A", func(l EngineLoad) bool { return l.WaitingUncachedTokens != nil && *l.WaitingUncachedTokens == 56 })
	if d, _ := g.Route(RouteRequest{TokenIDs: prompt}); d.Worker != "B" {
		t.Errorf("8 + 56 tokens over two ranks: %s", d.Worker)
	}
}

// TestKVPressureFromTheStream: an engine's token usage over the overload
// level suspends affinity; a stale record does not.
func TestKVPressureFromTheStream(t *testing.T) {
	prompt := tokens(0, 64)
	// Without placements: the request routed to B under pressure would
	// place its last block there, and B would then hold as much as A.
	g, a, b := twoHolders(t, Config{Picker: picker.Config{OverloadTokenUsage: 0.9}, NoPlacements: true}, prompt)
	if err := g.ReportLoad("A", 2); err != nil {
		t.Fatal(err)
	}
	b.batches <- loadBatch(0, &kvpb.EngineLoad{TokenUsage: 0.3})
	a.batches <- loadBatch(0, &kvpb.EngineLoad{TokenUsage: 0.95})
	waitLoad(t, g, "A", func(l EngineLoad) bool { return l.TokenUsage == 0.95 })
	waitLoad(t, g, "B", func(EngineLoad) bool { return true })
	d, err := g.Route(RouteRequest{TokenIDs: prompt})
	if err != nil || d.Worker != "B" || d.Reason != picker.ReasonKVPressure {
		t.Errorf("under pressure: %s/%s %v, want B/kv_pressure", d.Worker, d.Reason, err)
	}
	// The same record, older than a stream's heartbeats allow, is ignored.
	g.mu.Lock()
	g.now = func() time.Time { return time.Now().Add(engineLoadMaxAge + time.Second) }
	g.mu.Unlock()
	if d, _ := g.Route(RouteRequest{TokenIDs: prompt}); d.Worker != "A" || d.Reason != picker.ReasonHit {
		t.Errorf("stale record: %s/%s, want A/event_hit", d.Worker, d.Reason)
	}
}

// TestTrackedInflight: requests the gateway routed count as its workers'
// load until done, and trip the spill gate on their own.
func TestTrackedInflight(t *testing.T) {
	prompt := tokens(0, 64)
	g, _, _ := twoHolders(t, Config{Picker: picker.Config{AbsThreshold: 1, RelThreshold: 1}}, prompt)
	var ds []Decision
	for range 2 {
		d, err := g.Route(RouteRequest{TokenIDs: prompt, Track: true})
		if err != nil || d.Worker != "A" || d.RequestID == 0 {
			t.Fatalf("tracked route: %+v %v", d, err)
		}
		ds = append(ds, d)
	}
	// A has 2 in flight, mean 1: 2 > 1 but not > 1 + 1. A third makes 3 > 2.5.
	d, _ := g.Route(RouteRequest{TokenIDs: prompt, Track: true})
	if d.Worker != "A" {
		t.Fatalf("third: %s", d.Worker)
	}
	d4, _ := g.Route(RouteRequest{TokenIDs: prompt, Track: true})
	if d4.Worker != "B" || d4.Reason != picker.ReasonHit {
		t.Errorf("with 3 in flight on A: %s/%s, want B", d4.Worker, d4.Reason)
	}
	if st := workerStatus(t, g, "A"); st.Routed != 3 || st.Inflight != 3 {
		t.Errorf("A status %+v", st)
	}
	// An untracked route counts nothing.
	if u, _ := g.Route(RouteRequest{TokenIDs: prompt}); u.RequestID != 0 {
		t.Errorf("untracked route has id %d", u.RequestID)
	} else {
		u.Done() // a no-op, not a nil func
	}
	ds[0].Done()
	ds[0].Done() // twice: still one completion
	if err := g.Complete(ds[1].RequestID); err != nil {
		t.Fatal(err)
	}
	if err := g.Complete(ds[1].RequestID); !errors.Is(err, ErrUnknownRequest) {
		t.Errorf("second Complete: %v", err)
	}
	if st := workerStatus(t, g, "A"); st.Routed != 1 {
		t.Errorf("A routed %d after two completions, want 1", st.Routed)
	}
	// A client's report is the floor, not added: 2 reported, 1 routed → 2.
	if err := g.ReportLoad("A", 2); err != nil {
		t.Fatal(err)
	}
	if st := workerStatus(t, g, "A"); st.Inflight != 2 || st.Reported != 2 {
		t.Errorf("A status %+v", st)
	}
	// Removing a worker forgets its tracked requests.
	if err := g.RemoveWorker("B"); err != nil {
		t.Fatal(err)
	}
	if err := g.Complete(d4.RequestID); !errors.Is(err, ErrUnknownRequest) {
		t.Errorf("a removed worker's request: %v", err)
	}
}

func TestTrackedInflightExpires(t *testing.T) {
	e := startEngine(t)
	reg := prometheus.NewRegistry()
	g := runGateway(t, Config{Workers: []Worker{{ID: "A", Addr: e.addr}}, InflightTimeout: 50 * time.Millisecond, Registerer: reg})
	d, err := g.Route(RouteRequest{TokenIDs: tokens(0, 16), Track: true})
	if err != nil {
		t.Fatal(err)
	}
	eventually(t, "the request to expire", func() bool { return workerStatus(t, g, "A").Routed == 0 })
	if err := g.Complete(d.RequestID); !errors.Is(err, ErrUnknownRequest) {
		t.Errorf("Complete after expiry: %v", err)
	}
	if n := testutil.ToFloat64(g.metrics.inflightExpired); n != 1 {
		t.Errorf("expired counter %v", n)
	}
	if _, err := New(Config{InflightTimeout: -time.Second}); err == nil {
		t.Error("negative timeout accepted")
	}
}

// TestEngineGauges: the engines' cache hit rate per worker, model and rank,
// kept across records that omit it, and the learned block size per model.
func TestEngineGauges(t *testing.T) {
	e := startEngine(t)
	reg := prometheus.NewRegistry()
	g := runGateway(t, Config{Workers: []Worker{{ID: "A", Addr: e.addr, Model: "llama"}}, Registerer: reg})
	e.batches <- loadBatch(0, &kvpb.EngineLoad{CacheHitRate: proto.Float64(0.25)})
	e.batches <- loadBatch(1, &kvpb.EngineLoad{CacheHitRate: proto.Float64(0.75)})
	e.batches <- loadBatch(1, &kvpb.EngineLoad{RunningRequests: 3}) // no telemetry
	e.batches <- storeBatch(1, 32, 1, tokens(0, 64))
	waitLoad(t, g, "A", func(l EngineLoad) bool { return l.Rank == 1 && l.RunningRequests == 3 })
	eventually(t, "block size learned", func() bool { return workerStatus(t, g, "A").BlockSize == 32 })
	want := `
# HELP kvrelay_gateway_block_size Block size (tokens) learned from the model's KV events, or (partitioned) adopted from another partition's answer; absent until one is seen.
# TYPE kvrelay_gateway_block_size gauge
kvrelay_gateway_block_size{model="llama"} 32
# HELP kvrelay_gateway_engine_cache_hit_rate The engine's own prefix-cache hit rate, from its last load record that carried one.
# TYPE kvrelay_gateway_engine_cache_hit_rate gauge
kvrelay_gateway_engine_cache_hit_rate{model="llama",rank="0",worker="A"} 0.25
kvrelay_gateway_engine_cache_hit_rate{model="llama",rank="1",worker="A"} 0.75
`
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want), "kvrelay_gateway_block_size", "kvrelay_gateway_engine_cache_hit_rate"); err != nil {
		t.Error(err)
	}
	if st := workerStatus(t, g, "A"); len(st.EngineRanks) != 2 || st.EngineRanks[0].Rank != 0 || st.EngineRanks[1].Rank != 1 {
		t.Errorf("engine ranks %+v", st.EngineRanks)
	}
}

// routeDecisions are the "route decision" lines of a JSON log.
func routeDecisions(log string) []map[string]any {
	var out []map[string]any
	for _, l := range strings.Split(strings.TrimSpace(log), "\n") {
		var m map[string]any
		if json.Unmarshal([]byte(l), &m) == nil && m["msg"] == "route decision" {
			out = append(out, m)
		}
	}
	return out
}

// TestDecisionLog: one debug line per decision names its branch.
func TestDecisionLog(t *testing.T) {
	prompt := tokens(0, 64)
	var buf logbuf.Buffer
	log := slog.New(slog.NewJSONHandler(&buf, &slog.HandlerOptions{Level: slog.LevelDebug}))
	g, a, b := twoHolders(t, Config{Logger: log, Picker: picker.Config{AbsThreshold: 1, RelThreshold: 1, BalanceTokenUsage: 0.5}}, prompt)
	before := len(routeDecisions(buf.String()))
	route := func(req RouteRequest) {
		t.Helper()
		if _, err := g.Route(req); err != nil {
			t.Fatal(err)
		}
	}
	route(RouteRequest{TokenIDs: prompt})                                        // event_hit on A
	route(RouteRequest{TokenIDs: tokens(5000, 64)})                              // no_overlap
	route(RouteRequest{TokenIDs: prompt, Loads: map[string]int{"A": 9, "B": 9}}) // both trip? mean 9: no spill, hit
	route(RouteRequest{TokenIDs: tokens(0, 48), Loads: map[string]int{"A": 9, "B": 9}})
	// Only A and B hold the prompt; with a third worker idle they both trip.
	c := startEngine(t)
	if err := g.AddWorker(Worker{ID: "C", Addr: c.addr}); err != nil {
		t.Fatal(err)
	}
	route(RouteRequest{TokenIDs: prompt, Loads: map[string]int{"A": 9, "B": 9, "C": 0}}) // event_spill to C
	a.batches <- loadBatch(0, &kvpb.EngineLoad{TokenUsage: 0.9})
	b.batches <- loadBatch(0, &kvpb.EngineLoad{TokenUsage: 0.1})
	waitLoad(t, g, "A", func(l EngineLoad) bool { return l.TokenUsage == 0.9 })
	waitLoad(t, g, "B", func(l EngineLoad) bool { return l.TokenUsage == 0.1 })
	route(RouteRequest{TokenIDs: prompt, Loads: map[string]int{"A": 0, "B": 0, "C": 0}}) // kv_pressure
	lines := routeDecisions(buf.String())[before:]
	var branches []string
	for _, l := range lines {
		branches = append(branches, l["branch"].(string))
	}
	want := []string{"event_hit", "no_overlap", "event_hit", "event_hit", "event_spill", "kv_pressure"}
	if strings.Join(branches, " ") != strings.Join(want, " ") {
		t.Fatalf("branches %v, want %v", branches, want)
	}
	hit, spill, pressure := lines[0], lines[4], lines[5]
	if hit["worker"] != "A" || hit["matched_blocks"] != float64(4) || hit["request_blocks"] != float64(4) || hit["candidates"] != float64(2) {
		t.Errorf("hit line %v", hit)
	}
	if spill["worker"] != "C" || spill["best_blocks"] != float64(4) || spill["mean_inflight"] != float64(6) {
		t.Errorf("spill line %v", spill)
	}
	if pressure["hottest_token_usage"] != 0.9 || pressure["coolest_token_usage"] != 0.1 {
		t.Errorf("kv_pressure line %v", pressure)
	}
}

// TestTrackedRoutesCreditAtomically: concurrent tracked routes each see the
// ones chosen before them, so a burst on an empty index spreads evenly
// instead of every route reading the same loads and picking the same worker.
func TestTrackedRoutesCreditAtomically(t *testing.T) {
	var workers []Worker
	var engines []*engineServer
	for _, id := range []string{"A", "B", "C", "D"} {
		e := startEngine(t)
		engines = append(engines, e)
		workers = append(workers, Worker{ID: id, Addr: e.addr})
	}
	g := runGateway(t, Config{Workers: workers})
	// Every worker holds the whole long prompt, so each route is a tie of
	// four holders settled by load, and spends a 2,048-block lookup between
	// reading the loads and choosing, where a non-atomic route lets the
	// others in.
	prompt := tokens(0, 32_768)
	for i, e := range engines {
		e.batches <- storeBatch(1, 16, int64(i)<<32, prompt)
	}
	eventually(t, "the prompt indexed everywhere", func() bool {
		for _, w := range g.Workers() {
			if w.IndexBlocks != 2048 {
				return false
			}
		}
		return true
	})
	const n = 200
	var wg sync.WaitGroup
	start := make(chan struct{})
	for range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			if _, err := g.Route(RouteRequest{TokenIDs: prompt, Track: true}); err != nil {
				t.Error(err)
			}
		}()
	}
	close(start)
	wg.Wait()
	for _, w := range g.Workers() {
		if w.Routed != n/4 {
			t.Errorf("%s has %d tracked requests, want %d (the burst spread evenly)", w.ID, w.Routed, n/4)
		}
	}
}

// TestRouteFollowsEveryLoadChange drives reports, tracked routes,
// completions, expiries and worker changes at random, and checks after each
// that a route with no overlap goes to the least-loaded worker (ties to the
// first ID) by the in-flight counts Workers reports: the picker's Fleet is
// kept in step with every source of load.
func TestRouteFollowsEveryLoadChange(t *testing.T) {
	now := time.Unix(1000, 0)
	var cfg Config
	for i := range 6 {
		cfg.Workers = append(cfg.Workers, Worker{ID: fmt.Sprintf("w%d", i), Addr: fmt.Sprintf("127.0.0.1:%d", 1+i)})
	}
	cfg.InflightTimeout = time.Minute
	// Every route sends the same prompt: without placements it overlaps
	// nothing, so each pick is the least-loaded worker the test predicts.
	cfg.NoPlacements = true
	g, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	g.now = func() time.Time { return now }
	rng := rand.New(rand.NewPCG(1, 2))
	var open []Decision
	present := map[string]bool{}
	for _, w := range cfg.Workers {
		present[w.ID] = true
	}
	for step := range 2000 {
		w := fmt.Sprintf("w%d", rng.IntN(6))
		switch op := rng.IntN(20); {
		case op < 5:
			if present[w] {
				if err := g.ReportLoad(w, rng.IntN(6)-1); err != nil {
					t.Fatal(err)
				}
			}
		case op < 11:
			d, err := g.Route(RouteRequest{TokenIDs: tokens(0, 64), Track: true})
			if err == nil {
				open = append(open, d)
			} else if !errors.Is(err, ErrNoWorkers) {
				t.Fatal(err)
			}
		case op < 16:
			if len(open) > 0 {
				k := rng.IntN(len(open))
				open[k].Done()
				open = append(open[:k], open[k+1:]...)
			}
		case op < 17:
			now = now.Add(time.Duration(rng.IntN(40)) * time.Second)
			g.expireTracked()
		case op < 19:
			if present[w] {
				if err := g.RemoveWorker(w); err != nil {
					t.Fatal(err)
				}
				delete(present, w)
			}
		default:
			if !present[w] {
				if err := g.AddWorker(Worker{ID: w, Addr: "127.0.0.1:9"}); err != nil {
					t.Fatal(err)
				}
				present[w] = true
			}
		}
		want, least := "", 0
		for _, st := range g.Workers() {
			if want == "" || st.Inflight < least {
				want, least = st.ID, st.Inflight
			}
		}
		d, err := g.Route(RouteRequest{TokenIDs: tokens(0, 64)})
		if want == "" {
			if !errors.Is(err, ErrNoWorkers) {
				t.Fatalf("step %d: no workers: %+v %v", step, d, err)
			}
			continue
		}
		if err != nil || d.Worker != want {
			t.Fatalf("step %d: routed to %q (%v), want %q with %d in flight; workers %+v", step, d.Worker, err, want, least, g.Workers())
		}
	}
}

// TestPeerRouted: the other replicas' tracked counts add to this replica's
// own in what the picker reads, never to client reports (the larger wins),
// ignore workers this gateway does not route, and clear with nil.
func TestPeerRouted(t *testing.T) {
	g, err := New(Config{Workers: []Worker{{ID: "w0", Addr: "127.0.0.1:1"}, {ID: "w1", Addr: "127.0.0.1:1"}}, NoPlacements: true})
	if err != nil {
		t.Fatal(err)
	}
	inflight := func(w string) (total, peers int) {
		for _, ws := range g.Workers() {
			if ws.ID == w {
				return ws.Inflight, ws.PeerRouted
			}
		}
		t.Fatalf("no worker %s", w)
		return 0, 0
	}
	route := func() string {
		t.Helper()
		d, err := g.Route(RouteRequest{TokenIDs: []uint32{1, 2, 3}})
		if err != nil {
			t.Fatal(err)
		}
		return d.Worker
	}
	if w := route(); w != "w0" {
		t.Fatalf("idle fleet routed to %s, want w0 (ties to the first name)", w)
	}
	g.SetPeerRouted(map[string]int{"w0": 3, "elsewhere": 9})
	if total, peers := inflight("w0"); total != 3 || peers != 3 {
		t.Errorf("w0: inflight %d, peer %d; want 3, 3", total, peers)
	}
	if w := route(); w != "w1" {
		t.Errorf("routed to %s with 3 of the peers' on w0, want w1", w)
	}
	d, err := g.Route(RouteRequest{TokenIDs: []uint32{4, 5, 6}, Track: true})
	if err != nil || d.Worker != "w1" {
		t.Fatalf("tracked route: %v, %v", d.Worker, err)
	}
	d2, _ := g.Route(RouteRequest{TokenIDs: []uint32{4, 5, 6}, Track: true})
	d3, _ := g.Route(RouteRequest{TokenIDs: []uint32{4, 5, 6}, Track: true})
	d4, _ := g.Route(RouteRequest{TokenIDs: []uint32{4, 5, 6}, Track: true})
	for _, d := range []Decision{d2, d3, d4} {
		defer d.Done()
	}
	// 3 own on w1 ties 3 of the peers' on w0; a fourth own went to w0.
	if total, _ := inflight("w0"); total != 4 {
		t.Errorf("w0: inflight %d, want 1 own + 3 of the peers'", total)
	}
	if err := g.ReportLoad("w0", 10); err != nil {
		t.Fatal(err)
	}
	if total, _ := inflight("w0"); total != 10 {
		t.Errorf("w0 with a report of 10: inflight %d, want 10 (the larger, not a sum)", total)
	}
	if err := g.ReportLoad("w0", 0); err != nil {
		t.Fatal(err)
	}
	g.SetPeerRouted(nil)
	if total, peers := inflight("w0"); total != 1 || peers != 0 {
		t.Errorf("w0 after the peers left: inflight %d, peer %d; want 1, 0", total, peers)
	}
	d.Done()
}

// TestReportedLoadExpires: a client-reported count is dropped when not
// reported again within ReportedLoadTTL (issue 29: a forged MaxInt64 had
// no expiry): the worker's count is then its tracked requests (unknown,
// not zero), and routing follows; a new report lives a TTL from it.
func TestReportedLoadExpires(t *testing.T) {
	now := time.Unix(1000, 0)
	const ttl = time.Minute
	g, err := New(Config{
		Workers:         []Worker{{ID: "A", Addr: "127.0.0.1:1"}, {ID: "B", Addr: "127.0.0.1:2"}},
		ReportedLoadTTL: ttl, NoPlacements: true,
	})
	if err != nil {
		t.Fatal(err)
	}
	g.now = func() time.Time { return now }
	route := func() string {
		t.Helper()
		d, err := g.Route(RouteRequest{TokenIDs: tokens(0, 64)})
		if err != nil {
			t.Fatal(err)
		}
		return d.Worker
	}
	// A has 2 tracked requests, B 3; a client reports 1,000 on A.
	for _, w := range []string{"A", "A", "B", "B", "B"} {
		g.mu.Lock()
		g.trackLocked(w, now)
		g.mu.Unlock()
	}
	if err := g.ReportLoad("A", 1000); err != nil {
		t.Fatal(err)
	}
	if st := workerStatus(t, g, "A"); st.Inflight != 1000 || route() != "B" {
		t.Fatalf("with the report: A %+v, route %s; want 1000 and B", st, route())
	}
	now = now.Add(ttl - time.Nanosecond)
	if n := g.expireReported(); n != 0 || workerStatus(t, g, "A").Reported != 1000 {
		t.Fatalf("expired %d before the TTL", n)
	}
	now = now.Add(time.Nanosecond)
	if n := g.expireReported(); n != 1 {
		t.Fatalf("expired %d at the TTL, want 1", n)
	}
	if st := workerStatus(t, g, "A"); st.Inflight != 2 || st.Reported != 0 || st.Routed != 2 {
		t.Errorf("after the TTL: A %+v, want its 2 tracked requests", st)
	}
	if w := route(); w != "A" {
		t.Errorf("after the TTL the route went to %s, want A (2 in flight against 3)", w)
	}
	// Reporting again starts a new TTL.
	if err := g.ReportLoads(map[string]int{"A": 7}); err != nil {
		t.Fatal(err)
	}
	now = now.Add(ttl / 2)
	if err := g.ReportLoads(map[string]int{"A": 8}); err != nil {
		t.Fatal(err)
	}
	now = now.Add(ttl/2 + time.Second)
	if n := g.expireReported(); n != 0 || workerStatus(t, g, "A").Reported != 8 {
		t.Errorf("a report renewed within the TTL expired (%d)", n)
	}
	if _, err := New(Config{ReportedLoadTTL: -time.Second}); err == nil {
		t.Error("a negative TTL accepted")
	}
}

// TestReportedLoadExpiresWhileRunning: Run's expiry loop drops a report
// within its TTL and a quarter.
func TestReportedLoadExpiresWhileRunning(t *testing.T) {
	const ttl = 200 * time.Millisecond
	g := runGateway(t, Config{Workers: []Worker{{ID: "A", Addr: "127.0.0.1:1"}}, ReportedLoadTTL: ttl, NoPlacements: true})
	if err := g.ReportLoad("A", 5); err != nil {
		t.Fatal(err)
	}
	reported := time.Now()
	eventually(t, "the report to expire", func() bool { return workerStatus(t, g, "A").Reported == 0 })
	if took := time.Since(reported); took < ttl {
		t.Errorf("the report expired after %v, before its TTL %v", took, ttl)
	}
}
