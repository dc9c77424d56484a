package record

import (
	"bytes"
	"fmt"
	"math"
	"slices"
	"strings"
	"testing"

	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	"github.com/kvrelay/kvrelay/proto/kvpb"
)

const (
	device = kvpb.KvCacheTier_KV_CACHE_TIER_DEVICE
	host   = kvpb.KvCacheTier_KV_CACHE_TIER_HOST
	noTier = kvpb.KvCacheTier_KV_CACHE_TIER_UNSPECIFIED
)

func TestStoresAddCopiesRemovalsTakeThemAndAClearEmptiesTheRank(t *testing.T) {
	type want struct {
		entries, blocks                                  uint64
		ranks                                            []RankStats
		stored, removed, removedUnknown, capped, cleared uint64
	}
	steps := []struct {
		name  string
		apply func(r *Record)
		want  want
	}{
		{
			name: "chains on two ranks",
			apply: func(r *Record) {
				r.Apply(batchOf(0, storedEv([]int64{1, 2, 3})))
				r.Apply(batchOf(1, storedEv([]int64{1})))
			},
			want: want{entries: 4, blocks: 4, ranks: []RankStats{{0, 3, 3}, {1, 1, 1}}, stored: 4},
		},
		{
			name:  "a resend adds a copy",
			apply: func(r *Record) { r.Apply(batchOf(0, storedEv([]int64{1}))) },
			want:  want{entries: 4, blocks: 5, ranks: []RankStats{{0, 3, 4}, {1, 1, 1}}, stored: 5},
		},
		{
			name:  "a removal takes one copy",
			apply: func(r *Record) { r.Apply(batchOf(0, removedEv(noTier, 1))) },
			want:  want{entries: 4, blocks: 4, ranks: []RankStats{{0, 3, 3}, {1, 1, 1}}, stored: 5, removed: 1},
		},
		{
			name:  "the last copy's removal drops the entry",
			apply: func(r *Record) { r.Apply(batchOf(0, removedEv(device, 1))) },
			want:  want{entries: 3, blocks: 3, ranks: []RankStats{{0, 2, 2}, {1, 1, 1}}, stored: 5, removed: 2},
		},
		{
			name: "unknown hashes, tiers and ranks count as removed_unknown",
			apply: func(r *Record) {
				r.Apply(batchOf(0, removedEv(noTier, 99)))
				r.Apply(batchOf(0, removedEv(host, 2)))
				r.Apply(batchOf(7, removedEv(noTier, 2)))
			},
			want: want{entries: 3, blocks: 3, ranks: []RankStats{{0, 2, 2}, {1, 1, 1}}, stored: 5, removed: 2, removedUnknown: 3},
		},
		{
			name: "the host tier is a separate entry, by tier or by cache level",
			apply: func(r *Record) {
				r.Apply(batchOf(0, storedEv([]int64{2}, withTier(host))))
				r.Apply(batchOf(0, storedEv([]int64{2}, withCacheLevel(1))))
				r.Apply(batchOf(0, removedEv(device, 2)))
			},
			want: want{entries: 3, blocks: 4, ranks: []RankStats{{0, 2, 3}, {1, 1, 1}}, stored: 7, removed: 3, removedUnknown: 3},
		},
		{
			name:  "a clear of rank 0 leaves rank 1",
			apply: func(r *Record) { r.Apply(batchOf(0, clearedEv())) },
			want:  want{entries: 1, blocks: 1, ranks: []RankStats{{1, 1, 1}}, stored: 7, removed: 3, removedUnknown: 3, cleared: 1},
		},
		{
			name: "ClearRank forgets a rank without counting",
			apply: func(r *Record) {
				r.Apply(batchOf(NoRank, storedEv([]int64{5, 6})))
				r.ClearRank(1)
			},
			want: want{entries: 2, blocks: 2, ranks: []RankStats{{NoRank, 2, 2}}, stored: 9, removed: 3, removedUnknown: 3, cleared: 1},
		},
		{
			name:  "Reset empties everything and keeps the counters",
			apply: func(r *Record) { r.Reset() },
			want:  want{stored: 9, removed: 3, removedUnknown: 3, cleared: 1},
		},
		{
			name: "empty stores, nil batches and nil blocks are ignored",
			apply: func(r *Record) {
				r.Apply(nil)
				r.Apply(batchOf(0, storedEv(nil)))
				r.Apply(batchOf(0, &kvpb.KvCacheEvent{Data: &kvpb.KvCacheEvent_Stored{
					Stored: &kvpb.KvBlocksStored{Blocks: []*kvpb.KvBlock{nil}}}}))
				r.Apply(batchOf(0, &kvpb.KvCacheEvent{}))
			},
			want: want{stored: 9, removed: 3, removedUnknown: 3, cleared: 1},
		},
	}
	r := New()
	for _, step := range steps {
		step.apply(r)
		got := r.Stats()
		w := step.want
		mustEqualStats(t, got, w.entries, w.blocks, w.ranks)
		if got.Stored != w.stored || got.Removed != w.removed || got.RemovedUnknown != w.removedUnknown ||
			got.Capped != w.capped || got.Cleared != w.cleared {
			t.Fatalf("%s: counters %+v, want %+v", step.name, got, w)
		}
	}
}

