package index

import (
	"fmt"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/kvrelay/kvrelay/proto/kvpb"
)

func newTestIndex() *Index { return New(Options{BlockSize: 4}) }

func matchMap(m Matches) map[WorkerID]int {
	out := map[WorkerID]int{}
	for _, w := range m.Workers {
		out[w.Worker] = w.Blocks
	}
	return out
}

func TestFindMatchesLongestPrefix(t *testing.T) {
	ix := newTestIndex()
	ix.Apply("a", batch(0, stored(chainBlocks(100, seq(1, 12)))))
	ix.Apply("b", batch(0, stored(chainBlocks(200, seq(1, 8)))))
	ix.Apply("c", batch(0, stored(chainBlocks(300, seq(5, 12))))) // same content, other position

	tests := []struct {
		name   string
		tokens []uint32
		want   map[WorkerID]int
	}{
		{"full", seq(1, 12), map[WorkerID]int{"a": 3, "b": 2}},
		{"partial tail ignored", append(seq(1, 12), 13, 14, 15), map[WorkerID]int{"a": 3, "b": 2}},
		{"longer than held", seq(1, 20), map[WorkerID]int{"a": 3, "b": 2}},
		{"one block", seq(1, 4), map[WorkerID]int{"a": 1, "b": 1}},
		{"miss in the middle stops", append(append(seq(1, 4), 99, 98, 97, 96), seq(9, 12)...), map[WorkerID]int{"a": 1, "b": 1}},
		{"content elsewhere is not a prefix", seq(5, 12), map[WorkerID]int{"c": 2}},
		{"no full block", seq(1, 3), map[WorkerID]int{}},
		{"unknown", seq(50, 70), map[WorkerID]int{}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			m := ix.FindMatches(tc.tokens, Namespace{})
			if diff := cmp.Diff(tc.want, matchMap(m)); diff != "" {
				t.Errorf("matches (-want +got):\n%s", diff)
			}
			if m.RequestBlocks != len(tc.tokens)/4 {
				t.Errorf("RequestBlocks = %d", m.RequestBlocks)
			}
		})
	}
	m := ix.FindMatches(seq(1, 12), Namespace{})
	if len(m.Workers) != 2 || m.Workers[0].Worker != "a" || m.Best() != 3 || m.Blocks("b") != 2 || m.Blocks("zz") != 0 {
		t.Errorf("ordering/accessors wrong: %+v", m)
	}
}

// An event hashed by the index and a request hashed with SMG's vectors name
// the same blocks.
func TestStoredBlocksHaveSMGIdentity(t *testing.T) {
	ix := newTestIndex()
	ix.Apply("a", batch(0, stored(chainBlocks(1, seq(1, 12)))))
	ix.Apply("l", batch(0, stored([]*kvpb.KvBlock{blk(9, 1, 2, 3, 4)}, withNS("adapter", ""))))
	got := matchMap(ix.FindMatchesHashes([]uint64{0xcb38e4d7fb2dca5c, 0x44a2b2379d6d3c3d, 0xaea1e67a6c80cf84}))
	if diff := cmp.Diff(map[WorkerID]int{"a": 3}, got); diff != "" {
		t.Errorf("base vectors (-want +got):\n%s", diff)
	}
	got = matchMap(ix.FindMatchesHashes([]uint64{0x4af8e65e6822e2c9}))
	if diff := cmp.Diff(map[WorkerID]int{"l": 1}, got); diff != "" {
		t.Errorf("lora vector (-want +got):\n%s", diff)
	}
}

func TestParentChainingAcrossEvents(t *testing.T) {
	ix := newTestIndex()
	ix.Apply("a", batch(0,
		stored([]*kvpb.KvBlock{blk(1, 1, 2, 3, 4)}),
		stored([]*kvpb.KvBlock{blk(2, 5, 6, 7, 8), blk(3, 9, 10, 11, 12)}, withParent(1)),
	))
	if got := ix.FindMatches(seq(1, 12), Namespace{}).Blocks("a"); got != 3 {
		t.Errorf("chained store: %d blocks, want 3", got)
	}
	if c := ix.Stats().Workers["a"].Counters; c.ParentlessStores != 0 || c.StoredBlocks != 3 {
		t.Errorf("counters %+v", c)
	}
}

