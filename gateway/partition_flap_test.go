package gateway

import (
	"fmt"
	"sync/atomic"
	"testing"

	"github.com/prometheus/client_golang/prometheus/testutil"
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
