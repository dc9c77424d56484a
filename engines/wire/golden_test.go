package wire

import (
	"math"
	"slices"
	"testing"

	"google.golang.org/protobuf/proto"

	"github.com/kvrelay/kvrelay/proto/kvpb"
)

// relay-semantics §7.1 item 3: smg's golden vLLM 0.30.1rc1 batches.
func TestGoldenBatchesConvertLikeSMG(t *testing.T) {
	n := NewNormalizer(VLLM)
	b1, d1 := mustNormalize(t, n, unhex(t, hexF1Batch1), 9, -1)
	if got, want := eventIDs(b1), []uint64{1, 2, 4, 5}; !slices.Equal(got, want) {
		t.Fatalf("BATCH1 ids %v, want %v (the unaligned third store consumes id 3)", got, want)
	}
	if d1 != dropsOf(DropUnalignedBlocks, 1) {
		t.Errorf("BATCH1 drops %v", d1)
	}
	if b1.GetSequenceNumber() != 9 || b1.GetTimestamp() != 1700000000.5 || b1.DpRank != nil {
		t.Errorf("BATCH1 header: seq %d ts %v rank %v", b1.GetSequenceNumber(), b1.GetTimestamp(), b1.DpRank)
	}
	s1 := b1.Events[0].GetStored()
	if s1.GetParentBlockHash() != 7 || !slices.Equal(storedHashes(s1), []int64{math.MinInt64, -2}) {
		t.Errorf("store 1: parent %d hashes %v", s1.GetParentBlockHash(), storedHashes(s1))
	}
	if !slices.Equal(s1.Blocks[0].TokenIds, []uint32{1, 2, 3, 4}) || !slices.Equal(s1.Blocks[1].TokenIds, []uint32{5, 6, 7, 8}) {
		t.Errorf("store 1 tokens %v %v", s1.Blocks[0].TokenIds, s1.Blocks[1].TokenIds)
	}
	s2 := b1.Events[1].GetStored()
	if !slices.Equal(storedHashes(s2), []int64{0x1234}) || !slices.Equal(s2.Blocks[0].TokenIds, []uint32{9, 10}) ||
		s2.Blocks[0].GetLoraId() != 3 || s2.GetGroupIdx() != 0 || s2.GetKvCacheSpecKind() != "full_attention" {
		t.Errorf("store 2: %v", s2)
	}
	r := b1.Events[2].GetRemoved()
	if !slices.Equal(r.GetBlockHashes(), []int64{0x1234, -1}) || r.GetTier() != kvpb.KvCacheTier_KV_CACHE_TIER_DEVICE ||
		r.GetMedium() != "GPU" || r.GetLocality() != kvpb.KvCacheLocality_KV_CACHE_LOCALITY_LOCAL || r.CacheLevel != nil {
		t.Errorf("removed: %v", r)
	}
	if b1.Events[3].GetCleared() == nil {
		t.Errorf("event 5 is not a clear: %v", b1.Events[3])
	}

	b2, _ := mustNormalize(t, n, unhex(t, hexF1Batch2), 10, -1)
	if !slices.Equal(eventIDs(b2), []uint64{6}) || b2.GetDpRank() != 1 || b2.DpRank == nil {
		t.Fatalf("BATCH2: ids %v rank %v", eventIDs(b2), b2.DpRank)
	}
	s := b2.Events[0].GetStored()
	if s.GetParentBlockHash() != 41 || !slices.Equal(storedHashes(s), []int64{42}) || !slices.Equal(s.Blocks[0].TokenIds, []uint32{100, 101}) {
		t.Errorf("BATCH2 store: %v", s)
	}
	c := n.Counts()
	if c.ForwardedStored != 3 || c.ForwardedRemoved != 1 || c.ForwardedCleared != 1 || c.Dropped != dropsOf(DropUnalignedBlocks, 1) {
		t.Errorf("counts %+v", c)
	}
}

