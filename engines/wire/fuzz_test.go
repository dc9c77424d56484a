package wire

import (
	"errors"
	"testing"
)

// FuzzNormalize feeds arbitrary payloads to a Normalizer of each dialect:
// no panic, errors only as ErrUndecodable, and every forwarded block well
// formed.
func FuzzNormalize(f *testing.F) {
	for _, h := range []string{hexF1Batch1, hexF1Batch2, hexF2, hexF5, hexF6Legacy, hexF8, hexF9,
		hexVLLMMap, hexVLLMArray12, hexVLLM16750, hexSGLangMap, hexSGLangArray7, hexSGLangArraySalted,
		hexSGLangOldest, hexTokenSpeed, hexVLLM034Batch, hexSGLang0523Batch} {
		for d := VLLM; d <= TokenSpeed; d++ {
			f.Add(uint8(d), unhex(f, h))
		}
	}
	f.Add(uint8(SGLang), batchOf(f, "00", hexSGLangSaltedMapEvent, hexVLLMRemovedMapEvent, hexClearedArrayEvent))
	f.Add(uint8(VLLM), batch(f, 1, append(stored([]any{1, 2}, nil, toks(1, 12), 4), "group_idx", 1, "kv_cache_spec_kind", "sliding_window"),
		removed([]any{1}, "group_idx", 1), stored([]any{3}, 2, []any{[]any{1, 2}, []any{3, 4}}, 2, "extra_keys", []any{[]any{"s", []any{"m", 1}}})))
	f.Add(uint8(VLLM), []byte{0xdd, 0x00, 0x10, 0x00, 0x00})
	f.Fuzz(func(t *testing.T, dialect uint8, payload []byte) {
		n := NewNormalizer(Dialect(dialect%3) + 1)
		var lastID uint64
		for round := uint64(0); round < 2; round++ {
			before := n.eventID
			b, d, err := n.Normalize(payload, round, int32(dialect%5)-1)
			if err != nil {
				if !errors.Is(err, ErrUndecodable) || b != nil {
					t.Fatalf("error %v (batch %v)", err, b)
				}
				if n.eventID != before {
					t.Fatalf("an undecodable batch consumed event ids")
				}
				return
			}
			consumed := n.eventID - before
			if uint64(len(b.Events))+d.Total() != consumed {
				t.Fatalf("%d forwarded + %d dropped != %d input events", len(b.Events), d.Total(), consumed)
			}
			for _, e := range b.Events {
				if e.EventId <= lastID || e.EventId > n.eventID {
					t.Fatalf("event id %d after %d (max %d)", e.EventId, lastID, n.eventID)
				}
				lastID = e.EventId
				if s := e.GetStored(); s != nil {
					if len(s.Blocks) == 0 {
						t.Fatalf("store without blocks")
					}
					for _, blk := range s.Blocks {
						if blk.BlockSize <= 0 || len(blk.TokenIds) != int(blk.BlockSize) {
							t.Fatalf("block of size %d has %d tokens", blk.BlockSize, len(blk.TokenIds))
						}
					}
				}
			}
		}
	})
}