func TestCopiesAreCappedLikeTheGatewayCountsThem(t *testing.T) {
	for _, tc := range []struct {
		stores     int
		wantCopies uint64
		wantCapped uint64
	}{
		{stores: 1, wantCopies: 1},
		{stores: 8, wantCopies: 8},
		{stores: 20, wantCopies: 8, wantCapped: 12},
	} {
		r := New()
		for range tc.stores {
			r.Apply(batchOf(0, storedEv([]int64{42})))
		}
		s := r.Stats()
		if s.Blocks != tc.wantCopies || s.Capped != tc.wantCapped || s.Stored != uint64(tc.stores) || s.Entries != 1 {
			t.Fatalf("%d stores: %+v", tc.stores, s)
		}
		c := r.Cut(nil)
		chunks := c.Chunks(map[int32]uint64{0: 5}, nil, 1)
		c.Release()
		units := checkChunks(t, chunks, chunkRule{cursors: map[int32]uint64{0: 5}})
		if len(chunks) != 1 || units[0] != int(tc.wantCopies) {
			t.Fatalf("%d stores: %d chunks with %v units", tc.stores, len(chunks), units)
		}
		// Each physical copy is a one-block store of its own, copies adjacent.
		if got := len(chunks[0].Events) - 1; got != int(tc.wantCopies) {
			t.Fatalf("%d stores: %d store events", tc.stores, got)
		}
	}
}

func TestASnapshotListsTheLiveSetParentsFirstWithTheStoreFields(t *testing.T) {
	tail := []storeOpt{withMedium("GPU"), withKind("full_attention"), withGroup(0)}
	r := New()
	r.Apply(batchOf(0, storedEv([]int64{1, 2, 3, 4, 5}, tail...)))
	// The root is evicted and stored again: its store order is now after its children's.
	r.Apply(batchOf(0, removedEv(noTier, 1)))
	r.Apply(batchOf(0, storedEv([]int64{1}, tail...)))
	c := r.Cut([]int32{0})
	chunks := c.Chunks(map[int32]uint64{0: 9}, map[int32]uint64{0: 3}, 1234.5)
	c.Release()

	want := storedEv([]int64{1, 2, 3, 4, 5}, tail...)
	want.EventId = 0
	wantBatch := &kvpb.KvEventBatch{
		SequenceNumber: 9, Timestamp: 1234.5, DpRank: proto.Int32(0),
		Events:   []*kvpb.KvCacheEvent{clearedEv(), want},
		Snapshot: &kvpb.KvSnapshotChunk{Index: 0, Count: 1, Blocks: 5, UnknownBefore: 3},
	}
	if len(chunks) != 1 || !proto.Equal(chunks[0], wantBatch) {
		t.Fatalf("snapshot:\n got %v\nwant %v", chunks, wantBatch)
	}
}