// Every encoding of the §3.6 example (one store, 2 blocks of [1..8]) in
// every engine generation yields the same blocks.
func TestWorkedEncodingsDecodeAlike(t *testing.T) {
	const (
		vA, vB = -8885242862429187823, -3153830497298837583 // vLLM, as int64
		sA, sB = -3488128144981237669, 5674439469042975057  // SGLang
		tA, tB = 3718046898735569995, 3308615664605479373   // SGLang salted "tenant-a"
	)
	vBytes := "92" + hexVLLMBytesHash1 + hexVLLMBytesHash2
	bytesEvent := hexVLLMMapMinimalEvent[:len("88a474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657392")-2] +
		vBytes + hexVLLMMapMinimalEvent[len("88a474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657392cf84b146b151d55111cfd43b57df56b58fb1"):]
	cases := []struct {
		name    string
		dialect Dialect
		payload []byte
		hashes  []int64
		rank    *int32
		medium  string
		salt    string
		group   bool
	}{
		{"vllm map", VLLM, unhex(t, hexVLLMMap), []int64{vA, vB}, ptr(int32(0)), "GPU", "", true},
		{"vllm minimal map", VLLM, batchOf(t, "00", hexVLLMMapMinimalEvent), []int64{vA, vB}, ptr(int32(0)), "GPU", "", false},
		{"vllm bytes hashes", VLLM, batchOf(t, "00", bytesEvent), []int64{vA, vB}, ptr(int32(0)), "GPU", "", false},
		{"vllm 12-slot array", VLLM, unhex(t, hexVLLMArray12), []int64{vA, vB}, ptr(int32(0)), "GPU", "", true},
		{"vllm #16750", VLLM, unhex(t, hexVLLM16750), []int64{vA, vB}, nil, "", "", false},
		{"sglang map", SGLang, unhex(t, hexSGLangMap), []int64{sA, sB}, ptr(int32(0)), "GPU", "", false},
		{"sglang salted map", SGLang, batchOf(t, "00", hexSGLangSaltedMapEvent), []int64{tA, tB}, ptr(int32(0)), "GPU", "tenant-a", false},
		{"sglang 7-slot array", SGLang, unhex(t, hexSGLangArray7), []int64{sA, sB}, ptr(int32(0)), "GPU", "", false},
		{"sglang salted array", SGLang, unhex(t, hexSGLangArraySalted), []int64{tA, tB}, ptr(int32(0)), "GPU", "tenant-a", false},
		// smg's behaviour: the salt in slot 7 is lost when the engine is unknown.
		{"sglang salted array read as vllm", VLLM, unhex(t, hexSGLangArraySalted), []int64{tA, tB}, ptr(int32(0)), "GPU", "", false},
		{"sglang oldest", SGLang, unhex(t, hexSGLangOldest), []int64{sA, sB}, nil, "", "", false},
		{"tokenspeed", TokenSpeed, unhex(t, hexTokenSpeed), []int64{vA, vB}, ptr(int32(0)), "", "", false},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			b, d := mustNormalize(t, NewNormalizer(c.dialect), c.payload, 1, -1)
			if d.Total() != 0 || len(b.Events) != 1 {
				t.Fatalf("drops %v, events %d", d, len(b.Events))
			}
			s := b.Events[0].GetStored()
			if !slices.Equal(storedHashes(s), c.hashes) {
				t.Errorf("hashes %v, want %v", storedHashes(s), c.hashes)
			}
			if !slices.Equal(s.Blocks[0].TokenIds, []uint32{1, 2, 3, 4}) || !slices.Equal(s.Blocks[1].TokenIds, []uint32{5, 6, 7, 8}) ||
				s.Blocks[0].BlockSize != 4 || s.Blocks[0].LoraId != nil || s.Blocks[0].CacheLevel != nil {
				t.Errorf("blocks %v", s.Blocks)
			}
			if (b.DpRank == nil) != (c.rank == nil) || (c.rank != nil && *b.DpRank != *c.rank) {
				t.Errorf("rank %v, want %v", b.DpRank, c.rank)
			}
			if s.GetMedium() != c.medium || (s.Medium == nil) != (c.medium == "") {
				t.Errorf("medium %v, want %q", s.Medium, c.medium)
			}
			if s.GetCacheSalt() != c.salt || (s.CacheSalt == nil) != (c.salt == "") {
				t.Errorf("salt %v, want %q", s.CacheSalt, c.salt)
			}
			if (s.GroupIdx != nil) != c.group || s.ParentBlockHash != nil || s.LoraName != nil {
				t.Errorf("group %v parent %v lora %v", s.GroupIdx, s.ParentBlockHash, s.LoraName)
			}
			if s.GetTier() != kvpb.KvCacheTier_KV_CACHE_TIER_DEVICE || s.GetLocality() != kvpb.KvCacheLocality_KV_CACHE_LOCALITY_LOCAL {
				t.Errorf("tier %v locality %v", s.Tier, s.Locality)
			}
		})
	}
}

