package wire

import (
	"bytes"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"google.golang.org/protobuf/proto"

	"github.com/kvrelay/kvrelay/proto/kvenc"
)

// wirePayload is one payload of a differential run and the socket rank and
// sequence it is normalized under.
type wirePayload struct {
	payload []byte
	seq     uint64
	rank    int32
}

// sameAsMarshalled feeds the payloads, in order, to two Normalizers of the
// dialect: one through Normalize and proto.Marshal (the reference), the
// other through AppendNormalized into one reused buffer that starts with a
// prefix. Every batch's bytes, drops and error class must agree, and so must
// the two normalizers' counters and event ids afterwards. It returns how
// many batches encoded.
func sameAsMarshalled(t testing.TB, d Dialect, payloads []wirePayload) int {
	t.Helper()
	ref, direct := NewNormalizer(d), NewNormalizer(d)
	prefix := []byte("prefix")
	buf := append([]byte(nil), prefix...)
	encoded := 0
	for i, p := range payloads {
		b, wantDrops, wantErr := ref.Normalize(p.payload, p.seq, p.rank)
		var want []byte
		var marshalErr error
		if wantErr == nil {
			want, marshalErr = proto.Marshal(b)
		}
		got, gotDrops, gotErr := direct.AppendNormalized(buf, p.payload, p.seq, p.rank)
		switch {
		case wantErr != nil:
			if !errors.Is(gotErr, ErrUndecodable) {
				t.Fatalf("%v payload %d: Normalize refused it (%v), AppendNormalized said %v", d, i, wantErr, gotErr)
			}
		case marshalErr != nil:
			if !errors.Is(gotErr, kvenc.ErrInvalidUTF8) {
				t.Fatalf("%v payload %d: proto.Marshal refused the batch (%v), AppendNormalized said %v", d, i, marshalErr, gotErr)
			}
		case gotErr != nil:
			t.Fatalf("%v payload %d: AppendNormalized: %v (batch %v)", d, i, gotErr, b)
		default:
			if !bytes.Equal(got[len(prefix):], want) {
				t.Fatalf("%v payload %d: bytes differ from proto.Marshal's\n got  %x\n want %x\n batch %v", d, i, got[len(prefix):], want, b)
			}
			encoded++
		}
		if !bytes.Equal(got[:len(prefix)], prefix) || (gotErr != nil && len(got) != len(prefix)) {
			t.Fatalf("%v payload %d: the buffer's prefix or length was not kept (err %v)", d, i, gotErr)
		}
		if gotDrops != wantDrops {
			t.Fatalf("%v payload %d: drops %v, Normalize's %v", d, i, gotDrops, wantDrops)
		}
		buf = got[:len(prefix)]
	}
	if ref.Counts() != direct.Counts() || ref.eventID != direct.eventID {
		t.Fatalf("%v: counts %+v (event id %d), Normalize's %+v (event id %d)", d, direct.Counts(), direct.eventID, ref.Counts(), ref.eventID)
	}
	return encoded
}

