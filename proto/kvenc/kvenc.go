// Package kvenc writes a KvEventBatch's protobuf wire bytes by hand: the
// same bytes proto.Marshal writes for it, without its reflective size pass
// and per-field dispatch. The relay encodes every batch it admits once, for
// its history and for every subscriber, and proto.Marshal was the largest
// single cost of that path (23 % of the relay's CPU in the in-process
// profile of issue 19).
//
// Byte equality with proto.Marshal is the contract (the differential test
// over the golden vectors and FuzzAppendBatchMatchesMarshal check it): fields
// in field-number order, proto3 scalars omitted at their zero value (a
// double only at +0), optional fields written whenever set, repeated scalars
// packed, a nil element of a repeated or oneof message written as an empty
// message, and a string that is not valid UTF-8 refused with an error, as
// proto.Marshal refuses it. Unknown fields are not written: the batches the
// relay encodes are built by its normalizer and have none. EngineLoad, which
// the relay never puts in an event batch, is delegated to proto.Marshal.
//
// AppendBatchFunc, AppendEvent and AppendStoredEvent write the same bytes
// from parts: the wire normalizer's direct path (wire.AppendNormalized)
// writes a store's blocks from flat hash and token slices (BlockRun)
// without building a KvBlock message each.
package kvenc

import (
	"errors"
	"fmt"
	"math"
	"slices"
	"unicode/utf8"

	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	"github.com/kvrelay/kvrelay/proto/kvpb"
)

// ErrInvalidUTF8 is returned for a string field that is not valid UTF-8,
// which proto3 forbids and proto.Marshal refuses.
var ErrInvalidUTF8 = errors.New("string field contains invalid UTF-8")

// Wire tags, precomputed (field number << 3 | wire type). Every field number
// here is below 16, so each tag is one byte, except the batch's 16 and 17.
const (
	tagVarint  = byte(protowire.VarintType)
	tagFixed64 = byte(protowire.Fixed64Type)
	tagBytes   = byte(protowire.BytesType)
)

func tag(num int, typ byte) byte { return byte(num<<3) | typ }

// AppendBatch appends b's encoding to dst and returns the extended slice.
// A nil b appends nothing, as proto.Marshal encodes it as empty.
func AppendBatch(dst []byte, b *kvpb.KvEventBatch) ([]byte, error) {
	if b == nil {
		return dst, nil
	}
	return AppendBatchFunc(dst, b, len(b.Events), func(dst []byte, i int) ([]byte, error) {
		return AppendEvent(dst, b.Events[i])
	})
}

// AppendBatchFunc appends the encoding of b with n events written by event
// (each call appends the fields of event i, as AppendEvent does) in place
// of b.Events, which it ignores. The normalizer's direct path writes its
// events from the decoder's slabs this way, without building their
// messages; the bytes are AppendBatch's for the batch those calls describe.
func AppendBatchFunc(dst []byte, b *kvpb.KvEventBatch, n int, event func(dst []byte, i int) ([]byte, error)) ([]byte, error) {
	if b.SequenceNumber != 0 {
		dst = append(dst, tag(1, tagVarint))
		dst = protowire.AppendVarint(dst, b.SequenceNumber)
	}
	if b.Timestamp != 0 || math.Signbit(b.Timestamp) {
		dst = append(dst, tag(2, tagFixed64))
		dst = protowire.AppendFixed64(dst, math.Float64bits(b.Timestamp))
	}
	var err error
	for i := range n {
		dst = append(dst, tag(3, tagBytes))
		at := len(dst)
		dst = append(dst, 0)
		if dst, err = event(dst, i); err != nil {
			return dst, err
		}
		dst = closeLen(dst, at)
	}
	if b.DpRank != nil {
		dst = append(dst, tag(4, tagVarint))
		dst = protowire.AppendVarint(dst, uint64(int64(*b.DpRank)))
	}
	if s := b.Snapshot; s != nil {
		dst = append(dst, tag(7, tagBytes))
		at := len(dst)
		dst = append(dst, 0)
		dst = appendUintField(dst, 1, uint64(s.Index))
		dst = appendUintField(dst, 2, uint64(s.Count))
		dst = appendUintField(dst, 3, s.Blocks)
		dst = appendUintField(dst, 4, s.UnknownBefore)
		dst = closeLen(dst, at)
	}
	if b.Load != nil {
		// Not on the event path; proto.Marshal writes the same bytes for a
		// sub-message as for the field inside its parent.
		dst = append(dst, tag(8, tagBytes))
		dst = protowire.AppendVarint(dst, uint64(proto.Size(b.Load)))
		if dst, err = (proto.MarshalOptions{}).MarshalAppend(dst, b.Load); err != nil {
			return dst, fmt.Errorf("load: %w", err)
		}
	}
	if b.LiveDigest != nil {
		dst = protowire.AppendTag(dst, 16, protowire.Fixed64Type)
		dst = protowire.AppendFixed64(dst, *b.LiveDigest)
	}
	if b.LiveBlocks != nil {
		dst = protowire.AppendTag(dst, 17, protowire.VarintType)
		dst = protowire.AppendVarint(dst, *b.LiveBlocks)
	}
	return dst, nil
}

