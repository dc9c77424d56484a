package gateway

import (
	"context"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrelay/kvrelay/gateway/index"
	"github.com/kvrelay/kvrelay/gateway/picker"
	"github.com/kvrelay/kvrelay/relay"
	"github.com/kvrelay/kvrelay/sim"
	"github.com/kvrelay/kvrelay/testkit/testrelay"
)

// relayedEngine is a simulated vLLM engine behind a real kvrelay relay and
// gRPC server, all in this process (ZeroMQ and gRPC over loopback). The
// relay and the server can be stopped and started again on the same address.
type relayedEngine struct {
	t      *testing.T
	eng    *sim.Engine
	dpSize int
	addr   string

	stopServer func() // set while the server runs
	stopRelay  func() // set while the relay runs
	rel        *relay.Relay
}

func startRelayedEngine(t *testing.T, dpSize int) *relayedEngine {
	t.Helper()
	r := &relayedEngine{t: t, eng: testrelay.StartEngine(t, dpSize, 256), dpSize: dpSize, addr: "127.0.0.1:0"}
	t.Cleanup(r.down)
	r.startRelay()
	r.startServer()
	return r
}

// startRelay starts a fresh relay (no history, no record) and waits until
// it is connected to every rank.
func (r *relayedEngine) startRelay() {
	r.t.Helper()
	r.rel, r.stopRelay = testrelay.StartRelay(r.t, r.eng, r.dpSize)
}

// startServer serves the current relay on r.addr (a fresh port the first
// time, the same one afterwards).
func (r *relayedEngine) startServer() {
	r.t.Helper()
	r.addr, r.stopServer = testrelay.Serve(r.t, r.rel, r.addr)
}

// down stops whatever runs of the server and the relay.
func (r *relayedEngine) down() {
	if r.stopServer != nil {
		r.stopServer()
		r.stopServer = nil
	}
	if r.stopRelay != nil {
		r.stopRelay()
		r.stopRelay = nil
	}
}

// step serves one prompt on one rank.
func step(t *testing.T, e *sim.Engine, rank int, toks []uint32) {
	t.Helper()
	if _, err := e.Step(sim.Request{Rank: rank, Tokens: toks}); err != nil {
		t.Fatal(err)
	}
}

func workload(t *testing.T, e *sim.Engine, n int) {
	t.Helper()
	if _, err := e.RunWorkload(n); err != nil {
		t.Fatal(err)
	}
}

// startGateway runs a gateway over the engines; stop ends it (and is also
// registered as a cleanup).
func startGateway(t *testing.T, a, b *relayedEngine) (g *Gateway, reg *prometheus.Registry, stop func()) {
	t.Helper()
	return startGatewayWith(t, Worker{ID: "A", Addr: a.addr, Model: "llama"}, Worker{ID: "B", Addr: b.addr, Model: "llama"})
}

// startGatewayAt runs a gateway with one worker "P" of model llama at addr.
func startGatewayAt(t *testing.T, addr string) (g *Gateway, reg *prometheus.Registry, stop func()) {
	t.Helper()
	return startGatewayWith(t, Worker{ID: "P", Addr: addr, Model: "llama"})
}

func startGatewayWith(t *testing.T, workers ...Worker) (g *Gateway, reg *prometheus.Registry, stop func()) {
	t.Helper()
	reg = prometheus.NewRegistry()
	g, err := New(Config{Workers: workers, Registerer: reg})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = g.Run(ctx) }()
	var once sync.Once
	stop = func() { once.Do(func() { cancel(); <-done }) }
	t.Cleanup(stop)
	return g, reg, stop
}

// counter reads a counter's value for the given labels, 0 if absent.
func counter(t *testing.T, reg *prometheus.Registry, name string, labels map[string]string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	metrics:
		for _, m := range mf.GetMetric() {
			have := map[string]string{}
			for _, l := range m.GetLabel() {
				have[l.GetName()] = l.GetValue()
			}
			for k, v := range labels {
				if have[k] != v {
					continue metrics
				}
			}
			return m.GetCounter().GetValue()
		}
	}
	return 0
}

// assertExact waits until the index holds exactly each engine's live set.
func assertExact(t *testing.T, g *Gateway, engines map[string]*sim.Engine, when string) {
	t.Helper()
	ix := g.models["llama"].ix
	for id, e := range engines {
		want := testrelay.EngineLive(e)
		deadline := time.Now().Add(waitFor)
		for !slices.Equal(ix.LiveSet(id), want) {
			if time.Now().After(deadline) {
				got := ix.LiveSet(id)
				t.Fatalf("%s: index of %s holds %d blocks, engine %d; status %+v\nmissing %v\nextra %v", when, id, len(got), len(want), workerStatus(t, g, id), diffLive(want, got), diffLive(got, want))
			}
			time.Sleep(5 * time.Millisecond)
		}
	}
}