// TestAppendNormalizedMatchesMarshalOnGoldenVectors: every golden vector
// set (testdata/golden, state carried across a set's payloads) under every
// dialect, the package's own captures, and the benchmark's realistic
// streams: AppendNormalized writes proto.Marshal's bytes of Normalize's
// batch, batch for batch.
func TestAppendNormalizedMatchesMarshalOnGoldenVectors(t *testing.T) {
	files, err := filepath.Glob("../../testdata/golden/*.json")
	if err != nil {
		t.Fatal(err)
	}
	if len(files) < 30 {
		t.Fatalf("found %d golden vector sets, want at least 30", len(files))
	}
	encoded := 0
	for _, f := range files {
		raw, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		var set struct {
			Payloads []struct {
				Hex  string `json:"hex"`
				Seq  uint64 `json:"seq"`
				Rank int32  `json:"rank"`
			} `json:"payloads"`
		}
		if err := json.Unmarshal(raw, &set); err != nil {
			t.Fatalf("%s: %v", f, err)
		}
		var payloads []wirePayload
		for _, p := range set.Payloads {
			b, err := hex.DecodeString(p.Hex)
			if err != nil {
				t.Fatalf("%s: %v", f, err)
			}
			payloads = append(payloads, wirePayload{b, p.Seq, p.Rank})
		}
		for d := VLLM; d <= TokenSpeed; d++ {
			encoded += sameAsMarshalled(t, d, payloads)
		}
	}
	var captures []wirePayload
	for i, h := range []string{hexF1Batch1, hexF1Batch2, hexF2, hexF5, hexF6Legacy, hexF8, hexF9,
		hexVLLMMap, hexVLLMArray12, hexVLLM16750, hexSGLangMap, hexSGLangArray7, hexSGLangArraySalted,
		hexSGLangOldest, hexTokenSpeed, hexVLLM034Batch, hexSGLang0523Batch} {
		captures = append(captures, wirePayload{unhex(t, h), uint64(i + 1), int32(i%3) - 1})
	}
	for d := VLLM; d <= TokenSpeed; d++ {
		encoded += sameAsMarshalled(t, d, captures)
	}
	for _, f := range streamForms {
		var stream []wirePayload
		for i, sb := range realisticStream(t, f, 64) {
			stream = append(stream, wirePayload{sb.payload, uint64(i), 0})
		}
		encoded += sameAsMarshalled(t, f.dialect, stream)
	}
	// A run that compared nothing would pass: most batches must encode.
	if encoded < 500 {
		t.Fatalf("only %d batches encoded and compared", encoded)
	}
}

// TestAppendNormalizedMatchesMarshalOnEveryField: stores and removals with
// every optional field, every extra-key form, host and disk tiers, bigram
// tokens, tail alignment, sliding-window groups, multi-byte lengths, zero
// and extreme hashes, a clear with an ownership, and strings that are not
// valid UTF-8 (which both paths refuse).
func TestAppendNormalizedMatchesMarshalOnEveryField(t *testing.T) {
	longTokens := toks(100_000, 100_000+4*300)
	payloads := [][]byte{
		batch(t, 3, stored([]any{0, uint64(math.MaxUint64), int64(math.MinInt64)}, int64(-1), toks(1, 12), 4,
			"lora_id", 7, "medium", "CPU", "lora_name", "adapter", "cache_salt", "salt", "group_idx", 2,
			"kv_cache_spec_kind", "full_attention", "kv_cache_spec_sliding_window", 4096, "locality", "local",
			"ownership", "engine", "session_id", "sess-1",
			"extra_keys", []any{[]any{"text", -5, []byte{1, 2, 3}, []any{"img", 16}, []any{"mm", uint64(math.MaxUint64)}}, nil, []any{}})),
		batch(t, 0, removed([]any{1, 2, int64(-3)}, "medium", "DISK", "group_idx", 2, "ownership", "engine"),
			removed([]any{}, "medium", "external"), cleared("ownership", "engine"), cleared()),
		batch(t, 0, stored([]any{5, 6}, 4, []any{[]any{1, 2}, []any{3, 4}, []any{5, 6}, []any{7, 8}}, 2)),
		batch(t, 0, stored([]any{7}, nil, toks(1, 8), 4)), // tail aligned
		batch(t, 0, append(stored([]any{8, 9}, nil, toks(1, 8), 4), "group_idx", 1, "kv_cache_spec_kind", "sliding_window"),
			removed([]any{8}, "group_idx", 1)),
		batch(t, 0, stored([]any{10, 11, 12, 13}, nil, longTokens[:4*300], 300, "lora_id", 1)), // blocks over 127 bytes
		batch(t, 0, stored([]any{14}, 10, toks(1, 2), 2)),                                      // inherits the chain's namespace
		batch(t, 0, stored([]any{15}, nil, toks(1, 2), 2, "cache_salt", "\xff\xfe")),           // invalid UTF-8
		batch(t, 0, stored([]any{16}, nil, toks(1, 2), 2, "extra_keys", []any{[]any{"\xff", "ok"}})),
		batch(t, 0, stored([]any{17}, nil, toks(1, 2), 2, "extra_keys", []any{[]any{[]any{"\xc3", 1}}})),
		batch(t, 0, stored([]any{18}, nil, toks(1, 2), 2), removed([]any{18})),
		{0x93}, // truncated
	}
	var in []wirePayload
	for i, p := range payloads {
		in = append(in, wirePayload{p, uint64(i * 1000), int32(i%4) - 1})
	}
	for d := VLLM; d <= TokenSpeed; d++ {
		if got := sameAsMarshalled(t, d, in); got < 8 {
			t.Fatalf("%v: only %d of %d batches encoded", d, got, len(in))
		}
	}
}

