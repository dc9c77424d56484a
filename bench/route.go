package bench

import (
	"context"
	"fmt"
	"math/rand/v2"
	"runtime"
	"slices"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvrelay/kvrelay/gateway/index"
	"github.com/kvrelay/kvrelay/gateway/picker"
	"github.com/kvrelay/kvrelay/gateway/placement"
	"github.com/kvrelay/kvrelay/proto/kvpb"
)

// RouteResults is the gateway's routing cost: prefix lookup plus pick.
type RouteResults struct {
	Workload string       `json:"workload"`
	Points   []RoutePoint `json:"points"`
}

// RoutePoint is one (workers, prompt length) pair.
type RoutePoint struct {
	Workers      int     `json:"workers"`
	PromptTokens int     `json:"prompt_tokens"`
	IndexBlocks  int     `json:"index_blocks"` // (worker, block) pairs indexed
	FindP50us    float64 `json:"find_p50_us"`
	// PickCPUP50us is the median thread CPU time of the pick alone.
	PickCPUP50us float64 `json:"pick_cpu_p50_us"`
	// RouteCPUP50us is the median thread CPU time of a route: unlike the
	// wall clock, it leaves out the time the thread waited for a CPU on a
	// shared host.
	RouteCPUP50us float64 `json:"route_cpu_p50_us"`
	RouteP50us    float64 `json:"route_p50_us"`
	RouteP99us    float64 `json:"route_p99_us"`
	// The same route with placements on, as the gateway runs by default:
	// the request hashed once in full, the index's overlaps extended by
	// the placements, and the request's blocks past the chosen worker's
	// overlap placed on it (so later requests meet the placements).
	PlacedRouteP50us    float64 `json:"placed_route_p50_us"`
	PlacedRouteCPUP50us float64 `json:"placed_route_cpu_p50_us"`
	Reps                int     `json:"reps"`
}

const (
	routeDocs      = 16     // shared documents (system prompts, RAG contexts)
	routeDocTokens = 32_768 // each as long as the longest prompt
)

func runRoute(ctx context.Context, env *environment) (*RouteResults, error) {
	workers := []int{8, 32, 128, 512}
	prompts := []int{1024, 2048, 4096, 8192, 16384, 32768}
	reps := 2000
	if env.quick {
		workers, prompts, reps = []int{8}, []int{1024}, 50
	}
	rt := &RouteResults{Workload: fmt.Sprintf(
		"%d shared %d-token documents; worker w holds document w mod %d to a random depth of 25-100%% and another document to 0-25%%; "+
			"each request is a document's first N tokens, so the lookup walks every block up to 8k tokens (a holder has 25%% or more); block size %d; "+
			"picker with SMG's default spill gate over a Fleet of random in-flight loads 0-7, as the gateway keeps it; "+
			"with placements: the gateway's default store, filled by the routes themselves",
		routeDocs, routeDocTokens, routeDocs, blockSize)}
	rng := rand.New(rand.NewPCG(7, 11))
	docs := make([][]uint32, routeDocs)
	for d := range docs {
		docs[d] = make([]uint32, routeDocTokens)
		for i := range docs[d] {
			docs[d][i] = rng.Uint32N(151_936)
		}
	}
	for _, w := range workers {
		ix, names, blocks := buildIndex(w, docs, rng)
		pk, err := picker.New(picker.Config{Rand: rand.New(rand.NewPCG(1, 2))})
		if err != nil {
			return nil, fmt.Errorf("bench: picker: %w", err)
		}
		// The gateway keeps its workers' loads in a Fleet updated as they
		// change, so a pick reads the mean and the least-loaded worker
		// instead of walking the fleet.
		fleet := picker.NewFleet()
		for _, n := range names {
			fleet.Add(n)
			fleet.Set(n, rng.IntN(8))
		}
		places, err := placement.New(placement.Options{})
		if err != nil {
			return nil, fmt.Errorf("bench: placements: %w", err)
		}
		for _, l := range prompts {
			if ctx.Err() != nil {
				return nil, ctx.Err()
			}
			p := RoutePoint{Workers: w, PromptTokens: l, IndexBlocks: blocks, Reps: reps}
			finds := make([]time.Duration, 0, reps)
			routes := make([]time.Duration, 0, reps)
			cpus := make([]time.Duration, 0, reps)
			pickCPUs := make([]time.Duration, 0, reps)
			placed := make([]time.Duration, 0, reps)
			placedCPUs := make([]time.Duration, 0, reps)
			now := time.Now()
			// One result reused by every lookup, as the gateway reuses one
			// per request: a lookup then allocates nothing.
			var m index.Matches
			runtime.GC() // the index build's garbage is not the lookup's
			runtime.LockOSThread()
			for i := range reps {
				tokens := docs[i%routeDocs][:l]
				c0 := threadCPU()
				t0 := time.Now()
				ix.FindMatchesInto(&m, tokens, index.Namespace{})
				t1 := time.Now()
				c1 := threadCPU()
				if _, err := pk.PickFleet(fleet, picker.Request{}, m); err != nil {
					runtime.UnlockOSThread()
					return nil, fmt.Errorf("bench: pick: %w", err)
				}
				c2 := threadCPU()
				t2 := time.Now()
				finds = append(finds, t1.Sub(t0))
				routes = append(routes, t2.Sub(t0))
				cpus = append(cpus, c2-c0)
				pickCPUs = append(pickCPUs, c2-c1)

				c0, t0 = threadCPU(), time.Now()
				prefix := index.PrefixHashes(tokens, blockSize, index.Namespace{})
				ix.FindMatchesHashesInto(&m, prefix)
				ext := places.Extend(prefix, m, now)
				d, err := pk.PickFleet(fleet, picker.Request{}, ext.Matches)
				if err != nil {
					runtime.UnlockOSThread()
					return nil, fmt.Errorf("bench: pick: %w", err)
				}
				places.Record(d.Worker, prefix, m.Blocks(d.Worker), now)
				c1, t1 = threadCPU(), time.Now()
				placed = append(placed, t1.Sub(t0))
				placedCPUs = append(placedCPUs, c1-c0)
			}
			runtime.UnlockOSThread()
			slices.Sort(finds)
			slices.Sort(routes)
			slices.Sort(cpus)
			slices.Sort(pickCPUs)
			slices.Sort(placed)
			slices.Sort(placedCPUs)
			p.PlacedRouteP50us = us(quantile(placed, 0.5))
			p.PlacedRouteCPUP50us = us(quantile(placedCPUs, 0.5))
			p.PickCPUP50us = us(quantile(pickCPUs, 0.5))
			p.RouteCPUP50us = us(quantile(cpus, 0.5))
			p.FindP50us = us(quantile(finds, 0.5))
			p.RouteP50us = us(quantile(routes, 0.5))
			p.RouteP99us = us(quantile(routes, 0.99))
			env.log.Info("route", "workers", w, "tokens", l, "p50_us", p.RouteP50us)
			rt.Points = append(rt.Points, p)
		}
	}
	return rt, nil
}