// SMG re-applies a store whose parent the worker does not hold as a new chain
// from the root: its blocks match only a request that starts with them.
func TestUnknownParentStartsNewChain(t *testing.T) {
	ix := newTestIndex()
	ix.Apply("a", batch(0, stored([]*kvpb.KvBlock{blk(2, 5, 6, 7, 8), blk(3, 9, 10, 11, 12)}, withParent(999))))
	if got := ix.FindMatches(seq(1, 12), Namespace{}).Blocks("a"); got != 0 {
		t.Errorf("request from block 0: %d blocks, want 0", got)
	}
	if got := ix.FindMatches(seq(5, 12), Namespace{}).Blocks("a"); got != 2 {
		t.Errorf("request starting with the orphan run: %d blocks, want 2", got)
	}
	// The orphan run is a valid parent for what follows it.
	ix.Apply("a", batch(0, stored([]*kvpb.KvBlock{blk(4, 13, 14, 15, 16)}, withParent(3))))
	if got := ix.FindMatches(seq(5, 16), Namespace{}).Blocks("a"); got != 3 {
		t.Errorf("extended orphan run: %d blocks, want 3", got)
	}
	c := ix.Stats().Workers["a"].Counters
	if c.ParentlessStores != 1 || c.ParentlessBlocks != 2 {
		t.Errorf("parentless counters %+v", c)
	}
	// A parent on another rank is not this rank's parent.
	ix.Apply("a", batch(1, stored([]*kvpb.KvBlock{blk(5, 17, 18, 19, 20)}, withParent(4))))
	if c := ix.Stats().Workers["a"].Counters; c.ParentlessStores != 2 {
		t.Errorf("cross-rank parent resolved: %+v", c)
	}
}

func TestCopiesAndTiers(t *testing.T) {
	one := []*kvpb.KvBlock{blk(7, 1, 2, 3, 4)}
	type step struct {
		b          *kvpb.KvEventBatch
		wantBlocks int
		wantLive   []LiveBlock
	}
	tests := []struct {
		name          string
		steps         []step
		wantUnknown   uint64
		wantCapped    uint64
		wantRemovedOK uint64
	}{
		{
			name: "two device copies need two removals",
			steps: []step{
				{batch(0, stored(one), stored(one)), 1, []LiveBlock{{0, TierDevice, 7, 2}}},
				{batch(0, removed(device, 7)), 1, []LiveBlock{{0, TierDevice, 7, 1}}},
				{batch(0, removed(unspec, 7)), 0, nil},
			},
			wantRemovedOK: 2,
		},
		{
			name: "host copy keeps the block after the device copy goes",
			steps: []step{
				{batch(0, stored(one), stored(one, onTier(host))), 1, []LiveBlock{{0, TierDevice, 7, 1}, {0, TierHost, 7, 1}}},
				{batch(0, removed(device, 7)), 1, []LiveBlock{{0, TierHost, 7, 1}}},
				{batch(0, removed(device, 7)), 1, []LiveBlock{{0, TierHost, 7, 1}}},
				{batch(0, removed(host, 7)), 0, nil},
			},
			wantUnknown:   1,
			wantRemovedOK: 2,
		},
		{
			name: "disk tier is not indexed",
			steps: []step{
				{batch(0, stored(one, onTier(disk))), 0, nil},
				{batch(0, removed(disk, 7)), 0, nil},
			},
		},
		{
			name: "copies capped at 8",
			steps: []step{
				{batch(0, stored(one), stored(one), stored(one), stored(one), stored(one),
					stored(one), stored(one), stored(one), stored(one), stored(one)), 1, []LiveBlock{{0, TierDevice, 7, 8}}},
			},
			wantCapped: 2,
		},
		{
			name: "unknown removals are counted and harmless",
			steps: []step{
				{batch(0, removed(device, 7, 8)), 0, nil},
				{batch(3, removed(host, 7)), 0, nil},
			},
			wantUnknown: 3,
		},
		{
			name: "cleared drops the batch's rank only",
			steps: []step{
				{batch(0, stored(one)), 1, []LiveBlock{{0, TierDevice, 7, 1}}},
				{batch(1, stored(one)), 1, []LiveBlock{{0, TierDevice, 7, 1}, {1, TierDevice, 7, 1}}},
				{batch(0, cleared()), 1, []LiveBlock{{1, TierDevice, 7, 1}}},
				{batch(1, removed(device, 7)), 0, nil},
			},
			wantRemovedOK: 1,
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			ix := newTestIndex()
			for i, s := range tc.steps {
				ix.Apply("w", s.b)
				if got := ix.FindMatches(seq(1, 4), Namespace{}).Blocks("w"); got != s.wantBlocks {
					t.Errorf("step %d: matched %d blocks, want %d", i, got, s.wantBlocks)
				}
				if diff := cmp.Diff(s.wantLive, ix.LiveSet("w")); diff != "" {
					t.Errorf("step %d: live set (-want +got):\n%s", i, diff)
				}
			}
			c := ix.Stats().Workers["w"].Counters
			if c.UnknownRemovals != tc.wantUnknown || c.CappedCopies != tc.wantCapped || c.RemovedBlocks != tc.wantRemovedOK {
				t.Errorf("counters %+v", c)
			}
			if st := ix.Stats(); len(ix.LiveSet("w")) == 0 && (st.Entries != 0 || st.Memberships != 0) {
				t.Errorf("empty worker but stats %+v", st)
			}
		})
	}
}

