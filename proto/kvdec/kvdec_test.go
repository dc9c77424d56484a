package kvdec_test

import (
	"bytes"
	"errors"
	"math"
	"math/rand/v2"
	"strings"
	"testing"

	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	"github.com/kvrelay/kvrelay/proto/kvdec"
	"github.com/kvrelay/kvrelay/proto/kvenc"
	"github.com/kvrelay/kvrelay/proto/kvpb"
	"github.com/kvrelay/kvrelay/relay/record"
	"github.com/kvrelay/kvrelay/testkit/goldenvec"
)

// goldenBatches is every batch the golden vectors stand for (goldenvec.Batches).
func goldenBatches(tb testing.TB) []*kvpb.KvEventBatch {
	return goldenvec.Batches(tb, "../../testdata/golden")
}

// sameAsUnmarshal fails unless d decodes data as proto.Unmarshal does: both
// refuse it, or both accept it with equal results. Equal is compared on
// proto.Marshal's bytes of the two messages, which keeps what proto.Equal
// would miss (a NaN timestamp) and checks unknown fields byte for byte; the
// presence of every message and optional field is part of those bytes.
func sameAsUnmarshal(t testing.TB, d *kvdec.Decoder, data []byte) (accepted bool) {
	t.Helper()
	want := &kvpb.KvEventBatch{}
	wantErr := proto.Unmarshal(data, want)
	got, gotErr := d.Decode(data)
	if (wantErr != nil) != (gotErr != nil) {
		t.Fatalf("proto.Unmarshal error %v, Decode error %v, for %x", wantErr, gotErr, data)
	}
	if wantErr != nil {
		if got != nil || !strings.HasPrefix(gotErr.Error(), "kvdec: KvEventBatch: ") {
			t.Fatalf("a refusal must return no batch and say what it was decoding: %v, %v", got, gotErr)
		}
		return false
	}
	wantBytes, err := proto.Marshal(want)
	if err != nil {
		t.Fatalf("re-encoding proto.Unmarshal's result: %v", err)
	}
	gotBytes, err := proto.Marshal(got)
	if err != nil {
		t.Fatalf("re-encoding Decode's result: %v", err)
	}
	if !bytes.Equal(gotBytes, wantBytes) {
		t.Fatalf("results differ for %x\n got  %v\n want %v", data, got, want)
	}
	return true
}

// TestGoldenVectorsDecodeLikeUnmarshal: the encoding of every golden batch
// decodes as proto.Unmarshal decodes it, with one Decoder reused across all
// of them (so one batch's leftovers would show in the next).
func TestGoldenVectorsDecodeLikeUnmarshal(t *testing.T) {
	var d kvdec.Decoder
	n := 0
	for _, b := range goldenBatches(t) {
		data, err := proto.Marshal(b)
		if err != nil {
			continue // an invalid string a normalizer let through; kvenc refuses it too
		}
		if !sameAsUnmarshal(t, &d, data) {
			t.Fatalf("a golden batch was refused: %v", b)
		}
		n++
	}
	if n < 250 {
		t.Fatalf("only %d batches checked", n)
	}
}

