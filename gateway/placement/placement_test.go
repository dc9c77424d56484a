package placement

import (
	"cmp"
	"math/rand/v2"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvrelay/kvrelay/gateway/index"
)

var t0 = time.Unix(1_000_000, 0)

func newStore(t *testing.T, o Options) *Store {
	t.Helper()
	s, err := New(o)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func matches(n int, ws ...index.Match) index.Matches {
	return index.Matches{RequestBlocks: n, Workers: ws}
}

func TestExtend(t *testing.T) {
	prefix := []uint64{10, 11, 12, 13, 14}
	type rec struct {
		worker string
		blocks []uint64
		from   int
	}
	for _, tc := range []struct {
		name     string
		weight   float64
		recs     []rec
		base     index.Matches
		want     []index.Match
		inferred map[string]int
		left     int // entries after the lookup
	}{
		{
			name: "empty index: placements are the overlap",
			recs: []rec{{"A", prefix[:3], 0}},
			base: matches(5),
			want: []index.Match{{Worker: "A", Blocks: 3}}, inferred: map[string]int{"A": 3}, left: 3,
		},
		{
			name: "placements extend an index overlap",
			recs: []rec{{"A", prefix, 2}},
			base: matches(5, index.Match{Worker: "A", Blocks: 2}, index.Match{Worker: "B", Blocks: 1}),
			want: []index.Match{{Worker: "A", Blocks: 5}, {Worker: "B", Blocks: 1}}, inferred: map[string]int{"A": 3}, left: 3,
		},
		{
			name: "a hole stops the overlap",
			recs: []rec{{"A", []uint64{10, 11, 13}, 0}},
			base: matches(5),
			want: []index.Match{{Worker: "A", Blocks: 2}}, inferred: map[string]int{"A": 2}, left: 3,
		},
		{
			name: "a placement on a block the index holds is confirmed and dropped",
			recs: []rec{{"A", prefix[:4], 0}},
			base: matches(5, index.Match{Worker: "A", Blocks: 3}),
			want: []index.Match{{Worker: "A", Blocks: 4}}, inferred: map[string]int{"A": 1}, left: 1,
		},
		{
			name: "all confirmed: the index's answer as is",
			recs: []rec{{"A", prefix[:2], 0}},
			base: matches(5, index.Match{Worker: "A", Blocks: 2}),
			want: []index.Match{{Worker: "A", Blocks: 2}}, left: 0,
		},
		{
			name: "a placement not starting at block 0 is no overlap",
			recs: []rec{{"A", prefix[1:], 0}},
			base: matches(5),
			want: nil, left: 4,
		},
		{
			name:   "weight scales inferred blocks only",
			weight: 0.5,
			recs:   []rec{{"A", prefix, 0}, {"B", prefix, 2}},
			base:   matches(5, index.Match{Worker: "B", Blocks: 2}),
			want:   []index.Match{{Worker: "B", Blocks: 4}, {Worker: "A", Blocks: 3}}, inferred: map[string]int{"A": 5, "B": 3}, left: 8,
		},
		{
			name:     "two workers, deepest first then by name",
			recs:     []rec{{"B", prefix[:2], 0}, {"A", prefix[:2], 0}, {"C", prefix[:1], 0}},
			base:     matches(5),
			want:     []index.Match{{Worker: "A", Blocks: 2}, {Worker: "B", Blocks: 2}, {Worker: "C", Blocks: 1}},
			inferred: map[string]int{"A": 2, "B": 2, "C": 1}, left: 5,
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := newStore(t, Options{Weight: tc.weight})
			for _, r := range tc.recs {
				full := append([]uint64(nil), prefix[:r.from]...)
				s.Record(r.worker, append(full, r.blocks...), r.from, t0)
			}
			got := s.Extend(prefix, tc.base, t0.Add(time.Second))
			if !reflect.DeepEqual(got.Matches.Workers, tc.want) && len(got.Matches.Workers)+len(tc.want) > 0 {
				t.Errorf("matches = %v, want %v", got.Matches.Workers, tc.want)
			}
			if got.Matches.RequestBlocks != 5 {
				t.Errorf("request blocks = %d, want 5", got.Matches.RequestBlocks)
			}
			if !reflect.DeepEqual(got.Inferred, tc.inferred) {
				t.Errorf("inferred = %v, want %v", got.Inferred, tc.inferred)
			}
			if n := s.Stats().Entries; n != tc.left {
				t.Errorf("entries left = %d, want %d", n, tc.left)
			}
		})
	}
}