func TestCacheLevelResolvesTier(t *testing.T) {
	level := int32(1)
	b := blk(7, 1, 2, 3, 4)
	b.CacheLevel = &level
	ix := newTestIndex()
	ix.Apply("w", batch(0, stored([]*kvpb.KvBlock{b})))
	if diff := cmp.Diff([]LiveBlock{{0, TierHost, 7, 1}}, ix.LiveSet("w")); diff != "" {
		t.Errorf("live set (-want +got):\n%s", diff)
	}
	lv2 := int32(2)
	b2 := blk(8, 5, 6, 7, 8)
	b2.CacheLevel = &lv2
	ix.Apply("w", batch(0, stored([]*kvpb.KvBlock{b2})))
	if c := ix.Stats().Workers["w"].Counters; c.SkippedTier != 1 {
		t.Errorf("disk cache level not skipped: %+v", c)
	}
}

func TestFilters(t *testing.T) {
	kvcr, remoteLoc := "KvCr", kvpb.KvCacheLocality_KV_CACHE_LOCALITY_REMOTE
	swa, full := "sliding_window", "full_attention"
	g1, g0 := uint32(1), uint32(0)
	one := func() []*kvpb.KvBlock { return []*kvpb.KvBlock{blk(7, 1, 2, 3, 4)} }
	tests := []struct {
		name  string
		ev    *kvpb.KvCacheEvent
		check func(WorkerCounters) bool
	}{
		{"foreign owner", stored(one(), func(s *kvpb.KvBlocksStored) { s.Ownership = &kvcr }), func(c WorkerCounters) bool { return c.SkippedForeign == 1 }},
		{"remote", stored(one(), func(s *kvpb.KvBlocksStored) { s.Locality = &remoteLoc }), func(c WorkerCounters) bool { return c.SkippedRemote == 1 }},
		{"sliding window group", stored(one(), func(s *kvpb.KvBlocksStored) { s.KvCacheSpecKind, s.GroupIdx = &swa, &g1 }), func(c WorkerCounters) bool { return c.SkippedGroup == 1 }},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			ix := newTestIndex()
			ix.Apply("w", batch(0, tc.ev))
			if got := ix.FindMatches(seq(1, 4), Namespace{}).Blocks("w"); got != 0 {
				t.Errorf("filtered event indexed")
			}
			if c := ix.Stats().Workers["w"].Counters; !tc.check(c) {
				t.Errorf("counters %+v", c)
			}
		})
	}
	t.Run("group remembered as non-main", func(t *testing.T) {
		ix := newTestIndex()
		ix.Apply("w", batch(0,
			stored(one(), func(s *kvpb.KvBlocksStored) { s.KvCacheSpecKind, s.GroupIdx = &swa, &g1 }),
			stored([]*kvpb.KvBlock{blk(8, 5, 6, 7, 8)}, func(s *kvpb.KvBlocksStored) { s.GroupIdx = &g1 }),
			stored([]*kvpb.KvBlock{blk(9, 1, 2, 3, 4)}, func(s *kvpb.KvBlocksStored) { s.KvCacheSpecKind, s.GroupIdx = &full, &g0 }),
		))
		if c := ix.Stats().Workers["w"].Counters; c.SkippedGroup != 2 {
			t.Errorf("counters %+v", c)
		}
		if diff := cmp.Diff([]LiveBlock{{0, TierDevice, 9, 1}}, ix.LiveSet("w")); diff != "" {
			t.Errorf("live set (-want +got):\n%s", diff)
		}
		r := removed(device, 9)
		r.GetRemoved().GroupIdx = &g1
		ix.Apply("w", batch(0, r))
		if len(ix.LiveSet("w")) != 1 {
			t.Errorf("removal of a non-main group applied")
		}
	})
	t.Run("foreign clear", func(t *testing.T) {
		ix := newTestIndex()
		ix.Apply("w", batch(0, stored(one())))
		ix.Apply("w", batch(0, &kvpb.KvCacheEvent{Data: &kvpb.KvCacheEvent_Cleared{Cleared: &kvpb.KvCacheCleared{Ownership: &kvcr}}}))
		if len(ix.LiveSet("w")) != 1 {
			t.Errorf("foreign clear applied")
		}
	})
}