// closeLen fills in the length of the message that starts at at+1, where one
// byte was reserved for its length. Most blocks are shorter than 128 bytes
// and need no more; a longer message is moved up to make room, which costs a
// copy of its bytes and is cheaper than a sizing pass over every token.
func closeLen(dst []byte, at int) []byte {
	n := len(dst) - at - 1
	if n < 0x80 {
		dst[at] = byte(n)
		return dst
	}
	k := protowire.SizeVarint(uint64(n))
	for range k - 1 {
		dst = append(dst, 0)
	}
	copy(dst[at+k:], dst[at+1:at+1+n])
	protowire.AppendVarint(dst[at:at], uint64(n))
	return dst
}

func appendUintField(dst []byte, num int, v uint64) []byte {
	if v == 0 {
		return dst
	}
	dst = append(dst, tag(num, tagVarint))
	return protowire.AppendVarint(dst, v)
}

func appendOptInt(dst []byte, num int, v int64) []byte {
	dst = append(dst, tag(num, tagVarint))
	return appendVarint64(dst, uint64(v))
}

// appendVarint64 is protowire.AppendVarint with a path for the values at
// or above 2^56 that block hashes nearly all are (nine or ten bytes):
// protowire tests the value against each shorter length first and appends
// byte by byte; here the ten bytes are stored unrolled and the length is
// nine plus the top bit. Hashes are a tenth of a batch's bytes.
func appendVarint64(dst []byte, v uint64) []byte {
	if v < 1<<56 {
		return protowire.AppendVarint(dst, v)
	}
	n := len(dst)
	dst = slices.Grow(dst, 10)
	b := dst[n : n+10]
	b[0] = byte(v) | 0x80
	b[1] = byte(v>>7) | 0x80
	b[2] = byte(v>>14) | 0x80
	b[3] = byte(v>>21) | 0x80
	b[4] = byte(v>>28) | 0x80
	b[5] = byte(v>>35) | 0x80
	b[6] = byte(v>>42) | 0x80
	b[7] = byte(v>>49) | 0x80
	b[8] = byte(v >> 56) // its top bit, bit 63, is the continuation bit
	b[9] = byte(v >> 63)
	return dst[:n+9+int(v>>63)]
}

func appendOptString(dst []byte, num int, s *string, field string) ([]byte, error) {
	if s == nil {
		return dst, nil
	}
	return appendString(dst, num, *s, field)
}

func appendString(dst []byte, num int, s string, field string) ([]byte, error) {
	if !utf8.ValidString(s) {
		return dst, fmt.Errorf("%s: %w", field, ErrInvalidUTF8)
	}
	dst = append(dst, tag(num, tagBytes))
	dst = protowire.AppendVarint(dst, uint64(len(s)))
	return append(dst, s...), nil
}

