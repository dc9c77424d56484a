package placement

import (
	"fmt"
	"testing"
	"time"

	"github.com/kvrelay/kvrelay/gateway/index"
)

// BenchmarkExtendRecord is the placements' share of a route (Extend, then
// Record on the chosen worker) for an 8k-token prompt at block size 16 (512
// blocks): of 128 workers, 16 hold the whole prompt in the index and 16 its
// first half, and one of the half holders has the second half placed (a
// route sent it there). The route picks that worker, so Record refreshes its
// 256 placed blocks. The old store probed its map on every one of the 512
// blocks in Extend and the 256 in Record.
func BenchmarkExtendRecord(b *testing.B) {
	const blocks, workers = 512, 128
	prefix := make([]uint64, blocks)
	for i := range prefix {
		prefix[i] = uint64(i)*0x9E3779B97F4A7C15 + 1
	}
	base := index.Matches{RequestBlocks: blocks}
	for _, depth := range []int{blocks, blocks / 2} {
		for w := range workers / 8 {
			base.Workers = append(base.Workers, index.Match{Worker: fmt.Sprintf("w%03d-%d", w, depth), Blocks: depth})
		}
	}
	chosen := base.Workers[workers/8].Worker // a half holder
	s, err := New(Options{})
	if err != nil {
		b.Fatal(err)
	}
	now := time.Unix(1_000_000, 0)
	s.Record(chosen, prefix, blocks/2, now)
	b.ReportAllocs()
	b.ResetTimer()
	for range b.N {
		r := s.Extend(prefix, base, now)
		if r.Inferred[chosen] != blocks/2 {
			b.Fatalf("inferred %v", r.Inferred)
		}
		s.Record(chosen, prefix, blocks/2, now)
	}
}

// BenchmarkEvictFlood is the cost of a peer's flood into a full store:
// each op records 2,048 new blocks from one peer (the per-record cap of a
// 32,768-entry store) into a store full of the gateway's own 16,384
// entries and 8 other peers' 2,048 each, so each op evicts 2,048. Reported
// per op and per evicted entry.
func BenchmarkEvictFlood(b *testing.B) {
	const capacity, per = 1 << 15, 2048
	s, err := New(Options{MaxEntries: capacity, MaxPerRecord: per})
	if err != nil {
		b.Fatal(err)
	}
	now := time.Unix(1_000_000, 0)
	next := uint64(1)
	fresh := func() []uint64 {
		out := make([]uint64, per)
		for i := range out {
			out[i] = next * 0x9E3779B97F4A7C15
			next++
		}
		return out
	}
	for range capacity / 2 / per {
		s.Record("local", fresh(), 0, now)
	}
	for p := range 8 {
		s.RecordFrom(fmt.Sprint("peer", p), "w", fresh(), 0, now)
	}
	floods := make([][]uint64, 64)
	for i := range floods {
		floods[i] = fresh()
	}
	b.ReportAllocs()
	b.ResetTimer()
	for i := range b.N {
		s.RecordFrom("forger", "f", floods[i%len(floods)], 0, now)
		if i%len(floods) == len(floods)-1 {
			b.StopTimer()
			for j := range floods {
				floods[j] = fresh()
			}
			b.StartTimer()
		}
	}
	b.StopTimer()
	st := s.Stats()
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(st.Evicted), "ns/evicted")
}