func TestChunksAreCutPerRankAndStampedUpToTheCut(t *testing.T) {
	r := New()
	r.Apply(batchOf(0, storedEv(chain(1000, 2058))))
	r.Apply(batchOf(1, storedEv(chain(1, 2))))
	cursors := map[int32]uint64{0: 40, 1: 40}
	c := r.Cut(nil)
	chunks := c.Chunks(cursors, nil, 1)
	c.Release()
	units := checkChunks(t, chunks, chunkRule{cursors: cursors})

	type stamp struct {
		rank  int32
		seq   uint64
		units int
	}
	var got []stamp
	for i, b := range chunks {
		got = append(got, stamp{b.GetDpRank(), b.SequenceNumber, units[i]})
		if b.Snapshot.Blocks != 2060 {
			t.Fatalf("chunk %d: blocks %d", i, b.Snapshot.Blocks)
		}
	}
	want := []stamp{{0, 39, 2048}, {0, 40, 10}, {1, 40, 2}}
	if len(got) != len(want) {
		t.Fatalf("stamps %v, want %v", got, want)
	}
	for i := range want {
		if got[i] != want[i] {
			t.Fatalf("stamps %v, want %v", got, want)
		}
	}
	// The run split at the chunk boundary continues from the last block of chunk 0.
	second := chunks[1].Events[0].GetStored()
	if second.GetParentBlockHash() != 1000+2047 || second.Blocks[0].BlockHash != 1000+2048 {
		t.Fatalf("chunk 1 starts with parent %d, block %d", second.GetParentBlockHash(), second.Blocks[0].BlockHash)
	}
	if len(chunks[0].Events) != 2 || len(chunks[1].Events) != 1 || len(chunks[2].Events) != 1 {
		t.Fatalf("events per chunk: %d %d %d", len(chunks[0].Events), len(chunks[1].Events), len(chunks[2].Events))
	}
}

func TestFewSequencesBehindALargeStateMeanLargerChunks(t *testing.T) {
	type stamp struct {
		rank  int32
		seq   uint64
		units int
	}
	for _, tc := range []struct {
		name    string
		blocks  map[int32]int
		cursors map[int32]uint64
		want    []stamp
	}{
		{
			name: "one rank", blocks: map[int32]int{0: 8193}, cursors: map[int32]uint64{0: 1},
			want: []stamp{{0, 0, 8192}, {0, 1, 1}},
		},
		{
			name: "only the short rank grows", blocks: map[int32]int{0: 8193, 1: 4097},
			cursors: map[int32]uint64{0: 1, 1: 100},
			want:    []stamp{{0, 0, 8192}, {0, 1, 1}, {1, 98, 2048}, {1, 99, 2048}, {1, 100, 1}},
		},
		{
			name: "a rank at sequence 0 gets one chunk", blocks: map[int32]int{3: 5000},
			cursors: map[int32]uint64{3: 0}, want: []stamp{{3, 0, 5000}},
		},
		{
			name: "a rank without a cursor counts as sequence 0", blocks: map[int32]int{2: 3000},
			cursors: map[int32]uint64{}, want: []stamp{{2, 0, 3000}},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := New()
			for rank, n := range tc.blocks {
				r.Apply(batchOf(rank, storedEv(chain(1, n))))
			}
			c := r.Cut(nil)
			chunks := c.Chunks(tc.cursors, nil, 1)
			c.Release()
			units := checkChunks(t, chunks, chunkRule{cursors: tc.cursors, maxUnits: -1})
			var got []stamp
			for i, b := range chunks {
				got = append(got, stamp{b.GetDpRank(), b.SequenceNumber, units[i]})
			}
			if len(got) != len(tc.want) {
				t.Fatalf("stamps %v, want %v", got, tc.want)
			}
			for i := range got {
				if got[i] != tc.want[i] {
					t.Fatalf("stamps %v, want %v", got, tc.want)
				}
			}
		})
	}
}

func TestAnEmptyStateSnapshotsAsOneClear(t *testing.T) {
	for _, tc := range []struct {
		name     string
		ranks    []int32
		cursors  map[int32]uint64
		unknown  map[int32]uint64
		wantRank *int32
		wantSeq  uint64
		wantUB   uint64
	}{
		{name: "no rank", cursors: map[int32]uint64{NoRank: 12}, unknown: map[int32]uint64{NoRank: 7}, wantSeq: 12, wantUB: 7},
		{name: "a requested rank", ranks: []int32{3, 1}, cursors: map[int32]uint64{1: 4, 3: 12},
			unknown: map[int32]uint64{3: 7}, wantRank: proto.Int32(3), wantSeq: 12, wantUB: 7},
		{name: "the lowest rank with a cursor", cursors: map[int32]uint64{2: 5, 1: 9},
			wantRank: proto.Int32(1), wantSeq: 9},
		{name: "nothing known", wantSeq: 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := New()
			r.Apply(batchOf(0, storedEv([]int64{1})))
			r.Apply(batchOf(0, removedEv(noTier, 1)))
			c := r.Cut(tc.ranks)
			chunks := c.Chunks(tc.cursors, tc.unknown, 77)
			c.Release()
			want := &kvpb.KvEventBatch{
				SequenceNumber: tc.wantSeq, Timestamp: 77, DpRank: tc.wantRank,
				Events:   []*kvpb.KvCacheEvent{clearedEv()},
				Snapshot: &kvpb.KvSnapshotChunk{Index: 0, Count: 1, Blocks: 0, UnknownBefore: tc.wantUB},
			}
			if len(chunks) != 1 || !proto.Equal(chunks[0], want) {
				t.Fatalf("got %v, want %v", chunks, want)
			}
		})
	}
}

