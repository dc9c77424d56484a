package bench

import (
	"cmp"
	"fmt"
	"math/rand/v2"
	"os"
	"runtime"
	"slices"
	"strconv"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"

	"github.com/kvrelay/kvrelay/gateway/index"
	"github.com/kvrelay/kvrelay/proto/kvdec"
)

// The partitioned gateway tier (issue 31.3), simulated in one process: the
// fleet's workers split into R groups, one index per group (a replica that
// applies only its group's events), and a route scattered to every group
// and merged. A worker's match is the run of leading request blocks that
// worker holds, which depends on no other worker's blocks, so the merge of
// the groups' answers is the whole index's answer: TestWorkerGroupTier
// checks it on the fleet-scale workload. BenchmarkPartitionedTier measures
// what each group costs (heap, CPU per applied batch, lookup CPU) at 1, 4
// and 16 groups. The NATS hop of the scatter is not in these figures.

// tierGroup is one partition: an index holding the workers w with
// w % groups == g.
type tierGroup struct {
	ix      *index.Index
	workers []int
}

// buildTier fills groups indexes (groups = 1 is today's full copy) with the
// fleet-scale workload's fill phase for workers workers, through Apply.
func buildTier(wl *FleetWorkload, docs [][]uint32, workers, groups int, rng *rand.Rand) ([]tierGroup, []tailState) {
	tg := make([]tierGroup, groups)
	for g := range tg {
		tg[g].ix = index.New(index.Options{BlockSize: wl.BlockSize})
	}
	tails := make([]tailState, workers)
	for w := range workers {
		g := &tg[w%groups]
		g.workers = append(g.workers, w)
		for _, b := range docBatches(wl, docs, docOf(wl, w)) {
			g.ix.Apply(workerName(w), b)
		}
		for (len(tails[w].fifo)+1)*wl.StoreBlocks <= wl.CacheBlocks-wl.DocBlocks {
			g.ix.Apply(workerName(w), nextBatch(wl, docs, w, &tails[w], rng))
		}
	}
	return tg, tails
}

// scatter looks tokens up in every group and merges the answers in the
// index's order (deepest first, then by name).
func scatter(tg []tierGroup, tokens []uint32) index.Matches {
	var out index.Matches
	for _, g := range tg {
		m := g.ix.FindMatches(tokens, index.Namespace{})
		out.RequestBlocks = m.RequestBlocks
		out.Workers = append(out.Workers, m.Workers...)
	}
	slices.SortFunc(out.Workers, func(a, b index.Match) int {
		return cmp.Or(cmp.Compare(b.Blocks, a.Blocks), cmp.Compare(a.Worker, b.Worker))
	})
	return out
}

// tierPrompt is a routed request: shared document d's tokens cut at a
// random depth, then a new question.
func tierPrompt(wl *FleetWorkload, docs [][]uint32, rng *rand.Rand) []uint32 {
	d := rng.IntN(len(docs))
	cut := (1 + rng.IntN(wl.DocBlocks)) * wl.BlockSize
	q := make([]uint32, 4*wl.BlockSize)
	for i := range q {
		q[i] = rng.Uint32N(151_936)
	}
	return append(slices.Clip(docs[d][:cut]), q...)
}

func TestWorkerGroupTier(t *testing.T) {
	wl := fleetWorkload(true)
	docs := fleetDocs(&wl)
	const workers = 48
	for _, groups := range []int{2, 4, 16} {
		full, ta := buildTier(&wl, docs, workers, 1, rand.New(rand.NewPCG(7, 1)))
		tg, tails := buildTier(&wl, docs, workers, groups, rand.New(rand.NewPCG(7, 1)))
		// The same steady stream into both: every worker, a few steps, the
		// workers' own tails (and their parents) identical by seed.
		rngA, rngB := rand.New(rand.NewPCG(8, uint64(groups))), rand.New(rand.NewPCG(8, uint64(groups)))
		for range 3 {
			for w := range workers {
				full[0].ix.Apply(workerName(w), nextBatch(&wl, docs, w, &ta[w], rngA))
				tg[w%groups].ix.Apply(workerName(w), nextBatch(&wl, docs, w, &tails[w], rngB))
			}
		}
		prompts := rand.New(rand.NewPCG(9, uint64(groups)))
		deep := 0
		for i := range 200 {
			tokens := tierPrompt(&wl, docs, prompts)
			want := full[0].ix.FindMatches(tokens, index.Namespace{})
			got := scatter(tg, tokens)
			if !slices.Equal(got.Workers, want.Workers) || got.RequestBlocks != want.RequestBlocks {
				t.Fatalf("%d groups, prompt %d: scattered answer %+v, whole index %+v", groups, i, got, want)
			}
			if want.Best() > 0 {
				deep++
			}
		}
		if deep == 0 {
			t.Fatalf("%d groups: no prompt matched any worker: the comparison compared nothing", groups)
		}
	}
}

