package wire

import (
	"testing"

	"github.com/kvrelay/kvrelay/proto/kvpb"
)

// Batches encoded by the engines' own publisher modules (vLLM 0.34.0, whose
// kv_events is 0.33.0's; SGLang 0.5.23), captured from their replay rings
// with testdata/engines/release_peer.py's ring_payload, so the decoder is
// held to the newest releases without Python at test time.
const (
	// One store with every 0.33 field (extra_keys [["salt-1"], None],
	// group_idx 0, full_attention, LOCAL, session-9, lookahead_token_ids),
	// a CPU placeholder (no tokens, block_size 0) and a removal.
	hexVLLM034Batch = "93cb41da86294020000093de000ea474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657392cf800000000000000506b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f6964739401020304aa626c6f636b5f73697a6502a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c0aa65787472615f6b6579739291a673616c742d31c0a967726f75705f69647800b26b765f63616368655f737065635f6b696e64ae66756c6c5f617474656e74696f6ea86c6f63616c697479a54c4f43414caa73657373696f6e5f6964a973657373696f6e2d39b36c6f6f6b61686561645f746f6b656e5f6964739292070892090ade0008a474797065ab426c6f636b53746f726564ac626c6f636b5f686173686573920a0bb1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f69647390aa626c6f636b5f73697a6500a76c6f72615f6964c0a66d656469756da3435055a96c6f72615f6e616d65c084a474797065ac426c6f636b52656d6f766564ac626c6f636b5f6861736865739106a66d656469756da3475055a967726f75705f6964780000"
	// A salted CPU_PINNED store with a session, an EXTERNAL child, a
	// CPU_PINNED removal and a clear.
	hexSGLang0523Batch = "93cb41da8629402000009489a474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657392fb07b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f6964739401020304aa626c6f636b5f73697a6502a76c6f72615f6964c0a66d656469756daa4350555f50494e4e4544aa63616368655f73616c74a874656e616e742d61aa73657373696f6e5f6964a2733187a474797065ab426c6f636b53746f726564ac626c6f636b5f6861736865739108b1706172656e745f626c6f636b5f6861736807a9746f6b656e5f696473920506aa626c6f636b5f73697a6502a76c6f72615f6964c0a66d656469756da845585445524e414c83a474797065ac426c6f636b52656d6f766564ac626c6f636b5f68617368657391fba66d656469756daa4350555f50494e4e454481a474797065b0416c6c426c6f636b73436c656172656400"
)

func TestNewestReleaseVectors(t *testing.T) {
	t.Run("vllm-0.34.0", func(t *testing.T) {
		b, d, err := NewNormalizer(VLLM).Normalize(unhex(t, hexVLLM034Batch), 0, 0)
		if err != nil {
			t.Fatal(err)
		}
		if len(b.Events) != 2 || d.Map()["placeholder"] != 1 || d.Total() != 1 {
			t.Fatalf("%d events, drops %v; want the store and the removal, the placeholder dropped", len(b.Events), d)
		}
		s := b.Events[0].GetStored()
		if s.GetGroupIdx() != 0 || s.GroupIdx == nil || s.GetKvCacheSpecKind() != "full_attention" ||
			s.GetLocality() != kvpb.KvCacheLocality_KV_CACHE_LOCALITY_LOCAL || s.GetSessionId() != "session-9" ||
			s.GetCacheSalt() != "salt-1" || len(s.GetBlocks()) != 2 || s.GetBlocks()[0].GetBlockHash() != -(1<<63)+5 {
			t.Errorf("store decoded as %v", s)
		}
		if r := b.Events[1].GetRemoved(); len(r.GetBlockHashes()) != 1 || r.GetBlockHashes()[0] != 6 || r.GroupIdx == nil {
			t.Errorf("removal decoded as %v", r)
		}
	})
	t.Run("sglang-0.5.23", func(t *testing.T) {
		b, d, err := NewNormalizer(SGLang).Normalize(unhex(t, hexSGLang0523Batch), 0, 0)
		if err != nil {
			t.Fatal(err)
		}
		if len(b.Events) != 4 || d.Total() != 0 {
			t.Fatalf("%d events, drops %v; want all four", len(b.Events), d)
		}
		host := b.Events[0].GetStored()
		if host.GetTier() != kvpb.KvCacheTier_KV_CACHE_TIER_HOST || host.GetCacheSalt() != "tenant-a" || host.GetSessionId() != "s1" ||
			len(host.GetBlocks()) != 2 || host.GetBlocks()[0].GetBlockHash() != -5 {
			t.Errorf("CPU_PINNED store decoded as %v", host)
		}
		ext := b.Events[1].GetStored()
		if ext.GetTier() != kvpb.KvCacheTier_KV_CACHE_TIER_EXTERNAL || ext.GetParentBlockHash() != 7 {
			t.Errorf("EXTERNAL store decoded as %v", ext)
		}
		if r := b.Events[2].GetRemoved(); r.GetTier() != kvpb.KvCacheTier_KV_CACHE_TIER_HOST || r.GetBlockHashes()[0] != -5 {
			t.Errorf("CPU_PINNED removal decoded as %v", r)
		}
		if b.Events[3].GetCleared() == nil {
			t.Errorf("last event %v, want AllBlocksCleared", b.Events[3])
		}
	})
}