// AppendEvent appends the fields of ev (its message body, without a tag or
// length of its own). A nil ev appends nothing.
func AppendEvent(dst []byte, ev *kvpb.KvCacheEvent) ([]byte, error) {
	if ev == nil {
		return dst, nil
	}
	dst = appendUintField(dst, 1, ev.EventId)
	var err error
	switch d := ev.Data.(type) {
	case *kvpb.KvCacheEvent_Stored:
		dst = append(dst, tag(2, tagBytes))
		at := len(dst)
		dst = append(dst, 0)
		if dst, err = appendStored(dst, d.Stored); err != nil {
			return dst, err
		}
		dst = closeLen(dst, at)
	case *kvpb.KvCacheEvent_Removed:
		dst = append(dst, tag(3, tagBytes))
		at := len(dst)
		dst = append(dst, 0)
		if dst, err = appendRemoved(dst, d.Removed); err != nil {
			return dst, err
		}
		dst = closeLen(dst, at)
	case *kvpb.KvCacheEvent_Cleared:
		dst = append(dst, tag(4, tagBytes))
		at := len(dst)
		dst = append(dst, 0)
		if d.Cleared != nil {
			if dst, err = appendOptString(dst, 1, d.Cleared.Ownership, "cleared.ownership"); err != nil {
				return dst, err
			}
		}
		dst = closeLen(dst, at)
	}
	return dst, nil
}

func appendStored(dst []byte, s *kvpb.KvBlocksStored) ([]byte, error) {
	if s == nil {
		return dst, nil
	}
	var err error
	for _, blk := range s.Blocks {
		dst = append(dst, tag(1, tagBytes))
		at := len(dst)
		dst = append(dst, 0)
		if blk != nil {
			if dst, err = appendBlock(dst, blk); err != nil {
				return dst, err
			}
		}
		dst = closeLen(dst, at)
	}
	return appendStoredTail(dst, s)
}

// BlockRun is a store's blocks held as flat slices, the way the normalizer's
// decoder holds them, instead of one KvBlock message each.
type BlockRun struct {
	Hashes []int64
	// Tokens holds BlockSize token ids per hash, block j's at
	// [j*BlockSize, (j+1)*BlockSize).
	Tokens     []uint32
	BlockSize  int32
	LoraID     *int64 // every block's lora_id
	CacheLevel *int32 // every block's cache_level
	// ExtraKeys[j] are block j's extra keys; blocks beyond its end have none.
	// Consecutive blocks may share one list (the same slice): its bytes are
	// then written once and copied.
	ExtraKeys [][]*kvpb.KvBlockExtraKey
}

// AppendStoredEvent appends the fields of the KvCacheEvent{EventId: eventID,
// Data: Stored{tail with Blocks from run}} (as AppendEvent would for it):
// tail gives the store's own fields, its Blocks are ignored. Tokens shorter
// than the blocks need is an error, not a panic.
func AppendStoredEvent(dst []byte, eventID uint64, tail *kvpb.KvBlocksStored, run *BlockRun) ([]byte, error) {
	size := int(run.BlockSize)
	if size < 0 || len(run.Tokens) < len(run.Hashes)*size {
		return dst, fmt.Errorf("stored run: %d tokens for %d blocks of %d", len(run.Tokens), len(run.Hashes), size)
	}
	dst = appendUintField(dst, 1, eventID)
	dst = append(dst, tag(2, tagBytes))
	at := len(dst)
	dst = append(dst, 0)
	var err error
	// prevKeys were the last block's extra keys, its last prevKeysLen
	// bytes; prevEnd is where it ended.
	var prevKeys []*kvpb.KvBlockExtraKey
	prevKeysLen, prevEnd := 0, 0
	for j, h := range run.Hashes {
		dst = append(dst, tag(1, tagBytes))
		blockAt := len(dst)
		dst = append(dst, 0)
		if h != 0 {
			dst = appendOptInt(dst, 1, h)
		}
		if size > 0 {
			dst = append(dst, tag(2, tagBytes))
			tokAt := len(dst)
			dst = append(dst, 0)
			dst = appendPackedUint32(dst, run.Tokens[j*size:(j+1)*size])
			dst = closeLen(dst, tokAt)
			dst = appendOptInt(dst, 3, int64(size))
		}
		if run.LoraID != nil {
			dst = appendOptInt(dst, 4, *run.LoraID)
		}
		if run.CacheLevel != nil {
			dst = appendOptInt(dst, 5, int64(*run.CacheLevel))
		}
		if j < len(run.ExtraKeys) && len(run.ExtraKeys[j]) > 0 {
			keys := run.ExtraKeys[j]
			if len(keys) == len(prevKeys) && &keys[0] == &prevKeys[0] {
				// The previous block's list again (the wire normalizer
				// shares one list among blocks whose keys are equal, as
				// vLLM's LoRA name on every block): the previous block
				// ends with its bytes, already checked; they are copied.
				dst = append(dst, dst[prevEnd-prevKeysLen:prevEnd]...)
			} else {
				keysAt := len(dst)
				if dst, err = appendExtraKeys(dst, keys); err != nil {
					return dst, err
				}
				prevKeys, prevKeysLen = keys, len(dst)-keysAt
			}
		} else {
			prevKeys = nil
		}
		dst = closeLen(dst, blockAt)
		prevEnd = len(dst)
	}
	if tail != nil {
		if dst, err = appendStoredTail(dst, tail); err != nil {
			return dst, err
		}
	}
	return closeLen(dst, at), nil
}