// TestAppendNormalizedAllocatesNothingPerBatch: in the steady state the
// direct path reuses its scratch and the caller's buffer; Normalize, for
// comparison, builds its messages in fresh slabs every batch.
func TestAppendNormalizedAllocatesNothingPerBatch(t *testing.T) {
	for _, f := range streamForms {
		stream := realisticStream(t, f, 64)
		n := NewNormalizer(f.dialect)
		var buf []byte
		i := 0
		run := func() {
			var err error
			buf, _, err = n.AppendNormalized(buf[:0], stream[i%len(stream)].payload, uint64(i), 0)
			if err != nil {
				t.Fatal(err)
			}
			i++
		}
		for range 2 * len(stream) { // grow every buffer and slab first
			run()
		}
		if allocs := testing.AllocsPerRun(len(stream), run); allocs > 1 {
			t.Errorf("%s: %.1f allocations per batch, want at most 1 (a namespace or string first seen)", f.name, allocs)
		}
	}
}

// FuzzAppendNormalizedMatchesMarshal: for arbitrary payloads of every
// dialect, two rounds each (so the record carries state), the direct path
// agrees with Normalize + proto.Marshal.
func FuzzAppendNormalizedMatchesMarshal(f *testing.F) {
	for _, h := range []string{hexF1Batch1, hexF1Batch2, hexF2, hexF5, hexF6Legacy, hexF8, hexF9,
		hexVLLMMap, hexVLLMArray12, hexVLLM16750, hexSGLangMap, hexSGLangArray7, hexSGLangArraySalted,
		hexSGLangOldest, hexTokenSpeed, hexVLLM034Batch, hexSGLang0523Batch} {
		f.Add(uint8(0), unhex(f, h))
	}
	f.Add(uint8(1), batch(f, 1, append(stored([]any{1, 2}, nil, toks(1, 12), 4), "group_idx", 1, "kv_cache_spec_kind", "sliding_window"),
		removed([]any{1}, "group_idx", 1), stored([]any{3}, 2, []any{[]any{1, 2}, []any{3, 4}}, 2,
			"extra_keys", []any{[]any{"s", []any{"m", 1}, []byte{9}, 4}}, "lora_id", 3, "medium", "cpu")))
	f.Fuzz(func(t *testing.T, dialect uint8, payload []byte) {
		in := []wirePayload{{payload, 1, int32(dialect%5) - 1}, {payload, 2, int32(dialect%5) - 1}}
		sameAsMarshalled(t, Dialect(dialect%3)+1, in)
	})
}

// cellOf writes v as a msgpack integer cell of the given code's width
// (0: a positive or negative fixint), whether or not the form is the
// shortest; ok is false when v does not fit the form.
func cellOf(code byte, v int64) (raw, bool) {
	be := func(n int) raw {
		out := raw{code}
		for i := n - 1; i >= 0; i-- {
			out = append(out, byte(uint64(v)>>(8*i)))
		}
		return out
	}
	switch code {
	case 0:
		return raw{byte(v)}, v >= -32 && v <= 0x7f
	case 0xcc:
		return be(1), v >= 0 && v <= math.MaxUint8
	case 0xcd:
		return be(2), v >= 0 && v <= math.MaxUint16
	case 0xce:
		return be(4), v >= 0 && v <= math.MaxUint32
	case 0xcf:
		return be(8), v >= 0
	case 0xd0:
		return be(1), v >= math.MinInt8 && v <= math.MaxInt8
	case 0xd1:
		return be(2), v >= math.MinInt16 && v <= math.MaxInt16
	case 0xd2:
		return be(4), v >= math.MinInt32 && v <= math.MaxInt32
	case 0xd3:
		return be(8), true
	}
	return nil, false
}