func TestCutSelectsRanks(t *testing.T) {
	r := New()
	for rank := int32(-1); rank < 3; rank++ {
		r.Apply(batchOf(rank, storedEv(chain(10, int(rank)+2))))
	}
	for _, tc := range []struct {
		ranks []int32
		want  []int32
	}{
		{ranks: nil, want: []int32{NoRank, 0, 1, 2}},
		{ranks: []int32{2, 0, 2, 9}, want: []int32{0, 2}},
	} {
		c := r.Cut(tc.ranks)
		if got := c.Ranks(); !slices.Equal(got, tc.want) {
			t.Fatalf("ranks %v: the cut holds %v, want %v", tc.ranks, got, tc.want)
		}
		var entries uint64
		for _, rank := range tc.want {
			entries += uint64(rank) + 2
		}
		if c.Entries() != entries || c.Blocks() != entries {
			t.Fatalf("ranks %v: entries %d blocks %d, want %d", tc.ranks, c.Entries(), c.Blocks(), entries)
		}
		cursors := map[int32]uint64{NoRank: 3, 0: 3, 1: 3, 2: 3}
		chunks := c.Chunks(cursors, nil, 1)
		c.Release()
		checkChunks(t, chunks, chunkRule{cursors: cursors})
		var got []int32
		for _, b := range chunks {
			rank := NoRank
			if b.DpRank != nil {
				rank = *b.DpRank
			}
			got = append(got, rank)
		}
		if len(got) != len(tc.want) {
			t.Fatalf("ranks %v: chunk ranks %v, want %v", tc.ranks, got, tc.want)
		}
		for i := range got {
			if got[i] != tc.want[i] {
				t.Fatalf("ranks %v: chunk ranks %v, want %v", tc.ranks, got, tc.want)
			}
		}
	}
}

func TestAParentCycleStillEmitsEveryBlock(t *testing.T) {
	r := New()
	r.Apply(batchOf(0, storedEv([]int64{1}, withParent(2)), storedEv([]int64{2}, withParent(1)),
		storedEv([]int64{3}, withParent(3))))
	c := r.Cut(nil)
	chunks := c.Chunks(map[int32]uint64{0: 1}, nil, 1)
	c.Release()
	m := model{}
	var counts modelCounts
	m.apply(batchOf(0, storedEv([]int64{1}, withParent(2)), storedEv([]int64{2}, withParent(1)),
		storedEv([]int64{3}, withParent(3))), &counts)
	if d := diffModels(m, replayChunks(t, chunks)); d != "" {
		t.Fatalf("replayed snapshot differs (-want +got):\n%s", d)
	}
}

func TestReleaseIsIdempotentAndEndsTheCut(t *testing.T) {
	r := New()
	r.Apply(batchOf(0, storedEv([]int64{1})))
	c := r.Cut(nil)
	c.Release()
	c.Release()
	if n := r.liveCuts.Load(); n != 0 {
		t.Fatalf("live cuts %d after a double release", n)
	}
	if got := c.Chunks(nil, nil, 0); got != nil {
		t.Fatalf("chunks after release: %v", got)
	}
}

func TestStoreOrderSurvivesTheCounterRunningOut(t *testing.T) {
	r := New()
	r.Apply(batchOf(0, storedEv(chain(100, 3))))
	r.ranks[0].nextOrder = maxOrder - 1
	r.Apply(batchOf(0, storedEv(chain(200, 3))))
	r.Apply(batchOf(0, storedEv(chain(300, 2))))
	c := r.Cut(nil)
	var got []int64
	for _, slot := range c.orderRank(&c.ranks[0]) {
		got = append(got, c.ranks[0].entry(slot).hash)
	}
	c.Release()
	want := []int64{100, 101, 102, 200, 201, 202, 300, 301}
	if len(got) != len(want) {
		t.Fatalf("order %v, want %v", got, want)
	}
	for i := range want {
		if got[i] != want[i] {
			t.Fatalf("order %v, want %v", got, want)
		}
	}
}

