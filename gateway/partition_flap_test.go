package gateway

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/kvrelay/kvrelay/gateway/monitor"
)

// flapTier is partition 0 of a 2-partition tier over models × perModel
// workers, whose scatter answers for partition 1 as two of its replicas
// that disagree on one worker's reachability would, taking turns: one
// says the worker is unreachable, the other does not.
type flapTier struct {
	g      *Gateway
	victim string // partition 1's worker of model m0 the replicas disagree on
	turn   atomic.Uint64
}

func newFlapTier(tb testing.TB, models, perModel int, flap bool) *flapTier {
	tb.Helper()
	cfg := Config{Partitions: 2, Partition: 0, NoPlacements: true, LoadPollInterval: -1}
	for m := range models {
		for i := range perModel {
			id := fmt.Sprintf("grpc://m%d-w%05d:1", m, i)
			cfg.Workers = append(cfg.Workers, Worker{ID: id, Addr: id[len("grpc://"):], Model: fmt.Sprintf("m%d", m)})
		}
	}
	g, err := New(cfg)
	if err != nil {
		tb.Fatal(err)
	}
	f := &flapTier{g: g}
	for _, w := range cfg.Workers {
		if w.Model == "m0" && PartitionOf(w.ID, 2) == 1 {
			f.victim = w.ID
			break
		}
	}
	g.SetScatterer(&fakeScatter{answer: func(q PartitionQuery) []PartitionAnswer {
		a := PartitionAnswer{Partition: 1}
		if !flap || f.turn.Add(1)%2 == 0 {
			a.Unreachable = []string{f.victim}
		}
		return []PartitionAnswer{a}
	}})
	return f
}

func (f *flapTier) fullSyncs() float64 { return testutil.ToFloat64(f.g.metrics.fleetSyncsAll) }

// BenchmarkRouteReachabilityFlap: a route on a partitioned replica whose
// other partition's replicas disagree on one worker's reachability, so
// that each answer says the opposite of the last (flap=true), against
// answers that agree (flap=false); 1,000 and 10,000 workers over 8
// models, half of them the other partition's. A 256-token request, no
// placements, the default picker: what is left of the route is the flip.
func BenchmarkRouteReachabilityFlap(b *testing.B) {
	for _, workers := range []int{1000, 10000} {
		for _, flap := range []bool{false, true} {
			b.Run(fmt.Sprintf("workers=%d/flap=%v", workers, flap), func(b *testing.B) {
				f := newFlapTier(b, 8, workers/8, flap)
				req := RouteRequest{Model: "m0", TokenIDs: tokens(0, 256)}
				if _, err := f.g.Route(req); err != nil {
					b.Fatal(err)
				}
				before := f.fullSyncs()
				b.ReportAllocs()
				b.ResetTimer()
				for range b.N {
					if _, err := f.g.Route(req); err != nil {
						b.Fatal(err)
					}
				}
				b.StopTimer()
				b.ReportMetric((f.fullSyncs()-before)/float64(b.N), "full-syncs/route")
			})
		}
	}
}

