package record

import (
	"fmt"
	"maps"
	"slices"
	"testing"

	"github.com/kvrelay/kvrelay/proto/kvpb"
)

// copiesOf is the record's live set as hash → copies for one rank's device
// tier, read from a snapshot (one store per physical copy).
func copiesOf(t *testing.T, r *Record, rank int32) map[int64]int {
	t.Helper()
	c := r.Cut([]int32{rank})
	defer c.Release()
	got := map[int64]int{}
	for k, e := range replayChunks(t, c.Chunks(map[int32]uint64{rank: 1}, map[int32]uint64{}, 0))[rank] {
		if k.tier != device {
			t.Fatalf("unexpected tier %v", k)
		}
		got[k.hash] = e.Copies
	}
	return got
}

// The lives of a few vLLM requests with report mode "full" on one rank, as
// vLLM's block pool publishes them: re-announced hit chains (parent None,
// from block 0, every block cached, no removal ever matching) between real
// stores, with genuine second copies (a block cached again under a hash
// another block id holds, removed one copy at a time). With
// DetectReannouncements the record, and a snapshot cut from it, hold the
// engine's exact copies after every step; without it the re-announced
// blocks are phantoms at the end.
func TestReportModeFullReannouncementsAddNoCopiesWhileSecondCopiesCount(t *testing.T) {
	steps := []struct {
		name        string
		ev          *kvpb.KvCacheEvent
		reannounced bool
		want        map[int64]int // the engine's physical copies afterwards
	}{
		{"request A caches its prompt", storedEv([]int64{1, 2, 3}), false, map[int64]int{1: 1, 2: 1, 3: 1}},
		{"request B hits 1, 2: re-announced", storedEv([]int64{1, 2}), true, map[int64]int{1: 1, 2: 1, 3: 1}},
		{"B caches its own block after the hit", storedEv([]int64{4}, withParent(2)), false, map[int64]int{1: 1, 2: 1, 3: 1, 4: 1}},
		{"C recomputes 3 into a new block: a second copy", storedEv([]int64{3}, withParent(2)), false, map[int64]int{1: 1, 2: 1, 3: 2, 4: 1}},
		{"D hits 1, 2, 3: re-announced", storedEv([]int64{1, 2, 3}), true, map[int64]int{1: 1, 2: 1, 3: 2, 4: 1}},
		{"a store from block 0 with a new block is not a re-announcement", storedEv([]int64{1, 9}), false, map[int64]int{1: 2, 2: 1, 3: 2, 4: 1, 9: 1}},
		{"a parent-less chain in another order is not either", storedEv([]int64{2, 1}), false, map[int64]int{1: 3, 2: 2, 3: 2, 4: 1, 9: 1}},
		{"one copy of 3 evicted", removedEv(noTier, 3), false, map[int64]int{1: 3, 2: 2, 3: 1, 4: 1, 9: 1}},
		{"E hits 1: re-announced", storedEv([]int64{1}), true, map[int64]int{1: 3, 2: 2, 3: 1, 4: 1, 9: 1}},
		{"everything evicted, one copy at a time", removedEv(noTier, 3, 4, 9, 2, 2, 1, 1, 1), false, map[int64]int{}},
	}
	for _, detect := range []bool{true, false} {
		t.Run(fmt.Sprintf("detect=%v", detect), func(t *testing.T) {
			r := New()
			if detect {
				r.DetectReannouncements()
			}
			var reannounced uint64
			for _, st := range steps {
				got := r.Apply(batchOf(0, st.ev))
				if st.reannounced && detect {
					reannounced++
				}
				if detect && (len(got) == 1) != st.reannounced {
					t.Fatalf("%s: Apply took events %v for re-announcements, want re-announced=%v", st.name, got, st.reannounced)
				}
				if !detect && got != nil {
					t.Fatalf("%s: re-announcements %v with the rule off", st.name, got)
				}
				if !detect {
					continue
				}
				if snap := copiesOf(t, r, 0); !maps.Equal(snap, st.want) {
					t.Fatalf("%s: the snapshot holds %v, the engine %v", st.name, snap, st.want)
				}
				want := 0
				for _, n := range st.want {
					want += n
				}
				if s := r.Stats(); s.Blocks != uint64(want) || s.Entries != uint64(len(st.want)) {
					t.Fatalf("%s: record %d blocks in %d entries, the engine %d in %d", st.name, s.Blocks, s.Entries, want, len(st.want))
				}
			}
			s := r.Stats()
			if s.Reannounced != reannounced {
				t.Errorf("Reannounced %d, want %d", s.Reannounced, reannounced)
			}
			if !detect && s.Blocks == 0 {
				t.Fatalf("with the rule off the re-announced blocks should be left as phantoms; the record is empty")
			}
			if !detect {
				t.Logf("rule off: %d phantom copies of %v", s.Blocks, slices.Sorted(maps.Keys(copiesOf(t, r, 0))))
			}
		})
	}
}

// A re-announcement is judged per tier and per rank: the same chain live on
// another rank or only on the host tier adds copies.
func TestAReannouncementIsJudgedOnItsOwnRankAndTier(t *testing.T) {
	r := New()
	r.DetectReannouncements()
	r.Apply(batchOf(0, storedEv([]int64{1, 2})))
	r.Apply(batchOf(0, storedEv([]int64{1, 2}, withTier(host))))
	if got := r.Apply(batchOf(1, storedEv([]int64{1, 2}))); got != nil {
		t.Fatalf("rank 1's first store taken for a re-announcement: %v", got)
	}
	if got := r.Apply(batchOf(0, storedEv([]int64{1, 2}, withTier(host)))); len(got) != 1 {
		t.Fatalf("a host-tier re-announcement of a host-tier chain: %v", got)
	}
	r.Apply(batchOf(0, removedEv(host, 1, 2)))
	if got := r.Apply(batchOf(0, storedEv([]int64{1, 2}, withTier(host)))); got != nil {
		t.Fatalf("a host-tier store of a chain live only on the device: %v", got)
	}
	if s := r.Stats(); s.Blocks != 6 || s.Reannounced != 1 {
		t.Fatalf("blocks %d reannounced %d, want 6 and 1", s.Blocks, s.Reannounced)
	}
}
