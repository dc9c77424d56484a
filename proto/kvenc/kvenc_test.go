package kvenc_test

import (
	"bytes"
	"encoding/hex"
	"errors"
	"hash/fnv"
	"math"
	"math/rand/v2"
	"testing"

	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	"github.com/kvrelay/kvrelay/engines/wire"
	"github.com/kvrelay/kvrelay/proto/kvenc"
	"github.com/kvrelay/kvrelay/proto/kvpb"
	"github.com/kvrelay/kvrelay/testkit/goldenvec"
)

// sameAsMarshal fails unless AppendBatch writes exactly proto.Marshal's
// bytes for b, or both refuse it. It also appends after a prefix, as the
// relay does into a reused buffer.
func sameAsMarshal(t testing.TB, b *kvpb.KvEventBatch) {
	t.Helper()
	want, wantErr := proto.Marshal(b)
	got, gotErr := kvenc.AppendBatch(nil, b)
	if (wantErr != nil) != (gotErr != nil) {
		t.Fatalf("proto.Marshal error %v, AppendBatch error %v, for %v", wantErr, gotErr, b)
	}
	if wantErr != nil {
		// EngineLoad is delegated to proto.Marshal, and so is its error.
		if !errors.Is(gotErr, kvenc.ErrInvalidUTF8) && b.Load == nil {
			t.Fatalf("AppendBatch refused with %v, want ErrInvalidUTF8 (proto.Marshal: %v)", gotErr, wantErr)
		}
		return
	}
	if !bytes.Equal(got, want) {
		t.Fatalf("bytes differ for %v\n got  %x\n want %x", b, got, want)
	}
	prefix := []byte("prefix")
	got2, err := kvenc.AppendBatch(prefix, b)
	if err != nil || !bytes.Equal(got2[:len(prefix)], prefix) || !bytes.Equal(got2[len(prefix):], want) {
		t.Fatalf("appending after a prefix: err %v, got %x", err, got2)
	}
}

// TestGoldenVectorsEncodeLikeMarshal: every golden payload, normalized by a
// normalizer of every dialect (state carried across a set's payloads, as the
// golden test does), and every expected batch of the vectors, encode to
// proto.Marshal's bytes.
func TestGoldenVectorsEncodeLikeMarshal(t *testing.T) {
	batches := 0
	for _, b := range goldenvec.Batches(t, "../../testdata/golden") {
		sameAsMarshal(t, b)
		batches++
	}
	if batches < 250 {
		t.Fatalf("only %d batches checked", batches)
	}
}

// TestGeneratedBatchesEncodeLikeMarshal covers what the golden vectors may
// not: every optional field set and unset, negative and extreme values,
// empty and long strings, nil elements, large messages whose lengths need
// several varint bytes, the snapshot and load fields.
func TestGeneratedBatchesEncodeLikeMarshal(t *testing.T) {
	for seed := range uint64(3000) {
		sameAsMarshal(t, genBatch(rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))))
	}
}

