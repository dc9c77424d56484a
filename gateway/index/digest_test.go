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
