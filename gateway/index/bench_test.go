package index

import (
	"fmt"
	"math/rand/v2"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvrelay/kvrelay/proto/kvpb"
)

// benchDoc returns n tokens: the first shared tokens are common to every doc
// with the same group, the rest are unique to (group, id).
func benchDoc(rng *rand.Rand, n, shared int) []uint32 {
	doc := make([]uint32, n)
	for i := range doc {
		if i < shared {
			doc[i] = uint32(i)
		} else {
			doc[i] = rng.Uint32()
		}
	}
	return doc
}

// storeEvents cuts doc into stored events of perEvent blocks, chained by
// parent, with engine hashes from ehBase.
func storeEvents(doc []uint32, bs, perEvent int, ehBase int64) []*kvpb.KvEventBatch {
	var out []*kvpb.KvEventBatch
	n := len(doc) / bs
	for s := 0; s < n; s += perEvent {
		st := &kvpb.KvBlocksStored{}
		if s > 0 {
			p := ehBase + int64(s-1)
			st.ParentBlockHash = &p
		}
		for k := s; k < min(n, s+perEvent); k++ {
			st.Blocks = append(st.Blocks, &kvpb.KvBlock{BlockHash: ehBase + int64(k), TokenIds: doc[k*bs : (k+1)*bs], BlockSize: int32(bs)})
		}
		out = append(out, batch(0, &kvpb.KvCacheEvent{Data: &kvpb.KvCacheEvent_Stored{Stored: st}}))
	}
	return out
}

func removeEvents(nBlocks, perEvent int, ehBase int64) []*kvpb.KvEventBatch {
	var out []*kvpb.KvEventBatch
	for s := nBlocks - 1; s >= 0; s -= perEvent {
		var hs []int64
		for k := s; k > s-perEvent && k >= 0; k-- {
			hs = append(hs, ehBase+int64(k))
		}
		out = append(out, batch(0, removed(unspec, hs...)))
	}
	return out
}

// BenchmarkApply measures the write path: 128 workers store 1,024-block
// conversations (block size 16) in 64-block events and then remove them
// (vLLM evicts tails first), so the index stays at a steady size.
func BenchmarkApply(b *testing.B) {
	const workers, bs, blocks, per = 128, 16, 1024, 64
	rng := rand.New(rand.NewPCG(1, 1))
	type cycle struct {
		w   WorkerID
		evs []*kvpb.KvEventBatch
	}
	var cycles []cycle
	for w := range workers {
		doc := benchDoc(rng, blocks*bs, 256*bs)
		base := int64(w) << 32
		evs := append(storeEvents(doc, bs, per, base), removeEvents(blocks, per, base)...)
		cycles = append(cycles, cycle{fmt.Sprintf("w%03d", w), evs})
	}
	for _, shardBits := range []int{3, 4, 6, 8} {
		b.Run(fmt.Sprintf("shards%d", 1<<shardBits), func(b *testing.B) {
			ix := New(Options{BlockSize: bs, ShardBits: shardBits})
			perCycle := 2 * blocks
			b.ResetTimer()
			start := time.Now()
			cpu0 := cpuTime()
			ops := 0
			for i := 0; ops < b.N; i++ {
				c := cycles[i%workers]
				for _, e := range c.evs {
					ix.Apply(c.w, e)
				}
				ops += perCycle
			}
			el := time.Since(start)
			if cpu := cpuTime() - cpu0; cpu > 0 {
				b.ReportMetric(float64(ops)/cpu.Seconds(), "block-events/cpu-s")
			}
			b.ReportMetric(float64(ops)/el.Seconds(), "block-events/s")
			b.ReportMetric(float64(el.Nanoseconds())/float64(ops), "ns/block-event")
			b.ReportMetric(0, "ns/op")
		})
	}
}

// fleet builds an index where 128 workers each hold an 8,192-token
// conversation (block size 16) sharing its first half with every other worker.
func fleet(tb testing.TB, workers, tokens, shared int) (*Index, [][]uint32) {
	const bs = 16
	rng := rand.New(rand.NewPCG(2, 2))
	ix := New(Options{BlockSize: bs})
	var docs [][]uint32
	for w := range workers {
		doc := benchDoc(rng, tokens, shared)
		docs = append(docs, doc)
		for _, e := range storeEvents(doc, bs, 64, int64(w)<<32) {
			ix.Apply(fmt.Sprintf("w%03d", w), e)
		}
	}
	return ix, docs
}

func reportLatency(b *testing.B, samples []time.Duration) {
	slices.Sort(samples)
	q := func(p float64) float64 { return float64(samples[int(p*float64(len(samples)-1))].Nanoseconds()) / 1e3 }
	b.ReportMetric(q(0), "min-µs")
	b.ReportMetric(q(0.50), "p50-µs")
	b.ReportMetric(q(0.99), "p99-µs")
	b.ReportMetric(0, "ns/op")
}