func TestEdgeCases(t *testing.T) {
	i32 := func(v int32) *int32 { return &v }
	s := func(v string) *string { return &v }
	stored := func(st *kvpb.KvBlocksStored) *kvpb.KvCacheEvent {
		return &kvpb.KvCacheEvent{Data: &kvpb.KvCacheEvent_Stored{Stored: st}}
	}
	bigToks := make([]uint32, 5000)
	for i := range bigToks {
		bigToks[i] = math.MaxUint32 - uint32(i)
	}
	for name, b := range map[string]*kvpb.KvEventBatch{
		"nil":                   nil,
		"empty":                 {},
		"negative zero ts":      {Timestamp: math.Copysign(0, -1)},
		"nan ts":                {Timestamp: math.NaN()},
		"negative rank":         {DpRank: i32(-1)},
		"zero rank":             {DpRank: i32(0)},
		"nil event":             {Events: []*kvpb.KvCacheEvent{nil}},
		"event without data":    {Events: []*kvpb.KvCacheEvent{{EventId: 3}}},
		"nil stored":            {Events: []*kvpb.KvCacheEvent{stored(nil)}},
		"nil removed":           {Events: []*kvpb.KvCacheEvent{{Data: &kvpb.KvCacheEvent_Removed{}}}},
		"nil cleared":           {Events: []*kvpb.KvCacheEvent{{Data: &kvpb.KvCacheEvent_Cleared{}}}},
		"nil block":             {Events: []*kvpb.KvCacheEvent{stored(&kvpb.KvBlocksStored{Blocks: []*kvpb.KvBlock{nil}})}},
		"empty optional string": {Events: []*kvpb.KvCacheEvent{stored(&kvpb.KvBlocksStored{Medium: s("")})}},
		"invalid utf8 medium":   {Events: []*kvpb.KvCacheEvent{stored(&kvpb.KvBlocksStored{Medium: s("\xff")})}},
		"invalid utf8 extra key": {Events: []*kvpb.KvCacheEvent{stored(&kvpb.KvBlocksStored{Blocks: []*kvpb.KvBlock{{
			ExtraKeys: []*kvpb.KvBlockExtraKey{{Key: &kvpb.KvBlockExtraKey_Text{Text: "a\xc0"}}}}}})}},
		"invalid utf8 multimodal": {Events: []*kvpb.KvCacheEvent{stored(&kvpb.KvBlocksStored{Blocks: []*kvpb.KvBlock{{
			ExtraKeys: []*kvpb.KvBlockExtraKey{{Key: &kvpb.KvBlockExtraKey_Multimodal{Multimodal: &kvpb.KvMultimodalKey{Identifier: "\xfe"}}}}}}})}},
		"nil extra key and nil multimodal": {Events: []*kvpb.KvCacheEvent{stored(&kvpb.KvBlocksStored{Blocks: []*kvpb.KvBlock{{
			ExtraKeys: []*kvpb.KvBlockExtraKey{nil, {}, {Key: &kvpb.KvBlockExtraKey_Multimodal{}}, {Key: &kvpb.KvBlockExtraKey_Blob{}},
				{Key: &kvpb.KvBlockExtraKey_Number{}}, {Key: &kvpb.KvBlockExtraKey_Text{}}}}}})}},
		"huge block": {Events: []*kvpb.KvCacheEvent{stored(&kvpb.KvBlocksStored{Blocks: []*kvpb.KvBlock{{
			BlockHash: math.MinInt64, TokenIds: bigToks, BlockSize: int32(len(bigToks))}}})}},
		"invalid utf8 load": {Load: &kvpb.EngineLoad{Disaggregation: &kvpb.EngineDisaggregation{Mode: "\xff"}}},
	} {
		t.Run(name, func(t *testing.T) { sameAsMarshal(t, b) })
	}
	// The refusals above must be refusals, not silently equal output.
	if _, err := kvenc.AppendBatch(nil, &kvpb.KvEventBatch{Events: []*kvpb.KvCacheEvent{stored(&kvpb.KvBlocksStored{CacheSalt: s("\xff")})}}); !errors.Is(err, kvenc.ErrInvalidUTF8) {
		t.Fatalf("an invalid UTF-8 salt: error %v, want ErrInvalidUTF8", err)
	}
}

// FuzzAppendBatchMatchesMarshal normalizes arbitrary payloads with a
// normalizer of each dialect and requires AppendBatch's bytes to equal
// proto.Marshal's; the same input also seeds a generated batch that reaches
// fields no decoder output has.
func FuzzAppendBatchMatchesMarshal(f *testing.F) {
	for _, set := range goldenvec.Load(f, "../../testdata/golden") {
		for _, p := range set.Payloads {
			payload, err := hex.DecodeString(p.Hex)
			if err != nil {
				f.Fatal(err)
			}
			f.Add(uint8(0), payload)
		}
	}
	f.Fuzz(func(t *testing.T, dialect uint8, payload []byte) {
		n := wire.NewNormalizer(wire.Dialect(dialect%3) + 1)
		for round := range uint64(2) {
			b, _, err := n.Normalize(payload, round, int32(dialect%5)-1)
			if err != nil {
				break
			}
			sameAsMarshal(t, b)
		}
		h := fnv.New64a()
		h.Write(payload)
		sameAsMarshal(t, genBatch(rand.New(rand.NewPCG(h.Sum64(), uint64(dialect)))))
	})
}