// TestTokenArenasAreCompacted re-stores a segment's blocks with ever longer token lists, so no
// freed space fits, with and without a Cut outstanding: the arena must stay bounded and every
// block must keep its own tokens.
func TestTokenArenasAreCompacted(t *testing.T) {
	for _, withCut := range []bool{false, true} {
		t.Run(fmt.Sprintf("cut=%v", withCut), func(t *testing.T) {
			r := New()
			m := model{}
			var counts modelCounts
			hashes := chain(1, segSize)
			for round := 1; round <= 12; round++ {
				var c *Cut
				if withCut {
					c = r.Cut(nil)
				}
				ev := storedEv(hashes)
				for i, blk := range ev.GetStored().Blocks {
					blk.TokenIds = make([]uint32, round)
					for j := range blk.TokenIds {
						blk.TokenIds[j] = uint32(round*1000 + i + j)
					}
					blk.BlockSize = int32(round)
				}
				for _, b := range []*kvpb.KvEventBatch{batchOf(0, ev), batchOf(0, removedEv(noTier, hashes[:segSize/2]...))} {
					r.Apply(b)
					m.apply(b, &counts)
				}
				if c != nil {
					c.Release()
				}
				if round < 12 {
					// Drop the rest too, so the next round reuses every slot.
					b := batchOf(0, removedEv(noTier, hashes[segSize/2:]...))
					r.Apply(b)
					m.apply(b, &counts)
				}
			}
			seg := r.ranks[0].segs[0]
			// The live records' bytes: 12 tokens of 2 varint bytes and the length byte each.
			live := 0
			for i := range seg.entries {
				if e := &seg.entries[i]; e.flags&flagLive != 0 {
					_, end := seg.record(e)
					live += end - int(e.tokOff)
				}
			}
			if want := (segSize / 2) * (1 + 12*2); live != want {
				t.Fatalf("live records hold %d bytes, want %d", live, want)
			}
			if len(seg.tokens) > 3*live+arenaSlack {
				t.Fatalf("arena holds %d bytes for %d live", len(seg.tokens), live)
			}
			c := r.Cut(nil)
			defer c.Release()
			if d := diffModels(m, replayChunks(t, c.Chunks(map[int32]uint64{0: 1}, nil, 1))); d != "" {
				t.Fatalf("snapshot differs (-want +got):\n%s", d)
			}
		})
	}
}

func TestDuplicateStoresCountStoresWhoseEveryBlockWasHeld(t *testing.T) {
	r := New()
	r.Apply(batchOf(0, storedEv([]int64{1, 2})))
	r.Apply(batchOf(0, storedEv([]int64{1, 2}))) // a second physical copy of both
	r.Apply(batchOf(0, storedEv([]int64{2, 3}))) // 3 is new
	r.Apply(batchOf(1, storedEv([]int64{1})))    // another rank holds nothing yet
	if got := r.Stats().DuplicateStores; got != 1 {
		t.Fatalf("DuplicateStores = %d, want 1", got)
	}
}

func TestSnapshotChunksStayUnderFourMiBWhateverTheCursor(t *testing.T) {
	// A rank holding many blocks at a small cursor: the chunk size used to
	// double until the chunks fit in cursor+1 sequences, so cursor 0 made
	// one chunk of every block (tens of MB), over the 4 MiB a gRPC client
	// accepts by default.
	tests := []struct {
		name   string
		blocks int
		cursor uint64
	}{
		{"cursor 0", 300_000, 0},
		{"cursor 3", 300_000, 3},
		{"cursor past the chunk count", 300_000, 1_000},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r, want := New(), model{}
			const perBatch = 4096
			for from := 1; from <= tt.blocks; from += perBatch {
				b := batchOf(0, storedEv(chain(int64(from), min(perBatch, tt.blocks-from+1))))
				r.Apply(b)
				want.apply(b, &modelCounts{})
			}
			c := r.Cut(nil)
			defer c.Release()
			cursors := map[int32]uint64{0: tt.cursor}
			st := c.Stream(cursors, nil, 1)
			var chunks []*kvpb.KvEventBatch
			for b := st.Next(); b != nil; b = st.Next() {
				chunks = append(chunks, b)
			}
			if uint64(len(chunks)) != st.Count() {
				t.Fatalf("%d chunks streamed, Count says %d", len(chunks), st.Count())
			}
			// checkChunks asserts every chunk's encoded size is at most MaxChunkBytes.
			checkChunks(t, chunks, chunkRule{cursors: cursors, maxUnits: -1})
			if len(chunks) < 2 {
				t.Fatalf("%d blocks in %d chunk(s)", tt.blocks, len(chunks))
			}
			if d := diffModels(want, replayChunks(t, chunks)); d != "" {
				t.Fatalf("the streamed snapshot differs from the record: %s", d)
			}
		})
	}
}

