package prefixcache

import (
	"crypto/sha256"
	"encoding/binary"
	"fmt"
)

// Digest is a block's full chain hash as the engine keeps it internally.
// Chaining uses the whole digest (SGLang and vLLM chain on 32-byte SHA-256
// digests), while events carry only a 64-bit projection of it (Published).
type Digest [32]byte

// Hasher computes an engine's block hashes. Chain hashes one full block given
// its parent's digest (nil at the root of a sequence); Published is the
// integer the engine puts in its KV events, as a 64-bit pattern.
type Hasher interface {
	Chain(parent *Digest, tokens []uint32) Digest
	Published(d Digest) uint64
}

// HasherFor returns the default block hash algorithm of engine ("vllm",
// "sglang" or "tokenspeed").
func HasherFor(engine string) (Hasher, error) {
	switch engine {
	case "vllm":
		return VLLMSHA256CBOR{}, nil
	case "sglang":
		return SGLangSHA256{}, nil
	case "tokenspeed":
		return TokenSpeedFNV{}, nil
	}
	return nil, fmt.Errorf("prefixcache: no hash algorithm for engine %q", engine)
}

// SGLangSHA256 is SGLang's page hash: SHA-256 over the prior page's raw
// digest followed by each token as a 4-byte little-endian unsigned integer.
// Events carry the first 8 digest bytes read big-endian as a signed int64;
// Published returns that value's bit pattern.
type SGLangSHA256 struct{}

// Chain implements Hasher.
func (SGLangSHA256) Chain(parent *Digest, tokens []uint32) Digest {
	// One buffer and one Sum: per-token Writes cost ten times more.
	b := make([]byte, 0, len(Digest{})+4*len(tokens))
	if parent != nil {
		b = append(b, parent[:]...)
	}
	for _, t := range tokens {
		b = binary.LittleEndian.AppendUint32(b, t)
	}
	return sha256.Sum256(b)
}

// Published implements Hasher.
func (SGLangSHA256) Published(d Digest) uint64 { return binary.BigEndian.Uint64(d[:8]) }

// VLLMSHA256CBOR is vLLM's sha256_cbor block hash with the fixed seed used
// when PYTHONHASHSEED is unset: SHA-256 over the canonical CBOR encoding of
// [parent digest or NONE_HASH, [tokens...], null], where NONE_HASH is
// SHA-256 of the CBOR text "vllm-none-hash". Events carry the last 8 digest
// bytes, big-endian, unsigned (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1).
// The simulator never uses extra keys (no LoRA, salt or multimodal input),
// so the third element is always null.
type VLLMSHA256CBOR struct{}

// vllmNoneHash is the root parent of every vLLM chain.
var vllmNoneHash = func() Digest {
	var b []byte
	b = cborHead(b, 3, uint64(len("vllm-none-hash")))
	b = append(b, "vllm-none-hash"...)
	return sha256.Sum256(b)
}()

// cborHead appends a canonical (shortest-form) CBOR head for major type
// major with argument v.
func cborHead(b []byte, major byte, v uint64) []byte {
	m := major << 5
	switch {
	case v < 24:
		return append(b, m|byte(v))
	case v <= 0xff:
		return append(b, m|24, byte(v))
	case v <= 0xffff:
		return binary.BigEndian.AppendUint16(append(b, m|25), uint16(v))
	case v <= 0xffffffff:
		return binary.BigEndian.AppendUint32(append(b, m|26), uint32(v))
	}
	return binary.BigEndian.AppendUint64(append(b, m|27), v)
}

// Chain implements Hasher.
func (VLLMSHA256CBOR) Chain(parent *Digest, tokens []uint32) Digest {
	p := vllmNoneHash
	if parent != nil {
		p = *parent
	}
	b := make([]byte, 0, 40+5*len(tokens))
	b = cborHead(b, 4, 3) // the 3-tuple
	b = cborHead(b, 2, uint64(len(p)))
	b = append(b, p[:]...)
	b = cborHead(b, 4, uint64(len(tokens)))
	for _, t := range tokens {
		b = cborHead(b, 0, uint64(t))
	}
	b = append(b, 0xf6) // null: no extra keys
	return sha256.Sum256(b)
}

// Published implements Hasher.
func (VLLMSHA256CBOR) Published(d Digest) uint64 { return binary.BigEndian.Uint64(d[24:]) }

// TokenSpeedFNV is TokenSpeed's FNV-1a-64 page hash over: one byte
// has_parent, the parent's published hash as u64 little-endian (if any), the
// token count as u64 little-endian, and each token as i32 little-endian.
// TokenSpeed chains on the 64-bit value, so the digest holds just that value
// (big-endian in its first 8 bytes).
type TokenSpeedFNV struct{}

const (
	fnvOffset64 = 14695981039346656037
	fnvPrime64  = 1099511628211
)

// Chain implements Hasher.
func (TokenSpeedFNV) Chain(parent *Digest, tokens []uint32) Digest {
	h := uint64(fnvOffset64)
	mix := func(b []byte) {
		for _, c := range b {
			h ^= uint64(c)
			h *= fnvPrime64
		}
	}
	var b8 [8]byte
	if parent != nil {
		mix([]byte{1})
		binary.LittleEndian.PutUint64(b8[:], binary.BigEndian.Uint64(parent[:8]))
		mix(b8[:])
	} else {
		mix([]byte{0})
	}
	binary.LittleEndian.PutUint64(b8[:], uint64(len(tokens)))
	mix(b8[:])
	var b4 [4]byte
	for _, t := range tokens {
		binary.LittleEndian.PutUint32(b4[:], t)
		mix(b4[:])
	}
	var d Digest
	binary.BigEndian.PutUint64(d[:8], h)
	return d
}

// Published implements Hasher.
func (TokenSpeedFNV) Published(d Digest) uint64 { return binary.BigEndian.Uint64(d[:8]) }