// TestAppendNormalizedTokenCellsOfEveryWidth: a store's token ids either
// side of every varint length, each written in every msgpack integer form
// that holds it (not only the shortest), are forwarded with those ids and
// AppendNormalized writes proto.Marshal's bytes for them; negative ids and
// ids beyond uint32, in any form, make the store malformed on both paths
// alike. uint64 values above MaxInt64 are written as 0xcf only.
func TestAppendNormalizedTokenCellsOfEveryWidth(t *testing.T) {
	values := []int64{0, 1, 127, 128, 255, 256, 16383, 16384, 65535, 65536,
		1<<21 - 1, 1 << 21, 1<<28 - 1, 1 << 28, 1<<31 - 1, 1 << 31, math.MaxUint32,
		1 << 32, math.MaxInt64, -1, -32, -33, -128, -129, math.MinInt32, math.MinInt64}
	codes := []byte{0, 0xcc, 0xcd, 0xce, 0xcf, 0xd0, 0xd1, 0xd2, 0xd3}
	cases := 0
	for _, v := range values {
		for _, code := range codes {
			cell, fits := cellOf(code, v)
			if !fits {
				continue
			}
			cases++
			// Four blocks of 2: the cell alone, then next to neighbours of
			// other widths, so a wrong length shifts what follows.
			tokens := []any{cell, cell, raw{0x05}, cell, cell, raw{0xcd, 0x40, 0x00}, raw{0xce, 0x00, 0x20, 0x00, 0x00}, cell}
			payload := batch(t, 0, []any{"BlockStored", []any{11, 12, 13, 14}, nil, tokens, 2, nil, "GPU"})
			name := fmt.Sprintf("%d as 0x%02x", v, code)
			b, drops, err := NewNormalizer(SGLang).Normalize(payload, 1, 0)
			if err != nil {
				t.Fatalf("%s: %v", name, err)
			}
			if v >= 0 && v <= math.MaxUint32 {
				u := uint32(v)
				want := [][]uint32{{u, u}, {5, u}, {u, 0x4000}, {0x200000, u}}
				if len(b.Events) != 1 || drops.Total() != 0 {
					t.Fatalf("%s: %d events, drops %v; want the store forwarded", name, len(b.Events), drops)
				}
				for j, blk := range b.Events[0].GetStored().Blocks {
					if !slices.Equal(blk.TokenIds, want[j]) {
						t.Fatalf("%s: block %d holds %v, want %v", name, j, blk.TokenIds, want[j])
					}
				}
			} else if len(b.Events) != 0 || drops != dropsOf(DropMalformed, 1) {
				t.Fatalf("%s: %d events, drops %v; want the store malformed", name, len(b.Events), drops)
			}
			sameAsMarshalled(t, SGLang, []wirePayload{{payload, 1, 0}, {payload, 2, -1}})
		}
	}
	big := raw{0xcf, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff} // 2^64-1
	payload := batch(t, 0, []any{"BlockStored", []any{11}, nil, []any{big, raw{0x01}}, 2, nil, "GPU"})
	if b, drops, err := NewNormalizer(SGLang).Normalize(payload, 1, 0); err != nil || len(b.Events) != 0 || drops != dropsOf(DropMalformed, 1) {
		t.Fatalf("2^64-1 as a token: %v, %v, %v; want the store malformed", b, drops, err)
	}
	sameAsMarshalled(t, SGLang, []wirePayload{{payload, 1, 0}})
	if cases < 100 {
		t.Fatalf("only %d (value, form) cases", cases)
	}
}

