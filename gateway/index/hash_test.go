package index

import (
	"encoding/binary"
	"math"
	"math/rand/v2"
	"testing"

	"github.com/zeebo/xxh3"
)

func seq(from, to uint32) []uint32 {
	out := make([]uint32, 0, to-from+1)
	for t := from; t <= to; t++ {
		out = append(out, t)
	}
	return out
}

// Known-answer vectors from gateway-side.md §2.1 (libxxhash 0.8.1).
func TestContentHashVectors(t *testing.T) {
	adapter := NamespaceSeed("adapter", "")
	tests := []struct {
		name   string
		tokens []uint32
		seed   uint64
		want   uint64
	}{
		{"1..4", []uint32{1, 2, 3, 4}, BaseSeed, 0xcb38e4d7fb2dca5c},
		{"5..8", []uint32{5, 6, 7, 8}, BaseSeed, 0xe8d3ec39b907b74c},
		{"9..12", []uint32{9, 10, 11, 12}, BaseSeed, 0x06b748f1777d599c},
		{"empty", nil, BaseSeed, 0xd1f3e77444430ab9},
		{"empty non-nil", []uint32{}, BaseSeed, 0xd1f3e77444430ab9},
		{"0..15", seq(0, 15), BaseSeed, 0xd47a8f41c833328a},
		{"0..299", seq(0, 299), BaseSeed, 0x1474c801f1576d1c},
		{"1..4 lora adapter", []uint32{1, 2, 3, 4}, adapter, 0x4af8e65e6822e2c9},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if got := ContentHash(tc.tokens, tc.seed); got != tc.want {
				t.Errorf("ContentHash = %#016x, want %#016x", got, tc.want)
			}
		})
	}
}

func TestNamespaceSeedVectors(t *testing.T) {
	tests := []struct {
		name       string
		lora, salt string
		want       uint64
	}{
		{"base", "", "", BaseSeed},
		{"lora adapter", "adapter", "", 0xdcf577bc7589cc16},
		{"lora adapter salt salty", "adapter", "salty", 0x6afe0c57a29d587c},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if got := NamespaceSeed(tc.lora, tc.salt); got != tc.want {
				t.Errorf("NamespaceSeed = %#016x, want %#016x", got, tc.want)
			}
			if got := (Namespace{LoraName: tc.lora, CacheSalt: tc.salt}).Seed(); got != tc.want {
				t.Errorf("Namespace.Seed = %#016x, want %#016x", got, tc.want)
			}
		})
	}
}

func TestChainVectors(t *testing.T) {
	tokens := seq(1, 12)
	want := []uint64{0xcb38e4d7fb2dca5c, 0x44a2b2379d6d3c3d, 0xaea1e67a6c80cf84}
	tests := []struct {
		name string
		got  []uint64
	}{
		{"PrefixHashes", PrefixHashes(tokens, 4, Namespace{})},
		{"PrefixHashes drops partial block", PrefixHashes(append(seq(1, 12), 13, 14), 4, Namespace{})},
		{"ChainHash by hand", []uint64{
			ContentHash(tokens[0:4], BaseSeed),
			ChainHash(ContentHash(tokens[0:4], BaseSeed), ContentHash(tokens[4:8], BaseSeed)),
			ChainHash(ChainHash(ContentHash(tokens[0:4], BaseSeed), ContentHash(tokens[4:8], BaseSeed)), ContentHash(tokens[8:12], BaseSeed)),
		}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if len(tc.got) != len(want) {
				t.Fatalf("got %d hashes, want %d", len(tc.got), len(want))
			}
			for i := range want {
				if tc.got[i] != want[i] {
					t.Errorf("position %d = %#016x, want %#016x", i, tc.got[i], want[i])
				}
			}
		})
	}
}

func TestContentHashesCut(t *testing.T) {
	tests := []struct {
		name      string
		tokens    int
		blockSize int
		want      int
	}{
		{"exact", 32, 16, 2},
		{"partial tail dropped", 47, 16, 2},
		{"shorter than a block", 15, 16, 0},
		{"block size 0", 32, 0, 0},
		{"negative block size", 32, -1, 0},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			toks := make([]uint32, tc.tokens)
			if got := len(ContentHashes(toks, tc.blockSize, BaseSeed)); got != tc.want {
				t.Errorf("got %d blocks, want %d", got, tc.want)
			}
		})
	}
}

// The portable path (used on big-endian machines) must agree with the
// in-place one.
func TestContentHashPortable(t *testing.T) {
	old := nativeLittleEndian
	t.Cleanup(func() { nativeLittleEndian = old })
	toks := seq(0, 299)
	nativeLittleEndian = false
	if got := ContentHash(toks, BaseSeed); got != 0x1474c801f1576d1c {
		t.Errorf("portable ContentHash = %#016x", got)
	}
}

// TestChainHashIsXXH3: the inlined 16-byte XXH3 of ChainHash equals the
// xxh3 package's over the two words, little-endian, seed 1337, on edge and
// random words.
func TestChainHashIsXXH3(t *testing.T) {
	words := []uint64{0, 1, 1337, 1 << 63, math.MaxUint64, 0x9E3779B97F4A7C15}
	rng := rand.New(rand.NewPCG(5, 6))
	for range 1000 {
		words = append(words, rng.Uint64())
	}
	for _, a := range words {
		for _, b := range words[:40] {
			if got, want := ChainHash(a, b), chainHashXXH3(a, b); got != want {
				t.Fatalf("ChainHash(%#x, %#x) = %#x, xxh3 %#x", a, b, got, want)
			}
			if got, want := ChainHash(b, a), chainHashXXH3(b, a); got != want {
				t.Fatalf("ChainHash(%#x, %#x) = %#x, xxh3 %#x", b, a, got, want)
			}
		}
	}
}

// chainHashXXH3 is ChainHash through the xxh3 package.
func chainHashXXH3(prev, content uint64) uint64 {
	var b [16]byte
	binary.LittleEndian.PutUint64(b[:8], prev)
	binary.LittleEndian.PutUint64(b[8:], content)
	return xxh3.HashSeed(b[:], BaseSeed)
}
