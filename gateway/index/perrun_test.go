package index

import (
	"fmt"
	"testing"

	"github.com/google/go-cmp/cmp"
	"github.com/kvrelay/kvrelay/proto/kvpb"
)

// docTokens returns n blocks of 4 tokens, distinct per doc and position.
func docTokens(doc, n int) []uint32 {
	out := make([]uint32, 4*n)
	for i := range out {
		out[i] = uint32(doc*100000 + i)
	}
	return out
}

// TestPerRunEdgesAgainstModel drives the two-pass, per-run application of
// stored and removed events (applyStored, applyRemoved) through the cases
// where an event's blocks do not simply extend one run, and compares the
// index with the reference model after every batch: matches of every
// document's every prefix, each worker's live set and the entry counts.
func TestPerRunEdgesAgainstModel(t *testing.T) {
	long := docTokens(1, 300) // longer than a run (maxRunLen)
	shared := docTokens(2, 12)
	fork := append(append([]uint32(nil), shared[:4*5]...), docTokens(3, 7)...) // shares 5 blocks with shared
	mid := docTokens(4, 10)
	rep := docTokens(5, 3)
	queries := [][]uint32{long, shared, fork, mid, rep, long[:4*256], long[:4*257]}

	type step struct {
		w WorkerID
		b *kvpb.KvEventBatch
	}
	eh := func(base int64, from, to int) []int64 {
		var out []int64
		for k := from; k < to; k++ {
			out = append(out, base+int64(k)+1)
		}
		return out
	}
	cases := []struct {
		name  string
		steps []step
	}{
		{"one store crosses a full run into the next", []step{
			{"a", batch(0, stored(chainBlocks(1000, long)))},
			{"b", batch(0, stored(chainBlocks(1000, long[:4*40])))},
			{"a", batch(0, removed(unspec, eh(1000, 250, 260)...))},
			{"b", batch(0, stored(chainBlocks(1000, long)[40:], withParent(1040)))},
			{"a", batch(0, removed(unspec, eh(1000, 0, 300)...))},
		}},
		{"a store follows a shared run, then leaves it", []step{
			{"a", batch(0, stored(chainBlocks(2000, shared)))},
			{"b", batch(0, stored(chainBlocks(3000, fork)))},
			{"b", batch(0, stored(chainBlocks(2000, shared)[5:], withParent(3005)))},
			{"a", batch(0, removed(unspec, eh(2000, 0, 12)...))},
			{"b", batch(0, removed(unspec, eh(3000, 3, 12)...))},
		}},
		{"a removal takes a run's middle, and a store puts it back", []step{
			{"a", batch(0, stored(chainBlocks(4000, mid)))},
			{"b", batch(0, stored(chainBlocks(4000, mid[:4*6])))},
			{"a", batch(0, removed(unspec, eh(4000, 3, 7)...))},
			{"a", batch(0, stored(chainBlocks(4000, mid)[3:7], withParent(4003)))},
			{"a", batch(0, removed(unspec, eh(4000, 0, 2)...), removed(unspec, eh(4000, 5, 10)...))},
			{"b", batch(0, removed(unspec, eh(4000, 0, 6)...))},
			{"a", batch(0, removed(unspec, eh(4000, 2, 5)...))},
		}},
		{"a store whose parent is unknown starts from the root", []step{
			{"a", batch(0, stored(chainBlocks(4000, mid)[4:], withParent(999999)))},
			{"a", batch(0, stored(chainBlocks(5000, mid[:4*4])))},
			{"a", batch(0, stored(chainBlocks(4000, mid)[4:], withParent(5004)))},
			{"a", batch(0, removed(unspec, eh(4000, 4, 10)...))},
		}},
		{"repeated blocks within one event", []step{
			{"a", batch(0, stored([]*kvpb.KvBlock{blk(6001, rep[0:4]...), blk(6002, rep[4:8]...), blk(6001, rep[0:4]...), blk(6003, rep[8:12]...)}))},
			{"a", batch(0, stored([]*kvpb.KvBlock{blk(6001, rep[0:4]...), blk(6001, rep[0:4]...)}))},
			{"b", batch(0, stored([]*kvpb.KvBlock{blk(7001, rep[0:4]...), blk(7002, rep[4:8]...), blk(7002, rep[4:8]...)}, onTier(host)))},
			{"a", batch(0, removed(unspec, 6001, 6001, 6002, 6001))},
			{"b", batch(0, removed(host, 7002, 7002, 7002, 7001))},
			{"a", batch(0, removed(unspec, 6001, 6003, 6001))},
		}},
		{"store and remove in one batch, two ranks", []step{
			{"a", batch(0, stored(chainBlocks(8000, shared)), removed(unspec, eh(8000, 6, 12)...), stored(chainBlocks(8000, shared)[6:], withParent(8006)))},
			{"a", batch(1, stored(chainBlocks(8000, shared)))},
			{"a", batch(0, removed(unspec, eh(8000, 0, 12)...))},
		}},
	}
	for _, sb := range []int{1, 0} {
		for _, tc := range cases {
			t.Run(fmt.Sprintf("%s/shardbits%d", tc.name, sb), func(t *testing.T) {
				ix := New(Options{BlockSize: 4, ShardBits: sb})
				ref := newRefModel()
				for n, st := range tc.steps {
					if n%2 == 0 {
						ix.Apply(st.w, st.b)
					} else {
						ix.ApplyPrepared(st.w, Prepare(st.b))
					}
					ref.apply(st.w, st.b)
					for qi, q := range queries {
						for k := 1; k <= len(q)/4; k++ {
							if diff := cmp.Diff(ref.find(q[:4*k], 4, Namespace{}), matchMap(ix.FindMatches(q[:4*k], Namespace{}))); diff != "" {
								t.Fatalf("step %d, query %d, %d blocks: matches (-model +index):\n%s", n, qi, k, diff)
							}
						}
					}
					entries := map[uint64]bool{}
					memberships := 0
					for _, w := range []WorkerID{"a", "b"} {
						if diff := cmp.Diff(ref.liveSet(w), ix.LiveSet(w)); diff != "" {
							t.Fatalf("step %d: %s live set (-model +index):\n%s", n, w, diff)
						}
						for p := range ref.holds(w) {
							entries[p] = true
							memberships++
						}
					}
					if s := ix.Stats(); s.Entries != len(entries) || s.Memberships != memberships {
						t.Fatalf("step %d: %d entries, %d memberships; model %d, %d", n, s.Entries, s.Memberships, len(entries), memberships)
					}
				}
			})
		}
	}
}

