package placementsync

import (
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/kvrelay/kvrelay/gateway"
	"github.com/kvrelay/kvrelay/gateway/picker"
	"github.com/kvrelay/kvrelay/internal/freeport"
	"github.com/kvrelay/kvrelay/testkit/logbuf"
	"github.com/kvrelay/kvrelay/testkit/testnats"
)

const waitFor = 10 * time.Second

// runNATS starts an embedded core NATS server (placements use no
// JetStream) on a random port and stops it at the test's end; Stop and
// Restart it in place to take it away and bring it back on its port.
func runNATS(t testing.TB) *testnats.Node {
	t.Helper()
	return testnats.Start(t, testnats.Config{NoJetStream: true})
}

// replica is one gateway replica with its sync. Its workers never connect
// (their index stays empty), so what it knows of a prefix is placements.
type replica struct {
	g    *gateway.Gateway
	sync *Sync
	reg  *prometheus.Registry
}

func startReplica(t testing.TB, url string, workers int) *replica {
	t.Helper()
	var ws []gateway.Worker
	for i := range workers {
		ws = append(ws, gateway.Worker{ID: fmt.Sprintf("w%d", i), Addr: "127.0.0.1:1", Model: "llama"})
	}
	g, err := gateway.New(gateway.Config{Workers: ws})
	if err != nil {
		t.Fatal(err)
	}
	reg := prometheus.NewRegistry()
	s, err := Start(g, Options{URL: url, Registerer: reg, ReconnectWait: 50 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Close)
	g.SetPlacementPublisher(s)
	return &replica{g: g, sync: s, reg: reg}
}

func eventually(t testing.TB, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(waitFor)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func prompt(base, n int) []uint32 {
	out := make([]uint32, n)
	for i := range out {
		out[i] = uint32(base + i)
	}
	return out
}

func placements(r *replica) int {
	st, _ := r.g.PlacementStats("llama")
	return st.Entries
}

// routeTracked routes p on r as a tracked request (its load counts).
func routeTracked(t testing.TB, r *replica, p []uint32) gateway.Decision {
	t.Helper()
	d, err := r.g.Route(gateway.RouteRequest{Model: "llama", TokenIDs: p, Track: true})
	if err != nil {
		t.Fatal(err)
	}
	return d
}

// TestSharedBetweenReplicas: a prefix routed on one replica is routed to
// the same worker by the others (placement_hit), each of which has its own
// load view and an empty index, with two and with three replicas.
func TestSharedBetweenReplicas(t *testing.T) {
	for _, n := range []int{2, 3} {
		t.Run(fmt.Sprintf("%d replicas", n), func(t *testing.T) {
			url := runNATS(t).URL()
			var rs []*replica
			for range n {
				rs = append(rs, startReplica(t, url, 4))
			}
			for _, r := range rs {
				eventually(t, "connected", r.sync.Connected)
				// A flush round-trip puts its subscription in place.
				if err := r.sync.Flush(waitFor); err != nil {
					t.Fatal(err)
				}
			}
			// Each other replica first routes something else, so its least
			// loaded worker is not the one the first replica chose.
			for i, r := range rs[1:] {
				routeTracked(t, r, prompt(100000*(i+1), 64))
			}
			first := routeTracked(t, rs[0], prompt(0, 256)) // 16 blocks
			for i, r := range rs[1:] {
				eventually(t, fmt.Sprintf("replica %d has the placement", i+1), func() bool { return placements(r) >= 16+4 })
				d := routeTracked(t, r, append(prompt(0, 256), 7, 7, 7))
				if d.Worker != first.Worker || d.Reason != picker.ReasonPlacementHit {
					t.Errorf("replica %d: %s (%s), want %s (placement_hit)", i+1, d.Worker, d.Reason, first.Worker)
				}
			}
			if got := testutil.ToFloat64(rs[0].sync.shared.WithLabelValues("published")); got != 1 {
				t.Errorf("replica 0 published %v, want 1", got)
			}
			// NoEcho: replica 0 never applies its own placement twice.
			if got := testutil.ToFloat64(rs[0].sync.shared.WithLabelValues("received")); got != float64(n-1) {
				t.Errorf("replica 0 received %v, want the other replicas' %d", got, n-1)
			}
		})
	}
}

// TestNATSUnavailableAtStart: a replica whose NATS is down routes on its own
// placements, says so in its gauge, and shares once the server comes up.
func TestNATSUnavailableAtStart(t *testing.T) {
	port := freeport.ForTest(t, 1)
	url := fmt.Sprintf("nats://127.0.0.1:%d", port)
	a, b := startReplica(t, url, 4), startReplica(t, url, 4)
	if got := testutil.ToFloat64(gaugeOf(t, a.reg)); got != 0 {
		t.Fatalf("nats_connected = %v before the server exists", got)
	}
	// Local routing works, with local placements.
	first := routeTracked(t, a, prompt(0, 64))
	if d := routeTracked(t, a, prompt(0, 64)); d.Worker != first.Worker || d.Reason != picker.ReasonPlacementHit {
		t.Fatalf("local placement while NATS is down: %+v", d)
	}
	if got := testutil.ToFloat64(a.sync.shared.WithLabelValues("dropped")); got < 1 {
		t.Errorf("dropped = %v, want ≥ 1", got)
	}
	if placements(b) != 0 {
		t.Fatalf("b has placements with NATS down")
	}
	testnats.Start(t, testnats.Config{Port: port, NoJetStream: true})
	eventually(t, "both connected", func() bool { return a.sync.Connected() && b.sync.Connected() })
	if got := testutil.ToFloat64(gaugeOf(t, a.reg)); got != 1 {
		t.Fatalf("nats_connected = %v after connecting", got)
	}
	// The subscription is in place once a flush round-trips after connect.
	if err := b.sync.Flush(waitFor); err != nil {
		t.Fatal(err)
	}
	routeTracked(t, b, prompt(500000, 64))
	d := routeTracked(t, a, prompt(900000, 128))
	eventually(t, "b has a's placement", func() bool { return placements(b) == 4+8 })
	if got := routeTracked(t, b, prompt(900000, 128)); got.Worker != d.Worker || got.Reason != picker.ReasonPlacementHit {
		t.Errorf("b after reconnect: %+v, want %s", got, d.Worker)
	}
}

// TestNATSLostDuringARun: the server goes away and comes back on the same
// port; routing never stops and sharing resumes.
func TestNATSLostDuringARun(t *testing.T) {
	ns := runNATS(t)
	url := ns.URL()
	a, b := startReplica(t, url, 4), startReplica(t, url, 4)
	eventually(t, "both connected", func() bool { return a.sync.Connected() && b.sync.Connected() })
	if err := b.sync.Flush(waitFor); err != nil {
		t.Fatal(err)
	}
	routeTracked(t, a, prompt(0, 64))
	eventually(t, "shared before the outage", func() bool { return placements(b) == 4 })

	ns.Stop()
	eventually(t, "both see the outage", func() bool { return !a.sync.Connected() && !b.sync.Connected() })
	if got := testutil.ToFloat64(gaugeOf(t, a.reg)); got != 0 {
		t.Fatalf("nats_connected = %v during the outage", got)
	}
	first := routeTracked(t, a, prompt(1000, 64))
	if d := routeTracked(t, a, prompt(1000, 64)); d.Worker != first.Worker || d.Reason != picker.ReasonPlacementHit {
		t.Fatalf("routing during the outage: %+v", d)
	}

	ns.Restart()
	eventually(t, "both reconnected", func() bool { return a.sync.Connected() && b.sync.Connected() })
	if err := b.sync.Flush(waitFor); err != nil {
		t.Fatal(err)
	}
	before := placements(b)
	routeTracked(t, a, prompt(2000, 64))
	eventually(t, "shared after the outage", func() bool { return placements(b) == before+4 })
	// What a placed during the outage was dropped, not replayed late.
	if got := testutil.ToFloat64(b.sync.shared.WithLabelValues("received")); got != 2 {
		t.Errorf("b received %v placements, want 2 (before and after the outage)", got)
	}
}

// TestRejectsUnknownWorkersAndGarbage: a placement naming a worker or
// model this replica does not route, or an undecodable one, is counted and
// ignored.
func TestRejectsUnknownWorkersAndGarbage(t *testing.T) {
	url := runNATS(t).URL()
	a := startReplica(t, url, 2)
	other := startReplica(t, url, 2)
	eventually(t, "connected", func() bool { return a.sync.Connected() && other.sync.Connected() })
	if err := a.sync.Flush(waitFor); err != nil {
		t.Fatal(err)
	}
	other.sync.PublishPlacement("llama", "w9", []uint64{1, 2})
	other.sync.PublishPlacement("mistral", "w0", []uint64{1, 2})
	if err := other.sync.nc.Publish(DefaultSubjectPrefix+".llama", []byte{1, 200}); err != nil {
		t.Fatal(err)
	}
	other.sync.PublishPlacement("llama", "w1", []uint64{1, 2})
	eventually(t, "all four handled", func() bool {
		return testutil.ToFloat64(a.sync.shared.WithLabelValues("rejected")) == 3 &&
			testutil.ToFloat64(a.sync.shared.WithLabelValues("received")) == 1
	})
	if placements(a) != 2 {
		t.Errorf("placements = %d, want the valid one's 2", placements(a))
	}
}

func TestStartValidates(t *testing.T) {
	g, err := gateway.New(gateway.Config{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := Start(g, Options{URL: " "}); err == nil {
		t.Error("empty URL accepted")
	}
	if _, err := Start(nil, Options{URL: "nats://127.0.0.1:4222"}); err == nil {
		t.Error("nil target accepted")
	}
}

func gaugeOf(t testing.TB, reg *prometheus.Registry) prometheus.Collector {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() == "kvrelay_gateway_nats_connected" {
			g := prometheus.NewGauge(prometheus.GaugeOpts{Name: "x"})
			g.Set(mf.GetMetric()[0].GetGauge().GetValue())
			return g
		}
	}
	t.Fatal("no kvrelay_gateway_nats_connected")
	return nil
}

// TestAsyncErrorsGoToTheLog: nats.go's asynchronous errors reach the
// replica's logger; without a handler of ours, nats.go writes them to
// stderr, past slog and --log-format json.
func TestAsyncErrorsGoToTheLog(t *testing.T) {
	url := runNATS(t).URL()
	g, err := gateway.New(gateway.Config{Workers: []gateway.Worker{{ID: "w0", Addr: "127.0.0.1:1", Model: "llama"}}})
	if err != nil {
		t.Fatal(err)
	}
	var logs logbuf.Buffer
	s, err := Start(g, Options{URL: url, Registerer: prometheus.NewRegistry(), Logger: slog.New(slog.NewJSONHandler(&logs, nil))})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Close)
	h := s.nc.ErrorHandler()
	if h == nil {
		t.Fatal("no asynchronous error handler: nats.go would write its errors to stderr")
	}
	h(s.nc, nil, errors.New("write on a broken pipe"))
	if !strings.Contains(logs.String(), `"err":"write on a broken pipe"`) {
		t.Fatalf("the error did not reach the log: %q", logs.String())
	}
}

func TestRemovalDropsThePlacementsOnTheOtherReplicas(t *testing.T) {
	srv := runNATS(t)
	a := startReplica(t, srv.URL(), 2)
	b := startReplica(t, srv.URL(), 2)
	// Both connected, b's subscriptions on the server.
	eventually(t, "both replicas connected", func() bool { return a.sync.Connected() && b.sync.Connected() })
	if err := b.sync.Flush(waitFor); err != nil {
		t.Fatal(err)
	}
	// Placements on both workers, made on a and shared with b: 8 prompts
	// of 4 blocks (block size 16), tracked so the load spreads them.
	perWorker := map[string]int{}
	for i := range 8 {
		d, err := a.g.Route(gateway.RouteRequest{Model: "llama", TokenIDs: prompt(1000*i, 64), Track: true})
		if err != nil {
			t.Fatal(err)
		}
		perWorker[d.Worker] += d.RequestBlocks
	}
	if perWorker["w0"] == 0 || perWorker["w1"] == 0 {
		t.Fatalf("placements not on both workers: %v", perWorker)
	}
	if err := a.sync.Flush(waitFor); err != nil {
		t.Fatal(err)
	}
	entries := func(r *replica) int {
		st, _ := r.g.PlacementStats("llama")
		return st.Entries
	}
	total := perWorker["w0"] + perWorker["w1"]
	eventually(t, "b holds a's placements", func() bool { return entries(b) == total })
	if err := a.g.RemoveWorker("w1"); err != nil {
		t.Fatal(err)
	}
	eventually(t, "b drops its placements on w1, and only those", func() bool { return entries(b) == perWorker["w0"] })
	if got := testutil.ToFloat64(b.sync.removals.WithLabelValues("received")); got != 1 {
		t.Fatalf("removals received %v", got)
	}
	if got := testutil.ToFloat64(a.sync.removals.WithLabelValues("published")); got != 1 {
		t.Fatalf("removals published %v", got)
	}
}
