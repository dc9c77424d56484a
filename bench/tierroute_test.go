package bench

import (
	"context"
	"fmt"
	"io"
	"maps"
	"os"
	"runtime"
	"slices"
	"strconv"
	"testing"
	"time"

	"google.golang.org/grpc/metadata"

	"github.com/kvrelay/kvrelay/gateway"
	"github.com/kvrelay/kvrelay/gateway/index"
	"github.com/kvrelay/kvrelay/gateway/monitor"
	"github.com/kvrelay/kvrelay/gateway/partitionsync"
	"github.com/kvrelay/kvrelay/proto/kvpb"
	"github.com/kvrelay/kvrelay/testkit/testnats"
)

// BenchmarkTierRoute measures the partitioned tier as built (package
// gateway's partition option, package partitionsync over a real NATS
// server): three tiers side by side on one fleet, P = 1 (one unpartitioned
// gateway, today's replica), 4 and 16 (one gateway per partition), every
// gateway in this process. Each worker's fill (its shared document and its
// own conversations, the fleet-scale study's stream, BenchmarkTier's) goes
// through each gateway's monitor admission and index as a stream would,
// served from memory (monitor.Options.OpenStream) instead of 1,024
// relays; a partitioned gateway subscribes to its partition's workers
// only.
//
// Reported per tier: the CPU and heap the tier's gateways took to apply
// the fill (process CPU and heap in use, measured around each tier's build
// alone); the route's wall time on the tier's first replica, p50 and p99,
// the routes of the three tiers interleaved request by request, every
// partitioned decision checked equal to the unpartitioned one's; and the
// process CPU per route (the routing replica, the partitions answering and
// the NATS server together), each tier's routes run again alone.
//
//	go test -run '^$' -bench '^BenchmarkTierRoute$' -benchtime=1x ./bench/
//
// KVRELAY_TIER_WORKERS sets the fleet (default 1,024 workers of 2,048
// cached blocks), KVRELAY_TIER_ROUTES the routes per tier (default 4,000).
func BenchmarkTierRoute(b *testing.B) {
	workers, routes := 1024, 4000
	if v, err := strconv.Atoi(os.Getenv("KVRELAY_TIER_WORKERS")); err == nil && v > 0 {
		workers = v
	}
	if v, err := strconv.Atoi(os.Getenv("KVRELAY_TIER_ROUTES")); err == nil && v > 0 {
		routes = v
	}
	f := newTierFleet(workers, false)
	reqs := tierRequests(f, routes)
	ns := testnats.Start(b, testnats.Config{NoJetStream: true})
	counts := []int{1, 4, 16}
	tiers := make([][]*gateway.Gateway, len(counts))
	type cost struct {
		cpu  time.Duration
		heap int64
	}
	costs := make([]cost, len(counts))
	for i, parts := range counts {
		runtime.GC()
		h0, c0 := heapInUse(), processCPU()
		tiers[i] = startRouteTier(b, f, ns.URL(), parts)
		costs[i] = cost{cpu: processCPU() - c0}
		runtime.GC()
		costs[i].heap = heapInUse() - h0
	}
	walls := make([][]time.Duration, len(counts))
	for _, tokens := range reqs {
		var want gateway.Decision
		for i, t := range tiers {
			t0 := time.Now()
			d, err := t[0].Route(gateway.RouteRequest{TokenIDs: tokens})
			walls[i] = append(walls[i], time.Since(t0))
			if err != nil {
				b.Fatal(err)
			}
			if i == 0 {
				want = d
			} else if d.Worker != want.Worker || !maps.Equal(d.MatchedBlocks, want.MatchedBlocks) {
				b.Fatalf("%d partitions: %s (matched %d workers), unpartitioned: %s (%d)", counts[i], d.Worker, len(d.MatchedBlocks), want.Worker, len(want.MatchedBlocks))
			}
		}
	}
	// The CPU a route costs the whole process (the routing replica, the
	// partitions answering, the NATS server), each tier's routes alone.
	cpus := make([]time.Duration, len(counts))
	for i, t := range tiers {
		c0 := processCPU()
		for _, tokens := range reqs {
			if _, err := t[0].Route(gateway.RouteRequest{TokenIDs: tokens}); err != nil {
				b.Fatal(err)
			}
		}
		cpus[i] = (processCPU() - c0) / time.Duration(len(reqs))
	}
	for i, parts := range counts {
		b.Run(fmt.Sprintf("partitions=%d", parts), func(b *testing.B) {
			b.ReportMetric(us(cpus[i]), "route-cpu-all-us")
			w := slices.Sorted(slices.Values(walls[i]))
			b.ReportMetric(us(quantile(w, 0.5)), "route-p50-us")
			b.ReportMetric(us(quantile(w, 0.99)), "route-p99-us")
			b.ReportMetric(costs[i].cpu.Seconds(), "tier-fill-cpu-s")
			b.ReportMetric(float64(costs[i].heap)/(1<<20), "tier-heap-MiB")
			b.ReportMetric(costs[i].cpu.Seconds()/(16*costs[0].cpu.Seconds()), "fill-cpu-vs-16-full-copies")
			b.ReportMetric(float64(costs[i].heap)/float64(16*costs[0].heap), "heap-vs-16-full-copies")
		})
	}
	runtime.KeepAlive(tiers)
}