// appendStoredTail writes a store's fields after its blocks.
func appendStoredTail(dst []byte, s *kvpb.KvBlocksStored) ([]byte, error) {
	var err error
	if s.ParentBlockHash != nil {
		dst = appendOptInt(dst, 2, *s.ParentBlockHash)
	}
	if s.Tier != nil {
		dst = appendOptInt(dst, 3, int64(*s.Tier))
	}
	if dst, err = appendOptString(dst, 4, s.Medium, "stored.medium"); err != nil {
		return dst, err
	}
	if s.GroupIdx != nil {
		dst = appendOptInt(dst, 5, int64(*s.GroupIdx))
	}
	if dst, err = appendOptString(dst, 6, s.KvCacheSpecKind, "stored.kv_cache_spec_kind"); err != nil {
		return dst, err
	}
	if s.KvCacheSpecSlidingWindow != nil {
		dst = appendOptInt(dst, 7, int64(*s.KvCacheSpecSlidingWindow))
	}
	if s.Locality != nil {
		dst = appendOptInt(dst, 8, int64(*s.Locality))
	}
	if dst, err = appendOptString(dst, 9, s.Ownership, "stored.ownership"); err != nil {
		return dst, err
	}
	if dst, err = appendOptString(dst, 10, s.SessionId, "stored.session_id"); err != nil {
		return dst, err
	}
	if dst, err = appendOptString(dst, 11, s.LoraName, "stored.lora_name"); err != nil {
		return dst, err
	}
	return appendOptString(dst, 12, s.CacheSalt, "stored.cache_salt")
}

func appendBlock(dst []byte, blk *kvpb.KvBlock) ([]byte, error) {
	if blk.BlockHash != 0 {
		dst = appendOptInt(dst, 1, blk.BlockHash)
	}
	if toks := blk.TokenIds; len(toks) > 0 {
		dst = append(dst, tag(2, tagBytes))
		at := len(dst)
		dst = append(dst, 0)
		dst = appendPackedUint32(dst, toks)
		dst = closeLen(dst, at)
	}
	if blk.BlockSize != 0 {
		dst = appendOptInt(dst, 3, int64(blk.BlockSize))
	}
	if blk.LoraId != nil {
		dst = appendOptInt(dst, 4, *blk.LoraId)
	}
	if blk.CacheLevel != nil {
		dst = appendOptInt(dst, 5, int64(*blk.CacheLevel))
	}
	return appendExtraKeys(dst, blk.ExtraKeys)
}

func appendExtraKeys(dst []byte, keys []*kvpb.KvBlockExtraKey) ([]byte, error) {
	var err error
	for _, k := range keys {
		dst = append(dst, tag(6, tagBytes))
		at := len(dst)
		dst = append(dst, 0)
		if k != nil {
			if dst, err = appendExtraKey(dst, k); err != nil {
				return dst, err
			}
		}
		dst = closeLen(dst, at)
	}
	return dst, nil
}

// appendPackedUint32 writes token ids, most of a batch's bytes: the buffer
// grows once for the worst case (5 bytes a token) and the varints are
// written in place.
func appendPackedUint32(dst []byte, vs []uint32) []byte {
	n := len(dst)
	if cap(dst)-n < 5*len(vs) {
		grown := make([]byte, n, 2*cap(dst)+5*len(vs))
		copy(grown, dst)
		dst = grown
	}
	return dst[:PutVarints32(dst[:n+5*len(vs)], n, vs)]
}

