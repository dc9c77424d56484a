package wire

// Dialect selects the engine-specific decoding rules. The three engines share
// one skeleton (tag-first arrays or tagged maps inside a [ts, events, rank]
// envelope); they differ in a few slots and in how hashes are produced.
type Dialect int

const (
	// VLLM: 64-bit unsigned or 32-byte hashes; cache salt in extra_keys.
	VLLM Dialect = iota + 1
	// SGLang: signed hashes; a salted array store carries an 8th element
	// {"cache_salt": s}; bigram token cells under EAGLE.
	SGLang
	// TokenSpeed: 5-element stores (no lora_id, no medium), unsigned hashes.
	TokenSpeed
)

func (d Dialect) String() string {
	switch d {
	case VLLM:
		return "vllm"
	case SGLang:
		return "sglang"
	case TokenSpeed:
		return "tokenspeed"
	}
	return "unknown"
}