// TestRelayStreamsDecodeLikeUnmarshal decodes the bytes the relay sends:
// its live batches (kvenc) and the snapshot chunks its record encodes
// (record.ChunkStream.NextEncoded), for a record filled from the golden
// vectors and one of 20,000 chained blocks, plain and LoRA-namespaced.
func TestRelayStreamsDecodeLikeUnmarshal(t *testing.T) {
	var d kvdec.Decoder
	check := func(data []byte) {
		t.Helper()
		if !sameAsUnmarshal(t, &d, data) {
			t.Fatalf("the relay's bytes were refused: %x", data)
		}
	}
	golden := record.New()
	for _, b := range goldenBatches(t) {
		data, err := kvenc.AppendBatch(nil, b)
		if err != nil {
			continue
		}
		check(data)
		golden.Apply(b)
	}
	big := record.New()
	r := rand.New(rand.NewPCG(1, 2))
	for i := range 2 * 20_000 / 64 {
		st := &kvpb.KvBlocksStored{}
		if i%2 == 1 {
			st.LoraName = proto.String("adapter-7")
		}
		for j := range 64 {
			toks := make([]uint32, 16)
			for k := range toks {
				toks[k] = r.Uint32N(152_000)
			}
			blk := &kvpb.KvBlock{BlockHash: int64(i*64 + j + 1), TokenIds: toks, BlockSize: 16}
			if i%2 == 1 {
				blk.LoraId = proto.Int64(7)
			}
			st.Blocks = append(st.Blocks, blk)
		}
		b := &kvpb.KvEventBatch{SequenceNumber: uint64(i), DpRank: proto.Int32(int32(i % 2)), Timestamp: 1.5,
			Events: []*kvpb.KvCacheEvent{{Data: &kvpb.KvCacheEvent_Stored{Stored: st}}}}
		data, err := kvenc.AppendBatch(nil, b)
		if err != nil {
			t.Fatal(err)
		}
		check(data)
		big.Apply(b)
	}
	for name, rec := range map[string]*record.Record{"golden": golden, "20k": big} {
		cut := rec.Cut(nil)
		st := cut.Stream(map[int32]uint64{0: 5, 1: 7}, map[int32]uint64{1: 3}, 2.5)
		chunks, blocks := 0, uint64(0)
		for data := st.NextEncoded(); data != nil; data = st.NextEncoded() {
			check(data)
			b, _ := d.Decode(data)
			for _, ev := range b.GetEvents() {
				blocks += uint64(len(ev.GetStored().GetBlocks()))
			}
			chunks++
		}
		if blocks != cut.Blocks() || chunks == 0 {
			t.Fatalf("%s: %d chunks carried %d blocks, the cut holds %d", name, chunks, blocks, cut.Blocks())
		}
		cut.Release()
	}
}

// w builds wire bytes for the structured cases.
type w []byte

func (b w) tag(num protowire.Number, typ protowire.Type) w { return protowire.AppendTag(b, num, typ) }
func (b w) varint(num protowire.Number, v uint64) w {
	return protowire.AppendVarint(b.tag(num, protowire.VarintType), v)
}
func (b w) bytes(num protowire.Number, v []byte) w {
	return protowire.AppendBytes(b.tag(num, protowire.BytesType), v)
}
func (b w) msg(num protowire.Number, v w) w { return b.bytes(num, v) }

func packed(vs ...uint64) []byte {
	var b []byte
	for _, v := range vs {
		b = protowire.AppendVarint(b, v)
	}
	return b
}

// groups nests n unknown groups of field 9 in one another.
func groups(n int) w {
	var b w
	for range n {
		b = b.tag(9, protowire.StartGroupType)
	}
	b = b.varint(1, 1)
	for range n {
		b = b.tag(9, protowire.EndGroupType)
	}
	return b
}