// genBatch makes a batch with every field of the event path chosen at
// random, set or unset, with values drawn from the edges of their types.
func genBatch(r *rand.Rand) *kvpb.KvEventBatch {
	b := &kvpb.KvEventBatch{}
	if r.IntN(4) > 0 {
		b.SequenceNumber = genU64(r)
	}
	switch r.IntN(4) {
	case 0:
	case 1:
		b.Timestamp = math.Copysign(0, -1)
	default:
		b.Timestamp = r.NormFloat64() * 1e9
	}
	if r.IntN(2) == 0 {
		v := int32(genI64(r))
		b.DpRank = &v
	}
	for range r.IntN(6) {
		b.Events = append(b.Events, genEvent(r))
	}
	if r.IntN(8) == 0 {
		b.Snapshot = &kvpb.KvSnapshotChunk{Index: uint32(genU64(r)), Count: uint32(genU64(r)), Blocks: genU64(r), UnknownBefore: genU64(r)}
	}
	if r.IntN(8) == 0 {
		b.Load = &kvpb.EngineLoad{RunningRequests: uint32(r.IntN(100)), TokenUsage: r.Float64(),
			Lora: &kvpb.EngineLora{SlotsUsed: int32(r.IntN(8))}}
	}
	if r.IntN(4) == 0 {
		v := genU64(r)
		b.LiveDigest = &v
	}
	if r.IntN(4) == 0 {
		v := genU64(r)
		b.LiveBlocks = &v
	}
	return b
}

func genU64(r *rand.Rand) uint64 {
	switch r.IntN(5) {
	case 0:
		return 0
	case 1:
		return uint64(r.IntN(128))
	case 2:
		return math.MaxUint64 - uint64(r.IntN(3))
	default:
		return r.Uint64() >> r.IntN(64)
	}
}

func genI64(r *rand.Rand) int64 {
	v := int64(genU64(r))
	if r.IntN(3) == 0 {
		return -v
	}
	return v
}

func genString(r *rand.Rand) string {
	switch r.IntN(8) {
	case 0:
		return ""
	case 1:
		return "\xff\xfe" // invalid UTF-8: both must refuse
	case 2:
		return string(bytes.Repeat([]byte("ü"), 100+r.IntN(100)))
	default:
		return []string{"GPU", "CPU", "lora-a", "salt-1", "full_attention", "kvcr"}[r.IntN(6)]
	}
}

func optString(r *rand.Rand) *string {
	if r.IntN(3) == 0 {
		return nil
	}
	s := genString(r)
	if r.IntN(4) > 0 && !isValid(s) {
		s = "x"
	}
	return &s
}

func isValid(s string) bool { return s != "\xff\xfe" }

func optI64(r *rand.Rand) *int64 {
	if r.IntN(2) == 0 {
		return nil
	}
	v := genI64(r)
	return &v
}

func optI32(r *rand.Rand) *int32 {
	if r.IntN(2) == 0 {
		return nil
	}
	v := int32(genI64(r))
	return &v
}

func optU32(r *rand.Rand) *uint32 {
	if r.IntN(2) == 0 {
		return nil
	}
	v := uint32(genU64(r))
	return &v
}

func genEvent(r *rand.Rand) *kvpb.KvCacheEvent {
	if r.IntN(30) == 0 {
		return nil
	}
	ev := &kvpb.KvCacheEvent{EventId: genU64(r)}
	switch r.IntN(8) {
	case 0:
		ev.Data = &kvpb.KvCacheEvent_Cleared{Cleared: &kvpb.KvCacheCleared{Ownership: optString(r)}}
	case 1, 2:
		rm := &kvpb.KvBlocksRemoved{CacheLevel: optI32(r), Medium: optString(r), GroupIdx: optU32(r), Ownership: optString(r)}
		for range r.IntN(40) {
			rm.BlockHashes = append(rm.BlockHashes, genI64(r))
		}
		if r.IntN(2) == 0 {
			t := kvpb.KvCacheTier(r.IntN(6) - 1)
			rm.Tier = &t
		}
		if r.IntN(2) == 0 {
			l := kvpb.KvCacheLocality(r.IntN(3))
			rm.Locality = &l
		}
		ev.Data = &kvpb.KvCacheEvent_Removed{Removed: rm}
	case 3:
	default:
		ev.Data = &kvpb.KvCacheEvent_Stored{Stored: genStored(r)}
	}
	return ev
}

