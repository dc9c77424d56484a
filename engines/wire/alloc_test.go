package wire

import (
	"testing"
)

// TestExtraKeysCostNoAllocationEach: the output's extra-key messages come
// from one slab per batch, so normalizing a store whose every block carries
// extra keys costs the decoder's allocations for them (a list per block)
// and no more: before, each key was three more allocations (its message,
// its oneof wrapper, and a pointer list per block).
func TestExtraKeysCostNoAllocationEach(t *testing.T) {
	allocs := func(blocks int) float64 {
		hashes := make([]any, blocks)
		keys := make([]any, blocks)
		for i := range hashes {
			hashes[i] = i + 1
			keys[i] = []any{"adapter-1", "salt-x", []any{"image-hash", 7}}
		}
		payload := batch(t, 0, stored(hashes, nil, toks(1, 4*blocks), 4, "extra_keys", keys))
		n := NewNormalizer(VLLM)
		dec := newDecoder(VLLM)
		var seq uint64
		whole := testing.AllocsPerRun(20, func() {
			seq++
			b, _, err := n.Normalize(payload, seq, 0)
			if err != nil || len(b.Events) != 1 || len(b.Events[0].GetStored().Blocks[blocks-1].ExtraKeys) != 3 {
				t.Fatalf("normalize: %v %v", err, b)
			}
		})
		decodeOnly := testing.AllocsPerRun(20, func() {
			if err := dec.decode(payload); err != nil {
				t.Fatal(err)
			}
		})
		return whole - decodeOnly
	}
	small, large := allocs(2), allocs(64)
	// 62 more blocks of 3 keys each: the old build made 62×7 more
	// allocations; the slab makes none.
	if large-small > 4 {
		t.Fatalf("normalizing beyond decoding: %.0f allocations for 2 blocks with 3 extra keys each, %.0f for 64: the keys are allocated one by one", small, large)
	}
}