// TestStructuredInputs covers what a relay does not send and a peer may:
// every case must decode as proto.Unmarshal decodes it, and the accept
// column says which way that is (so a case cannot pass by both refusing
// something that should decode).
func TestStructuredInputs(t *testing.T) {
	block := w{}.varint(1, 42).bytes(2, packed(1, 2, 300, 70000)).varint(3, 16)
	stored := w{}.msg(1, block).varint(2, 7)
	event := w{}.varint(1, 3).msg(2, stored)
	for _, c := range []struct {
		name   string
		data   []byte
		accept bool
	}{
		{"empty", nil, true},
		{"one stored event", w{}.varint(1, 9).msg(3, event), true},
		{"tokens unpacked", w{}.msg(3, w{}.msg(2, w{}.msg(1, w{}.varint(2, 5).varint(2, 1<<40).varint(2, 6)))), true},
		{"tokens packed then unpacked then packed", w{}.msg(3, w{}.msg(2, w{}.msg(1,
			w{}.bytes(2, packed(1, 2)).varint(2, 3).bytes(2, packed(math.MaxUint64, 4))))), true},
		{"empty packed tokens", w{}.msg(3, w{}.msg(2, w{}.msg(1, w{}.bytes(2, nil)))), true},
		{"removed hashes packed and unpacked", w{}.msg(3, w{}.msg(3, w{}.bytes(1, packed(1, math.MaxUint64)).varint(1, 5).varint(2, 1))), true},
		{"stored twice in one event merges", w{}.msg(3, w{}.msg(2, stored).msg(2, w{}.msg(1, block).bytes(11, []byte("x")))), true},
		{"stored then removed then stored replaces", w{}.msg(3, w{}.msg(2, stored).msg(3, w{}.varint(1, 1)).msg(2, stored)), true},
		{"snapshot twice merges", w{}.msg(7, w{}.varint(1, 2).varint(2, 5)).msg(7, w{}.varint(3, 9)), true},
		{"empty snapshot is present", w{}.msg(7, nil), true},
		{"load merges", w{}.msg(8, w{}.varint(1, 3)).msg(8, w{}.varint(2, 4)), true},
		{"last scalar wins", w{}.varint(1, 1).varint(1, 2).varint(4, 1).varint(4, math.MaxUint64), true},
		{"unknown fields at every level", w{}.varint(99, 1).msg(3, w{}.bytes(50, []byte("u")).msg(2,
			w{}.tag(40, protowire.Fixed32Type).append(1, 2, 3, 4).msg(1, w{}.varint(77, 5).msg(6, w{}.varint(3, 1).varint(9, 9))))).
			msg(7, w{}.varint(5, 1)), true},
		{"reserved batch fields 5 and 6 kept as unknown", w{}.varint(5, 1).bytes(6, []byte("r")), true},
		{"known field with another wire type is unknown", w{}.bytes(1, []byte("x")).varint(3, 1).varint(7, 1).
			tag(2, protowire.Fixed32Type).append(0, 0, 0, 0), true},
		{"over-long tag and varint", w{0x88, 0x80, 0x80, 0x00, 0x81, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x00}, true},
		{"max field number", w{}.varint(protowire.MaxValidNumber, 1), true},
		{"field number above max", w{}.append(protowire.AppendVarint(nil, uint64(protowire.MaxValidNumber+1)<<3)...), false},
		{"field number 0", w{0x00, 0x01}, false},
		{"eleven-byte varint", w{0x08, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x01}, false},
		{"ten-byte varint overflowing", w{0x08, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x02}, false},
		{"truncated varint in packed tokens", w{}.msg(3, w{}.msg(2, w{}.msg(1, w{}.bytes(2, []byte{1, 0x80})))), false},
		{"huge declared length", w{}.tag(3, protowire.BytesType).append(protowire.AppendVarint(nil, 1<<62)...), false},
		{"declared length one past the end", w{}.tag(3, protowire.BytesType).append(5, 1, 2, 3, 4), false},
		{"huge declared length of nested tokens", w{}.msg(3, w{}.msg(2, w{}.msg(1, w{}.tag(2, protowire.BytesType).append(0xff, 0xff, 0xff, 0xff, 0x0f)))), false},
		{"truncated fixed64", w{}.tag(2, protowire.Fixed64Type).append(1, 2, 3), false},
		{"end group at top level", w{}.tag(3, protowire.EndGroupType), false},
		{"wire type 6", w{}.tag(3, 6), false},
		{"wire type 7 on an unknown field", w{}.tag(40, 7), false},
		{"unknown group", w{}.msg(3, groups(3)), true},
		{"unknown group mismatched end", w{}.tag(9, protowire.StartGroupType).tag(10, protowire.EndGroupType), false},
		{"unknown group unterminated", w{}.tag(9, protowire.StartGroupType).varint(1, 1), false},
		{"groups nested to the limit", groups(protowire.DefaultRecursionLimit + 1), true},
		{"groups nested past the limit", groups(protowire.DefaultRecursionLimit + 2), false},
		{"groups nested 200,000 deep", groups(200_000), false},
		{"invalid UTF-8 lora_name", w{}.msg(3, w{}.msg(2, w{}.bytes(11, []byte{0xff}))), false},
		{"invalid UTF-8 medium of a removal", w{}.msg(3, w{}.msg(3, w{}.bytes(4, []byte{0xc0}))), false},
		{"invalid UTF-8 cleared ownership", w{}.msg(3, w{}.msg(4, w{}.bytes(1, []byte{0xfe}))), false},
		{"invalid UTF-8 extra key text", w{}.msg(3, w{}.msg(2, w{}.msg(1, w{}.msg(6, w{}.bytes(1, []byte{0xff}))))), false},
		{"invalid UTF-8 multimodal identifier", w{}.msg(3, w{}.msg(2, w{}.msg(1, w{}.msg(6, w{}.msg(4, w{}.bytes(1, []byte{0xff})))))), false},
		{"invalid bytes in a blob are fine", w{}.msg(3, w{}.msg(2, w{}.msg(1, w{}.msg(6, w{}.bytes(2, []byte{0xff}))))), true},
		{"extra key members replace each other", w{}.msg(3, w{}.msg(2, w{}.msg(1, w{}.msg(6,
			w{}.bytes(1, []byte("a")).varint(3, 5).msg(4, w{}.varint(2, 1)).msg(4, w{}.bytes(1, []byte("id"))))))), true},
		{"invalid UTF-8 in the load", w{}.msg(8, w{}.msg(17, w{}.bytes(1, []byte{0xff}))), false},
		{"every optional field", w{}.varint(4, 0).tag(16, protowire.Fixed64Type).append(1, 2, 3, 4, 5, 6, 7, 8).varint(17, 0).
			msg(3, w{}.msg(2, w{}.varint(2, 0).varint(3, 2).bytes(4, nil).varint(5, 0).bytes(6, []byte("k")).varint(7, 1<<35).
				varint(8, 1).bytes(9, []byte("o")).bytes(10, []byte("s")).bytes(11, []byte("l")).bytes(12, []byte("c")).
				msg(1, w{}.varint(4, 0).varint(5, math.MaxUint64)))).
			msg(3, w{}.msg(3, w{}.varint(2, 1).varint(3, 1).bytes(4, []byte("m")).varint(5, 2).varint(6, 2).bytes(7, []byte("o")))).
			msg(3, w{}.msg(4, nil)), true},
		// The one-byte forms a block's fields are read in without the general walk, at and
		// past their edges: each side must decode (or fail) as proto.Unmarshal does.
		{"block fields at the one-byte edge", inBlock(w{}.varint(1, math.MaxUint64).bytes(2, bytes.Repeat([]byte{1}, 127)).
			varint(3, 127).varint(4, 127)), true},
		{"block fields one past the one-byte edge", inBlock(w{}.varint(1, 1<<63).bytes(2, bytes.Repeat([]byte{1}, 128)).
			varint(3, 128).varint(4, 128)), true},
		{"a block of 127 bytes and one of 128", inStored(w{}.msg(1, w{}.bytes(2, bytes.Repeat([]byte{2}, 125))).
			msg(1, w{}.bytes(2, bytes.Repeat([]byte{3}, 125)).varint(3, 1))), true},
		{"an empty block", inStored(w{}.msg(1, nil)), true},
		{"block fields twice, the last wins and tokens add up", inBlock(w{}.varint(4, 5).varint(3, 7).varint(1, 9).
			bytes(2, packed(4)).varint(4, 6).varint(3, 8).varint(1, 10).bytes(2, packed(5, 1<<35))), true},
		{"negative lora_id and block_size", inBlock(w{}.varint(3, math.MaxUint64).varint(4, math.MaxUint64-1)), true},
		{"block hashes of nine and ten bytes, then more fields", inStored(w{}.msg(1, w{}.varint(1, math.MaxInt64).varint(3, 16)).
			msg(1, w{}.varint(1, 1<<63|0x0123456789abcdef).varint(4, 7)).msg(1, w{}.varint(1, math.MaxUint64).bytes(2, packed(9))).
			msg(1, w{}.varint(1, 1<<56).varint(1, 1<<56-1))), true},
		{"block hashes of nine and ten bytes ending the block", inStored(w{}.msg(1, w{}.varint(1, math.MaxInt64)).
			msg(1, w{}.varint(1, math.MaxUint64))), true},
		{"a ten-byte block hash written over-long", inBlock(w{}.tag(1, protowire.VarintType).
			append(0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x00, 0x18, 0x01)), true},
		{"a ten-byte block hash overflowing", inBlock(w{}.tag(1, protowire.VarintType).
			append(0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x02, 0x18, 0x01)), false},
		{"an eleven-byte block hash", inBlock(w{}.tag(1, protowire.VarintType).
			append(0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x01, 0x18)), false},
		{"block hash cut short at the block's end", inBlock(w{}.tag(1, protowire.VarintType).append(0x80)), false},
		{"block hash of eleven bytes", inBlock(w{}.tag(1, protowire.VarintType).append(0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x01)), false},
		{"tokens one byte past the block's end", inBlock(w{}.tag(2, protowire.BytesType).append(3, 1, 2)), false},
		{"a malformed token inside a block", inBlock(w{}.bytes(2, []byte{1, 0x80})), false},
		{"block_size with no value", inBlock(w{}.tag(3, protowire.VarintType)), false},
		{"lora_id cut short", inBlock(w{}.tag(4, protowire.VarintType).append(0x81)), false},
		{"a block one byte past the store's end", inStored(w{}.tag(1, protowire.BytesType).append(3, 0x08, 1)), false},
	} {
		t.Run(c.name, func(t *testing.T) {
			var d kvdec.Decoder
			if got := sameAsUnmarshal(t, &d, c.data); got != c.accept {
				t.Fatalf("accepted %v, want %v", got, c.accept)
			}
		})
	}
}