func genStored(r *rand.Rand) *kvpb.KvBlocksStored {
	s := &kvpb.KvBlocksStored{ParentBlockHash: optI64(r), Medium: optString(r), GroupIdx: optU32(r),
		KvCacheSpecKind: optString(r), KvCacheSpecSlidingWindow: optU32(r), Ownership: optString(r),
		SessionId: optString(r), LoraName: optString(r), CacheSalt: optString(r)}
	if r.IntN(2) == 0 {
		t := kvpb.KvCacheTier(r.IntN(6))
		s.Tier = &t
	}
	if r.IntN(2) == 0 {
		l := kvpb.KvCacheLocality(r.IntN(4) - 1)
		s.Locality = &l
	}
	width := []int{0, 1, 16, 64, 200}[r.IntN(5)]
	for range r.IntN(70) {
		if r.IntN(50) == 0 {
			s.Blocks = append(s.Blocks, nil)
			continue
		}
		blk := &kvpb.KvBlock{BlockHash: genI64(r), BlockSize: int32(genI64(r)), LoraId: optI64(r), CacheLevel: optI32(r)}
		for range width {
			blk.TokenIds = append(blk.TokenIds, uint32(genU64(r)))
		}
		for range r.IntN(3) {
			var k kvpb.KvBlockExtraKey
			switch r.IntN(5) {
			case 0:
				k.Key = &kvpb.KvBlockExtraKey_Text{Text: genString(r)}
			case 1:
				k.Key = &kvpb.KvBlockExtraKey_Blob{Blob: []byte(genString(r))}
			case 2:
				k.Key = &kvpb.KvBlockExtraKey_Number{Number: genI64(r)}
			case 3:
				k.Key = &kvpb.KvBlockExtraKey_Multimodal{Multimodal: &kvpb.KvMultimodalKey{Identifier: genString(r), Offset: genI64(r)}}
			}
			blk.ExtraKeys = append(blk.ExtraKeys, &k)
		}
		s.Blocks = append(s.Blocks, blk)
	}
	return s
}

// TestStoredRunsEncodeLikeTheirMessages: a store written from flat slices
// (AppendStoredEvent) has the bytes proto.Marshal writes for the same store
// built as messages, for generated stores of every width, with and without
// lora_id, cache_level, extra keys (nil ones too) and every store field.
func TestStoredRunsEncodeLikeTheirMessages(t *testing.T) {
	for seed := range uint64(2000) {
		r := rand.New(rand.NewPCG(seed, 0x5eed))
		tail := genStored(r)
		tail.Blocks = nil
		size := []int32{0, 1, 16, 64, 200}[r.IntN(5)]
		run := kvenc.BlockRun{BlockSize: size, LoraID: optI64(r), CacheLevel: optI32(r)}
		want := proto.CloneOf(tail)
		for j := range r.IntN(70) {
			h := genI64(r)
			run.Hashes = append(run.Hashes, h)
			blk := &kvpb.KvBlock{BlockHash: h, BlockSize: size, LoraId: run.LoraID, CacheLevel: run.CacheLevel}
			for range size {
				blk.TokenIds = append(blk.TokenIds, uint32(genU64(r)))
			}
			run.Tokens = append(run.Tokens, blk.TokenIds...)
			if r.IntN(3) == 0 {
				for len(run.ExtraKeys) < j {
					run.ExtraKeys = append(run.ExtraKeys, nil)
				}
				var keys []*kvpb.KvBlockExtraKey
				for range 1 + r.IntN(3) {
					switch r.IntN(4) {
					case 0:
						keys = append(keys, &kvpb.KvBlockExtraKey{Key: &kvpb.KvBlockExtraKey_Text{Text: genString(r)}})
					case 1:
						keys = append(keys, &kvpb.KvBlockExtraKey{Key: &kvpb.KvBlockExtraKey_Number{Number: genI64(r)}})
					case 2:
						keys = append(keys, &kvpb.KvBlockExtraKey{Key: &kvpb.KvBlockExtraKey_Multimodal{
							Multimodal: &kvpb.KvMultimodalKey{Identifier: genString(r), Offset: genI64(r)}}})
					default:
						keys = append(keys, nil)
					}
				}
				run.ExtraKeys = append(run.ExtraKeys, keys)
				blk.ExtraKeys = keys
			}
			want.Blocks = append(want.Blocks, blk)
		}
		id := genU64(r)
		ev := &kvpb.KvCacheEvent{EventId: id, Data: &kvpb.KvCacheEvent_Stored{Stored: want}}
		wantBytes, wantErr := proto.Marshal(ev)
		got, gotErr := kvenc.AppendStoredEvent([]byte("prefix"), id, tail, &run)
		if (wantErr != nil) != (gotErr != nil) {
			t.Fatalf("seed %d: proto.Marshal error %v, AppendStoredEvent error %v", seed, wantErr, gotErr)
		}
		if wantErr == nil && (string(got[:6]) != "prefix" || !bytes.Equal(got[6:], wantBytes)) {
			t.Fatalf("seed %d: bytes differ\n got  %x\n want %x", seed, got[6:], wantBytes)
		}
	}
}