func us(d time.Duration) float64 { return float64(d) / 1e3 }

// threadCPU is the calling thread's CPU time (lock the goroutine to its
// thread around a measurement). It costs a system call, well under a
// microsecond, which the figure includes.
func threadCPU() time.Duration {
	var ts unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_THREAD_CPUTIME_ID, &ts); err != nil {
		return 0
	}
	return time.Duration(ts.Nano())
}

// buildIndex gives each of n workers two documents' prefixes through the
// index's own event path.
func buildIndex(n int, docs [][]uint32, rng *rand.Rand) (*index.Index, []string, int) {
	ix := index.New(index.Options{BlockSize: blockSize})
	names := make([]string, n)
	docBlocks := routeDocTokens / blockSize
	total := 0
	for w := range n {
		names[w] = fmt.Sprintf("grpc://worker-%03d:50051", w)
		main := w % len(docs)
		other := (main + 1 + rng.IntN(len(docs)-1)) % len(docs)
		for k, held := range []struct{ doc, depth int }{
			{main, docBlocks/4 + rng.IntN(docBlocks-docBlocks/4+1)},
			{other, rng.IntN(docBlocks/4 + 1)},
		} {
			base := int64(w)<<32 | int64(k)<<24
			for _, b := range storeBatches(docs[held.doc][:held.depth*blockSize], base) {
				ix.Apply(names[w], b)
			}
			total += held.depth
		}
	}
	return ix, names, total
}

// storeBatches cuts tokens into chained 64-block stores with engine hashes
// from base on.
func storeBatches(tokens []uint32, base int64) []*kvpb.KvEventBatch {
	var out []*kvpb.KvEventBatch
	n := len(tokens) / blockSize
	for s := 0; s < n; s += storeBlocks {
		st := &kvpb.KvBlocksStored{}
		if s > 0 {
			parent := base + int64(s-1)
			st.ParentBlockHash = &parent
		}
		for k := s; k < min(n, s+storeBlocks); k++ {
			st.Blocks = append(st.Blocks, &kvpb.KvBlock{
				BlockHash: base + int64(k), TokenIds: tokens[k*blockSize : (k+1)*blockSize], BlockSize: blockSize,
			})
		}
		out = append(out, &kvpb.KvEventBatch{Events: []*kvpb.KvCacheEvent{{Data: &kvpb.KvCacheEvent_Stored{Stored: st}}}})
	}
	return out
}