func TestNamespaceIsolation(t *testing.T) {
	ix := newTestIndex()
	ix.Apply("base", batch(0, stored(chainBlocks(1, seq(1, 8)))))
	ix.Apply("salted", batch(0, stored(chainBlocks(1, seq(1, 8)), withNS("", "s1"))))
	ix.Apply("lora", batch(0, stored(chainBlocks(1, seq(1, 8)), withNS("adapter", ""))))
	tests := []struct {
		ns   Namespace
		want map[WorkerID]int
	}{
		{Namespace{}, map[WorkerID]int{"base": 2}},
		{Namespace{CacheSalt: "s1"}, map[WorkerID]int{"salted": 2}},
		{Namespace{CacheSalt: "s2"}, map[WorkerID]int{}},
		{Namespace{LoraName: "adapter"}, map[WorkerID]int{"lora": 2}},
		{Namespace{LoraName: "adapter", CacheSalt: "s1"}, map[WorkerID]int{}},
	}
	for _, tc := range tests {
		t.Run(fmt.Sprintf("%+v", tc.ns), func(t *testing.T) {
			if diff := cmp.Diff(tc.want, matchMap(ix.FindMatches(seq(1, 8), tc.ns))); diff != "" {
				t.Errorf("(-want +got):\n%s", diff)
			}
		})
	}
}

func TestHoleStopsWorker(t *testing.T) {
	ix := newTestIndex()
	ix.Apply("a", batch(0, stored(chainBlocks(100, seq(1, 16)))))
	ix.Apply("b", batch(0, stored(chainBlocks(200, seq(1, 16)))))
	ix.Apply("a", batch(0, removed(device, 102))) // a's block 2 of 4
	if diff := cmp.Diff(map[WorkerID]int{"a": 1, "b": 4}, matchMap(ix.FindMatches(seq(1, 16), Namespace{}))); diff != "" {
		t.Errorf("(-want +got):\n%s", diff)
	}
}

func TestBlockSizeLearning(t *testing.T) {
	ix := New(Options{})
	if ix.BlockSize() != DefaultBlockSize {
		t.Fatalf("default block size %d", ix.BlockSize())
	}
	ix.Apply("w", batch(0, stored(chainBlocks(1, seq(1, 8)))))
	if ix.BlockSize() != 4 {
		t.Errorf("learned %d, want 4", ix.BlockSize())
	}
	if got := ix.FindMatches(seq(1, 8), Namespace{}).Blocks("w"); got != 2 {
		t.Errorf("matched %d after learning", got)
	}
	ix.SetBlockSize(32)
	if ix.BlockSize() != 32 {
		t.Errorf("SetBlockSize ignored")
	}
	fixed := New(Options{BlockSize: 16})
	fixed.Apply("w", batch(0, stored(chainBlocks(1, seq(1, 8)))))
	fixed.SetBlockSize(8)
	if fixed.BlockSize() != 16 {
		t.Errorf("fixed block size changed to %d", fixed.BlockSize())
	}
}