func TestExpiry(t *testing.T) {
	s := newStore(t, Options{TTL: 10 * time.Second})
	prefix := []uint64{1, 2, 3}
	s.Record("A", prefix, 0, t0)
	s.Record("B", prefix[:1], 0, t0.Add(5*time.Second))
	// Lazy: a lookup after A's TTL drops A's entries it walks over.
	got := s.Extend(prefix, matches(3), t0.Add(10*time.Second))
	if want := []index.Match{{Worker: "B", Blocks: 1}}; !reflect.DeepEqual(got.Matches.Workers, want) {
		t.Fatalf("after A's TTL: %v, want %v", got.Matches.Workers, want)
	}
	// The walk dropped A's entries on blocks 0 and 1 and stopped (nobody
	// reaches block 2), so A's entry on block 2 is left for the sweep.
	if st := s.Stats(); st.Entries != 2 || st.Expired != 2 {
		t.Fatalf("stats after lookup = %+v, want 2 entries, 2 expired", st)
	}
	if n := s.Sweep(t0.Add(10 * time.Second)); n != 1 {
		t.Fatalf("sweep dropped %d, want A's 1 left", n)
	}
	if n := s.Sweep(t0.Add(15 * time.Second)); n != 1 {
		t.Fatalf("sweep at B's TTL dropped %d, want 1", n)
	}
	if st := s.Stats(); st.Entries != 0 || st.Expired != 4 {
		t.Fatalf("stats = %+v, want empty, 4 expired", st)
	}
}

func TestRecordRefreshes(t *testing.T) {
	s := newStore(t, Options{TTL: 10 * time.Second})
	prefix := []uint64{1, 2}
	s.Record("A", prefix, 0, t0)
	s.Record("A", prefix, 0, t0.Add(8*time.Second))
	if st := s.Stats(); st.Entries != 2 {
		t.Fatalf("entries = %d, want 2 (recording again refreshes)", st.Entries)
	}
	if n := s.Sweep(t0.Add(12 * time.Second)); n != 0 {
		t.Fatalf("sweep dropped %d refreshed entries", n)
	}
	if got := s.Extend(prefix, matches(2), t0.Add(12*time.Second)); got.Matches.Best() != 2 {
		t.Fatalf("refreshed overlap = %v, want 2", got.Matches)
	}
}

func TestMaxEntriesEvictsOldest(t *testing.T) {
	s := newStore(t, Options{MaxEntries: 4})
	s.Record("A", []uint64{1, 2, 3}, 0, t0)
	s.Record("B", []uint64{7, 8}, 0, t0.Add(time.Second)) // evicts A's 1, the oldest
	s.Record("A", []uint64{1}, 0, t0.Add(2*time.Second))  // back as the newest; evicts A's 2
	s.Record("C", []uint64{9}, 0, t0.Add(3*time.Second))  // evicts A's 3
	st := s.Stats()
	if st.Entries != 4 || st.Evicted != 3 {
		t.Fatalf("stats = %+v, want 4 entries, 3 evicted", st)
	}
	if got := s.Extend([]uint64{1, 2, 3}, matches(3), t0.Add(4*time.Second)); got.Matches.Blocks("A") != 1 {
		t.Fatalf("A's overlap = %v, want 1 (2 and 3 evicted)", got.Matches)
	}
	if got := s.Extend([]uint64{7, 8}, matches(2), t0.Add(4*time.Second)); got.Matches.Blocks("B") != 2 {
		t.Fatalf("B's overlap = %v, want 2", got.Matches)
	}
}

func TestRemoveWorker(t *testing.T) {
	s := newStore(t, Options{})
	s.Record("A", []uint64{1, 2}, 0, t0)
	s.Record("B", []uint64{1, 2}, 0, t0)
	if n := s.RemoveWorker("A"); n != 2 {
		t.Fatalf("removed %d, want 2", n)
	}
	got := s.Extend([]uint64{1, 2}, matches(2), t0)
	if want := []index.Match{{Worker: "B", Blocks: 2}}; !reflect.DeepEqual(got.Matches.Workers, want) {
		t.Fatalf("after removal: %v, want %v", got.Matches.Workers, want)
	}
	if st := s.Stats(); st.Removed != 2 || st.Entries != 2 {
		t.Fatalf("stats = %+v", st)
	}
}

func TestRecordIgnoresOutOfRange(t *testing.T) {
	s := newStore(t, Options{})
	for _, from := range []int{-1, 2, 3} {
		s.Record("A", []uint64{1, 2}, from, t0)
	}
	s.Record("", []uint64{1, 2}, 0, t0)
	if n := s.Stats().Entries; n != 0 {
		t.Fatalf("entries = %d, want 0", n)
	}
}

func TestOptionsValidation(t *testing.T) {
	for _, o := range []Options{{TTL: -1}, {MaxEntries: -1}, {Weight: -0.5}, {Weight: 1.5}} {
		if _, err := New(o); err == nil {
			t.Errorf("New(%+v) accepted", o)
		}
	}
	s := newStore(t, Options{})
	if o := s.Options(); o.TTL != DefaultTTL || o.MaxEntries != DefaultMaxEntries || o.Weight != DefaultWeight {
		t.Fatalf("defaults = %+v", o)
	}
}