// TestReachabilityFlipsMatchAFullSync: the fleets a partitioned replica
// keeps by applying only the workers another partition's answer flipped
// are the fleets a walk of every worker would give, through random
// answers (any subset of the other partition's workers unreachable,
// including all of a model's, where "none reachable: route to all" moves
// every worker) mixed with this replica's own workers going in and out of
// backoff, drains and undrains, and workers removed and added back. Each
// route is checked against the rule computed afresh, without syncing, so
// a count gone wrong would show at once and stay visible.
func TestReachabilityFlipsMatchAFullSync(t *testing.T) {
	rng := rand.New(rand.NewPCG(8, 31))
	var rngMu sync.Mutex
	cfg := Config{Partitions: 2, Partition: 0, NoPlacements: true, LoadPollInterval: -1}
	cfg.Workers = append(cfg.Workers, workersOf("big", append(idsIn(t, "big-own", 0, 2, 8), idsIn(t, "big-rem", 1, 2, 12)...)...)...)
	cfg.Workers = append(cfg.Workers, workersOf("remote", idsIn(t, "rem", 1, 2, 3)...)...)
	cfg.Workers = append(cfg.Workers, workersOf("small", append(idsIn(t, "small-own", 0, 2, 1), idsIn(t, "small-rem", 1, 2, 2)...)...)...)
	g, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	remoteOf := map[string][]string{}
	var own []string
	for _, w := range cfg.Workers {
		if PartitionOf(w.ID, 2) == 1 {
			remoteOf[w.Model] = append(remoteOf[w.Model], w.ID)
		} else {
			own = append(own, w.ID)
		}
	}
	g.SetScatterer(&fakeScatter{answer: func(q PartitionQuery) []PartitionAnswer {
		rngMu.Lock()
		defer rngMu.Unlock()
		a := PartitionAnswer{Partition: 1}
		all := rng.IntN(4) == 0
		for _, w := range remoteOf[q.Model] {
			if all || rng.IntN(3) == 0 {
				a.Unreachable = append(a.Unreachable, w)
			}
		}
		return []PartitionAnswer{a}
	}})
	check := func(step int) {
		t.Helper()
		g.mu.Lock()
		defer g.mu.Unlock()
		g.reachMu.Lock()
		defer g.reachMu.Unlock()
		for name, m := range g.models {
			reachable := 0
			for _, w := range m.list {
				if _, drained := g.draining[w]; !drained && !g.downLocked(name, w) {
					reachable++
				}
			}
			if m.reachable != reachable {
				t.Fatalf("step %d, model %s: %d reachable counted, %d by the rule", step, name, m.reachable, reachable)
			}
			for _, w := range m.list {
				_, drained := g.draining[w]
				if want := !drained && (reachable == 0 || !g.downLocked(name, w)); m.fleet.Has(w) != want {
					t.Fatalf("step %d, model %s: %s in the fleet %v, by the rule %v (reachable %d)", step, name, w, m.fleet.Has(w), want, reachable)
				}
			}
		}
	}
	models := []string{"big", "remote", "small"}
	removed := map[string]Worker{}
	for step := range 3000 {
		switch r := rng.IntN(20); {
		case r < 14:
			if _, err := g.Route(RouteRequest{Model: models[rng.IntN(len(models))], TokenIDs: tokens(step, 48)}); err != nil && !errors.Is(err, ErrNoWorkers) {
				t.Fatal(err)
			}
			check(step)
		case r < 16:
			st := monitor.StateBackoff
			if rng.IntN(2) == 0 {
				st = monitor.StateStreaming
			}
			g.onState(own[rng.IntN(len(own))], st)
		case r < 18:
			w := cfg.Workers[rng.IntN(len(cfg.Workers))]
			if _, gone := removed[w.ID]; gone {
				continue
			}
			if rng.IntN(2) == 0 {
				if _, err := g.DrainWorker(w.ID); err != nil {
					t.Fatal(err)
				}
			} else if err := g.UndrainWorker(w.ID); err != nil {
				t.Fatal(err)
			}
		default:
			w := cfg.Workers[rng.IntN(len(cfg.Workers))]
			if _, gone := removed[w.ID]; gone {
				if err := g.AddWorker(w); err != nil {
					t.Fatal(err)
				}
				delete(removed, w.ID)
			} else if len(removed) < 4 {
				if err := g.RemoveWorker(w.ID); err != nil {
					t.Fatal(err)
				}
				removed[w.ID] = w
			}
		}
	}
	for _, scope := range []string{"all", "model", "workers"} {
		n := testutil.ToFloat64(g.metrics.fleetSyncs.WithLabelValues(scope))
		t.Logf("fleet syncs, scope %s: %v", scope, n)
		if n == 0 {
			t.Errorf("no fleet sync of scope %s: the test did not exercise it", scope)
		}
	}
}
