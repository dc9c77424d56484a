//go:build indexerbench

package index

import (
	"encoding/json"
	"fmt"
	"slices"
	"testing"
	"time"
)

// TestIndexerCorpusRepass replays KVRELAY_CORPUS, then times every lookup of
// the corpus again against the finished index, rounds times in a row: with
// nothing between lookups, and with KVRELAY_CORPUS_EVICT_LINES (default
// 1024) writes to cache lines scattered over KVRELAY_CORPUS_EVICT_MB
// (default 64) MiB of its own between lookups, which leaves the
// caches and the TLB as cold as the replay's events do, without changing
// the index. If the evicting pass shows the replay's stalls and the quiet one
// does not, the stalls come from cold caches/TLB rather than from the write
// path's own work. Prints one "REPASS {json}" line per pass.
func TestIndexerCorpusRepass(t *testing.T) {
	c := corpusFromEnv(t)
	ix, r := replayCorpus(c, replayOptions{})
	var lookups [][]uint64
	for _, op := range c.ops {
		if op.kind == corpusLookup {
			lookups = append(lookups, op.content)
		}
	}
	evict := make([]uint64, envInt("KVRELAY_CORPUS_EVICT_MB", 64)<<20/8)
	for i := range evict { // touched once, so that the passes fault nothing in
		evict[i] = uint64(i)
	}
	rounds := envInt("KVRELAY_CORPUS_REPASS_ROUNDS", 3)
	lines := envInt("KVRELAY_CORPUS_EVICT_LINES", 1024)
	var m Matches
	pos := uint64(1)
	var want uint64
	for round := 0; round < rounds; round++ {
		for _, evicting := range []bool{false, true} {
			lat := make([]time.Duration, 0, len(lookups))
			var sum uint64
			for _, content := range lookups {
				if evicting {
					for k := 0; k < lines; k++ {
						pos = pos*6364136223846793005 + 1442695040888963407
						evict[(pos>>20)%uint64(len(evict))&^7]++
					}
				}
				s := time.Now()
				ix.FindMatchesContentInto(&m, content)
				lat = append(lat, time.Since(s))
				sum += uint64(m.Best())
			}
			// The finished index answers differently from the replay (blocks
			// were evicted after their lookups), but every pass alike.
			if want == 0 {
				want = sum
			} else if sum != want {
				t.Fatalf("pass answered %d, the first pass %d", sum, want)
			}
			slices.Sort(lat)
			slow := 0
			for _, l := range lat {
				if l >= 5*time.Microsecond {
					slow++
				}
			}
			rank := func(p float64) time.Duration {
				i := int(p/100*float64(len(lat)) + 0.999999)
				return lat[min(max(i, 1), len(lat))-1]
			}
			line, err := json.Marshal(map[string]any{"round": round, "evicting": evicting, "evict_lines": lines, "lookups": len(lat),
				"p50_ns": rank(50).Nanoseconds(), "p99_ns": rank(99).Nanoseconds(), "slow_5us": slow})
			if err != nil {
				t.Fatal(err)
			}
			fmt.Printf("REPASS %s\n", line)
		}
	}
	rank := func(p float64) time.Duration {
		l := slices.Clone(r.lat)
		slices.Sort(l)
		return l[min(max(int(p/100*float64(len(l))+0.999999), 1), len(l))-1]
	}
	fmt.Printf("REPLAY {\"p50_ns\":%d,\"p99_ns\":%d}\n", rank(50).Nanoseconds(), rank(99).Nanoseconds())
}