// TestStoredRunWithTooFewTokensIsAnError: a run whose tokens do not cover
// its blocks is refused with an error naming the counts, not a panic.
func TestStoredRunWithTooFewTokensIsAnError(t *testing.T) {
	for _, run := range []kvenc.BlockRun{
		{Hashes: []int64{1, 2}, Tokens: make([]uint32, 7), BlockSize: 4},
		{Hashes: []int64{1}, Tokens: make([]uint32, 4), BlockSize: -4},
	} {
		if _, err := kvenc.AppendStoredEvent(nil, 1, nil, &run); err == nil {
			t.Errorf("run of %d tokens for %d blocks of %d: no error", len(run.Tokens), len(run.Hashes), run.BlockSize)
		}
	}
}

// varintEdges are the uint32 values either side of every varint length
// boundary, and the ends.
var varintEdges = []uint32{0, 1, 127, 128, 255, 256, 16383, 16384, 65535, 65536,
	1<<21 - 1, 1 << 21, 1<<28 - 1, 1 << 28, 1<<31 - 1, 1 << 31, math.MaxUint32}

// TestPutVarints32WritesProtowiresVarints: every value at a length
// boundary, alone and in runs of every order, is written as
// protowire.AppendVarint writes it, with the buffer's bytes before and
// after the varints left alone (the three-byte fast path writes junk past a
// short varint only where the next value, or nothing, goes).
func TestPutVarints32WritesProtowiresVarints(t *testing.T) {
	var runs [][]uint32
	for _, v := range varintEdges {
		runs = append(runs, []uint32{v})
		for _, w := range varintEdges {
			runs = append(runs, []uint32{v, w}, []uint32{w, v, w})
		}
	}
	r := rand.New(rand.NewPCG(3, 4))
	for range 200 {
		run := make([]uint32, r.IntN(40))
		for i := range run {
			run[i] = varintEdges[r.IntN(len(varintEdges))]
		}
		runs = append(runs, run)
	}
	for _, vs := range runs {
		var want []byte
		for _, v := range vs {
			want = protowire.AppendVarint(want, uint64(v))
		}
		// Room for the worst case, as appendPackedUint32 gives it, then
		// exactly as much as the varints need (the fast path must not
		// write past the slice's end), each between guard bytes.
		for _, room := range []int{5 * len(vs), len(want)} {
			buf := bytes.Repeat([]byte{0xee}, 2+room+2)
			end := kvenc.PutVarints32(buf[:2+room], 2, vs)
			if got := buf[2:end]; !bytes.Equal(got, want) {
				t.Fatalf("%v (room %d): wrote %x, want %x", vs, room, got, want)
			}
			if !bytes.Equal(buf[:2], []byte{0xee, 0xee}) || !bytes.Equal(buf[2+room:], []byte{0xee, 0xee}) {
				t.Fatalf("%v (room %d): wrote outside its bytes: %x", vs, room, buf)
			}
		}
	}
}

// TestHashesAtVarintLengthBoundariesEncodeLikeMarshal: block, parent and
// removed hashes either side of every varint length from 1 to 10 bytes
// (the nine- and ten-byte ones take appendVarint64's unrolled path), in a
// buffer with no spare capacity and after a prefix.
func TestHashesAtVarintLengthBoundariesEncodeLikeMarshal(t *testing.T) {
	var hashes []int64
	for k := 7; k < 64; k += 7 {
		hashes = append(hashes, int64(1)<<k-1, int64(1)<<k)
	}
	hashes = append(hashes, 1, math.MaxInt64, math.MinInt64, -1, -2, math.MinInt64+1, -1<<56, -1<<56-1)
	for _, h := range hashes {
		parent := h
		tier := kvpb.KvCacheTier_KV_CACHE_TIER_DEVICE
		b := &kvpb.KvEventBatch{SequenceNumber: 7, Events: []*kvpb.KvCacheEvent{
			{EventId: 1, Data: &kvpb.KvCacheEvent_Stored{Stored: &kvpb.KvBlocksStored{
				ParentBlockHash: &parent, Tier: &tier,
				Blocks: []*kvpb.KvBlock{{BlockHash: h, TokenIds: []uint32{1, 2}, BlockSize: 2}, {BlockHash: ^h, TokenIds: []uint32{3, 4}, BlockSize: 2}},
			}}},
			{EventId: 2, Data: &kvpb.KvCacheEvent_Removed{Removed: &kvpb.KvBlocksRemoved{BlockHashes: []int64{h, ^h, h}}}},
		}}
		sameAsMarshal(t, b)
	}
}

