package sim

import (
	"bytes"
	"encoding/hex"
	"reflect"
	"strings"
	"testing"

	"github.com/vmihailenco/msgpack/v5"

	"github.com/kvrelay/kvrelay/sim/prefixcache"
)

func unhex(t *testing.T, s string) []byte {
	t.Helper()
	b, err := hex.DecodeString(strings.Join(strings.Fields(s), ""))
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// The worked encodings of engine-wire.md §3.6: one BlockStored of tokens
// [1..8], two blocks of 4, no parent, medium GPU, ts 1700000000.5, rank 0.
// They are msgspec's bytes, so equality here is byte-identity with the
// engines' publishers.
const vectorTS = 1700000000.5

var (
	vllmHashes   = []uint64{9561501211280363793, 15292913576410714033}
	sglangHashes = []uint64{uint64(0xcf97adeedb59e05b), 0x4ebfa8a1f3c34151} // -3488128144981237669, 5674439469042975057
)

func vectorStore(hashes []uint64) prefixcache.BlockStored {
	return prefixcache.BlockStored{Hashes: hashes, Tokens: []uint32{1, 2, 3, 4, 5, 6, 7, 8}, BlockSize: 4}
}

func TestBatchVectors(t *testing.T) {
	tests := []struct {
		engine, gen string
		hashes      []uint64
		hex         string
	}{
		{"vllm", "map", vllmHashes, `
93cb41d954fc40200000918ba474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657392
cf84b146b151d55111cfd43b57df56b58fb1b1706172656e745f626c6f636b5f68617368c0a9746f6b656e
5f696473980102030405060708aa626c6f636b5f73697a6504a76c6f72615f6964c0a66d656469756da347
5055a96c6f72615f6e616d65c0aa65787472615f6b65797392c0c0a967726f75705f69647800b26b765f63
616368655f737065635f6b696e64ae66756c6c5f617474656e74696f6e00`},
		{"vllm", "array12", vllmHashes, `
93cb41d954fc40200000919cab426c6f636b53746f72656492cf84b146b151d55111cfd43b57df56b58fb1
c098010203040506070804c0a3475055c092c0c000ae66756c6c5f617474656e74696f6ec000`},
		{"vllm", "array6", vllmHashes,
			`92cb41d954fc402000009196ab426c6f636b53746f72656492cf84b146b151d55111cfd43b57df56b58fb1c098010203040506070804c0`},
		{"sglang", "map", sglangHashes, `
93cb41d954fc402000009187a474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657392
d3cf97adeedb59e05bcf4ebfa8a1f3c34151b1706172656e745f626c6f636b5f68617368c0a9746f6b656e
5f696473980102030405060708aa626c6f636b5f73697a6504a76c6f72615f6964c0a66d656469756da347
505500`},
		{"sglang", "array7", sglangHashes,
			`93cb41d954fc402000009197ab426c6f636b53746f72656492d3cf97adeedb59e05bcf4ebfa8a1f3c34151c098010203040506070804c0a347505500`},
		{"sglang", "array6", sglangHashes,
			`92cb41d954fc402000009196ab426c6f636b53746f72656492d3cf97adeedb59e05bcf4ebfa8a1f3c34151c098010203040506070804c0`},
		// The research note encodes TokenSpeed with the vLLM hashes as opaque
		// u64 values.
		{"tokenspeed", "array5", vllmHashes,
			`93cb41d954fc402000009195ab426c6f636b53746f72656492cf84b146b151d55111cfd43b57df56b58fb1c09801020304050607080400`},
	}
	for _, tc := range tests {
		t.Run(tc.engine+"/"+tc.gen, func(t *testing.T) {
			f, err := lookupWire(tc.engine, tc.gen)
			if err != nil {
				t.Fatal(err)
			}
			got, err := f.encodeBatch(vectorTS, []prefixcache.Event{vectorStore(tc.hashes)}, 0)
			if err != nil {
				t.Fatal(err)
			}
			if want := unhex(t, tc.hex); !bytes.Equal(got, want) {
				t.Fatalf("bytes differ\n got %x\nwant %x", got, want)
			}
		})
	}
}

func TestEventVectors(t *testing.T) {
	tests := []struct {
		name, engine, gen string
		ev                prefixcache.Event
		hex               string
	}{
		{"vllm map BlockRemoved", "vllm", "map", prefixcache.BlockRemoved{Hashes: vllmHashes},
			`84a474797065ac426c6f636b52656d6f766564ac626c6f636b5f68617368657392cf84b146b151d55111cfd43b57df56b58fb1a66d656469756da3475055a967726f75705f69647800`},
		{"map AllBlocksCleared", "sglang", "map", prefixcache.AllBlocksCleared{},
			`81a474797065b0416c6c426c6f636b73436c6561726564`},
		{"vllm map AllBlocksCleared", "vllm", "map", prefixcache.AllBlocksCleared{},
			`81a474797065b0416c6c426c6f636b73436c6561726564`},
		{"array AllBlocksCleared", "sglang", "array7", prefixcache.AllBlocksCleared{},
			`91b0416c6c426c6f636b73436c6561726564`},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			f, err := lookupWire(tc.engine, tc.gen)
			if err != nil {
				t.Fatal(err)
			}
			var buf bytes.Buffer
			if err := f.encodeEvent(&wireWriter{Encoder: msgpack.NewEncoder(&buf), f: f}, tc.ev); err != nil {
				t.Fatal(err)
			}
			if want := unhex(t, tc.hex); !bytes.Equal(buf.Bytes(), want) {
				t.Fatalf("bytes differ\n got %x\nwant %x", buf.Bytes(), want)
			}
		})
	}
}

