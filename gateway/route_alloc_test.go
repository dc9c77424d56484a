package gateway

import (
	"fmt"
	"sync"
	"testing"
)

var matchedSink map[string]int

// TestRouteAllocatesOnlyItsAnswer: without placements, a route's only
// allocations are its answer's MatchedBlocks map; the prefix lookup writes
// into a pooled result (it allocated its Workers slice and a sort buffer on
// every route before).
func TestRouteAllocatesOnlyItsAnswer(t *testing.T) {
	if raceEnabled {
		t.Skip("the race detector makes sync.Pool drop items on purpose; allocation counts do not hold")
	}
	const blockSize, promptTokens = 16, 2048
	for _, workers := range []int{16, 128} {
		t.Run(fmt.Sprint(workers), func(t *testing.T) {
			cfg := Config{NoPlacements: true}
			for i := 0; i < workers; i++ {
				cfg.Workers = append(cfg.Workers, Worker{ID: fmt.Sprintf("w%03d", i), Addr: fmt.Sprintf("10.0.0.%d:1", i), Model: "m"})
			}
			g, err := New(cfg)
			if err != nil {
				t.Fatal(err)
			}
			prompt := tokens(0, promptTokens)
			ix := g.models["m"].ix
			holders := 0
			for i := 0; i < workers; i += 4 {
				ix.Apply(fmt.Sprintf("w%03d", i), storeBatch(1, blockSize, 1, prompt[:promptTokens/(1+i%8/4)]))
				holders++
			}
			req := RouteRequest{Model: "m", TokenIDs: prompt}
			route := func() {
				d, err := g.Route(req)
				if err != nil || len(d.MatchedBlocks) != holders || d.MatchedBlocks[d.Worker] == 0 {
					t.Fatalf("%+v %v", d, err)
				}
			}
			route()
			got := testing.AllocsPerRun(200, route)
			names := make([]string, holders)
			for i := range names {
				names[i] = fmt.Sprintf("w%03d", 4*i)
			}
			answer := testing.AllocsPerRun(200, func() { // the picker's Matched, built as it builds it
				m := make(map[string]int, holders)
				for _, n := range names {
					m[n] = 1
				}
				matchedSink = m
			})
			if got != answer {
				t.Fatalf("a route allocates %v times, its MatchedBlocks map %v: the rest should be 0", got, answer)
			}
		})
	}
}

// TestConcurrentRoutesKeepTheirOwnMatches: routes in parallel, each for a
// prompt a different worker holds deepest, get their own overlaps although
// the lookup results are pooled and reused.
func TestConcurrentRoutesKeepTheirOwnMatches(t *testing.T) {
	const blockSize, workers, promptTokens = 16, 8, 512
	cfg := Config{NoPlacements: true}
	for i := 0; i < workers; i++ {
		cfg.Workers = append(cfg.Workers, Worker{ID: fmt.Sprintf("w%d", i), Addr: fmt.Sprintf("10.0.0.%d:1", i), Model: "m"})
	}
	g, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ix := g.models["m"].ix
	prompts := make([][]uint32, workers)
	for i := range prompts {
		prompts[i] = tokens(i*100_000, promptTokens)
		// Worker i holds prompt i whole, worker i+1 its first half.
		ix.Apply(fmt.Sprintf("w%d", i), storeBatch(1, blockSize, int64(i+1)<<20, prompts[i]))
		ix.Apply(fmt.Sprintf("w%d", (i+1)%workers), storeBatch(2, blockSize, int64(i+1)<<24, prompts[i][:promptTokens/2]))
	}
	var wg sync.WaitGroup
	errs := make(chan error, workers)
	for i := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			want, half := fmt.Sprintf("w%d", i), fmt.Sprintf("w%d", (i+1)%workers)
			for range 300 {
				d, err := g.Route(RouteRequest{Model: "m", TokenIDs: prompts[i]})
				if err != nil || d.Worker != want || len(d.MatchedBlocks) != 2 ||
					d.MatchedBlocks[want] != promptTokens/blockSize || d.MatchedBlocks[half] != promptTokens/blockSize/2 {
					errs <- fmt.Errorf("prompt %d: %+v %v", i, d, err)
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
}