// TestStoredRunsWithSharedKeyListsEncodeLikeTheirMessages: blocks sharing
// one extra-key list (the same slice, as the wire normalizer passes vLLM's
// LoRA name on every block) encode like their messages, the shared bytes
// copied from the block before: runs of shared lists broken by blocks
// without keys, by other lists and by a list equal in content but not
// shared, at block sizes whose blocks need one- and two-byte lengths; a
// shared list holding invalid UTF-8 is refused as proto.Marshal refuses it.
func TestStoredRunsWithSharedKeyListsEncodeLikeTheirMessages(t *testing.T) {
	text := func(s string) *kvpb.KvBlockExtraKey {
		return &kvpb.KvBlockExtraKey{Key: &kvpb.KvBlockExtraKey_Text{Text: s}}
	}
	lora := []*kvpb.KvBlockExtraKey{text("adapter-1")}
	salted := []*kvpb.KvBlockExtraKey{text("adapter-1"), text("tenant-3"),
		{Key: &kvpb.KvBlockExtraKey_Multimodal{Multimodal: &kvpb.KvMultimodalKey{Identifier: "img", Offset: 7}}}}
	sameButNotShared := []*kvpb.KvBlockExtraKey{text("adapter-1")}
	bad := []*kvpb.KvBlockExtraKey{text("ok"), text("\xff\xfe")}
	for _, tc := range []struct {
		name string
		keys [][]*kvpb.KvBlockExtraKey
	}{
		{"one list on every block", [][]*kvpb.KvBlockExtraKey{lora, lora, lora, lora, lora}},
		{"salt on the first block", [][]*kvpb.KvBlockExtraKey{salted, lora, lora, lora}},
		{"runs broken by gaps and others", [][]*kvpb.KvBlockExtraKey{lora, lora, nil, lora, salted, salted, lora, sameButNotShared, lora}},
		{"keys on the first blocks only", [][]*kvpb.KvBlockExtraKey{salted, salted}},
		{"a shared invalid list", [][]*kvpb.KvBlockExtraKey{lora, bad, bad}},
	} {
		for _, size := range []int32{0, 1, 16, 64} {
			run := kvenc.BlockRun{BlockSize: size, ExtraKeys: tc.keys}
			want := &kvpb.KvBlocksStored{}
			for j := range len(tc.keys) + 2 { // two blocks past the list's end have none
				h := int64(j+1) * -0x0123456789abcdef
				run.Hashes = append(run.Hashes, h)
				blk := &kvpb.KvBlock{BlockHash: h, BlockSize: size}
				for k := range size {
					blk.TokenIds = append(blk.TokenIds, uint32(j*1000+int(k)*200))
				}
				run.Tokens = append(run.Tokens, blk.TokenIds...)
				if j < len(tc.keys) {
					blk.ExtraKeys = tc.keys[j]
				}
				want.Blocks = append(want.Blocks, blk)
			}
			ev := &kvpb.KvCacheEvent{EventId: 9, Data: &kvpb.KvCacheEvent_Stored{Stored: want}}
			wantBytes, wantErr := proto.Marshal(ev)
			got, gotErr := kvenc.AppendStoredEvent([]byte("prefix"), 9, &kvpb.KvBlocksStored{}, &run)
			if (wantErr != nil) != (gotErr != nil) {
				t.Fatalf("%s, size %d: proto.Marshal error %v, AppendStoredEvent error %v", tc.name, size, wantErr, gotErr)
			}
			if wantErr == nil && (string(got[:6]) != "prefix" || !bytes.Equal(got[6:], wantBytes)) {
				t.Fatalf("%s, size %d: bytes differ\n got  %x\n want %x", tc.name, size, got[6:], wantBytes)
			}
		}
	}
}
