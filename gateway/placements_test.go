package gateway

import (
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/kvrelay/kvrelay/gateway/picker"
	"github.com/kvrelay/kvrelay/gateway/placement"
	"github.com/kvrelay/kvrelay/testkit/logbuf"
)

// idleGateway is a gateway over n workers that never connect: its index
// stays empty, as with engines that publish no events.
func idleGateway(t *testing.T, n int, cfg Config) *Gateway {
	t.Helper()
	for i := range n {
		cfg.Workers = append(cfg.Workers, Worker{ID: fmt.Sprintf("w%d", i), Addr: "127.0.0.1:1"})
	}
	g, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return g
}

// TestApproximateModeBeforeTheFirstEvent: with an empty index, a request
// whose prefix the gateway routed before goes to the same worker even when
// it is the busiest (issue 17.1's affinity before the first event); without
// placements it goes to the least loaded.
func TestApproximateModeBeforeTheFirstEvent(t *testing.T) {
	system := tokens(0, 256) // 16 blocks of 16
	turn := func(i int) []uint32 { return append(append([]uint32{}, system...), tokens(10000*(i+1), 40)...) }
	for _, tc := range []struct {
		name       string
		cfg        Config
		wantSame   bool
		wantReason picker.Reason
	}{
		{"placements", Config{}, true, picker.ReasonPlacementHit},
		{"placements off", Config{NoPlacements: true}, false, picker.ReasonNoOverlap},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g := idleGateway(t, 4, tc.cfg)
			first, err := g.Route(RouteRequest{TokenIDs: turn(0), Track: true})
			if err != nil || first.Reason != picker.ReasonNoOverlap {
				t.Fatalf("first route: %+v %v", first, err)
			}
			// The same system prompt, another user turn, while the first is
			// in flight on its worker.
			for i := 1; i <= 3; i++ {
				d, err := g.Route(RouteRequest{TokenIDs: turn(i), Track: true})
				if err != nil {
					t.Fatal(err)
				}
				if same := d.Worker == first.Worker; same != tc.wantSame || d.Reason != tc.wantReason {
					t.Fatalf("route %d: %s (%s), first went to %s; want same worker %v, reason %s", i, d.Worker, d.Reason, first.Worker, tc.wantSame, tc.wantReason)
				}
				if tc.wantSame && d.MatchedBlocks[first.Worker] != 16 {
					t.Errorf("route %d: matched %v, want 16 blocks on %s", i, d.MatchedBlocks, first.Worker)
				}
			}
			// An unrelated prompt still goes to the least loaded worker.
			d, err := g.Route(RouteRequest{TokenIDs: tokens(900000, 256), Track: true})
			if err != nil || d.Reason != picker.ReasonNoOverlap || (tc.wantSame && d.Worker == first.Worker) {
				t.Errorf("unrelated prompt: %+v %v", d, err)
			}
		})
	}
}

// TestBurstFollowsTheFirstPlacement: concurrent tracked requests with one
// new prefix all go where the first went (the spill gate allowing), instead
// of being spread by least load before any engine reports the prefix.
func TestBurstFollowsTheFirstPlacement(t *testing.T) {
	g := idleGateway(t, 8, Config{})
	prompt := tokens(0, 512)
	const burst = 16
	workers := make([]string, burst)
	var wg sync.WaitGroup
	for i := range burst {
		wg.Go(func() {
			d, err := g.Route(RouteRequest{TokenIDs: append(append([]uint32{}, prompt...), uint32(50000+i)), Track: true})
			if err != nil {
				t.Error(err)
				return
			}
			workers[i] = d.Worker
		})
	}
	wg.Wait()
	for i, w := range workers {
		if w != workers[0] {
			t.Fatalf("request %d went to %s, request 0 to %s: %v", i, w, workers[0], workers)
		}
	}
}