// assertRoutes checks that each prompt goes to the worker that served it.
func assertRoutes(t *testing.T, g *Gateway, when string, cases map[string][]uint32) {
	t.Helper()
	for worker, prompt := range cases {
		d, err := g.Route(RouteRequest{Model: "llama", TokenIDs: prompt})
		if err != nil {
			t.Fatal(err)
		}
		if d.Worker != worker || d.Reason != picker.ReasonHit || d.MatchedBlocks[worker] != len(prompt)/16 {
			t.Errorf("%s: route for %s's prompt: %+v", when, worker, d)
		}
	}
}

// TestEndToEndThroughTheRelay: simulated engines → kvrelay relay → gRPC →
// monitor → index → picker. A repeated prompt goes to the engine that served
// it, and the index holds exactly each engine's live set.
func TestEndToEndThroughTheRelay(t *testing.T) {
	a := startRelayedEngine(t, 2)
	b := startRelayedEngine(t, 1)
	g, reg, stopGateway := startGateway(t, a, b)
	engines := map[string]*sim.Engine{"A": a.eng, "B": b.eng}

	promptA := tokens(10_000, 16*12)
	promptB := tokens(90_000, 16*7)
	serve := func() {
		// Background traffic (evictions included), then the two prompts so
		// they are surely live.
		workload(t, a.eng, 40)
		workload(t, b.eng, 40)
		step(t, a.eng, 1, promptA)
		step(t, b.eng, 0, promptB)
	}
	routes := map[string][]uint32{"A": promptA, "B": promptB}

	serve()
	assertExact(t, g, engines, "first run")
	assertRoutes(t, g, "first run", routes)

	// A dropped connection: the server goes away while the relay keeps
	// recording; the gateway resumes from its cursors out of the history.
	a.stopServer()
	a.stopServer = nil
	workload(t, a.eng, 20)
	a.startServer()
	step(t, a.eng, 1, promptA)
	assertExact(t, g, engines, "after a dropped connection")
	if w := workerStatus(t, g, "A"); w.Degraded || w.Subscriptions < 2 {
		t.Errorf("after a dropped connection: %+v", w)
	}

	// A relay restart: the new relay knows nothing of the old cursors.
	a.down()
	workload(t, a.eng, 20)
	a.startRelay()
	a.startServer()
	step(t, a.eng, 1, promptA)
	assertExact(t, g, engines, "after a relay restart")
	assertRoutes(t, g, "after a relay restart", routes)
	if w := workerStatus(t, g, "A"); w.Subscriptions < 3 {
		t.Errorf("after a relay restart: %+v", w)
	}

	// A gateway restart: a new gateway starts from zero.
	stopGateway()
	g, reg, _ = startGateway(t, a, b)
	assertExact(t, g, engines, "after a gateway restart")
	assertRoutes(t, g, "after a gateway restart", routes)
	for _, w := range g.Workers() {
		if w.Degraded || w.BlockSize != 16 {
			t.Errorf("worker %s: %+v", w.ID, w)
		}
	}

	// A publisher restart: sequences start again at 0 and the cache is empty.
	// A SUB needs a moment to reconnect to the new PUB and misses what is
	// published before (ZeroMQ's slow joiner), so the engine serves small
	// requests until the relay hears one; the relay then sees the restart
	// and recovers the missed batches from the engine's replay ring.
	// It publishes only while the new sequences stay below the relay's old
	// cursor: one the relay reads as the old incarnation's next is no
	// restart to any relay. A relay slow to reconnect (a loaded machine)
	// finds the restart with its catch-up replay instead.
	st := b.rel.Status()
	relayed, old := st.Relayed, *st.Ranks[0].Cursor
	if err := b.eng.Fault(sim.Fault{Kind: sim.FaultRestart}); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(3 * waitFor)
	for i := 0; b.rel.Status().Relayed == relayed; i++ {
		if time.Now().After(deadline) {
			t.Fatalf("the relay received nothing from the restarted publisher: %+v", b.rel.Status())
		}
		if b.eng.PublisherStats()[0].NextSeq+2 < old {
			step(t, b.eng, 0, tokens(500_000+16*i, 16))
		}
		time.Sleep(25 * time.Millisecond)
	}
	serve()
	assertExact(t, g, engines, "after a publisher restart")
	assertRoutes(t, g, "after a publisher restart", routes)
	restarts := counter(t, reg, "kvrelay_gateway_resyncs_total", map[string]string{"worker": "B", "reason": "publisher_restart"}) +
		counter(t, reg, "kvrelay_gateway_resyncs_total", map[string]string{"worker": "B", "reason": "data_loss"}) +
		counter(t, reg, "kvrelay_gateway_resyncs_total", map[string]string{"worker": "B", "reason": "out_of_range"})
	if restarts < 1 {
		t.Error("the publisher restart left no resync")
	}
}

func workerStatus(t *testing.T, g *Gateway, id string) WorkerStatus {
	t.Helper()
	for _, w := range g.Workers() {
		if w.ID == id {
			return w
		}
	}
	t.Fatalf("no worker %s", id)
	return WorkerStatus{}
}

// diffLive lists the rows of a that b lacks.
func diffLive(a, b []index.LiveBlock) []index.LiveBlock {
	var out []index.LiveBlock
	for _, x := range a {
		if !slices.Contains(b, x) {
			out = append(out, x)
		}
	}
	return out
}