func TestTheRecordEvictsTheOldestStoredAtItsCap(t *testing.T) {
	tests := []struct {
		name   string
		cap    uint64
		stores int
	}{
		{"under the cap", 1000, 800},
		{"five times the cap", 1000, 5000},
		{"with a cut held (copy on write)", 1000, 3000},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := New()
			r.SetMaxEntries(tt.cap)
			var held *Cut
			for from := 1; from <= tt.stores; from += 100 {
				r.Apply(batchOf(0, storedEv(chain(int64(from), 100))))
				if s := r.Stats(); s.Entries > tt.cap {
					t.Fatalf("after %d stores the rank holds %d entries, over the cap %d", from+99, s.Entries, tt.cap)
				}
				if held == nil && strings.Contains(tt.name, "cut") && from > 1500 {
					held = r.Cut(nil)
				}
			}
			if held != nil {
				held.Release()
			}
			s := r.Stats()
			wantEvicted := uint64(0)
			if uint64(tt.stores) > tt.cap {
				wantEvicted = uint64(tt.stores) - s.Entries
			}
			if s.Evicted != wantEvicted || r.EvictedFrom(0) != wantEvicted {
				t.Fatalf("evicted %d (rank %d), want %d", s.Evicted, r.EvictedFrom(0), wantEvicted)
			}
			// What is left is the newest stores, every one of them.
			c := r.Cut(nil)
			defer c.Release()
			chunks := c.Chunks(map[int32]uint64{0: 100}, nil, 1)
			checkChunks(t, chunks, chunkRule{cursors: map[int32]uint64{0: 100}, maxUnits: -1})
			oldestKept := int64(tt.stores) - int64(s.Entries) + 1
			n := 0
			for _, b := range chunks {
				for _, ev := range b.Events {
					for _, blk := range ev.GetStored().GetBlocks() {
						if blk.BlockHash < oldestKept {
							t.Fatalf("block %d kept while newer ones went (oldest kept should be %d)", blk.BlockHash, oldestKept)
						}
						n++
					}
				}
			}
			if uint64(n) != s.Entries {
				t.Fatalf("the snapshot holds %d blocks, the stats %d", n, s.Entries)
			}
		})
	}
}

// TestExtraKeysThatAreNotUTF8 stores blocks whose extra keys hold strings that are not valid
// UTF-8, which proto.Marshal refuses (the relay refuses such batches before the record, but the
// record takes any batch): the snapshot must carry them back as they came, in both forms, and the
// encoder must not panic.
func TestExtraKeysThatAreNotUTF8(t *testing.T) {
	keys := []*kvpb.KvBlockExtraKey{
		{Key: &kvpb.KvBlockExtraKey_Text{Text: "bad-\xff"}},
		{Key: &kvpb.KvBlockExtraKey_Multimodal{Multimodal: &kvpb.KvMultimodalKey{Identifier: "img-\xfe", Offset: 7}}},
		{Key: &kvpb.KvBlockExtraKey_Number{Number: -3}},
		{Key: &kvpb.KvBlockExtraKey_Blob{Blob: []byte{0xff}}},
	}
	for i, k := range keys {
		ev := storedEv([]int64{int64(10 + i)})
		ev.GetStored().Blocks[0].ExtraKeys = []*kvpb.KvBlockExtraKey{k, {Key: &kvpb.KvBlockExtraKey_Text{Text: "ok"}}}
		r := New()
		r.Apply(batchOf(0, ev))
		c := r.Cut(nil)
		chunks := c.Chunks(map[int32]uint64{0: 1}, nil, 1)
		if len(chunks) != 1 {
			t.Fatalf("key %d: %d chunks", i, len(chunks))
		}
		got := chunks[0].Events[1].GetStored().Blocks[0].ExtraKeys
		if len(got) != 2 || !proto.Equal(got[0], k) || got[1].GetText() != "ok" {
			t.Fatalf("key %d: extra keys %v, want %v and ok", i, got, k)
		}
		enc := c.Stream(map[int32]uint64{0: 1}, nil, 1).NextEncoded()
		if len(enc) == 0 {
			t.Fatalf("key %d: no encoded chunk", i)
		}
		c.Release()
	}
}