// TestEventShapes checks, per generation, the event shapes the vectors do not
// cover: removals, host-tier media, parents, and the field counts of each era.
func TestEventShapes(t *testing.T) {
	stored := prefixcache.BlockStored{Hashes: []uint64{7}, Parent: 1<<63 + 5, HasParent: true, Tokens: []uint32{1000, 70000}, BlockSize: 2, Tier: prefixcache.Host}
	removed := prefixcache.BlockRemoved{Hashes: []uint64{7, 1 << 63}, Tier: prefixcache.Host}
	tests := []struct {
		engine, gen string
		want        []any // decoded stored, removed; nil means encoding must fail
	}{
		{"vllm", "map", []any{
			map[string]any{"type": "BlockStored", "block_hashes": []any{uint64(7)}, "parent_block_hash": uint64(1<<63 + 5), "token_ids": []any{uint64(1000), uint64(70000)},
				"block_size": uint64(2), "lora_id": nil, "medium": "CPU", "lora_name": nil, "extra_keys": []any{nil}, "group_idx": uint64(0), "kv_cache_spec_kind": "full_attention"},
			map[string]any{"type": "BlockRemoved", "block_hashes": []any{uint64(7), uint64(1 << 63)}, "medium": "CPU", "group_idx": uint64(0)},
		}},
		{"vllm", "array12", []any{
			[]any{"BlockStored", []any{uint64(7)}, uint64(1<<63 + 5), []any{uint64(1000), uint64(70000)}, uint64(2), nil, "CPU", nil, []any{nil}, uint64(0), "full_attention", nil},
			[]any{"BlockRemoved", []any{uint64(7), uint64(1 << 63)}, "CPU", uint64(0)},
		}},
		{"vllm", "array6", nil},
		{"sglang", "map", []any{
			map[string]any{"type": "BlockStored", "block_hashes": []any{uint64(7)}, "parent_block_hash": int64(-1<<63 + 5), "token_ids": []any{uint64(1000), uint64(70000)},
				"block_size": uint64(2), "lora_id": nil, "medium": "CPU_PINNED"},
			map[string]any{"type": "BlockRemoved", "block_hashes": []any{uint64(7), int64(-1 << 63)}, "medium": "CPU_PINNED"},
		}},
		{"sglang", "array7", []any{
			[]any{"BlockStored", []any{uint64(7)}, int64(-1<<63 + 5), []any{uint64(1000), uint64(70000)}, uint64(2), nil, "CPU_TIER1"},
			[]any{"BlockRemoved", []any{uint64(7), int64(-1 << 63)}, "CPU_TIER1"},
		}},
		{"sglang", "array6", nil},
		{"tokenspeed", "array5", nil},
	}
	for _, tc := range tests {
		t.Run(tc.engine+"/"+tc.gen, func(t *testing.T) {
			f, err := lookupWire(tc.engine, tc.gen)
			if err != nil {
				t.Fatal(err)
			}
			for i, ev := range []prefixcache.Event{stored, removed} {
				var buf bytes.Buffer
				err := f.encodeEvent(&wireWriter{Encoder: msgpack.NewEncoder(&buf), f: f}, ev)
				if tc.want == nil {
					if err == nil {
						t.Fatalf("event %d: a generation without medium encoded a host-tier event", i)
					}
					continue
				}
				if err != nil {
					t.Fatal(err)
				}
				assertDecodes(t, buf.Bytes(), tc.want[i])
			}
		})
	}
}

