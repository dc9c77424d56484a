package picker

import (
	"fmt"
	"math/rand/v2"
	"testing"

	"github.com/kvrelay/kvrelay/gateway/index"
)

// BenchmarkPick compares a pick that reads the loads from a map and an
// eligible list (Pick: one walk of the fleet per request) with one that
// reads them from a Fleet (PickFleet), at 128 and 512 workers, of which an
// eighth overlap the request at four depths; in-flight loads 0-7, SMG's default
// spill gate. PickFleet's cost should grow with the candidates only.
func BenchmarkPick(b *testing.B) {
	for _, workers := range []int{128, 512} {
		rng := rand.New(rand.NewPCG(1, uint64(workers)))
		names := make([]string, workers)
		loads := Loads{}
		fleet := NewFleet()
		for i := range names {
			names[i] = fmt.Sprintf("grpc://worker-%03d:50051", i)
			loads[names[i]] = rng.IntN(8)
			fleet.Add(names[i])
			fleet.Set(names[i], loads[names[i]])
		}
		candidates := workers / 8
		m := index.Matches{RequestBlocks: 512}
		for i := range candidates {
			m.Workers = append(m.Workers, index.Match{Worker: names[i*workers/candidates], Blocks: 512 - 128*(i*4/candidates)})
		}
		p, err := New(Config{})
		if err != nil {
			b.Fatal(err)
		}
		b.Run(fmt.Sprintf("map/workers=%d", workers), func(b *testing.B) {
			b.ReportAllocs()
			for range b.N {
				if _, err := p.Pick(Request{Eligible: names}, m, loads); err != nil {
					b.Fatal(err)
				}
			}
		})
		b.Run(fmt.Sprintf("fleet/workers=%d", workers), func(b *testing.B) {
			b.ReportAllocs()
			for range b.N {
				if _, err := p.PickFleet(fleet, Request{}, m); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