// TestExtendMatchesModel checks Extend against the rule it implements, on
// random stores: worker w's overlap continues from its index overlap c for
// as long as w has a live placement on each next block, whatever Record
// calls put them there (chains overlapping, broken, refreshed, expired).
// Prefix hashes come from a small tree of prompts, so records share blocks
// and branch as conversations do.
func TestExtendMatchesModel(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	const ttl = 10 * time.Second
	workers := []string{"A", "B", "C", "D", "E"}
	for trial := range 3000 {
		// Four prompts of up to 12 blocks over a tree: prompt p shares its
		// first split blocks with prompt p-1.
		var prompts [][]uint64
		next := uint64(1)
		for p := range 4 {
			n := 1 + rng.IntN(12)
			var pr []uint64
			if p > 0 {
				split := rng.IntN(len(prompts[p-1]) + 1)
				pr = append(pr, prompts[p-1][:min(split, n)]...)
			}
			for len(pr) < n {
				pr = append(pr, next)
				next++
			}
			prompts = append(prompts, pr)
		}
		s := newStore(t, Options{TTL: ttl})
		type key struct {
			h uint64
			w string
		}
		model := map[key]int64{}
		now := t0
		for range 1 + rng.IntN(8) {
			now = now.Add(time.Duration(rng.IntN(4000)) * time.Millisecond)
			w := workers[rng.IntN(len(workers))]
			pr := prompts[rng.IntN(len(prompts))]
			pr = pr[:1+rng.IntN(len(pr))]
			from := rng.IntN(len(pr))
			s.Record(w, pr, from, now)
			exp := now.Add(ttl).UnixNano()
			for _, h := range pr[from:] {
				if old, ok := model[key{h, w}]; !ok || old < exp-refreshSlack(ttl) {
					model[key{h, w}] = exp
				}
			}
		}
		req := prompts[rng.IntN(len(prompts))]
		var base []index.Match
		for _, w := range workers {
			if c := rng.IntN(len(req) + 2); c > 0 && c <= len(req) && rng.IntN(2) == 0 {
				base = append(base, index.Match{Worker: w, Blocks: c})
			}
		}
		slices.SortFunc(base, func(a, b index.Match) int {
			return cmp.Or(cmp.Compare(b.Blocks, a.Blocks), strings.Compare(a.Worker, b.Worker))
		})
		at := now.Add(time.Duration(rng.IntN(8000)) * time.Millisecond)
		got := s.Extend(req, index.Matches{RequestBlocks: len(req), Workers: base}, at)

		wantInferred := map[string]int{}
		var want []index.Match
		for _, w := range workers {
			c := index.Matches{Workers: base}.Blocks(w)
			j := 0
			for c+j < len(req) {
				if exp, ok := model[key{req[c+j], w}]; !ok || exp <= at.UnixNano() {
					break
				}
				j++
			}
			if j > 0 {
				wantInferred[w] = j
			}
			if c+j > 0 {
				want = append(want, index.Match{Worker: w, Blocks: c + j})
			}
		}
		slices.SortFunc(want, func(a, b index.Match) int {
			return cmp.Or(cmp.Compare(b.Blocks, a.Blocks), strings.Compare(a.Worker, b.Worker))
		})
		if len(wantInferred) == 0 {
			wantInferred = nil
		}
		if !reflect.DeepEqual(got.Inferred, wantInferred) || !reflect.DeepEqual(got.Matches.Workers, want) {
			t.Fatalf("trial %d: request %v, base %v:\ngot  %v inferred %v\nwant %v inferred %v",
				trial, req, base, got.Matches.Workers, got.Inferred, want, wantInferred)
		}
	}
}

// TestRecordCapsBlocksPerRecord: one request (or one peer's message)
// places at most MaxPerRecord blocks, from the prefix's start (issue 29:
// one 11 MiB "text" placed 180,224 blocks, 69 % of the cap).
func TestRecordCapsBlocksPerRecord(t *testing.T) {
	for _, tc := range []struct {
		name      string
		opts      Options
		n, from   int
		wantPlace int
	}{
		{"default: MaxEntries/16", Options{MaxEntries: 1 << 18}, 180_224, 0, 1 << 14},
		{"explicit cap", Options{MaxPerRecord: 8}, 100, 0, 8},
		{"from past the cap places nothing", Options{MaxPerRecord: 8}, 100, 10, 0},
		{"from inside the cap places the rest of it", Options{MaxPerRecord: 8}, 100, 5, 3},
		{"under the cap: all", Options{MaxPerRecord: 8}, 5, 0, 5},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := newStore(t, tc.opts)
			prefix := make([]uint64, tc.n)
			for i := range prefix {
				prefix[i] = uint64(i + 1)
			}
			s.Record("A", prefix, tc.from, t0)
			if got := s.Stats().Entries; got != tc.wantPlace {
				t.Fatalf("%d entries, want %d", got, tc.wantPlace)
			}
		})
	}
}