// BenchmarkFindMatches8k128 is issue 5's lookup goal: an 8,192-token request
// (block size 16, 512 blocks) against 128 workers. "shared-half": every
// worker holds the first 256 blocks, the queried worker all 512; "all-hold":
// every worker holds all 512 (a 128-wide intersection at every block);
// "hashes-only": the same walk with the prefix hashes precomputed.
func BenchmarkFindMatches8k128(b *testing.B) {
	const workers, tokens = 128, 8192
	for _, tc := range []struct {
		name   string
		shared int
		hashed bool
	}{
		{"shared-half", tokens / 2, false},
		{"all-hold", tokens, false},
		{"shared-half-hashes-only", tokens / 2, true},
	} {
		b.Run(tc.name, func(b *testing.B) {
			ix, docs := fleet(b, workers, tokens, tc.shared)
			var pre [][]uint64
			for _, d := range docs {
				pre = append(pre, PrefixHashes(d, 16, Namespace{}))
			}
			samples := make([]time.Duration, 0, b.N)
			b.ResetTimer()
			for i := range b.N {
				var m Matches
				t0 := time.Now()
				if tc.hashed {
					m = ix.FindMatchesHashes(pre[i%workers])
				} else {
					m = ix.FindMatches(docs[i%workers], Namespace{})
				}
				samples = append(samples, time.Since(t0))
				if m.Best() != 512 {
					b.Fatalf("best %d", m.Best())
				}
			}
			reportLatency(b, samples)
		})
	}
}

// BenchmarkHashRequest isolates the request hashing (512 content + 511 chain hashes).
func BenchmarkHashRequest(b *testing.B) {
	doc := benchDoc(rand.New(rand.NewPCG(3, 3)), 8192, 0)
	b.SetBytes(8192 * 4)
	for range b.N {
		_ = PrefixHashes(doc, 16, Namespace{})
	}
}

// BenchmarkMemoryPerBlock prints the heap per indexed (worker, block): 128
// workers × 1,024 blocks, with no sharing ("unique") and with the first half
// shared by all ("shared-half"). Tables grow in steps, so the figure depends
// on where the fill falls between two steps: "unique-N" repeats "unique"
// with N blocks a worker to show the spread.
func BenchmarkMemoryPerBlock(b *testing.B) {
	for _, tc := range []struct {
		name           string
		blocks, shared int
	}{
		{"unique", 1024, 0}, {"shared-half", 1024, 512 * 16},
		{"unique-600", 600, 0}, {"unique-800", 800, 0}, {"unique-1300", 1300, 0}, {"unique-1700", 1700, 0},
	} {
		b.Run(tc.name, func(b *testing.B) {
			const workers = 128
			tokens := tc.blocks * 16
			rng := rand.New(rand.NewPCG(4, 4))
			var batches [][]*kvpb.KvEventBatch
			for w := range workers {
				batches = append(batches, storeEvents(benchDoc(rng, tokens, tc.shared), 16, 64, int64(w)<<32))
			}
			for range b.N {
				var before, after runtime.MemStats
				runtime.GC()
				runtime.ReadMemStats(&before)
				ix := New(Options{BlockSize: 16})
				for w, evs := range batches {
					for _, e := range evs {
						ix.Apply(fmt.Sprintf("w%03d", w), e)
					}
				}
				runtime.GC()
				runtime.ReadMemStats(&after)
				st := ix.Stats()
				b.ReportMetric(float64(after.HeapAlloc-before.HeapAlloc)/float64(st.Memberships), "heap-B/worker-block")
				b.ReportMetric(float64(after.HeapAlloc-before.HeapAlloc)/float64(st.Entries), "heap-B/distinct-block")
				b.ReportMetric(float64(st.MemoryBytes)/float64(st.Memberships), "est-B/worker-block")
				runtime.KeepAlive(ix)
			}
			b.ReportMetric(0, "ns/op")
		})
	}
}

// BenchmarkParallelMixed runs with b.RunParallel (use -cpu 1,2,…): each
// goroutine owns its workers (the monitor's one-writer-per-worker model)
// and interleaves a 64-block store, a lookup of a 512-block request and, once
// its conversation is complete, removals; block ops = stored + removed +
// looked-up blocks.
func BenchmarkParallelMixed(b *testing.B) {
	const bs, blocks, per = 16, 512, 64
	ix := New(Options{BlockSize: bs})
	var ids atomic.Int64
	var total atomic.Int64
	rngMu := sync.Mutex{}
	seedRng := rand.New(rand.NewPCG(5, 5))
	b.ResetTimer()
	start := time.Now()
	b.RunParallel(func(pb *testing.PB) {
		g := ids.Add(1)
		rngMu.Lock()
		rng := rand.New(rand.NewPCG(seedRng.Uint64(), 0))
		rngMu.Unlock()
		var ops int64
		for round := int64(0); ; round++ {
			w := fmt.Sprintf("g%d-w%d", g, round%8)
			base := g<<40 | round<<20
			doc := benchDoc(rng, blocks*bs, 256*bs)
			stores := storeEvents(doc, bs, per, base)
			removes := removeEvents(blocks, per, base)
			for i := range stores {
				if !pb.Next() {
					total.Add(ops)
					return
				}
				ix.Apply(w, stores[i])
				ops += per
				m := ix.FindMatches(doc, Namespace{})
				ops += int64(m.Best())
			}
			for i := range removes {
				if !pb.Next() {
					total.Add(ops)
					return
				}
				ix.Apply(w, removes[i])
				ops += per
			}
		}
	})
	el := time.Since(start)
	b.ReportMetric(float64(total.Load())/el.Seconds(), "block-ops/s")
}
