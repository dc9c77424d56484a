package index

import (
	"testing"

	"github.com/kvrelay/kvrelay/proto/kvpb"
	"google.golang.org/protobuf/proto"
)

// FuzzApply feeds arbitrary wire batches (whatever a relay could send) to
// Apply: no input may panic or hang, and the index must stay consistent with
// itself (an emptied worker leaves no entries).
func FuzzApply(f *testing.F) {
	level := int32(1)
	host := kvpb.KvCacheTier_KV_CACHE_TIER_HOST
	seeds := []*kvpb.KvEventBatch{
		batch(0, stored(chainBlocks(1, seq(1, 12)))),
		batch(1, stored([]*kvpb.KvBlock{{BlockHash: -1, TokenIds: []uint32{1, 2, 3, 4}, BlockSize: 4, CacheLevel: &level}}, withParent(7), onTier(host)), removed(device, -1, 3)),
		batch(0, stored(chainBlocks(1, seq(1, 8)), withNS("a", "b")), cleared()),
	}
	for _, s := range seeds {
		b, err := proto.Marshal(s)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b, b)
	}
	f.Fuzz(func(t *testing.T, first, second []byte) {
		ix := New(Options{BlockSize: 4, MaxEntries: 3})
		for _, raw := range [][]byte{first, second} {
			var b kvpb.KvEventBatch
			if err := proto.Unmarshal(raw, &b); err != nil {
				return
			}
			ix.Apply("w", &b)
			ix.ApplyPrepared("v", Prepare(&b))
		}
		_ = ix.FindMatches(seq(1, 12), Namespace{})
		ix.Prune(ix.now())
		ix.RemoveWorker("w")
		ix.ClearWorker("v")
		if st := ix.Stats(); st.Entries != 0 || st.Memberships != 0 {
			t.Fatalf("entries left after removing every worker: %+v", st)
		}
	})
}
