package wire

import (
	"bytes"
	"errors"
	"testing"

	"github.com/vmihailenco/msgpack/v5"

	"github.com/kvrelay/kvrelay/proto/kvpb"
)

// om is a msgpack map written in the given key order: k1, v1, k2, v2, …
type om []any

func (m om) EncodeMsgpack(e *msgpack.Encoder) error {
	if err := e.EncodeMapLen(len(m) / 2); err != nil {
		return err
	}
	for i := 0; i+1 < len(m); i += 2 {
		if err := e.Encode(m[i]); err != nil {
			return err
		}
		if err := e.Encode(m[i+1]); err != nil {
			return err
		}
	}
	return nil
}

// raw is already-encoded msgpack, spliced in as is.
type raw []byte

func (r raw) EncodeMsgpack(e *msgpack.Encoder) error {
	_, err := e.Writer().Write(r)
	return err
}

func enc(t testing.TB, v any) []byte {
	t.Helper()
	var b bytes.Buffer
	e := msgpack.NewEncoder(&b)
	e.UseCompactInts(true)
	if err := e.Encode(v); err != nil {
		t.Fatalf("encode: %v", err)
	}
	return b.Bytes()
}

// batch encodes [ts, events, rank]; rank nil writes c0.
func batch(t testing.TB, rank any, events ...any) []byte {
	t.Helper()
	if events == nil {
		events = []any{}
	}
	return enc(t, []any{1700000000.5, events, rank})
}

func toks(from, to int) []any {
	var out []any
	for i := from; i <= to; i++ {
		out = append(out, i)
	}
	return out
}

// stored builds a map BlockStored with the required keys plus extra k/v.
func stored(hashes []any, parent any, tokens []any, blockSize any, extra ...any) om {
	m := om{"type", "BlockStored", "block_hashes", hashes, "parent_block_hash", parent,
		"token_ids", tokens, "block_size", blockSize, "lora_id", nil, "medium", "GPU", "lora_name", nil}
	return append(m, extra...)
}

func removed(hashes []any, extra ...any) om {
	m := om{"type", "BlockRemoved", "block_hashes", hashes, "medium", "GPU"}
	return append(m, extra...)
}

func cleared(extra ...any) om {
	return append(om{"type", "AllBlocksCleared"}, extra...)
}

func mustNormalize(t testing.TB, n *Normalizer, payload []byte, seq uint64, rank int32) (*kvpb.KvEventBatch, Drops) {
	t.Helper()
	b, d, err := n.Normalize(payload, seq, rank)
	if err != nil {
		t.Fatalf("Normalize: %v", err)
	}
	return b, d
}

func eventIDs(b *kvpb.KvEventBatch) []uint64 {
	var ids []uint64
	for _, e := range b.GetEvents() {
		ids = append(ids, e.GetEventId())
	}
	return ids
}

func storedHashes(s *kvpb.KvBlocksStored) []int64 {
	var out []int64
	for _, b := range s.GetBlocks() {
		out = append(out, b.GetBlockHash())
	}
	return out
}

func isUndecodable(err error) bool { return errors.Is(err, ErrUndecodable) }

func dropsOf(pairs ...any) Drops {
	var d Drops
	for i := 0; i+1 < len(pairs); i += 2 {
		d[pairs[i].(DropReason)] += uint64(pairs[i+1].(int))
	}
	return d
}