// TestPackTokensIsProtobufPacking: the arena's token encoding must be the wire's packed varints,
// since the snapshot encoder copies it as is; every length class and the edges between them.
func TestPackTokensIsProtobufPacking(t *testing.T) {
	edges := []uint32{0, 1, 127, 128, 16383, 16384, 151999, 1<<21 - 1, 1 << 21, 1<<28 - 1, 1 << 28, math.MaxUint32}
	// Every prefix of the edges, and every pair of them alone, after a 3-byte id and before one.
	var inputs [][]uint32
	for n := range len(edges) + 1 {
		inputs = append(inputs, edges[:n])
	}
	for _, a := range edges {
		for _, b := range edges {
			inputs = append(inputs, []uint32{a, b}, []uint32{16384, a, b}, []uint32{b, a, 151999})
		}
	}
	for _, in := range inputs {
		var want []byte
		for _, v := range in {
			want = protowire.AppendVarint(want, uint64(v))
		}
		got := make([]byte, len(want)) // packTokens writes only the record's bytes
		if end := packTokens(got, 0, in); end != len(want) || !bytes.Equal(got, want) {
			t.Fatalf("%v packed as %x (end %d), want %x", in, got, end, want)
		}
	}
}

// TestRecordsOfEverySizeRoundTrip: putRecord packs a record past the arena's end into room for its
// worst case and then keeps it there or copies it into a freed slot; past 25 tokens the worst
// case's length prefix is longer than the packed tokens' and the tokens move back. Every round
// refills the same slots with records of another size, with and without a Cut holding the arena,
// and the snapshot must give back every block's tokens and extra keys.
func TestRecordsOfEverySizeRoundTrip(t *testing.T) {
	for _, tc := range []struct {
		name  string
		count int                   // tokens a block at least: round r adds 2-r%3
		token func(i, j int) uint32 // block i's token j
	}{
		{"no tokens", 0, func(i, j int) uint32 { return 0 }},
		{"25 three-byte", 25, func(i, j int) uint32 { return 16384 + uint32(i*131+j) }},
		{"26 one-byte (prefix shrinks)", 26, func(i, j int) uint32 { return uint32(i+j) % 128 }},
		{"40 two-byte (prefix shrinks)", 40, func(i, j int) uint32 { return 128 + uint32(i*7+j) }},
		{"30 five-byte", 30, func(i, j int) uint32 { return math.MaxUint32 - uint32(i+j) }},
		{"300 mixed", 300, func(i, j int) uint32 { return []uint32{1, 200, 151999, 1 << 21, 1 << 28}[(i+j)%5] + uint32(j) }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := New()
			m := model{}
			var counts modelCounts
			hashes := chain(1, segSize)
			for round := range 6 {
				var c *Cut
				if round%2 == 1 {
					c = r.Cut(nil)
				}
				ev := storedEv(hashes)
				for i, blk := range ev.GetStored().Blocks {
					n := tc.count + 2 - round%3
					if tc.count == 0 {
						n = 0
					}
					blk.TokenIds = make([]uint32, n)
					for j := range blk.TokenIds {
						blk.TokenIds[j] = tc.token(i, j)
					}
					blk.BlockSize = int32(n)
					if i%3 == 0 {
						blk.ExtraKeys = []*kvpb.KvBlockExtraKey{{Key: &kvpb.KvBlockExtraKey_Number{Number: int64(round*100 + i)}}}
					}
				}
				b := batchOf(0, ev)
				r.Apply(b)
				m.apply(b, &counts)
				snap := r.Cut(nil)
				if d := diffModels(m, replayChunks(t, snap.Chunks(map[int32]uint64{0: 1}, nil, 1))); d != "" {
					t.Fatalf("round %d: snapshot differs (-want +got):\n%s", round, d)
				}
				snap.Release()
				if c != nil {
					c.Release()
				}
				b = batchOf(0, removedEv(noTier, hashes...))
				r.Apply(b)
				m.apply(b, &counts)
			}
		})
	}
}