func ptr[T any](v T) *T { return &v }

func TestOtherWorkedEvents(t *testing.T) {
	n := NewNormalizer(VLLM)
	b, d := mustNormalize(t, n, batchOf(t, "05", hexVLLMRemovedMapEvent, hexClearedMapEvent, hexClearedArrayEvent), 1, -1)
	if d.Total() != 0 || !slices.Equal(eventIDs(b), []uint64{1, 2, 3}) || b.GetDpRank() != 5 {
		t.Fatalf("drops %v ids %v rank %v", d, eventIDs(b), b.DpRank)
	}
	r := b.Events[0].GetRemoved()
	if !slices.Equal(r.BlockHashes, []int64{-8885242862429187823, -3153830497298837583}) || r.GetGroupIdx() != 0 || r.GroupIdx == nil || r.GetMedium() != "GPU" {
		t.Errorf("removed %v", r)
	}
	if b.Events[1].GetCleared() == nil || b.Events[2].GetCleared() == nil || b.Events[1].GetCleared().Ownership != nil {
		t.Errorf("clears %v %v", b.Events[1], b.Events[2])
	}
}

// F2: a real SGLang capture (map era).
func TestRealSGLangCapture(t *testing.T) {
	b, d := mustNormalize(t, NewNormalizer(SGLang), unhex(t, hexF2), 3, -1)
	if d.Total() != 0 || len(b.Events) != 1 || b.GetDpRank() != 0 || b.DpRank == nil {
		t.Fatalf("drops %v events %d rank %v", d, len(b.Events), b.DpRank)
	}
	s := b.Events[0].GetStored()
	if !slices.Equal(storedHashes(s), []int64{-2250709314800143512, 9213906022183458822}) {
		t.Errorf("hashes %v", storedHashes(s))
	}
	for _, blk := range s.Blocks {
		if blk.BlockSize != 64 || len(blk.TokenIds) != 64 {
			t.Errorf("block %d: size %d, %d tokens", blk.BlockHash, blk.BlockSize, len(blk.TokenIds))
		}
	}
	if s.Blocks[0].TokenIds[0] != 840 || s.Blocks[1].TokenIds[63] != 13 || s.GetMedium() != "GPU" || s.ParentBlockHash != nil {
		t.Errorf("store %v", s)
	}
}

// F5: vLLM's msgspec producer fixture, rank 3.
func TestF5CanonicalFixture(t *testing.T) {
	b, d := mustNormalize(t, NewNormalizer(VLLM), unhex(t, hexF5), 1, -1)
	if d.Total() != 0 || b.GetTimestamp() != 1.25 || b.GetDpRank() != 3 || len(b.Events) != 3 {
		t.Fatalf("drops %v ts %v rank %v events %d", d, b.GetTimestamp(), b.DpRank, len(b.Events))
	}
	s, r, c := b.Events[0].GetStored(), b.Events[1].GetRemoved(), b.Events[2].GetCleared()
	if !slices.Equal(storedHashes(s), []int64{42}) || !slices.Equal(s.Blocks[0].TokenIds, []uint32{1, 2}) || s.GroupIdx == nil {
		t.Errorf("stored %v", s)
	}
	if !slices.Equal(r.GetBlockHashes(), []int64{42}) || r.GroupIdx == nil || c == nil {
		t.Errorf("removed %v cleared %v", r, c)
	}
}