// startRouteTier starts parts gateways (one unpartitioned when parts is 1)
// on f's workers and returns once each has applied its workers' fill.
func startRouteTier(tb testing.TB, f *tierFleet, url string, parts int) []*gateway.Gateway {
	tb.Helper()
	ws := make([]gateway.Worker, len(f.names))
	fill := make(map[string][]*kvpb.KvEventBatch, len(f.names))
	for w, n := range f.names {
		ws[w] = gateway.Worker{ID: n, Addr: n[len("grpc://"):]}
		fill[n] = f.fill[w]
	}
	var out []*gateway.Gateway
	var answerers []*partitionsync.Tier
	for p := range parts {
		cfg := gateway.Config{
			Workers: ws, Index: index.Options{BlockSize: f.wl.BlockSize}, NoPlacements: true, LoadPollInterval: -1,
			Monitor: monitor.Options{OpenStream: memoryStreams(fill)},
		}
		if parts > 1 {
			cfg.Partitions, cfg.Partition = parts, p
		}
		g, err := gateway.New(cfg)
		if err != nil {
			tb.Fatal(err)
		}
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan struct{})
		go func() { defer close(done); _ = g.Run(ctx) }()
		tb.Cleanup(func() { cancel(); <-done })
		if parts > 1 {
			t, err := partitionsync.Start(g, partitionsync.Options{
				URL: url, Name: fmt.Sprintf("tier-%d-%d", parts, p), SubjectPrefix: "bench.tier" + strconv.Itoa(parts), Deadline: 10 * time.Second,
			})
			if err != nil {
				tb.Fatal(err)
			}
			tb.Cleanup(t.Close)
			g.SetScatterer(t)
			for !t.Ready() {
				time.Sleep(time.Millisecond)
			}
			answerers = append(answerers, t)
		}
		out = append(out, g)
	}
	for _, g := range out {
		for deadline := time.Now().Add(10 * time.Minute); ; time.Sleep(5 * time.Millisecond) {
			applied := true
			for _, st := range g.Workers() {
				if st.State != gateway.StateRemote && st.BatchesApplied < uint64(len(fill[st.ID])) {
					applied = false
					break
				}
			}
			if applied {
				break
			}
			if time.Now().After(deadline) {
				tb.Fatalf("%d partitions: the fill was not applied in 10 minutes", parts)
			}
		}
	}
	// Each partition answers once its workers' state is in (their first
	// batch here).
	for deadline := time.Now().Add(time.Minute); ; time.Sleep(5 * time.Millisecond) {
		if !slices.ContainsFunc(answerers, func(t *partitionsync.Tier) bool { return !t.Answering() }) {
			break
		}
		if time.Now().After(deadline) {
			tb.Fatalf("%d partitions: not every partition answering a minute after its fill", parts)
		}
	}
	return out
}

// memoryStreams serves each worker's batches from memory, numbered from 1,
// then holds the stream open until the subscription ends.
func memoryStreams(batches map[string][]*kvpb.KvEventBatch) monitor.StreamOpener {
	return func(ctx context.Context, w monitor.Worker, _ *kvpb.SubscribeKvEventsRequest, _ monitor.SubscribeFunc) (monitor.BatchStream, error) {
		return &memoryStream{ctx: ctx, batches: batches[w.ID]}, nil
	}
}

type memoryStream struct {
	ctx     context.Context
	batches []*kvpb.KvEventBatch
	next    int
}

func (s *memoryStream) Header() (metadata.MD, error) { return metadata.MD{}, nil }

func (s *memoryStream) Recv() (*kvpb.KvEventBatch, error) {
	if s.next < len(s.batches) {
		b := s.batches[s.next]
		s.next++
		return &kvpb.KvEventBatch{SequenceNumber: uint64(s.next), Events: b.Events, DpRank: b.DpRank, Timestamp: b.Timestamp}, nil
	}
	<-s.ctx.Done()
	return nil, io.EOF
}