func (b w) append(bs ...byte) w { return append(b, bs...) }

// inStored is a batch of one event storing the store's fields in stored; inBlock one whose store
// holds the block's fields in block.
func inStored(stored w) w { return w{}.msg(3, w{}.msg(2, stored)) }
func inBlock(block w) w   { return inStored(w{}.msg(1, block)) }

// TestErrorsNameTheField: a refusal says where it was and why.
func TestErrorsNameTheField(t *testing.T) {
	for _, c := range []struct {
		data []byte
		want string
	}{
		{w{}.msg(3, w{}.msg(2, w{}.msg(1, w{}).msg(1, w{}.bytes(2, []byte{0x80})))), "events[0]: stored: blocks[1]: token_ids: "},
		{w{}.msg(3, nil).msg(3, w{}.msg(2, w{}.bytes(11, []byte{0xff}))), "events[1]: stored: field 11: string field contains invalid UTF-8"},
		{w{}.tag(3, protowire.BytesType).append(0x80, 0x80, 0x80, 0x80, 0x08), "events: "},
	} {
		var d kvdec.Decoder
		_, err := d.Decode(c.data)
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("error %v, want it to contain %q", err, c.want)
		}
	}
	var d kvdec.Decoder
	if _, err := d.Decode(w{}.msg(3, w{}.msg(4, w{}.bytes(1, []byte{0xff})))); !errors.Is(err, kvdec.ErrInvalidUTF8) {
		t.Errorf("error %v, want ErrInvalidUTF8", err)
	}
}