// PutVarints32 writes vs as consecutive varints at b[i:], which has room
// (at most 5 bytes a value), and returns the index after them: a packed
// repeated uint32's payload. The snapshot chunk encoder writes its tokens
// with it too.
//
// Ids below 2^21 (every vocabulary's) take a path without a branch on
// their length: a loop over a varint's bytes mispredicts its exit whenever
// the lengths mix, as a real vocabulary's ids do (two and three bytes), and
// the branch-free path costs less CPU time on the realistic streams
// (BENCHMARKS.md, third pass). One 4-byte store per value with the length
// from bits.Len32 and a shifted mask was tried too and measured slower.
func PutVarints32(b []byte, i int, vs []uint32) int {
	for _, v := range vs {
		if v < 1<<21 && i+3 <= len(b) {
			// Three bytes written whatever the length (junk after a
			// shorter varint is overwritten by the next), continuation
			// bits from the value's magnitude, not from a branch.
			more1 := byte((v+(1<<31-1<<7))>>24) & 0x80  // v ≥ 2^7
			more2 := byte((v+(1<<31-1<<14))>>24) & 0x80 // v ≥ 2^14
			q := b[i : i+3 : i+3]
			q[0] = byte(v) | more1
			q[1] = byte(v>>7)&0x7f | more2
			q[2] = byte(v >> 14)
			i += 1 + int(more1>>7) + int(more2>>7)
			continue
		}
		for v >= 0x80 {
			b[i] = byte(v) | 0x80
			v >>= 7
			i++
		}
		b[i] = byte(v)
		i++
	}
	return i
}

func appendExtraKey(dst []byte, k *kvpb.KvBlockExtraKey) ([]byte, error) {
	switch key := k.Key.(type) {
	case *kvpb.KvBlockExtraKey_Text:
		return appendString(dst, 1, key.Text, "extra_key.text")
	case *kvpb.KvBlockExtraKey_Blob:
		dst = append(dst, tag(2, tagBytes))
		dst = protowire.AppendVarint(dst, uint64(len(key.Blob)))
		return append(dst, key.Blob...), nil
	case *kvpb.KvBlockExtraKey_Number:
		return appendOptInt(dst, 3, key.Number), nil
	case *kvpb.KvBlockExtraKey_Multimodal:
		dst = append(dst, tag(4, tagBytes))
		at := len(dst)
		dst = append(dst, 0)
		if m := key.Multimodal; m != nil {
			if m.Identifier != "" {
				var err error
				if dst, err = appendString(dst, 1, m.Identifier, "extra_key.multimodal.identifier"); err != nil {
					return dst, err
				}
			}
			if m.Offset != 0 {
				dst = appendOptInt(dst, 2, m.Offset)
			}
		}
		return closeLen(dst, at), nil
	}
	return dst, nil
}

func appendRemoved(dst []byte, rm *kvpb.KvBlocksRemoved) ([]byte, error) {
	if rm == nil {
		return dst, nil
	}
	if hs := rm.BlockHashes; len(hs) > 0 {
		dst = append(dst, tag(1, tagBytes))
		at := len(dst)
		dst = append(dst, 0)
		for _, h := range hs {
			dst = appendVarint64(dst, uint64(h))
		}
		dst = closeLen(dst, at)
	}
	if rm.CacheLevel != nil {
		dst = appendOptInt(dst, 2, int64(*rm.CacheLevel))
	}
	if rm.Tier != nil {
		dst = appendOptInt(dst, 3, int64(*rm.Tier))
	}
	var err error
	if dst, err = appendOptString(dst, 4, rm.Medium, "removed.medium"); err != nil {
		return dst, err
	}
	if rm.GroupIdx != nil {
		dst = appendOptInt(dst, 5, int64(*rm.GroupIdx))
	}
	if rm.Locality != nil {
		dst = appendOptInt(dst, 6, int64(*rm.Locality))
	}
	return appendOptString(dst, 7, rm.Ownership, "removed.ownership")
}