// TestPlacementWeight: a weight below 1 counts inferred blocks for less
// than stored ones.
// The decision log names the branch and the inferred blocks.
func TestPlacementWeight(t *testing.T) {
	var buf logbuf.Buffer
	log := slog.New(slog.NewJSONHandler(&buf, &slog.HandlerOptions{Level: slog.LevelDebug}))
	g := idleGateway(t, 2, Config{Logger: log, Placements: placement.Options{Weight: 0.25}})
	prompt := tokens(0, 128) // 8 blocks
	first, err := g.Route(RouteRequest{TokenIDs: prompt})
	if err != nil {
		t.Fatal(err)
	}
	d, err := g.Route(RouteRequest{TokenIDs: prompt})
	if err != nil || d.Worker != first.Worker || d.MatchedBlocks[first.Worker] != 2 {
		t.Fatalf("second route: %+v %v, want %s with 8 × 0.25 = 2 blocks", d, err, first.Worker)
	}
	lines := routeDecisions(buf.String())
	if len(lines) != 2 {
		t.Fatalf("%d decision lines, want 2", len(lines))
	}
	if l := lines[1]; l["branch"] != "placement_hit" || l["inferred_blocks"] != float64(8) || l["matched_blocks"] != float64(2) {
		t.Errorf("decision line %v", l)
	}
}

// TestPlacementExpires: past its TTL a placement no longer attracts the
// prefix; the sweep drops what no lookup walked over.
func TestPlacementExpires(t *testing.T) {
	g := idleGateway(t, 3, Config{Placements: placement.Options{TTL: time.Minute}})
	now := time.Unix(1_000_000, 0)
	g.now = func() time.Time { return now }
	prompt := tokens(0, 64)
	first, err := g.Route(RouteRequest{TokenIDs: prompt, Track: true})
	if err != nil {
		t.Fatal(err)
	}
	g.Route(RouteRequest{TokenIDs: tokens(7000, 64), Track: true}) // another prefix, elsewhere
	now = now.Add(time.Minute)
	d, err := g.Route(RouteRequest{TokenIDs: prompt})
	if err != nil || d.Worker == first.Worker || d.Reason != picker.ReasonNoOverlap {
		t.Fatalf("after the TTL: %+v %v, want no_overlap away from the busy %s", d, err, first.Worker)
	}
	g.sweepPlacements()
	// Left: only the route just made (4 blocks, fresh).
	if st := g.models[DefaultModel].places.Stats(); st.Entries != 4 || st.Expired != 8 {
		t.Fatalf("after the sweep: %+v, want 4 entries, 8 expired", st)
	}
}

// TestPlacementConfirmedByTheEngine: once the engine reports the blocks,
// the index holds them and the placements go (counted as confirmed); the
// route is then an event_hit, and the engine's removal of the blocks is
// seen through the index.
func TestPlacementConfirmedByTheEngine(t *testing.T) {
	a, b := startEngine(t), startEngine(t)
	reg := prometheus.NewRegistry()
	g := runGateway(t, Config{Registerer: reg, Workers: []Worker{{ID: "A", Addr: a.addr}, {ID: "B", Addr: b.addr}}})
	prompt := tokens(0, 64) // 4 blocks of 16
	d, err := g.Route(RouteRequest{TokenIDs: prompt, Loads: map[string]int{"A": 0, "B": 1}})
	if err != nil || d.Worker != "A" || d.Reason != picker.ReasonNoOverlap {
		t.Fatalf("first route: %+v %v", d, err)
	}
	if n := testutil.ToFloat64(gaugeOf(t, reg, "kvrelay_gateway_placements")); n != 4 {
		t.Fatalf("placements gauge = %v, want 4", n)
	}
	d, _ = g.Route(RouteRequest{TokenIDs: prompt})
	if d.Worker != "A" || d.Reason != picker.ReasonPlacementHit {
		t.Fatalf("before the engine reports: %+v", d)
	}
	a.batches <- storeBatch(1, 16, 100, prompt)
	eventually(t, "A's blocks indexed", func() bool { return workerStatus(t, g, "A").IndexBlocks == 4 })
	if d, err := g.Route(RouteRequest{TokenIDs: prompt}); err != nil || d.Worker != "A" || d.Reason != picker.ReasonHit {
		t.Fatalf("after the engine's store: %+v %v, want A/event_hit", d, err)
	}
	st := g.models[DefaultModel].places.Stats()
	if st.Entries != 0 || st.Confirmed != 4 {
		t.Fatalf("placements after the engine's store: %+v, want 0 left, 4 confirmed", st)
	}
	if got := testutil.ToFloat64(g.metrics.routes.WithLabelValues(DefaultModel, "placement_hit")); got != 1 {
		t.Errorf("placement_hit decisions = %v, want 1", got)
	}
}