func TestClearAndRemoveWorker(t *testing.T) {
	ix := newTestIndex()
	ix.Apply("a", batch(0, stored(chainBlocks(1, seq(1, 8)))))
	ix.Apply("a", batch(1, stored(chainBlocks(1, seq(1, 8)))))
	ix.Apply("b", batch(0, stored(chainBlocks(1, seq(1, 8)))))

	ix.ClearWorkerRank("a", 0)
	if got := ix.FindMatches(seq(1, 8), Namespace{}).Blocks("a"); got != 2 {
		t.Errorf("rank 1 copy lost with rank 0: %d", got)
	}
	ix.ClearWorker("a")
	if got := ix.FindMatches(seq(1, 8), Namespace{}).Blocks("a"); got != 0 || len(ix.LiveSet("a")) != 0 {
		t.Errorf("ClearWorker left blocks")
	}
	if _, ok := ix.Stats().Workers["a"]; !ok {
		t.Errorf("ClearWorker forgot the worker")
	}
	ix.RemoveWorker("b")
	st := ix.Stats()
	if st.Entries != 0 || st.Memberships != 0 || !ix.IsEmpty() {
		t.Errorf("entries left: %+v", st)
	}
	if _, ok := st.Workers["b"]; ok {
		t.Errorf("removed worker still listed")
	}
	// The freed slot is reused without resurrecting b.
	ix.Apply("c", batch(0, stored(chainBlocks(1, seq(1, 8)))))
	if diff := cmp.Diff(map[WorkerID]int{"c": 2}, matchMap(ix.FindMatches(seq(1, 8), Namespace{}))); diff != "" {
		t.Errorf("(-want +got):\n%s", diff)
	}
	if diff := cmp.Diff([]WorkerID{"a", "c"}, ix.Workers()); diff != "" {
		t.Errorf("workers (-want +got):\n%s", diff)
	}
	ix.RemoveWorker("nobody")
	ix.ClearWorker("nobody")
	ix.ClearWorkerRank("nobody", 0)
	if ix.LiveSet("nobody") != nil {
		t.Errorf("unknown worker has a live set")
	}
}

// 200 workers exercise multi-word holder bitsets and their shrinking back to
// the inline form.
func TestManyWorkers(t *testing.T) {
	ix := newTestIndex()
	const n = 200
	for i := range n {
		// Worker i holds the first 1 + i%4 blocks.
		ix.Apply(fmt.Sprintf("w%03d", i), batch(0, stored(chainBlocks(1, seq(1, uint32(4*(1+i%4)))))))
	}
	m := matchMap(ix.FindMatches(seq(1, 16), Namespace{}))
	for i := range n {
		if got, want := m[fmt.Sprintf("w%03d", i)], 1+i%4; got != want {
			t.Fatalf("w%03d: %d blocks, want %d", i, got, want)
		}
	}
	for i := range n - 1 {
		ix.RemoveWorker(fmt.Sprintf("w%03d", i))
	}
	if diff := cmp.Diff(map[WorkerID]int{"w199": 4}, matchMap(ix.FindMatches(seq(1, 16), Namespace{}))); diff != "" {
		t.Errorf("(-want +got):\n%s", diff)
	}
	if st := ix.Stats(); st.Entries != 4 || st.Memberships != 4 {
		t.Errorf("stats %+v", st)
	}
}

type fakeClock struct{ t time.Time }

func (c *fakeClock) Now() time.Time { return c.t }

func TestPruneTTL(t *testing.T) {
	clk := &fakeClock{t: time.Unix(1_000_000, 0)}
	ix := New(Options{BlockSize: 4, TTL: time.Minute, Now: clk.Now})
	ix.Apply("a", batch(0, stored(chainBlocks(1, seq(1, 8)))))
	clk.t = clk.t.Add(40 * time.Second)
	ix.Apply("b", batch(0, stored(chainBlocks(1, seq(101, 108)))))
	if r := ix.Prune(clk.t); r.TTL != 0 {
		t.Errorf("pruned %d while younger than the TTL", r.TTL)
	}
	clk.t = clk.t.Add(30 * time.Second)        // a's entries are 70 s old, b's 30 s
	_ = ix.FindMatches(seq(1, 4), Namespace{}) // a lookup touches a's first block
	r := ix.Prune(clk.t)
	if r.TTL != 1 {
		t.Errorf("TTL evicted %d, want 1 (a's untouched second block)", r.TTL)
	}
	if diff := cmp.Diff(map[WorkerID]int{"a": 1}, matchMap(ix.FindMatches(seq(1, 8), Namespace{}))); diff != "" {
		t.Errorf("(-want +got):\n%s", diff)
	}
	// Reverse maps stay: removing the pruned block is a no-op, re-storing re-files it.
	ix.Apply("a", batch(0, stored([]*kvpb.KvBlock{blk(3, 5, 6, 7, 8)}, withParent(2))))
	if got := ix.FindMatches(seq(1, 8), Namespace{}).Blocks("a"); got != 2 {
		t.Errorf("re-stored block not re-filed: %d", got)
	}
	if diff := cmp.Diff([]LiveBlock{{0, TierDevice, 2, 1}, {0, TierDevice, 3, 2}}, ix.LiveSet("a")); diff != "" {
		t.Errorf("live set (-want +got):\n%s", diff)
	}
}