// F6 legacy arrays: a 7-slot store whose 2 hashes × 16 do not cover its 2
// tokens, and a STORAGE removal (the disk tier).
func TestF6LegacyArrays(t *testing.T) {
	b, d := mustNormalize(t, NewNormalizer(VLLM), unhex(t, hexF6Legacy), 1, -1)
	if d != dropsOf(DropUnalignedBlocks, 1) || !slices.Equal(eventIDs(b), []uint64{2}) || b.DpRank != nil {
		t.Fatalf("drops %v ids %v rank %v", d, eventIDs(b), b.DpRank)
	}
	r := b.Events[0].GetRemoved()
	if !slices.Equal(r.BlockHashes, []int64{34}) || r.GetTier() != kvpb.KvCacheTier_KV_CACHE_TIER_DISK || r.GetCacheLevel() != 2 || r.GetMedium() != "STORAGE" {
		t.Errorf("removed %v", r)
	}
}

// F8: SGLang map store with a parent and lora_id 7 whose 2 hashes × 4 do not
// match its 4 tokens; its fields still decode.
func TestF8SGLangRouterGolden(t *testing.T) {
	n := NewNormalizer(SGLang)
	b, d := mustNormalize(t, n, unhex(t, hexF8), 1, -1)
	if d != dropsOf(DropUnalignedBlocks, 1) || len(b.Events) != 0 || b.GetDpRank() != 2 || b.GetTimestamp() != 123.456 {
		t.Fatalf("drops %v events %d rank %v ts %v", d, len(b.Events), b.DpRank, b.GetTimestamp())
	}
	ev := n.dec.events[0]
	if got := n.dec.hashes[ev.hashOff : ev.hashOff+ev.hashN]; !slices.Equal(got, []int64{1234567890123, -987654321}) ||
		ev.parent != (optI64{42, true}) || ev.loraID != (optI64{7, true}) || ev.tokN != 4 {
		t.Errorf("decoded %+v hashes %v", ev, got)
	}
}

// F9: a legacy array store with an LMCache medium nobody maps.
func TestF9UnknownMedium(t *testing.T) {
	b, d := mustNormalize(t, NewNormalizer(VLLM), unhex(t, hexF9), 1, -1)
	if d != dropsOf(DropUnknownMedium, 1) || len(b.Events) != 0 {
		t.Fatalf("drops %v events %d", d, len(b.Events))
	}
}

// TokenSpeed's own test shape: [1.5, [["BlockStored",[123],None,[1,2],2],
// ["BlockRemoved",[123]]], 2].
func TestTokenSpeedShape(t *testing.T) {
	payload := enc(t, []any{1.5, []any{
		[]any{"BlockStored", []any{123}, nil, []any{1, 2}, 2},
		[]any{"BlockRemoved", []any{123}},
	}, 2})
	b, d := mustNormalize(t, NewNormalizer(TokenSpeed), payload, 0, 2)
	if d.Total() != 0 || b.GetDpRank() != 2 || b.GetTimestamp() != 1.5 || len(b.Events) != 2 {
		t.Fatalf("drops %v batch %v", d, b)
	}
	want := &kvpb.KvBlocksStored{
		Blocks:   []*kvpb.KvBlock{{BlockHash: 123, TokenIds: []uint32{1, 2}, BlockSize: 2}},
		Tier:     ptr(kvpb.KvCacheTier_KV_CACHE_TIER_DEVICE),
		Locality: ptr(kvpb.KvCacheLocality_KV_CACHE_LOCALITY_LOCAL),
	}
	if !proto.Equal(b.Events[0].GetStored(), want) {
		t.Errorf("stored %v, want %v", b.Events[0].GetStored(), want)
	}
	wantR := &kvpb.KvBlocksRemoved{BlockHashes: []int64{123}, Tier: want.Tier, Locality: want.Locality}
	if !proto.Equal(b.Events[1].GetRemoved(), wantR) {
		t.Errorf("removed %v", b.Events[1].GetRemoved())
	}
}
