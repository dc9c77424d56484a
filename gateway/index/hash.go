package index

import (
	"encoding/binary"
	"math/bits"
	"unsafe"

	"github.com/zeebo/xxh3"
)

// BaseSeed is SMG's XXH3 seed (XXH3_SEED) for content and chain hashes.
const BaseSeed uint64 = 1337

// nativeLittleEndian lets the hot path hash a []uint32 in place: on a
// little-endian machine its memory already is the concatenation of the
// tokens' 4-byte little-endian encodings that SMG hashes.
var nativeLittleEndian = func() bool {
	x := uint16(1)
	return *(*byte)(unsafe.Pointer(&x)) == 1
}()

// Namespace separates blocks that carry the same tokens but must not be
// shared: a LoRA adapter's blocks, or a tenant's salted blocks. The zero value
// is the base model without salt.
type Namespace struct {
	LoraName  string
	CacheSalt string
}

// Seed is the namespace's content-hash seed (SMG salt.rs).
func (ns Namespace) Seed() uint64 { return NamespaceSeed(ns.LoraName, ns.CacheSalt) }

// NamespaceSeed is SMG's namespace seed: 1337 + XXH3-64(lora, seed 0) +
// XXH3-64(salt, seed 1) with wrapping addition. An empty string contributes
// nothing, so an empty LoRA name is the base model.
func NamespaceSeed(loraName, cacheSalt string) uint64 {
	seed := BaseSeed
	if loraName != "" {
		seed += xxh3.HashStringSeed(loraName, 0)
	}
	if cacheSalt != "" {
		seed += xxh3.HashStringSeed(cacheSalt, 1)
	}
	return seed
}

// ContentHash is a block's position-independent identity: XXH3-64 over its
// token ids, each a little-endian u32, with the namespace seed. An empty
// block hashes the empty input, as SMG does.
func ContentHash(tokens []uint32, seed uint64) uint64 {
	if len(tokens) == 0 {
		return xxh3.HashSeed(nil, seed)
	}
	if nativeLittleEndian {
		b := unsafe.Slice((*byte)(unsafe.Pointer(&tokens[0])), len(tokens)*4)
		return xxh3.HashSeed(b, seed)
	}
	b := make([]byte, 0, len(tokens)*4)
	for _, t := range tokens {
		b = binary.LittleEndian.AppendUint32(b, t)
	}
	return xxh3.HashSeed(b, seed)
}

// ChainHash extends a prefix by one block: XXH3-64, seed 1337 whatever the
// namespace (the namespace is already in the content hash), over the
// previous prefix hash and the block's content hash, both u64 little-endian.
// The first block's prefix hash is its bare content hash, not a chain from 0;
// chaining from 0 would silently match nothing SMG indexes.
//
// It is computed here rather than by the xxh3 package: a lookup chains every
// block of the request, and XXH3 of exactly 16 bytes is a few operations
// (the specification's 9–16-byte case: the input's two words, each masked by
// two words of the default secret and the seed, folded by a 128-bit
// multiply, then XXH3's avalanche) that the package's general entry point
// buries under its length dispatch, about half of a chain step.
// TestChainHashIsXXH3 holds it to the package.
func ChainHash(prev, content uint64) uint64 {
	// Words 24–55 of XXH3's default secret, little-endian.
	const secret24, secret32, secret40, secret48 = 0x1f67b3b7a4a44072, 0x78e5c0cc4ee679cb, 0x2172ffcc7dd05a82, 0x8e2443f7744608b8
	lo := prev ^ (secret24 ^ secret32 + BaseSeed)
	hi := content ^ (secret40 ^ secret48 - BaseSeed)
	mulHi, mulLo := bits.Mul64(lo, hi)
	acc := 16 + bits.ReverseBytes64(lo) + hi + (mulHi ^ mulLo)
	acc ^= acc >> 37
	acc *= 0x165667919E3779F9
	return acc ^ acc>>32
}

// ContentHashes cuts tokens into full blocks of blockSize from token 0 and
// returns one content hash per block; a partial trailing block is dropped
// because engines only cache full blocks. blockSize ≤ 0 gives nil.
func ContentHashes(tokens []uint32, blockSize int, seed uint64) []uint64 {
	if blockSize <= 0 {
		return nil
	}
	n := len(tokens) / blockSize
	out := make([]uint64, n)
	for i := range n {
		out[i] = ContentHash(tokens[i*blockSize:(i+1)*blockSize], seed)
	}
	return out
}

// PrefixHashes is the request side of block identity: the chained prefix hash
// of every full block, under the request's namespace. Position i's value names
// "blocks 0..i of this request" in the index.
func PrefixHashes(tokens []uint32, blockSize int, ns Namespace) []uint64 {
	hs := ContentHashes(tokens, blockSize, ns.Seed())
	for i := 1; i < len(hs); i++ {
		hs[i] = ChainHash(hs[i-1], hs[i])
	}
	return hs
}
