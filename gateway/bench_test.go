package gateway

import (
	"fmt"
	"testing"
)

// BenchmarkRoute measures Route end to end (lookup, picker, bookkeeping) for
// an 8,192-token request, block size 16, over 128 workers of which every
// eighth holds the first half of the prompt; without placements, and with
// them (the request is then hashed in full, looked up in the placements
// too, and its second half placed again on its worker each time).
func BenchmarkRoute(b *testing.B) {
	b.Run("no placements", func(b *testing.B) { benchmarkRoute(b, true) })
	b.Run("placements", func(b *testing.B) { benchmarkRoute(b, false) })
}

func benchmarkRoute(b *testing.B, noPlacements bool) {
	const workers, blockSize = 128, 16
	cfg := Config{NoPlacements: noPlacements}
	for i := 0; i < workers; i++ {
		cfg.Workers = append(cfg.Workers, Worker{ID: fmt.Sprintf("w%03d", i), Addr: fmt.Sprintf("10.0.0.%d:1", i), Model: "m"})
	}
	g, err := New(cfg)
	if err != nil {
		b.Fatal(err)
	}
	prompt := tokens(0, 8192)
	ix := g.models["m"].ix
	for i := 0; i < workers; i += 8 {
		ix.Apply(fmt.Sprintf("w%03d", i), storeBatch(1, blockSize, 1, prompt[:4096]))
	}
	req := RouteRequest{Model: "m", TokenIDs: prompt}
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		d, err := g.Route(req)
		if err != nil || d.MatchedBlocks[d.Worker] < 256 {
			b.Fatalf("%+v %v", d, err)
		}
	}
}
