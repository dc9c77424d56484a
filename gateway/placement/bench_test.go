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