// TestRemoveWorkerDropsItsPlacements: a removed worker's placements go with
// it, counted as removed.
func TestRemoveWorkerDropsItsPlacements(t *testing.T) {
	g := idleGateway(t, 2, Config{})
	prompt := tokens(0, 64)
	first, err := g.Route(RouteRequest{TokenIDs: prompt})
	if err != nil {
		t.Fatal(err)
	}
	if err := g.RemoveWorker(first.Worker); err != nil {
		t.Fatal(err)
	}
	if st := g.models[DefaultModel].places.Stats(); st.Entries != 0 || st.Removed != 4 {
		t.Fatalf("after removal: %+v", st)
	}
}

func TestNewValidatesPlacements(t *testing.T) {
	for _, o := range []placement.Options{{Weight: 2}, {TTL: -time.Second}, {MaxEntries: -1}} {
		if _, err := New(Config{Placements: o}); err == nil {
			t.Errorf("placement options %+v accepted", o)
		}
	}
	if _, err := New(Config{Placements: placement.Options{Weight: 2}, NoPlacements: true}); err != nil {
		t.Errorf("options of disabled placements checked: %v", err)
	}
}

// gaugeOf gathers the single-series gauge name.
func gaugeOf(t *testing.T, reg *prometheus.Registry, name string) prometheus.Collector {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() == name && len(mf.GetMetric()) == 1 {
			g := prometheus.NewGauge(prometheus.GaugeOpts{Name: name})
			g.Set(mf.GetMetric()[0].GetGauge().GetValue())
			return g
		}
	}
	t.Fatalf("no single series of %s", name)
	return nil
}

// TestTextRequests: requests without token ids get prefix affinity among
// themselves from the placements (64-byte pseudo-blocks), and never match
// token requests.
func TestTextRequests(t *testing.T) {
	g := idleGateway(t, 4, Config{})
	system := strings.Repeat("You are a careful assistant. Answer briefly and cite sources. ", 20) // 1,240 bytes: 19 blocks
	first, err := g.Route(RouteRequest{Text: system + "What is KV caching?", Track: true})
	if err != nil || first.Reason != picker.ReasonNoOverlap || first.RequestBlocks != 19 {
		t.Fatalf("first text route: %+v %v", first, err)
	}
	d, err := g.Route(RouteRequest{Text: system + "And prefix caching?", Track: true})
	if err != nil || d.Worker != first.Worker || d.Reason != picker.ReasonPlacementHit || d.MatchedBlocks[first.Worker] != 19 {
		t.Fatalf("same system prompt: %+v %v, want %s", d, err, first.Worker)
	}
	// Another salt is another namespace, as for tokens.
	if d, _ := g.Route(RouteRequest{Text: system, CacheSalt: "tenant-b", Track: true}); d.Reason != picker.ReasonNoOverlap {
		t.Errorf("other cache salt: %+v", d)
	}
	// Token ids win over text, and text blocks are not token blocks.
	var words []uint32
	for i := 0; i+4 <= len(system); i += 4 {
		words = append(words, uint32(system[i])|uint32(system[i+1])<<8|uint32(system[i+2])<<16|uint32(system[i+3])<<24)
	}
	if d, _ := g.Route(RouteRequest{TokenIDs: words, Text: system}); d.Reason != picker.ReasonNoOverlap {
		t.Errorf("token ids with the text's bytes: %+v", d)
	}
	// With placements off, text is routed by load.
	off := idleGateway(t, 2, Config{NoPlacements: true})
	off.Route(RouteRequest{Text: system, Track: true})
	if d, _ := off.Route(RouteRequest{Text: system, Track: true}); d.Reason != picker.ReasonNoOverlap || d.Worker != "w1" {
		t.Errorf("placements off: %+v", d)
	}
}