// TestReuseKeepsBatchesApart: a batch decoded after a bigger one carries
// nothing of it.
func TestReuseKeepsBatchesApart(t *testing.T) {
	var d kvdec.Decoder
	big := w{}.varint(1, 1).varint(4, 2).msg(7, w{}.varint(2, 3))
	for i := range 3000 {
		big = big.msg(3, w{}.msg(2, w{}.bytes(11, []byte("a")).msg(1, w{}.varint(1, uint64(i)).bytes(2, packed(1, 2, 3)).varint(4, 1))))
	}
	small := w{}.varint(1, 2).msg(3, w{}.msg(3, w{}.varint(1, 8)))
	for _, data := range [][]byte{big, small, big, small} {
		sameAsUnmarshal(t, &d, data)
	}
}

// genWire writes a random message of kind k (a KvEventBatch, an event, a
// store, a block, a removal, an extra key) with known fields in and out of
// their wire types, unknown fields, repeats, and now and then a corrupted
// byte. Nesting is bounded by the kinds' own depth.
func genWire(r *rand.Rand, k int) w {
	var b w
	known := [][]protowire.Number{{1, 2, 3, 4, 7, 8, 16, 17}, {1, 2, 3, 4}, {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12}, {1, 2, 3, 4, 5, 6}, {1, 2, 3, 4, 5, 6, 7}, {1, 2, 3, 4}}
	child := map[[2]int]int{{0, 3}: 1, {1, 2}: 2, {1, 3}: 4, {1, 4}: 4, {2, 1}: 3, {3, 6}: 5, {5, 4}: 5}
	for range r.IntN(6) {
		num := known[k][r.IntN(len(known[k]))]
		if r.IntN(8) == 0 {
			num = protowire.Number(20 + r.IntN(40))
		}
		switch typ := r.IntN(10); {
		case typ < 4:
			if c, ok := child[[2]int{k, int(num)}]; ok && r.IntN(4) != 0 {
				b = b.msg(num, genWire(r, c))
			} else {
				b = b.bytes(num, packed(r.Uint64()>>uint(r.IntN(64)), uint64(r.IntN(300))))
			}
		case typ < 7:
			b = b.varint(num, r.Uint64()>>uint(r.IntN(64)))
		case typ < 8:
			b = b.bytes(num, []byte([]string{"", "adapter", "\xff", "é"}[r.IntN(4)]))
		case typ < 9:
			b = b.tag(num, protowire.Fixed64Type).append(1, 2, 3, 4, 5, 6, 7, 8)
		default:
			b = b.tag(num, protowire.Fixed32Type).append(1, 2, 3, 4)
		}
	}
	if len(b) > 0 && r.IntN(20) == 0 {
		b[r.IntN(len(b))] ^= byte(1 << r.IntN(8))
	}
	return b
}

