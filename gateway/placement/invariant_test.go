package placement

import (
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/kvrelay/kvrelay/gateway/index"
)

// checkInvariants checks a store's books: every source's count is the
// length of its list and every entry is in the list of its source; the
// lists and the map hold the same entries, s.n of them, at most
// MaxEntries; a peer source kept holds entries and is the map's; at most
// MaxSources peers are kept.
func checkInvariants(t *testing.T, s *Store, step int, op string) {
	t.Helper()
	s.mu.Lock()
	defer s.mu.Unlock()
	inMap := 0
	for h, hs := range s.byHash {
		if len(hs) == 0 {
			t.Fatalf("step %d (%s): empty holders for %d", step, op, h)
		}
		for _, e := range hs {
			if e.hash != h || e.src == nil {
				t.Fatalf("step %d (%s): bad entry %+v", step, op, e)
			}
			inMap++
		}
	}
	total := 0
	for _, src := range s.sources() {
		n := 0
		for e := src.head.next; e != &src.head; e = e.next {
			if e.src != src {
				t.Fatalf("step %d (%s): entry in list of %q has src %q", step, op, src.peer, e.src.peer)
			}
			n++
		}
		if n != src.n {
			t.Fatalf("step %d (%s): source %q counts %d, its list holds %d", step, op, src.peer, src.n, n)
		}
		if src != &s.local && src != &s.overflow && n == 0 {
			t.Fatalf("step %d (%s): empty peer source %q kept", step, op, src.peer)
		}
		if src != &s.local && src != &s.overflow && s.peers[src.peer] != src {
			t.Fatalf("step %d (%s): peer source %q not in the map", step, op, src.peer)
		}
		total += n
	}
	if total != s.n || inMap != s.n {
		t.Fatalf("step %d (%s): s.n=%d lists=%d map=%d", step, op, s.n, total, inMap)
	}
	if s.n > s.opts.MaxEntries {
		t.Fatalf("step %d (%s): %d entries over %d", step, op, s.n, s.opts.MaxEntries)
	}
	if len(s.peers) > MaxSources {
		t.Fatalf("step %d (%s): %d peer sources kept", step, op, len(s.peers))
	}
}

// TestSourceBooksHoldUnderRandomOperations: records of the gateway and of
// peers (past MaxSources too) over one another's blocks and workers,
// lookups that confirm and expire, sweeps and worker removals, in random
// order, keep the store's books (checkInvariants) after every operation;
// a sweep leaves no expired entry.
func TestSourceBooksHoldUnderRandomOperations(t *testing.T) {
	for seed := range 200 {
		r := rand.New(rand.NewPCG(uint64(seed), 1))
		s := newStore(t, Options{MaxEntries: 40 + r.IntN(60), MaxPerRecord: 16, TTL: time.Minute})
		now := t0
		workers := []string{"A", "B", "C", "D"}
		for step := range 400 {
			now = now.Add(time.Duration(r.IntN(8000)) * time.Millisecond)
			base := r.IntN(30) * 7
			p := hashes(base, 1+r.IntN(20))
			w := workers[r.IntN(len(workers))]
			var op string
			switch k := r.IntN(10); {
			case k < 3:
				op = "record"
				s.Record(w, p, r.IntN(len(p)), now)
			case k < 6:
				peer := fmt.Sprint("p", r.IntN(MaxSources+10))
				op = "recordfrom " + peer
				s.RecordFrom(peer, w, p, r.IntN(len(p)), now)
			case k < 8:
				op = "extend"
				d := r.IntN(len(p) + 1)
				var ms index.Matches
				ms.RequestBlocks = len(p)
				if d > 0 {
					ms.Workers = []index.Match{{Worker: w, Blocks: d}}
				}
				s.Extend(p, ms, now)
			case k < 9:
				op = "sweep"
				s.Sweep(now)
				for _, hs := range s.byHash {
					for _, e := range hs {
						if e.expires <= now.UnixNano() {
							t.Fatalf("seed %d step %d: expired entry left by Sweep", seed, step)
						}
					}
				}
			default:
				op = "remove " + w
				s.RemoveWorker(w)
			}
			checkInvariants(t, s, step, op)
		}
	}
}
