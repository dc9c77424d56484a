package picker

import (
	"fmt"
	"testing"

	"github.com/kvrelay/kvrelay/gateway/index"
)

var matchedSink map[string]int

// TestPickAllocatesOnlyItsMatched: a pick's only allocations are its
// Decision's Matched map, also with more overlaps than its stack buffers
// hold (past 64 candidates they came from the heap on every pick).
func TestPickAllocatesOnlyItsMatched(t *testing.T) {
	if raceEnabled {
		t.Skip("the race detector makes sync.Pool drop items on purpose; allocation counts do not hold")
	}
	for _, overlaps := range []int{8, 64, 65, 300} {
		t.Run(fmt.Sprint(overlaps), func(t *testing.T) {
			p, err := New(Config{})
			if err != nil {
				t.Fatal(err)
			}
			f := NewFleet()
			m := index.Matches{RequestBlocks: 100}
			names := make([]string, 0, overlaps)
			for i := range 2 * overlaps {
				w := fmt.Sprintf("w%04d", i)
				f.Add(w)
				f.Set(w, i%5)
				if i < overlaps {
					names = append(names, w)
					m.Workers = append(m.Workers, index.Match{Worker: w, Blocks: 100 - i/4})
				}
			}
			pick := func() {
				d, err := p.PickFleet(f, Request{}, m)
				if err != nil || len(d.Matched) != overlaps || d.Blocks == 0 {
					t.Fatalf("%+v %v", d, err)
				}
			}
			pick()
			got := testing.AllocsPerRun(200, pick)
			want := testing.AllocsPerRun(200, func() { // Matched, built as choose builds it
				mm := make(map[string]int, overlaps)
				for _, n := range names {
					mm[n] = 1
				}
				matchedSink = mm
			})
			if got != want {
				t.Fatalf("a pick over %d overlaps allocates %v times, its Matched map %v", overlaps, got, want)
			}
		})
	}
}