// TestPutRecordPlacesEveryRecordWhereItBelongs drives putRecord on one slot through each way a
// record is placed: packed past the arena's end and kept there, packed there and copied into the
// slot's freed record, sized first when the arena lacks the worst case's room, and appended
// while a Cut may read the old record, whose bytes must then stay as they were. Each case runs
// with the tokens given as ids and given packed (ApplyEncoded's), which must place them alike.
func TestPutRecordPlacesEveryRecordWhereItBelongs(t *testing.T) {
	toks := func(n int, v uint32) []uint32 {
		out := make([]uint32, n)
		for i := range out {
			out[i] = v + uint32(i)
		}
		return out
	}
	type put struct {
		toks      []uint32
		extra     bool
		cutsLive  bool
		shared    bool // the arena is shared with a Cut before the put
		wantMoved bool // the record must not be where the slot's old one was
	}
	for _, tc := range []struct {
		name     string
		arenaCap int
		puts     []put
	}{
		{"fits the old record: copied into it", 1024, []put{
			{toks: toks(16, 16384), extra: true},
			{toks: toks(16, 200)},
			{toks: toks(3, 1), extra: true},
		}},
		{"bigger than the old record: appended", 1024, []put{
			{toks: toks(2, 1)},
			{toks: toks(16, 151000), extra: true, wantMoved: true},
		}},
		{"past 25 tokens: the length prefix shrinks", 1024, []put{
			{toks: toks(40, 1)},
			{toks: toks(26, 100), extra: true},
			{toks: toks(30, math.MaxUint32-40), wantMoved: true},
		}},
		{"no worst case's room: sized first", 0, []put{
			{toks: toks(16, 16384), extra: true},
			{toks: toks(8, 16384)},
			{toks: toks(9, 1<<28), wantMoved: true},
		}},
		{"a Cut may read the old record: appended", 1024, []put{
			{toks: toks(16, 1)},
			{toks: toks(4, 1<<21), cutsLive: true, shared: true, wantMoved: true},
			{toks: toks(2, 5), cutsLive: true, wantMoved: true},
			{toks: toks(1, 5)}, // no Cut left: the arena is private again
		}},
	} {
		for _, packed := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/packed=%v", tc.name, packed), func(t *testing.T) {
				seg := &segment{entries: new([segSize]entry), tokens: make([]byte, 0, tc.arenaCap)}
				e := &seg.entries[0]
				for i, p := range tc.puts {
					if p.shared {
						seg.sharedArena = true
					}
					oldFlags, oldOff := e.flags&flagsKept, e.tokOff
					var before []byte
					if oldFlags&flagRecord != 0 {
						before = slices.Clone(seg.tokens[:len(seg.tokens)])
					}
					flags := uint8(flagLive)
					if p.extra {
						flags |= flagExtra
					}
					extra := uint32(0xA0B0C0D0 + i)
					var want []byte
					for _, v := range p.toks {
						want = protowire.AppendVarint(want, uint64(v))
					}
					if packed {
						seg.putRecord(e, oldFlags, flags, nil, slices.Clone(want), extra, p.cutsLive)
					} else {
						seg.putRecord(e, oldFlags, flags, p.toks, nil, extra, p.cutsLive)
					}
					if got := seg.tokensOf(e); !bytes.Equal(got, want) {
						t.Fatalf("put %d: tokens %x, want %x", i, got, want)
					}
					if p.extra && seg.extraOf(e) != extra {
						t.Fatalf("put %d: extra id %x, want %x", i, seg.extraOf(e), extra)
					}
					if e.flags != flags|flagRecord {
						t.Fatalf("put %d: flags %b, want %b", i, e.flags, flags|flagRecord)
					}
					if before != nil {
						if moved := e.tokOff != oldOff; moved != p.wantMoved {
							t.Fatalf("put %d: record moved %v, want %v", i, moved, p.wantMoved)
						}
						if p.cutsLive && !bytes.Equal(seg.tokens[:len(before)], before) {
							t.Fatalf("put %d: a record a Cut may read was overwritten", i)
						}
					}
					if _, end := seg.record(e); end > len(seg.tokens) {
						t.Fatalf("put %d: record ends at %d, past the arena's %d bytes", i, end, len(seg.tokens))
					}
					e.flags &= flagsKept // freed, for the next put
				}
			})
		}
	}
}