// TestPerRunEventCounters: the two passes count what one loop counted,
// including a conflict found on a block the same event filed.
func TestPerRunEventCounters(t *testing.T) {
	ix := New(Options{BlockSize: 4})
	toks := docTokens(9, 3)
	// Block 3 repeats block 1's engine hash with other content: one
	// conflict, found in the second pass on a position filed by the first
	// block of the same event; the chain then continues from block 1.
	ix.Apply("w", batch(0, stored([]*kvpb.KvBlock{blk(1, toks[0:4]...), blk(2, toks[4:8]...), blk(1, toks[8:12]...)})))
	for range copiesCap {
		ix.Apply("w", batch(0, stored([]*kvpb.KvBlock{blk(2, toks[4:8]...)}, withParent(1))))
	}
	ix.Apply("w", batch(0, removed(unspec, 1, 3, 1, 1)))
	got := ix.Stats().Workers["w"].Counters
	want := WorkerCounters{StoredBlocks: 3 + copiesCap, RemovedBlocks: 2, UnknownRemovals: 2, CappedCopies: 1, EngineConflicts: 1}
	if got != want {
		t.Fatalf("counters %+v, want %+v", got, want)
	}
	// Block 1's last copy went, so w holds block 2's prefix only: no
	// leading block.
	if m := ix.FindMatches(toks[:8], Namespace{}); m.Blocks("w") != 0 {
		t.Fatalf("w matches %d leading blocks after losing block 1, want 0", m.Blocks("w"))
	}
	if diff := cmp.Diff([]LiveBlock{{Rank: 0, Tier: TierDevice, EngineHash: 2, Copies: copiesCap}}, ix.LiveSet("w")); diff != "" {
		t.Fatalf("live set (-want +got):\n%s", diff)
	}
}

// A long event's forward pass lets lookups through every settleEvery
// blocks: each run it changes goes odd and even again at least once per
// settleEvery of its blocks, not once for the whole event (found in review:
// a lookup of a 2,000-block snapshot chunk's runs retried for all of it).
func TestLongEventsSettleEverySoOften(t *testing.T) {
	const n = 1024
	blocks := func() []*kvpb.KvBlock { return chainBlocks(5000, docTokens(7, n)) }
	var hashes []int64
	for k := range n {
		hashes = append(hashes, int64(5000+k+1))
	}
	for _, tc := range []struct {
		name        string
		setup, last *kvpb.KvEventBatch // last is the event measured
	}{
		{"store", nil, batch(0, stored(blocks()))},
		{"removal", batch(0, stored(blocks())), batch(0, removed(unspec, hashes...))},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ix := New(Options{BlockSize: 4, ShardBits: 1})
			ix.Apply("b", batch(0, stored(blocks()))) // b keeps the runs alive through a's removal
			if tc.setup != nil {
				ix.Apply("a", tc.setup)
			}
			before := totalRunVersions(ix)
			ix.Apply("a", tc.last)
			cycles := (totalRunVersions(ix) - before) / 2
			if want := uint64(n/settleEvery - 1); cycles < want {
				t.Fatalf("a %d-block %s made %d version cycles over its runs, want at least %d (one per %d blocks)", n, tc.name, cycles, want, settleEvery)
			}
			for _, v := range runVersions(ix) {
				if v%2 != 0 {
					t.Fatalf("a run's version is odd (%d) after the event", v)
				}
			}
		})
	}
}

func runVersions(ix *Index) []uint64 {
	var out []uint64
	f := &ix.fw
	f.mu.Lock()
	defer f.mu.Unlock()
	for id := uint32(1); id < f.nruns; id++ {
		out = append(out, uint64(f.run(id).ver.Load()))
	}
	return out
}

func totalRunVersions(ix *Index) uint64 {
	var sum uint64
	for _, v := range runVersions(ix) {
		sum += v
	}
	return sum
}