func TestPruneCapacity(t *testing.T) {
	clk := &fakeClock{t: time.Unix(1_000_000, 0)}
	ix := New(Options{BlockSize: 4, MaxEntries: 10, Now: clk.Now})
	for i := range 15 { // 15 single-block chains, one second apart
		ix.Apply("a", batch(0, stored([]*kvpb.KvBlock{blk(int64(i+1), seq(uint32(i*4), uint32(i*4+3))...)})))
		clk.t = clk.t.Add(time.Second)
	}
	// At now, the last two stores are within the 2 s grace.
	r := ix.Prune(clk.t)
	if r.Capacity != 6 { // 15 → 9 (90 % of 10)
		t.Errorf("capacity evicted %d, want 6", r.Capacity)
	}
	m := matchMap(ix.FindMatches(seq(0, 3), Namespace{}))
	if m["a"] != 0 {
		t.Errorf("oldest entry survived")
	}
	if got := ix.FindMatches(seq(56, 59), Namespace{}).Blocks("a"); got != 1 {
		t.Errorf("newest entry evicted")
	}
	if st := ix.Stats(); st.Entries != 9 || st.Memberships != 9 {
		t.Errorf("stats %+v", st)
	}
	if r := ix.Prune(clk.t); r.Capacity != 0 {
		t.Errorf("second prune evicted %d", r.Capacity)
	}
}

func TestApplyIgnoresEmpty(t *testing.T) {
	ix := newTestIndex()
	ix.Apply("w", nil)
	ix.Apply("w", &kvpb.KvEventBatch{})
	ix.Apply("w", batch(0, &kvpb.KvCacheEvent{}, stored(nil), removed(device), &kvpb.KvCacheEvent{Data: &kvpb.KvCacheEvent_Stored{}},
		&kvpb.KvCacheEvent{Data: &kvpb.KvCacheEvent_Removed{}}, stored([]*kvpb.KvBlock{nil, blk(1, 1, 2, 3, 4)})))
	if diff := cmp.Diff([]LiveBlock{{0, TierDevice, 1, 1}}, ix.LiveSet("w")); diff != "" {
		t.Errorf("(-want +got):\n%s", diff)
	}
}

// TestPruneThenSecondCopyOnAnotherRank: a prune clears a block's holders,
// then the same block is stored on another DP rank and removed from the
// first: the worker still holds it through the second rank.
func TestPruneThenSecondCopyOnAnotherRank(t *testing.T) {
	clk := &fakeClock{t: time.Unix(1_000_000, 0)}
	ix := New(Options{BlockSize: 4, TTL: time.Minute, Now: clk.Now})
	ix.Apply("a", batch(0, stored([]*kvpb.KvBlock{blk(1, 1, 2, 3, 4)})))
	clk.t = clk.t.Add(2 * time.Minute)
	if r := ix.Prune(clk.t); r.TTL != 1 {
		t.Fatalf("TTL evicted %d, want 1", r.TTL)
	}
	ix.Apply("a", batch(1, stored([]*kvpb.KvBlock{blk(1, 1, 2, 3, 4)})))
	ix.Apply("a", batch(0, removed(device, 1)))
	if got := ix.FindMatches(seq(1, 4), Namespace{}).Blocks("a"); got != 1 {
		t.Errorf("a holds the block on rank 1, matched %d blocks", got)
	}
	ix.Apply("a", batch(1, removed(device, 1)))
	if st := ix.Stats(); st.Entries != 0 || st.Memberships != 0 {
		t.Errorf("after both copies went: %+v", st)
	}
}
