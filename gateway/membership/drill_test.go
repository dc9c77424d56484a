package membership

import (
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrelay/kvrelay/gateway"
	"github.com/kvrelay/kvrelay/gateway/monitor"
	"github.com/kvrelay/kvrelay/sim"
	"github.com/kvrelay/kvrelay/testkit/testrelay"
)

// drillNode is one engine with its relay: a simulated vLLM engine over
// ZeroMQ, a real relay, its gRPC server on loopback.
type drillNode struct {
	eng *sim.Engine
	reg *prometheus.Registry // the relay's metrics
	w   gateway.Worker
}

// subscriptions is how many SubscribeKvEvents the relay served.
func (n *drillNode) subscriptions(t *testing.T) int {
	t.Helper()
	mfs, err := n.reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	total := 0.0
	for _, mf := range mfs {
		if mf.GetName() == "kvrelay_subscriptions_total" {
			for _, m := range mf.GetMetric() {
				total += m.GetCounter().GetValue()
			}
		}
	}
	return int(total)
}

// router routes tracked requests until stopped, keeping a few in flight,
// and checks every decision against the workers that were out (draining or
// removed) when it started.
type router struct {
	g   *gateway.Gateway
	out atomic.Pointer[map[string]bool]

	mu         sync.Mutex
	routes     map[string]int
	violations []string
	failures   int
}

func (r *router) run(ctx context.Context) {
	var window []gateway.Decision
	defer func() {
		for _, d := range window {
			d.Done()
		}
	}()
	rng := rand.New(rand.NewPCG(1, 2))
	prompt := make([]uint32, 64)
	for ctx.Err() == nil {
		out := *r.out.Load()
		for i := range prompt {
			prompt[i] = rng.Uint32N(5000)
		}
		d, err := r.g.Route(gateway.RouteRequest{TokenIDs: prompt, Track: true})
		// Out when the route began and still out when it ended: a joiner
		// added meanwhile is not out any more.
		after := *r.out.Load()
		r.mu.Lock()
		switch {
		case err != nil:
			r.failures++
		case out[d.Worker] && after[d.Worker]:
			r.violations = append(r.violations, d.Worker)
		default:
			r.routes[d.Worker]++
		}
		r.mu.Unlock()
		if err != nil {
			continue
		}
		window = append(window, d)
		if len(window) > 8 {
			window[0].Done()
			window = window[1:]
		}
	}
}

func (r *router) count(w string) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.routes[w]
}

// TestJoinLeaveDrill: workers join and leave under routing load. After each
// change the index holds exactly each member engine's live blocks and
// nothing of the others, no request is routed to a worker that was
// draining or removed when its route began, every member is routed to, and
// each relay serves one subscription per time its worker joined: a change
// never makes the other workers resubscribe (no snapshot storm).
func TestJoinLeaveDrill(t *testing.T) {
	const nodes = 4
	var ns []*drillNode
	for range nodes {
		n := &drillNode{eng: testrelay.StartEngine(t, 1, 64), reg: prometheus.NewRegistry()}
		rel, stopRelay := testrelay.StartRelayRegistered(t, n.eng, 1, n.reg)
		addr, stopServer := testrelay.Serve(t, rel, "127.0.0.1:0")
		t.Cleanup(func() { stopServer(); stopRelay() })
		n.w = gateway.Worker{ID: "grpc://" + addr, Addr: addr, Service: monitor.ServiceVLLM, Model: gateway.DefaultModel}
		ns = append(ns, n)
	}
	g, err := gateway.New(gateway.Config{Monitor: monitor.Options{MaxBackoff: 200 * time.Millisecond}})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	runDone := make(chan struct{})
	go func() { defer close(runDone); _ = g.Run(ctx) }()
	defer func() { cancel(); <-runDone }()
	set, err := New(g, Options{DrainTimeout: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer set.Close()

	r := &router{g: g, routes: map[string]int{}}
	none := map[string]bool{}
	r.out.Store(&none)
	joins := make([]int, nodes)

	apply := func(members ...int) {
		t.Helper()
		var ws []gateway.Worker
		out := map[string]bool{}
		for i, n := range ns {
			if slices.Contains(members, i) {
				ws = append(ws, n.w)
				if !slices.Contains(set.Routable(), n.w.ID) {
					joins[i]++
				}
			} else {
				out[n.w.ID] = true
			}
		}
		// While Replace runs, the joiners may already be routed to and the
		// leavers still may: only the workers out before and after are
		// out for a route that begins meanwhile.
		during := map[string]bool{}
		for w := range *r.out.Load() {
			if out[w] {
				during[w] = true
			}
		}
		r.out.Store(&during)
		if err := set.Replace(SourceFile, ws); err != nil {
			t.Fatal(err)
		}
		// Replace has drained the leavers: from here on, no route begins
		// with one of them eligible.
		r.out.Store(&out)
	}
	rctx, rcancel := context.WithCancel(context.Background())
	routerDone := make(chan struct{})
	// The first members before routing starts: a model with no worker
	// is an error, not a route.
	apply(0, 1)
	go func() { defer close(routerDone); r.run(rctx) }()
	defer func() { rcancel(); <-routerDone }()

	for step, members := range [][]int{{0, 1}, {0, 1, 2}, {0, 2}, {2, 3}, {1, 2, 3}} {
		when := fmt.Sprintf("step %d (members %v)", step, members)
		apply(members...)
		for _, n := range ns {
			if _, err := n.eng.RunWorkload(40); err != nil {
				t.Fatal(err)
			}
		}
		before := map[string]int{}
		for _, n := range ns {
			before[n.w.ID] = r.count(n.w.ID)
		}
		deadline := time.Now().Add(30 * time.Second)
		for i, n := range ns {
			member := slices.Contains(members, i)
			for {
				got, known := g.LiveSet(n.w.ID)
				var ok bool
				if member {
					ok = known && slices.Equal(got, testrelay.EngineLive(n.eng))
				} else {
					ok = !known
				}
				if ok && (!member || r.count(n.w.ID) > before[n.w.ID]) {
					break
				}
				if time.Now().After(deadline) {
					t.Fatalf("%s: node %d (member %v): index holds %d rows (known %v), engine %d; routes %d → %d",
						when, i, member, len(got), known, len(testrelay.EngineLive(n.eng)), before[n.w.ID], r.count(n.w.ID))
				}
				time.Sleep(5 * time.Millisecond)
			}
		}
		r.mu.Lock()
		t.Logf("%s: exact; routes so far %v", when, r.routes)
		r.mu.Unlock()
	}
	rcancel()
	<-routerDone
	if len(r.violations) > 0 {
		t.Fatalf("%d routes went to a worker out of the fleet when they began: %v", len(r.violations), r.violations[:min(5, len(r.violations))])
	}
	if r.failures > 0 {
		t.Fatalf("%d routes failed", r.failures)
	}
	for i, n := range ns {
		if got := n.subscriptions(t); got != joins[i] {
			t.Errorf("node %d: its relay served %d subscriptions, want %d (one per join)", i, got, joins[i])
		}
	}
	if got := readCounter(set.changes.WithLabelValues(SourceFile, "remove")); got != 2 {
		t.Errorf("removals %v, want 2", got)
	}
}