// TestAppendNormalizedRefusesHostileTokenListsLikeNormalize: a token list
// declaring more cells than the payload has bytes, a truncated cell, and a
// cell nested far deeper than any stack could recurse are refused (or
// dropped) by AppendNormalized exactly as by Normalize, without a panic.
func TestAppendNormalizedRefusesHostileTokenListsLikeNormalize(t *testing.T) {
	deep := bytes.Repeat([]byte{0x91}, 200_000)
	deep = append(deep, 0x01)
	for _, tc := range []struct {
		name        string
		tokens      raw
		undecodable bool
	}{
		{"array32 declaring 2^32-1 cells", raw{0xdd, 0xff, 0xff, 0xff, 0xff, 0x01}, true},
		{"array16 declaring 65535 cells", raw{0xdc, 0xff, 0xff, 0x01, 0x02}, true},
		{"uint32 cell cut short", raw{0x92, 0x01, 0xce, 0x00}, true},
		{"cell nested 200,000 deep", append(raw{0x92, 0x01}, deep...), false},
		{"bigram pair beside a plain id", raw{0x92, 0x92, 0x01, 0x02, 0x03}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var payload []byte
			if tc.undecodable {
				// The cut or lying list ends the payload: nothing after it.
				head := enc(t, []any{1.5, raw{0x91, 0x97}})
				head = append(head, enc(t, "BlockStored")...)
				head = append(head, enc(t, []any{11})...)
				head = append(head, 0xc0)
				payload = append(head, tc.tokens...)
			} else {
				payload = batch(t, 0, []any{"BlockStored", []any{11}, nil, tc.tokens, 2, nil, "GPU"})
			}
			_, drops, err := NewNormalizer(SGLang).Normalize(payload, 1, 0)
			if tc.undecodable != isUndecodable(err) {
				t.Fatalf("Normalize: %v (drops %v), want undecodable %v", err, drops, tc.undecodable)
			}
			if !tc.undecodable && drops != dropsOf(DropMalformed, 1) {
				t.Fatalf("Normalize: drops %v, want the store malformed", drops)
			}
			sameAsMarshalled(t, SGLang, []wirePayload{{payload, 1, 0}})
		})
	}
}

// TestAppendNormalizedSharesOnlyEqualKeyLists: AppendNormalized writes a
// block's extra keys once and copies them for the next block when the two
// lists are equal; lists differing only in a text, a number, a blob, a
// multimodal identifier or offset, a key's kind or their length must each
// be written for themselves. Every pair is checked against proto.Marshal.
func TestAppendNormalizedSharesOnlyEqualKeyLists(t *testing.T) {
	for _, tc := range []struct {
		name       string
		first, sec []any
	}{
		{"equal", []any{"L", int64(3)}, []any{"L", int64(3)}},
		{"text", []any{"L"}, []any{"M"}},
		{"number", []any{int64(3)}, []any{int64(4)}},
		{"blob", []any{[]byte{1, 2}}, []any{[]byte{1, 3}}},
		{"equal blobs", []any{"L", []byte{1, 2}}, []any{"L", []byte{1, 2}}},
		{"multimodal identifier", []any{[]any{"img", 7}}, []any{[]any{"imh", 7}}},
		{"multimodal offset", []any{[]any{"img", 7}}, []any{[]any{"img", 8}}},
		{"kind only (empty text, empty blob)", []any{""}, []any{[]byte{}}},
		{"length", []any{"L"}, []any{"L", "L"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			keys := []any{tc.first, tc.sec, tc.sec, tc.first}
			payload := batch(t, 0, stored([]any{1, 2, 3, 4}, nil, toks(1, 8), 2, "extra_keys", keys))
			b, drops, err := NewNormalizer(VLLM).Normalize(payload, 1, 0)
			if err != nil || drops.Total() != 0 || len(b.Events) != 1 {
				t.Fatalf("Normalize: %v, drops %v", err, drops)
			}
			blocks := b.Events[0].GetStored().Blocks
			k0, k1 := blocks[0].ExtraKeys, blocks[1].ExtraKeys
			equal := len(k0) == len(k1)
			for i := 0; equal && i < len(k0); i++ {
				equal = proto.Equal(k0[i], k1[i])
			}
			if equal != strings.HasPrefix(tc.name, "equal") || len(k0) == 0 {
				t.Fatalf("blocks 0 and 1 have keys %v and %v: equal %v", k0, k1, equal)
			}
			// Normalize's messages are the caller's: equal blobs of two
			// blocks must not share bytes.
			for i := range min(len(k0), len(k1)) {
				if b0, b1 := k0[i].GetBlob(), k1[i].GetBlob(); len(b0) > 0 && len(b1) > 0 && &b0[0] == &b1[0] {
					t.Fatalf("blocks 0 and 1 share key %d's blob bytes", i)
				}
			}
			sameAsMarshalled(t, VLLM, []wirePayload{{payload, 1, 0}})
		})
	}
}
