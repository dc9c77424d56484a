package index

import (
	"testing"

	"github.com/kvrelay/kvrelay/internal/livedigest"
	"github.com/kvrelay/kvrelay/proto/kvpb"
)

// LiveDigest is the digest of exactly what LiveSet lists for the rank:
// copies counted, host tier in, other ranks and workers out.
func TestLiveDigestSumsTheRanksLiveCopies(t *testing.T) {
	ix := New(Options{BlockSize: 2})
	host := kvpb.KvCacheTier_KV_CACHE_TIER_HOST
	ix.Apply("w", batch(0, stored([]*kvpb.KvBlock{blk(1, 1, 2), blk(2, 3, 4)})))
	ix.Apply("w", batch(0, stored([]*kvpb.KvBlock{blk(2, 3, 4)}, withParent(1)))) // a second copy
	ix.Apply("w", batch(0, stored([]*kvpb.KvBlock{blk(1, 1, 2)}, onTier(host))))
	ix.Apply("w", batch(1, stored([]*kvpb.KvBlock{blk(9, 5, 6)})))
	ix.Apply("other", batch(0, stored([]*kvpb.KvBlock{blk(7, 7, 8)})))
	want := livedigest.Block(1, livedigest.TierDevice) + 2*livedigest.Block(2, livedigest.TierDevice) + livedigest.Block(1, livedigest.TierHost)
	if d, n := ix.LiveDigest("w", 0); d != want || n != 4 {
		t.Fatalf("rank 0: %x over %d copies, want %x over 4", d, n, want)
	}
	ix.Apply("w", batch(0, removed(kvpb.KvCacheTier_KV_CACHE_TIER_DEVICE, 2)))
	want -= livedigest.Block(2, livedigest.TierDevice)
	if d, n := ix.LiveDigest("w", 0); d != want || n != 3 {
		t.Fatalf("rank 0 after a removal: %x over %d copies, want %x over 3", d, n, want)
	}
	if d, n := ix.LiveDigest("w", 5); d != 0 || n != 0 {
		t.Fatalf("a rank with nothing: %x over %d", d, n)
	}
	if d, n := ix.LiveDigest("nobody", 0); d != 0 || n != 0 {
		t.Fatalf("an unknown worker: %x over %d", d, n)
	}
}

// BenchmarkLiveDigest: what the monitor's once-a-second comparison costs
// the worker's lock, for a rank holding 100,000 blocks.
func BenchmarkLiveDigest(b *testing.B) {
	ix := New(Options{BlockSize: 2})
	const n = 100_000
	blocks := make([]*kvpb.KvBlock, 0, 100)
	for i := 0; i < n; i += 100 {
		blocks = blocks[:0]
		for j := 0; j < 100; j++ {
			blocks = append(blocks, blk(int64(i+j+1), uint32(2*(i+j)), uint32(2*(i+j)+1)))
		}
		ix.Apply("w", batch(0, stored(blocks)))
	}
	if _, got := ix.LiveDigest("w", 0); got != n {
		b.Fatalf("%d blocks indexed, want %d", got, n)
	}
	b.ResetTimer()
	for b.Loop() {
		ix.LiveDigest("w", 0)
	}
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/n, "ns/block")
}

// With ReportModeFull, vLLM's re-announced hit chains add no copies while
// genuine second copies do; without it, the re-announced blocks stay as
// phantom copies after their one eviction.
func TestReportModeFullReannouncementsAddNoCopiesInTheIndex(t *testing.T) {
	b1, b2, b3, b4 := blk(1, 1, 2), blk(2, 3, 4), blk(3, 5, 6), blk(4, 7, 8)
	life := []*kvpb.KvEventBatch{
		batch(0, stored([]*kvpb.KvBlock{b1, b2, b3})),        // A caches its prompt
		batch(0, stored([]*kvpb.KvBlock{b1, b2})),            // B's hit, re-announced
		batch(0, stored([]*kvpb.KvBlock{b4}, withParent(2))), // B's own block
		batch(0, stored([]*kvpb.KvBlock{b3}, withParent(2))), // C's second copy of 3
		batch(0, stored([]*kvpb.KvBlock{b1, b2, b3})),        // D's hit, re-announced
		batch(0, removed(kvpb.KvCacheTier_KV_CACHE_TIER_DEVICE, 3)),
		batch(0, stored([]*kvpb.KvBlock{b1})), // E's hit, re-announced
		batch(0, removed(kvpb.KvCacheTier_KV_CACHE_TIER_DEVICE, 4, 2, 1)),
	}
	for _, rule := range []bool{true, false} {
		ix := New(Options{BlockSize: 2, ReportModeFull: rule})
		for _, b := range life {
			ix.Apply("w", b)
		}
		got := ix.LiveSet("w")
		want := []LiveBlock{{Rank: 0, Tier: TierDevice, EngineHash: 3, Copies: 1}}
		exact := len(got) == 1 && got[0] == want[0]
		if rule && !exact {
			t.Fatalf("with the rule: %v, want %v", got, want)
		}
		if !rule && exact {
			t.Fatalf("without the rule the re-announced blocks should stay as phantoms: %v", got)
		}
		if st := ix.Stats().Workers["w"].Counters; rule && st.ReannouncedStores != 3 {
			t.Fatalf("ReannouncedStores %d, want 3", st.ReannouncedStores)
		}
	}
}

// A snapshot lists one store per physical copy: two copies of a root block
// are two parent-less stores of it, which the rule must not take for a
// re-announcement.
func TestReportModeFullLeavesSnapshotCopiesAlone(t *testing.T) {
	ix := New(Options{BlockSize: 2, ReportModeFull: true})
	chunk := batch(0, stored([]*kvpb.KvBlock{blk(1, 1, 2)}), stored([]*kvpb.KvBlock{blk(1, 1, 2)}))
	chunk.Snapshot = &kvpb.KvSnapshotChunk{Index: 0, Count: 1, Blocks: 2}
	ix.Apply("w", chunk)
	if got := ix.LiveSet("w"); len(got) != 1 || got[0].Copies != 2 {
		t.Fatalf("after a snapshot with two copies of block 1: %v", got)
	}
}
