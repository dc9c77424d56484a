package index

import (
	"fmt"
	"math/rand/v2"
	"testing"
)

// sparseFleet builds an index with workers worker slots in which only 16
// workers, spread evenly over the slots up to the last one, hold an
// 8,192-token request's prefix (block size 16, 512 blocks), holder k the
// first 256+16k blocks; every other worker holds 4 blocks of its own. The
// holder bitsets are as wide as the fleet, the candidates 16 at most.
func sparseFleet(tb testing.TB, workers int) (*Index, []uint32) {
	const bs, tokens, holders = 16, 8192, 16
	rng := rand.New(rand.NewPCG(7, 7))
	ix := New(Options{BlockSize: bs})
	doc := benchDoc(rng, tokens, tokens)
	holder := map[int]int{}
	for k := range holders {
		holder[(k+1)*workers/holders-1] = 256 + 16*k
	}
	for w := range workers {
		name := fmt.Sprintf("w%05d", w)
		if n, ok := holder[w]; ok {
			for _, e := range storeEvents(doc[:n*bs], bs, 64, int64(w)<<32) {
				ix.Apply(name, e)
			}
			continue
		}
		for _, e := range storeEvents(benchDoc(rng, 4*bs, 0), bs, 64, int64(w)<<32) {
			ix.Apply(name, e)
		}
	}
	return ix, doc
}

// BenchmarkLookupSparseHolders is issue 19.4's walk cost: an 8k-token lookup
// (hashing included) where 16 workers hold the prefix, in fleets of 128 to
// 10,000 worker slots. With the walk visiting only the candidates' live
// words the cost stays about flat in the fleet; cpu-ns/op excludes the time
// the loop waited for a core on a shared host.
func BenchmarkLookupSparseHolders(b *testing.B) {
	for _, workers := range []int{128, 512, 2000, 10_000} {
		b.Run(fmt.Sprintf("workers%d", workers), func(b *testing.B) {
			ix, doc := sparseFleet(b, workers)
			if m := ix.FindMatches(doc, Namespace{}); m.Best() != 496 || len(m.Workers) != 16 {
				b.Fatalf("best %d over %d workers, want 496 over 16", m.Best(), len(m.Workers))
			}
			b.ResetTimer()
			cpu0 := cpuTime()
			for range b.N {
				_ = ix.FindMatches(doc, Namespace{})
			}
			if cpu := cpuTime() - cpu0; cpu > 0 {
				b.ReportMetric(float64(cpu.Nanoseconds())/float64(b.N), "cpu-ns/op")
			}
		})
	}
}