// assertDecodes decodes b keeping integer signedness as written (uint for
// cc..cf and positive fixints, int for d0..d3) and compares it to want.
func assertDecodes(t *testing.T, b []byte, want any) {
	t.Helper()
	d := msgpack.NewDecoder(bytes.NewReader(b))
	d.SetMapDecoder(func(d *msgpack.Decoder) (any, error) { return d.DecodeUntypedMap() })
	got, err := d.DecodeInterfaceLoose()
	if err != nil {
		t.Fatal(err)
	}
	if gs, ws := normalize(got), normalize(want); !equalAny(gs, ws) {
		t.Fatalf("decoded\n got %#v\nwant %#v", gs, ws)
	}
}

// normalize maps every non-negative integer to uint64 and every negative one
// to int64, which is how DecodeInterfaceLoose reports them.
func normalize(v any) any {
	switch v := v.(type) {
	case []any:
		out := make([]any, len(v))
		for i := range v {
			out[i] = normalize(v[i])
		}
		return out
	case map[string]any:
		out := map[string]any{}
		for k, x := range v {
			out[k] = normalize(x)
		}
		return out
	case map[any]any:
		out := map[string]any{}
		for k, x := range v {
			out[k.(string)] = normalize(x)
		}
		return out
	case int, int8, int16, int32, int64:
		n := reflect.ValueOf(v).Int()
		if n >= 0 {
			return uint64(n)
		}
		return n
	case uint, uint8, uint16, uint32, uint64:
		return reflect.ValueOf(v).Uint()
	}
	return v
}

func equalAny(a, b any) bool {
	switch a := a.(type) {
	case []any:
		bb, ok := b.([]any)
		if !ok || len(a) != len(bb) {
			return false
		}
		for i := range a {
			if !equalAny(a[i], bb[i]) {
				return false
			}
		}
		return true
	case map[string]any:
		bb, ok := b.(map[string]any)
		if !ok || len(a) != len(bb) {
			return false
		}
		for k, v := range a {
			w, ok := bb[k]
			if !ok || !equalAny(v, w) {
				return false
			}
		}
		return true
	}
	return a == b
}

func TestLookupWire(t *testing.T) {
	for _, engine := range []string{"vllm", "sglang", "tokenspeed"} {
		f, err := lookupWire(engine, "")
		if err != nil || f.gen != WireGenerations(engine)[0] {
			t.Fatalf("%s default: %v %v", engine, f, err)
		}
	}
	if f, _ := lookupWire("vllm", ""); f.gen != "map" {
		t.Fatalf("vllm default wire %s", f.gen)
	}
	if _, err := lookupWire("vllm", "array5"); err == nil || !strings.Contains(err.Error(), "map, array12, array6") {
		t.Fatalf("bad generation error: %v", err)
	}
	if _, err := lookupWire("trtllm", ""); err == nil {
		t.Fatal("unknown engine accepted")
	}
}