// BenchmarkPartitionedTier: KVRELAY_TIER_WORKERS workers (default 2,000)
// with the fleet-scale study's 2,048-block caches, split into 1, 4 and 16
// groups. Per group: heap after GC, process CPU per steady-state batch
// decoded (proto/kvdec) and applied, and per routed prompt the thread CPU
// of its lookup in every group (scatter, summed) and of the slowest group
// (what a route waits for when the groups run on separate replicas, plus
// the NATS request/reply not measured here). It reports what the tier
// needs at the fleet-scale target (10,000 workers at 20 batches/s each):
// cores to apply events, per replica and for the tier.
func BenchmarkPartitionedTier(b *testing.B) {
	workers := 2000
	if v, err := strconv.Atoi(os.Getenv("KVRELAY_TIER_WORKERS")); err == nil && v > 0 {
		workers = v
	}
	wl := fleetWorkload(false)
	docs := fleetDocs(&wl)
	for _, groups := range []int{1, 4, 16} {
		b.Run(fmt.Sprintf("workers%d/groups%d", workers, groups), func(b *testing.B) {
			for b.Loop() {
				before := heapInUse()
				tg, tails := buildTier(&wl, docs, workers, groups, rand.New(rand.NewPCG(uint64(workers), 1)))
				heap := heapInUse() - before
				rng := rand.New(rand.NewPCG(uint64(workers), 2))
				var dec kvdec.Decoder
				var cpu time.Duration
				batches := 0
				// Steady state, group by group: each group's workers' batches,
				// encoded outside the clock, decoded and applied inside.
				for gi := range tg {
					g := &tg[gi]
					frames := make([][]byte, 0, len(g.workers)*wl.SteadySteps)
					owners := make([]int, 0, cap(frames))
					for range wl.SteadySteps {
						for _, w := range g.workers {
							f, err := proto.Marshal(nextBatch(&wl, docs, w, &tails[w], rng))
							if err != nil {
								b.Fatal(err)
							}
							frames, owners = append(frames, f), append(owners, w)
						}
					}
					c0 := processCPU()
					for i, f := range frames {
						m, err := dec.Decode(f)
						if err != nil {
							b.Fatal(err)
						}
						g.ix.Apply(workerName(owners[i]), m)
					}
					cpu += processCPU() - c0
					batches += len(frames)
				}
				// Routes: the scatter's lookups, each timed on its own.
				runtime.LockOSThread()
				var sum, slowest []time.Duration
				prompts := rand.New(rand.NewPCG(uint64(workers), 3))
				for range 500 {
					tokens := tierPrompt(&wl, docs, prompts)
					var s, worst time.Duration
					for _, g := range tg {
						c0 := threadCPU()
						g.ix.FindMatches(tokens, index.Namespace{})
						d := threadCPU() - c0
						s += d
						worst = max(worst, d)
					}
					sum, slowest = append(sum, s), append(slowest, worst)
				}
				runtime.UnlockOSThread()
				slices.Sort(sum)
				slices.Sort(slowest)
				perBatch := cpu.Seconds() / float64(batches)
				rate := float64(wl.TargetWorkers) * wl.BatchesPerWorkerPerSec
				b.ReportMetric(float64(heap)/float64(groups)/(1<<20), "heap-MiB/group")
				b.ReportMetric(float64(heap)/float64(int64(workers)*int64(wl.CacheBlocks)), "heap-B/pair")
				b.ReportMetric(perBatch*1e6, "cpu-µs/batch")
				b.ReportMetric(rate*perBatch/float64(groups), "cores/replica@10k")
				b.ReportMetric(rate*perBatch, "cores/tier@10k")
				b.ReportMetric(us(sum[len(sum)/2]), "lookup-cpu-µs-p50-sum")
				b.ReportMetric(us(slowest[len(slowest)/2]), "lookup-cpu-µs-p50-slowest")
				b.ReportMetric(us(slowest[len(slowest)*99/100]), "lookup-cpu-µs-p99-slowest")
				runtime.KeepAlive(tg)
			}
		})
	}
}
