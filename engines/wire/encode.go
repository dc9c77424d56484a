package wire

import (
	"bytes"
	"fmt"

	"github.com/kvrelay/kvrelay/proto/kvenc"
	"github.com/kvrelay/kvrelay/proto/kvpb"
)

// AppendNormalized normalizes payload exactly as Normalize does (same gates,
// same record, same drops, same event ids) and appends the protobuf wire
// bytes of the batch Normalize would have returned, the bytes proto.Marshal
// writes for it, to dst. It builds no message per block: blocks are written
// straight from the decoder's hash and token slabs, and the few per-event
// messages it needs for the stores' own fields come from scratch the
// Normalizer reuses, so a batch costs no allocation in the steady state
// beyond growing dst.
//
// Errors: a payload Normalize refuses gives the same error (wrapping
// ErrUndecodable, no event id consumed) and dst unchanged. A batch that
// normalizes but cannot be encoded (a LoRA name, salt or other string that
// is not valid UTF-8, which proto3 forbids) returns dst unchanged and an
// error wrapping kvenc.ErrInvalidUTF8; its events were normalized and their
// ids consumed, as they are when Normalize's batch fails to encode.
func (n *Normalizer) AppendNormalized(dst []byte, payload []byte, seq uint64, rank int32) ([]byte, Drops, error) {
	h, drops, err := n.plan(payload, rank)
	if err != nil {
		return dst, drops, err
	}
	head := &n.enc.head
	*head = kvpb.KvEventBatch{SequenceNumber: seq, Timestamp: h.ts}
	if h.hasRank {
		n.enc.rank = h.rank
		head.DpRank = &n.enc.rank
	}
	out, err := kvenc.AppendBatchFunc(dst, head, len(n.plans), n.enc.event)
	if err != nil {
		return dst, drops, fmt.Errorf("encoding normalized batch %d: %w", seq, err)
	}
	return out, drops, nil
}

// encodeScratch is what AppendNormalized reuses from batch to batch: one
// message per event kind for the events' own fields, the run description
// of a store's blocks, and slabs for extra keys. Nothing in it outlives the
// call that fills it.
type encodeScratch struct {
	n       *Normalizer
	head    kvpb.KvEventBatch
	rank    int32
	stored  storedOut
	removed removedOut
	cleared clearedOut
	run     kvenc.BlockRun

	keySlab  []extraKeyOut
	keyPtrs  []*kvpb.KvBlockExtraKey
	perBlock [][]*kvpb.KvBlockExtraKey
}

// event appends planned event i's fields (kvenc.AppendBatchFunc's callback).
func (e *encodeScratch) event(dst []byte, i int) ([]byte, error) {
	n := e.n
	p := &n.plans[i]
	ev := p.ev
	switch ev.kind {
	case kindCleared:
		o := &e.cleared
		*o = clearedOut{}
		o.fill(p)
		return kvenc.AppendEvent(dst, &o.event)
	case kindRemoved:
		o := &e.removed
		*o = removedOut{}
		o.fill(p, n.removed[p.removedOff:p.removedOff+p.removedN])
		return kvenc.AppendEvent(dst, &o.event)
	case kindStored:
		o := &e.stored
		*o = storedOut{}
		loraID, cacheLevel := o.fill(p)
		width, nb := int(ev.blockSize), ev.hashN
		e.run = kvenc.BlockRun{
			Hashes:     n.dec.hashes[ev.hashOff : ev.hashOff+nb],
			Tokens:     n.dec.tokens[p.tokOff : p.tokOff+nb*width],
			BlockSize:  int32(width),
			LoraID:     loraID,
			CacheLevel: cacheLevel,
		}
		if len(ev.extraKeys) > 0 {
			e.run.ExtraKeys = e.extraKeys(ev)
		}
		return kvenc.AppendStoredEvent(dst, p.eventID, &o.msg, &e.run)
	}
	return dst, nil
}

// maxKeptKeys bounds the extra-key scratch a Normalizer keeps between
// batches: one batch full of keys should not pin its slabs for ever.
const maxKeptKeys = 1 << 14

// extraKeys builds a store's per-block extra-key messages in the reused
// slabs, as build does in a fresh one.
func (e *encodeScratch) extraKeys(ev *wireEvent) [][]*kvpb.KvBlockExtraKey {
	nb := min(ev.hashN, len(ev.extraKeys))
	total := 0
	for _, keys := range ev.extraKeys[:nb] {
		total += len(keys)
	}
	if cap(e.keySlab) < total || cap(e.keySlab) > maxKeptKeys && total <= maxKeptKeys {
		e.keySlab = make([]extraKeyOut, total)
		e.keyPtrs = make([]*kvpb.KvBlockExtraKey, total)
	}
	if cap(e.perBlock) < nb || cap(e.perBlock) > maxKeptKeys && nb <= maxKeptKeys {
		e.perBlock = make([][]*kvpb.KvBlockExtraKey, 0, nb)
	}
	slab, ptrs := e.keySlab[:total], e.keyPtrs[:total]
	perBlock := e.perBlock[:0]
	for j, keys := range ev.extraKeys[:nb] {
		k := len(keys)
		if k == 0 {
			perBlock = append(perBlock, nil)
			continue
		}
		if j > 0 && sameKeys(keys, ev.extraKeys[j-1]) {
			// The previous block's keys again (vLLM's LoRA name on every
			// block): one shared list, which kvenc writes once and copies.
			perBlock = append(perBlock, perBlock[j-1])
			continue
		}
		extraKeysProto(keys, slab[:k], ptrs[:k:k])
		perBlock = append(perBlock, ptrs[:k:k])
		slab, ptrs = slab[k:], ptrs[k:]
	}
	e.perBlock = perBlock
	return perBlock
}

// sameKeys reports whether two blocks' extra keys are equal, key by key.
func sameKeys(a, b []extraKey) bool {
	if len(a) != len(b) {
		return false
	}
	if len(a) > 0 && &a[0] == &b[0] {
		return true // one list (the decoder shares a repeated one)
	}
	for i := range a {
		if a[i].kind != b[i].kind || a[i].text != b[i].text || a[i].num != b[i].num || !bytes.Equal(a[i].blob, b[i].blob) {
			return false
		}
	}
	return true
}