// TestGeneratedWireDecodesLikeUnmarshal runs the generator over many seeds
// and requires both outcomes to occur often, so that it tests both paths.
func TestGeneratedWireDecodesLikeUnmarshal(t *testing.T) {
	var d kvdec.Decoder
	accepted := 0
	const n = 20_000
	for seed := range uint64(n) {
		if sameAsUnmarshal(t, &d, genWire(rand.New(rand.NewPCG(seed, 7)), 0)) {
			accepted++
		}
	}
	if accepted < n/4 || accepted > n-n/20 {
		t.Fatalf("%d of %d generated inputs accepted: the generator no longer exercises both outcomes", accepted, n)
	}
}

// FuzzDecodeMatchesUnmarshal decodes arbitrary bytes, seeded with the
// golden batches' encodings and the structured cases' shapes, and requires
// proto.Unmarshal's outcome; the same input also seeds the generator, which
// reaches nested shapes that byte mutations rarely build.
func FuzzDecodeMatchesUnmarshal(f *testing.F) {
	for i, b := range goldenBatches(f) {
		if data, err := proto.Marshal(b); err == nil && i%4 == 0 {
			f.Add(data)
		}
	}
	f.Add([]byte(groups(4)))
	f.Add([]byte(w{}.msg(3, w{}.msg(2, w{}.msg(1, w{}.varint(2, 5).bytes(2, packed(1, 300)))))))
	f.Fuzz(func(t *testing.T, data []byte) {
		var d kvdec.Decoder
		sameAsUnmarshal(t, &d, data)
		var seed [16]byte
		copy(seed[:], data)
		s1 := uint64(0)
		for _, c := range seed[:8] {
			s1 = s1<<8 | uint64(c)
		}
		sameAsUnmarshal(t, &d, genWire(rand.New(rand.NewPCG(s1, uint64(len(data)))), 0))
	})
}
