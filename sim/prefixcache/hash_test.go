package prefixcache

import (
	"encoding/hex"
	"testing"
)

func seq(from, to, step uint32) []uint32 {
	var out []uint32
	for t := from; t <= to; t += step {
		out = append(out, t)
	}
	return out
}

// chain hashes tokens page by page, as the cache does.
func chain(h Hasher, tokens []uint32, page int) []uint64 {
	var parent *Digest
	var out []uint64
	for i := 0; i+page <= len(tokens); i += page {
		d := h.Chain(parent, tokens[i:i+page])
		out = append(out, h.Published(d))
		parent = &d
	}
	return out
}

func TestHashVectors(t *testing.T) {
	// Vectors from engine-wire.md §4.3/§3.6 and relay-semantics.md §4.5 (the
	// same ones smg's relays test against).
	tests := []struct {
		name   string
		h      Hasher
		tokens []uint32
		page   int
		want   []uint64
	}{
		{"sglang [1..4]", SGLangSHA256{}, seq(1, 4, 1), 4, []uint64{u64(-3488128144981237669)}},
		{"sglang [1..8]", SGLangSHA256{}, seq(1, 8, 1), 4, []uint64{u64(-3488128144981237669), 5674439469042975057}},
		{"sglang [10..80] page 2", SGLangSHA256{}, seq(10, 80, 10), 2, []uint64{978178666101069530, u64(-895308556211281782), u64(-8033692805846017938), 835415944263129316}},
		{"vllm A,B", VLLMSHA256CBOR{}, seq(1, 8, 1), 4, []uint64{9561501211280363793, 15292913576410714033}},
		{"tokenspeed [1..8]", TokenSpeedFNV{}, seq(1, 8, 1), 4, []uint64{15932823548972441343, 12482753192408519678}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got := chain(tc.h, tc.tokens, tc.page)
			if len(got) != len(tc.want) {
				t.Fatalf("got %d hashes, want %d", len(got), len(tc.want))
			}
			for i := range got {
				if got[i] != tc.want[i] {
					t.Errorf("block %d: got %d (int64 %d), want %d", i, got[i], int64(got[i]), tc.want[i])
				}
			}
		})
	}
}

func TestSGLangEmptyPage(t *testing.T) {
	// int of sha256("") per relay-semantics §4.5.
	if got := int64(SGLangSHA256{}.Published(SGLangSHA256{}.Chain(nil, nil))); got != -2039914840885289964 {
		t.Fatalf("got %d", got)
	}
}

func TestVLLMNoneHash(t *testing.T) {
	if got := hex.EncodeToString(vllmNoneHash[:4]); got != "9bd96a48" {
		t.Fatalf("NONE_HASH starts %s, want 9bd96a48", got)
	}
	if got := hex.EncodeToString(vllmNoneHash[30:]); got != "eef0" {
		t.Fatalf("NONE_HASH ends %s, want eef0", got)
	}
}

func TestCBORHeadWidths(t *testing.T) {
	tests := []struct {
		v    uint64
		want string
	}{
		{0, "00"}, {23, "17"}, {24, "1818"}, {255, "18ff"}, {256, "190100"},
		{65535, "19ffff"}, {65536, "1a00010000"}, {1 << 32, "1b0000000100000000"},
	}
	for _, tc := range tests {
		if got := hex.EncodeToString(cborHead(nil, 0, tc.v)); got != tc.want {
			t.Errorf("cborHead(%d) = %s, want %s", tc.v, got, tc.want)
		}
	}
}

func u64(v int64) uint64 { return uint64(v) }
