package gateway

import (
	"fmt"
	"testing"
)

// BenchmarkRoute measures Route end to end (lookup, picker, bookkeeping) for
// an 8,192-token request, block size 16, over 128 and 512 workers of which
// every eighth holds the whole prompt and every other eighth its first
// half: the lookup walks all 512 blocks of the request, as the route goal
// (issue 19: 8k tokens × 128 workers, every block walked) says. The workers
// carry in-flight counts, so the picker reads real loads. Without
// placements, and with them (the request is then hashed in full and looked
// up in the placements too).
func BenchmarkRoute(b *testing.B) {
	for _, workers := range []int{128, 512} {
		for _, placements := range []bool{false, true} {
			b.Run(fmt.Sprintf("workers=%d/placements=%v", workers, placements), func(b *testing.B) {
				benchmarkRoute(b, workers, !placements)
			})
		}
	}
}

func benchmarkRoute(b *testing.B, workers int, noPlacements bool) {
	const blockSize, promptTokens = 16, 8192
	cfg := Config{NoPlacements: noPlacements}
	for i := 0; i < workers; i++ {
		cfg.Workers = append(cfg.Workers, Worker{ID: fmt.Sprintf("w%03d", i), Addr: fmt.Sprintf("10.0.%d.%d:1", i/256, i%256), Model: "m"})
	}
	g, err := New(cfg)
	if err != nil {
		b.Fatal(err)
	}
	prompt := tokens(0, promptTokens)
	ix := g.models["m"].ix
	loads := map[string]int{}
	for i := 0; i < workers; i++ {
		w := fmt.Sprintf("w%03d", i)
		loads[w] = i % 5
		switch i % 8 {
		case 0:
			ix.Apply(w, storeBatch(1, blockSize, 1, prompt))
		case 4:
			ix.Apply(w, storeBatch(1, blockSize, 1, prompt[:promptTokens/2]))
		}
	}
	if err := g.ReportLoads(loads); err != nil {
		b.Fatal(err)
	}
	req := RouteRequest{Model: "m", TokenIDs: prompt}
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		d, err := g.Route(req)
		if err != nil || d.MatchedBlocks[d.Worker] != promptTokens/blockSize {
			b.Fatalf("%+v %v", d, err)
		}
	}
}
