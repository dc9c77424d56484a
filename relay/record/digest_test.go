package record

import (
	"math/rand/v2"
	"testing"

	"github.com/kvrelay/kvrelay/internal/livedigest"
	"github.com/kvrelay/kvrelay/proto/kvpb"
)

// digestOf recomputes a rank's digest from scratch, from a snapshot.
func digestOf(t *testing.T, r *Record, rank int32) (digest, blocks uint64) {
	t.Helper()
	c := r.Cut([]int32{rank})
	defer c.Release()
	for k, e := range replayChunks(t, c.Chunks(map[int32]uint64{rank: 1}, map[int32]uint64{}, 0))[rank] {
		if !livedigest.Covered(uint8(k.tier)) {
			continue
		}
		for range e.Copies {
			digest += livedigest.Block(uint64(k.hash), uint8(k.tier))
			blocks++
		}
	}
	return digest, blocks
}

// The digest kept at every store and removal equals the one recomputed from
// the live set, through second copies, capped copies, the host tier (in),
// the disk tier (out), removals of unknown hashes and clears.
func TestTheLiveDigestKeptIncrementallyEqualsTheLiveSets(t *testing.T) {
	rng := rand.New(rand.NewPCG(14, 4))
	r := New()
	tiers := []kvpb.KvCacheTier{device, host, kvpb.KvCacheTier_KV_CACHE_TIER_DISK}
	for i := 0; i < 3000; i++ {
		rank := int32(rng.IntN(2))
		tier := tiers[rng.IntN(len(tiers))]
		switch n := rng.IntN(100); {
		case n < 55:
			r.Apply(batchOf(rank, storedEv(chain(int64(rng.IntN(40)), 1+rng.IntN(3)), withTier(tier))))
		case n < 98:
			r.Apply(batchOf(rank, removedEv(tier, int64(rng.IntN(45)))))
		default:
			r.Apply(batchOf(rank, clearedEv()))
		}
		if i%100 == 0 || i == 2999 {
			for rank := int32(0); rank < 2; rank++ {
				d, n := r.LiveDigest(rank)
				wd, wn := digestOf(t, r, rank)
				if d != wd || n != wn {
					t.Fatalf("step %d rank %d: kept digest %x over %d copies, recomputed %x over %d", i, rank, d, n, wd, wn)
				}
			}
		}
	}
}
