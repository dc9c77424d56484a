// Package kvdec reads a KvEventBatch's protobuf wire bytes by hand, the
// receiving half of what package kvenc writes. A gateway reads every batch a
// relay sends, and a snapshot of a million live blocks is 63 MB of them:
// proto.Unmarshal spent 400–575 ms of CPU on one such snapshot, most of it
// allocating a message per block and a slice per block's tokens (issue 19
// item 5). A Decoder fills the same generated messages, so the index and
// the monitor consume them unchanged, but it takes them from slabs it keeps
// from one batch to the next, and it keeps every block's tokens in one
// shared slice.
//
// The contract is proto.Unmarshal's result: for any input, Decode fails when
// proto.Unmarshal fails, and otherwise returns a message proto.Equal to what
// proto.Unmarshal builds (unknown fields kept, a message field seen twice
// merged, repeated scalars packed or not, the last of a scalar winning, a
// string that is not valid UTF-8 refused). The differential tests and
// FuzzDecodeMatchesUnmarshal check it.
//
// Safety on peer input: no length the peer declares sizes an allocation
// (slices grow with what was actually read), and nothing recurses: the
// message types nest to a fixed depth, and an unknown group, which may nest
// as deep as the peer likes, is skipped by a loop with proto.Unmarshal's
// depth limit.
package kvdec

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"unicode/utf8"

	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"

	"github.com/kvrelay/kvrelay/proto/kvpb"
)

// ErrInvalidUTF8 is returned for a string field that is not valid UTF-8,
// which proto3 forbids and proto.Unmarshal refuses.
var ErrInvalidUTF8 = errors.New("string field contains invalid UTF-8")

// errEndGroup is an end-group tag outside any group, or closing another.
var errEndGroup = errors.New("mismatched end-group tag")

// errDepth is an unknown group nested deeper than proto.Unmarshal allows.
var errDepth = errors.New("groups nested deeper than the recursion limit")

// A Decoder decodes batches, reusing its storage: the batch Decode returns,
// and everything it points to, is valid until the next call of Decode on the
// same Decoder. The one exception is the batch's Load, which is allocated
// afresh for every batch that carries one (a load callback may keep it).
// A Decoder is not safe for concurrent use.
type Decoder struct {
	batch    kvpb.KvEventBatch
	snapshot kvpb.KvSnapshotChunk

	events   slab[kvpb.KvCacheEvent]
	stored   slab[kvpb.KvBlocksStored]
	storedW  slab[kvpb.KvCacheEvent_Stored]
	removed  slab[kvpb.KvBlocksRemoved]
	removedW slab[kvpb.KvCacheEvent_Removed]
	blocks   slab[kvpb.KvBlock]
	ints     slab[int64] // the blocks' lora_id, the stores' parent_block_hash

	eventPtrs []*kvpb.KvCacheEvent
	blockPtrs []*kvpb.KvBlock
	tokens    []uint32 // every block's token ids, one after the other
	hashes    []int64  // every removal's block hashes

	lastString             *string
	dpRank                 int32
	liveDigest, liveBlocks uint64
}

// slab hands out zeroed values from chunks it keeps across batches. Chunks
// are never moved, so a pointer handed out stays valid until reset.
type slab[T any] struct {
	chunks [][]T
	n      int
}

const slabChunk = 512

// Storage a Decoder keeps between batches is bounded: a batch far larger
// than usual (a 131k-block live batch is 8 MB on the wire) would otherwise
// pin its slabs for the stream's life, once per worker. What a snapshot
// chunk (about 2,000 blocks) or a live batch needs stays.
const (
	keepSlabChunks = 16      // 8,192 values of each kind
	keepFlat       = 1 << 18 // tokens, hashes or pointers
)

func (s *slab[T]) next() *T {
	c, i := s.n/slabChunk, s.n%slabChunk
	if c == len(s.chunks) {
		s.chunks = append(s.chunks, make([]T, slabChunk))
	}
	s.n++
	p := &s.chunks[c][i]
	var zero T
	*p = zero
	return p
}

func (s *slab[T]) reset() {
	s.n = 0
	if len(s.chunks) > keepSlabChunks {
		clear(s.chunks[keepSlabChunks:])
		s.chunks = s.chunks[:keepSlabChunks]
	}
}

// resetFlat empties s for the next batch, dropping it when it grew past
// keepFlat.
func resetFlat[T any](s []T) []T {
	if cap(s) > keepFlat {
		return nil
	}
	clear(s)
	return s[:0]
}

// Decode decodes one KvEventBatch from data. data is not retained: strings,
// bytes and unknown fields are copied.
func (d *Decoder) Decode(data []byte) (*kvpb.KvEventBatch, error) {
	d.events.reset()
	d.stored.reset()
	d.storedW.reset()
	d.removed.reset()
	d.removedW.reset()
	d.blocks.reset()
	d.ints.reset()
	d.eventPtrs = resetFlat(d.eventPtrs)
	d.blockPtrs = resetFlat(d.blockPtrs)
	d.tokens = d.tokens[:0]
	d.hashes = d.hashes[:0]
	if cap(d.tokens) > keepFlat {
		d.tokens = nil
	}
	if cap(d.hashes) > keepFlat {
		d.hashes = nil
	}
	d.batch = kvpb.KvEventBatch{}
	if err := d.decodeBatch(data, &d.batch); err != nil {
		return nil, fmt.Errorf("kvdec: KvEventBatch: %w", err)
	}
	return &d.batch, nil
}

// field reads the tag at the head of b as proto.Unmarshal does: a varint of
// up to ten bytes whose field number must lie in the valid range.
func field(b []byte) (protowire.Number, protowire.Type, int, error) {
	var tag uint64
	n := 1
	if len(b) > 0 && b[0] < 0x80 {
		tag = uint64(b[0])
	} else {
		tag, n = protowire.ConsumeVarint(b)
		if n < 0 {
			return 0, 0, 0, fmt.Errorf("tag: %w", protowire.ParseError(n))
		}
	}
	num := tag >> 3
	if num < uint64(protowire.MinValidNumber) || num > uint64(protowire.MaxValidNumber) {
		return 0, 0, 0, fmt.Errorf("field number %d out of range", num)
	}
	typ := protowire.Type(tag & 7)
	if typ == protowire.EndGroupType {
		return 0, 0, 0, fmt.Errorf("field %d: %w", num, errEndGroup)
	}
	return protowire.Number(num), typ, n, nil
}

// unknown skips the field num of type typ at the head of b and keeps it in
// m's unknown fields, as proto.Unmarshal does. It returns the bytes read.
func unknown(m protoreflect.ProtoMessage, num protowire.Number, typ protowire.Type, b []byte) (int, error) {
	n, err := skip(num, typ, b)
	if err != nil {
		return 0, fmt.Errorf("field %d: %w", num, err)
	}
	r := m.ProtoReflect()
	u := append([]byte(r.GetUnknown()), protowire.AppendTag(nil, num, typ)...)
	r.SetUnknown(append(u, b[:n]...))
	return n, nil
}

// skip returns the length of the value of field num (type typ) at the head
// of b. A group is walked with a loop and a stack of open group numbers, not
// by recursion; its depth limit is proto.Unmarshal's
// (protowire.DefaultRecursionLimit levels below the outermost group).
func skip(num protowire.Number, typ protowire.Type, b []byte) (int, error) {
	if typ != protowire.StartGroupType {
		n := protowire.ConsumeFieldValue(num, typ, b)
		if n < 0 {
			return 0, protowire.ParseError(n)
		}
		return n, nil
	}
	open := []protowire.Number{num}
	pos := 0
	for {
		num2, typ2, n := protowire.ConsumeTag(b[pos:])
		if n < 0 {
			return 0, protowire.ParseError(n)
		}
		pos += n
		switch typ2 {
		case protowire.EndGroupType:
			if num2 != open[len(open)-1] {
				return 0, errEndGroup
			}
			open = open[:len(open)-1]
			if len(open) == 0 {
				return pos, nil
			}
		case protowire.StartGroupType:
			if len(open) > protowire.DefaultRecursionLimit {
				return 0, errDepth
			}
			open = append(open, num2)
		default:
			n = protowire.ConsumeFieldValue(num2, typ2, b[pos:])
			if n < 0 {
				return 0, protowire.ParseError(n)
			}
			pos += n
		}
	}
}

func varint(b []byte) (uint64, int, error) {
	if len(b) > 0 && b[0] < 0x80 {
		return uint64(b[0]), 1, nil
	}
	v, n := protowire.ConsumeVarint(b)
	if n < 0 {
		return 0, 0, protowire.ParseError(n)
	}
	return v, n, nil
}

func bytesField(b []byte) ([]byte, int, error) {
	v, n := protowire.ConsumeBytes(b)
	if n < 0 {
		return nil, 0, protowire.ParseError(n)
	}
	return v, n, nil
}

func str(b []byte) ([]byte, int, string, error) {
	v, n, err := bytesField(b)
	if err != nil {
		return nil, 0, "", err
	}
	if !utf8.Valid(v) {
		return nil, 0, "", ErrInvalidUTF8
	}
	return v, n, string(v), nil
}

// fieldErr names the field an error is in.
func fieldErr(name string, err error) error { return fmt.Errorf("%s: %w", name, err) }

func (d *Decoder) decodeBatch(b []byte, m *kvpb.KvEventBatch) error {
	eventsAt := len(d.eventPtrs)
	for len(b) > 0 {
		num, typ, n, err := field(b)
		if err != nil {
			return err
		}
		b = b[n:]
		switch {
		case num == 1 && typ == protowire.VarintType:
			if m.SequenceNumber, n, err = varint(b); err != nil {
				return fieldErr("sequence_number", err)
			}
		case num == 2 && typ == protowire.Fixed64Type:
			v, k := protowire.ConsumeFixed64(b)
			if k < 0 {
				return fieldErr("timestamp", protowire.ParseError(k))
			}
			m.Timestamp, n = math.Float64frombits(v), k
		case num == 3 && typ == protowire.BytesType:
			var v []byte
			if v, n, err = bytesField(b); err != nil {
				return fieldErr("events", err)
			}
			ev := d.events.next()
			if err := d.decodeEvent(v, ev); err != nil {
				return fmt.Errorf("events[%d]: %w", len(d.eventPtrs)-eventsAt, err)
			}
			d.eventPtrs = append(d.eventPtrs, ev)
		case num == 4 && typ == protowire.VarintType:
			var v uint64
			if v, n, err = varint(b); err != nil {
				return fieldErr("dp_rank", err)
			}
			d.dpRank = int32(v)
			m.DpRank = &d.dpRank
		case num == 7 && typ == protowire.BytesType:
			var v []byte
			if v, n, err = bytesField(b); err != nil {
				return fieldErr("snapshot", err)
			}
			if m.Snapshot == nil {
				d.snapshot = kvpb.KvSnapshotChunk{}
				m.Snapshot = &d.snapshot
			}
			if err := decodeSnapshot(v, m.Snapshot); err != nil {
				return fieldErr("snapshot", err)
			}
		case num == 8 && typ == protowire.BytesType:
			// Not on the event path (load-only batches, rare): the generated
			// code decodes it, into a message of its own.
			var v []byte
			if v, n, err = bytesField(b); err != nil {
				return fieldErr("load", err)
			}
			if m.Load == nil {
				m.Load = &kvpb.EngineLoad{}
			}
			if err := (proto.UnmarshalOptions{Merge: true}).Unmarshal(v, m.Load); err != nil {
				return fieldErr("load", err)
			}
		case num == 16 && typ == protowire.Fixed64Type:
			v, k := protowire.ConsumeFixed64(b)
			if k < 0 {
				return fieldErr("live_digest", protowire.ParseError(k))
			}
			d.liveDigest, n = v, k
			m.LiveDigest = &d.liveDigest
		case num == 17 && typ == protowire.VarintType:
			if d.liveBlocks, n, err = varint(b); err != nil {
				return fieldErr("live_blocks", err)
			}
			m.LiveBlocks = &d.liveBlocks
		default:
			if n, err = unknown(m, num, typ, b); err != nil {
				return err
			}
		}
		b = b[n:]
	}
	if k := len(d.eventPtrs); k > eventsAt {
		m.Events = d.eventPtrs[eventsAt:k:k]
	}
	return nil
}

func decodeSnapshot(b []byte, m *kvpb.KvSnapshotChunk) error {
	for len(b) > 0 {
		num, typ, n, err := field(b)
		if err != nil {
			return err
		}
		b = b[n:]
		if num >= 1 && num <= 4 && typ == protowire.VarintType {
			var v uint64
			if v, n, err = varint(b); err != nil {
				return fieldErr(fmt.Sprintf("field %d", num), err)
			}
			switch num {
			case 1:
				m.Index = uint32(v)
			case 2:
				m.Count = uint32(v)
			case 3:
				m.Blocks = v
			case 4:
				m.UnknownBefore = v
			}
		} else if n, err = unknown(m, num, typ, b); err != nil {
			return err
		}
		b = b[n:]
	}
	return nil
}

func (d *Decoder) decodeEvent(b []byte, m *kvpb.KvCacheEvent) error {
	for len(b) > 0 {
		num, typ, n, err := field(b)
		if err != nil {
			return err
		}
		b = b[n:]
		switch {
		case num == 1 && typ == protowire.VarintType:
			if m.EventId, n, err = varint(b); err != nil {
				return fieldErr("event_id", err)
			}
		case num == 2 && typ == protowire.BytesType:
			var v []byte
			if v, n, err = bytesField(b); err != nil {
				return fieldErr("stored", err)
			}
			// A oneof member seen again merges into the one it holds;
			// another member replaces it (proto.Unmarshal's rule).
			w, ok := m.Data.(*kvpb.KvCacheEvent_Stored)
			if !ok || w.Stored == nil {
				w = d.storedW.next()
				w.Stored = d.stored.next()
			}
			if err := d.decodeStored(v, w.Stored); err != nil {
				return fieldErr("stored", err)
			}
			m.Data = w
		case num == 3 && typ == protowire.BytesType:
			var v []byte
			if v, n, err = bytesField(b); err != nil {
				return fieldErr("removed", err)
			}
			w, ok := m.Data.(*kvpb.KvCacheEvent_Removed)
			if !ok || w.Removed == nil {
				w = d.removedW.next()
				w.Removed = d.removed.next()
			}
			if err := d.decodeRemoved(v, w.Removed); err != nil {
				return fieldErr("removed", err)
			}
			m.Data = w
		case num == 4 && typ == protowire.BytesType:
			var v []byte
			if v, n, err = bytesField(b); err != nil {
				return fieldErr("cleared", err)
			}
			w, ok := m.Data.(*kvpb.KvCacheEvent_Cleared)
			if !ok || w.Cleared == nil {
				w = &kvpb.KvCacheEvent_Cleared{Cleared: &kvpb.KvCacheCleared{}}
			}
			if err := decodeCleared(v, w.Cleared); err != nil {
				return fieldErr("cleared", err)
			}
			m.Data = w
		default:
			if n, err = unknown(m, num, typ, b); err != nil {
				return err
			}
		}
		b = b[n:]
	}
	return nil
}

func decodeCleared(b []byte, m *kvpb.KvCacheCleared) error {
	for len(b) > 0 {
		num, typ, n, err := field(b)
		if err != nil {
			return err
		}
		b = b[n:]
		if num == 1 && typ == protowire.BytesType {
			var s string
			if _, n, s, err = str(b); err != nil {
				return fieldErr("ownership", err)
			}
			m.Ownership = &s
		} else if n, err = unknown(m, num, typ, b); err != nil {
			return err
		}
		b = b[n:]
	}
	return nil
}

// optString sets *p to the string at the head of b. The last string made
// is reused when the text is the same: a namespace (lora_name) repeats on
// every event of a LoRA's stream, and a pointer to it is all a field holds.
func (d *Decoder) optString(b []byte, p **string) (int, error) {
	v, n, err := bytesField(b)
	if err != nil {
		return 0, err
	}
	if !utf8.Valid(v) {
		return 0, ErrInvalidUTF8
	}
	if d.lastString == nil || *d.lastString != string(v) {
		s := string(v)
		d.lastString = &s
	}
	*p = d.lastString
	return n, nil
}

func (d *Decoder) decodeStored(b []byte, m *kvpb.KvBlocksStored) error {
	blocksAt := len(d.blockPtrs)
	for len(b) > 0 {
		// A block under 128 bytes (a snapshot's are about 65) is taken here,
		// its tag and length one byte each, before the general walk below.
		if len(b) >= 2 && b[0] == tagStoredBlock && b[1] < 0x80 && int(b[1]) <= len(b)-2 {
			end := 2 + int(b[1])
			if err := d.storedBlock(b[2:end], m, blocksAt); err != nil {
				return err
			}
			b = b[end:]
			continue
		}
		num, typ, n, err := field(b)
		if err != nil {
			return err
		}
		b = b[n:]
		switch {
		case num == 1 && typ == protowire.BytesType:
			var v []byte
			if v, n, err = bytesField(b); err != nil {
				return fieldErr("blocks", err)
			}
			if err := d.storedBlock(v, m, blocksAt); err != nil {
				return err
			}
		case typ == protowire.VarintType && (num == 2 || num == 3 || num == 5 || num == 7 || num == 8):
			var v uint64
			if v, n, err = varint(b); err != nil {
				return fieldErr(fmt.Sprintf("field %d", num), err)
			}
			switch num {
			case 2:
				h := d.ints.next()
				*h = int64(v)
				m.ParentBlockHash = h
			case 3:
				t := kvpb.KvCacheTier(int32(v))
				m.Tier = &t
			case 5:
				g := uint32(v)
				m.GroupIdx = &g
			case 7:
				w := uint32(v)
				m.KvCacheSpecSlidingWindow = &w
			case 8:
				l := kvpb.KvCacheLocality(int32(v))
				m.Locality = &l
			}
		case typ == protowire.BytesType && (num == 4 || num == 6 || (num >= 9 && num <= 12)):
			var p **string
			switch num {
			case 4:
				p = &m.Medium
			case 6:
				p = &m.KvCacheSpecKind
			case 9:
				p = &m.Ownership
			case 10:
				p = &m.SessionId
			case 11:
				p = &m.LoraName
			case 12:
				p = &m.CacheSalt
			}
			if n, err = d.optString(b, p); err != nil {
				return fieldErr(fmt.Sprintf("field %d", num), err)
			}
		default:
			if n, err = unknown(m, num, typ, b); err != nil {
				return err
			}
		}
		b = b[n:]
	}
	if k := len(d.blockPtrs); k > blocksAt {
		if m.Blocks == nil {
			m.Blocks = d.blockPtrs[blocksAt:k:k]
		} else { // the same member seen twice in one event: merged
			m.Blocks = append(m.Blocks, d.blockPtrs[blocksAt:k]...)
		}
	}
	return nil
}

// storedBlock decodes one of a store's blocks (the store's own blocks before
// this event's start at blocksAt) and lists it.
func (d *Decoder) storedBlock(v []byte, m *kvpb.KvBlocksStored, blocksAt int) error {
	blk := d.blocks.next()
	if err := d.decodeBlock(v, blk); err != nil {
		return fmt.Errorf("blocks[%d]: %w", len(m.Blocks)+len(d.blockPtrs)-blocksAt, err)
	}
	d.blockPtrs = append(d.blockPtrs, blk)
	return nil
}

// One-byte tags of the fields every block a relay sends carries.
const (
	tagStoredBlock = 1<<3 | byte(protowire.BytesType)  // KvBlocksStored.blocks
	tagBlockHash   = 1<<3 | byte(protowire.VarintType) // KvBlock.block_hash
	tagBlockTokens = 2<<3 | byte(protowire.BytesType)  // KvBlock.token_ids, packed
	tagBlockSize   = 3<<3 | byte(protowire.VarintType) // KvBlock.block_size
	tagBlockLoraID = 4<<3 | byte(protowire.VarintType) // KvBlock.lora_id
)

func (d *Decoder) decodeBlock(b []byte, m *kvpb.KvBlock) error {
	tokensAt := len(d.tokens)
	for len(b) > 0 {
		// The fields a relay writes for every block, in the forms it writes
		// them, are read here without the general walk below (its calls and
		// checks per field were a third of a snapshot's decoding); anything
		// else, a malformed value included, falls through to it and decodes
		// or fails exactly as there.
		if len(b) >= 2 {
			switch c1 := b[1]; b[0] {
			case tagBlockHash:
				if v, n := consumeVarint64(b[1:]); n > 0 {
					m.BlockHash = int64(v)
					b = b[1+n:]
					continue
				}
			case tagBlockTokens:
				if c1 < 0x80 && int(c1) <= len(b)-2 {
					end := 2 + int(c1)
					var err error
					if d.tokens, err = appendPackedUint32(d.tokens, b[2:end]); err != nil {
						return fieldErr("token_ids", err)
					}
					b = b[end:]
					continue
				}
			case tagBlockSize:
				if c1 < 0x80 {
					m.BlockSize = int32(c1)
					b = b[2:]
					continue
				}
			case tagBlockLoraID:
				if c1 < 0x80 {
					p := d.ints.next()
					*p = int64(c1)
					m.LoraId = p
					b = b[2:]
					continue
				}
			}
		}
		num, typ, n, err := field(b)
		if err != nil {
			return err
		}
		b = b[n:]
		switch {
		case num == 2 && typ == protowire.BytesType:
			var v []byte
			if v, n, err = bytesField(b); err != nil {
				return fieldErr("token_ids", err)
			}
			if d.tokens, err = appendPackedUint32(d.tokens, v); err != nil {
				return fieldErr("token_ids", err)
			}
		case typ == protowire.VarintType && num >= 1 && num <= 5:
			var v uint64
			if v, n, err = varint(b); err != nil {
				return fieldErr(fmt.Sprintf("field %d", num), err)
			}
			switch num {
			case 1:
				m.BlockHash = int64(v)
			case 2:
				d.tokens = append(d.tokens, uint32(v))
			case 3:
				m.BlockSize = int32(v)
			case 4:
				p := d.ints.next()
				*p = int64(v)
				m.LoraId = p
			case 5:
				c := int32(v)
				m.CacheLevel = &c
			}
		case num == 6 && typ == protowire.BytesType:
			var v []byte
			if v, n, err = bytesField(b); err != nil {
				return fieldErr("extra_keys", err)
			}
			k := &kvpb.KvBlockExtraKey{}
			if err := decodeExtraKey(v, k); err != nil {
				return fmt.Errorf("extra_keys[%d]: %w", len(m.ExtraKeys), err)
			}
			m.ExtraKeys = append(m.ExtraKeys, k)
		default:
			if n, err = unknown(m, num, typ, b); err != nil {
				return err
			}
		}
		b = b[n:]
	}
	if k := len(d.tokens); k > tokensAt {
		m.TokenIds = d.tokens[tokensAt:k:k]
	}
	return nil
}

// consumeVarint64 is protowire.ConsumeVarint, reading the first eight bytes
// at once when all eight continue: a block hash with its top bit set takes
// ten (engines' hashes are uniform 64-bit values, half of them below zero as
// an int64), which ConsumeVarint reads a byte at a time, about 100
// instructions. Anything else, a malformed varint included, goes through
// ConsumeVarint.
func consumeVarint64(b []byte) (uint64, int) {
	if len(b) >= 10 {
		x := binary.LittleEndian.Uint64(b)
		if x&0x8080808080808080 == 0x8080808080808080 {
			v := x&0x7f | x>>1&(0x7f<<7) | x>>2&(0x7f<<14) | x>>3&(0x7f<<21) |
				x>>4&(0x7f<<28) | x>>5&(0x7f<<35) | x>>6&(0x7f<<42) | x>>7&(0x7f<<49)
			if c := b[8]; c < 0x80 {
				return v | uint64(c)<<56, 9
			} else if d := b[9]; d <= 1 { // a tenth byte above 1 overflows
				return v | uint64(c&0x7f)<<56 | uint64(d)<<63, 10
			}
		}
	}
	return protowire.ConsumeVarint(b)
}

// appendPackedUint32 appends the packed varints of p, each truncated to 32
// bits as proto.Unmarshal truncates them. p holds at most len(p) values, so
// the slice grows once, by what p actually holds. Token ids below 2^21 (every
// vocabulary's) take one to three bytes, which the loop reads without
// calling out; anything longer goes through protowire.
func appendPackedUint32(dst []uint32, p []byte) ([]uint32, error) {
	at := len(dst)
	if cap(dst)-at < len(p) {
		grown := make([]uint32, at, max(2*cap(dst), at+len(p)))
		copy(grown, dst)
		dst = grown
	}
	out := dst[at : at+len(p)]
	i, k := 0, 0
	// One to three bytes a value by hand (a loop that reads four bytes at
	// a time without a branch per byte measured about 17 % slower here: nine
	// tokens in ten of a 152k vocabulary take three bytes, so these
	// branches predict well).
	for ; i+3 <= len(p); k++ {
		c0 := uint32(p[i])
		if c0 < 0x80 {
			out[k] = c0
			i++
			continue
		}
		c1 := uint32(p[i+1])
		if c1 < 0x80 {
			out[k] = c0&0x7f | c1<<7
			i += 2
			continue
		}
		c2 := uint32(p[i+2])
		if c2 < 0x80 {
			out[k] = c0&0x7f | (c1&0x7f)<<7 | c2<<14
			i += 3
			continue
		}
		v, n := protowire.ConsumeVarint(p[i:])
		if n < 0 {
			return dst[:at], protowire.ParseError(n)
		}
		out[k] = uint32(v)
		i += n
	}
	for ; i < len(p); k++ {
		v, n := protowire.ConsumeVarint(p[i:])
		if n < 0 {
			return dst[:at], protowire.ParseError(n)
		}
		out[k] = uint32(v)
		i += n
	}
	return dst[:at+k], nil
}

func decodeExtraKey(b []byte, m *kvpb.KvBlockExtraKey) error {
	for len(b) > 0 {
		num, typ, n, err := field(b)
		if err != nil {
			return err
		}
		b = b[n:]
		switch {
		case num == 1 && typ == protowire.BytesType:
			var s string
			if _, n, s, err = str(b); err != nil {
				return fieldErr("text", err)
			}
			m.Key = &kvpb.KvBlockExtraKey_Text{Text: s}
		case num == 2 && typ == protowire.BytesType:
			var v []byte
			if v, n, err = bytesField(b); err != nil {
				return fieldErr("blob", err)
			}
			m.Key = &kvpb.KvBlockExtraKey_Blob{Blob: append([]byte{}, v...)}
		case num == 3 && typ == protowire.VarintType:
			var v uint64
			if v, n, err = varint(b); err != nil {
				return fieldErr("number", err)
			}
			m.Key = &kvpb.KvBlockExtraKey_Number{Number: int64(v)}
		case num == 4 && typ == protowire.BytesType:
			var v []byte
			if v, n, err = bytesField(b); err != nil {
				return fieldErr("multimodal", err)
			}
			w, ok := m.Key.(*kvpb.KvBlockExtraKey_Multimodal)
			if !ok || w.Multimodal == nil {
				w = &kvpb.KvBlockExtraKey_Multimodal{Multimodal: &kvpb.KvMultimodalKey{}}
			}
			if err := decodeMultimodal(v, w.Multimodal); err != nil {
				return fieldErr("multimodal", err)
			}
			m.Key = w
		default:
			if n, err = unknown(m, num, typ, b); err != nil {
				return err
			}
		}
		b = b[n:]
	}
	return nil
}

func decodeMultimodal(b []byte, m *kvpb.KvMultimodalKey) error {
	for len(b) > 0 {
		num, typ, n, err := field(b)
		if err != nil {
			return err
		}
		b = b[n:]
		switch {
		case num == 1 && typ == protowire.BytesType:
			if _, n, m.Identifier, err = str(b); err != nil {
				return fieldErr("identifier", err)
			}
		case num == 2 && typ == protowire.VarintType:
			var v uint64
			if v, n, err = varint(b); err != nil {
				return fieldErr("offset", err)
			}
			m.Offset = int64(v)
		default:
			if n, err = unknown(m, num, typ, b); err != nil {
				return err
			}
		}
		b = b[n:]
	}
	return nil
}

func (d *Decoder) decodeRemoved(b []byte, m *kvpb.KvBlocksRemoved) error {
	hashesAt := len(d.hashes)
	for len(b) > 0 {
		num, typ, n, err := field(b)
		if err != nil {
			return err
		}
		b = b[n:]
		switch {
		case num == 1 && typ == protowire.BytesType:
			var v []byte
			if v, n, err = bytesField(b); err != nil {
				return fieldErr("block_hashes", err)
			}
			for len(v) > 0 {
				h, k, err := varint(v)
				if err != nil {
					return fieldErr("block_hashes", err)
				}
				d.hashes = append(d.hashes, int64(h))
				v = v[k:]
			}
		case typ == protowire.VarintType && (num == 1 || num == 2 || num == 3 || num == 5 || num == 6):
			var v uint64
			if v, n, err = varint(b); err != nil {
				return fieldErr(fmt.Sprintf("field %d", num), err)
			}
			switch num {
			case 1:
				d.hashes = append(d.hashes, int64(v))
			case 2:
				c := int32(v)
				m.CacheLevel = &c
			case 3:
				t := kvpb.KvCacheTier(int32(v))
				m.Tier = &t
			case 5:
				g := uint32(v)
				m.GroupIdx = &g
			case 6:
				l := kvpb.KvCacheLocality(int32(v))
				m.Locality = &l
			}
		case typ == protowire.BytesType && (num == 4 || num == 7):
			p := &m.Medium
			if num == 7 {
				p = &m.Ownership
			}
			if n, err = d.optString(b, p); err != nil {
				return fieldErr(fmt.Sprintf("field %d", num), err)
			}
		default:
			if n, err = unknown(m, num, typ, b); err != nil {
				return err
			}
		}
		b = b[n:]
	}
	if k := len(d.hashes); k > hashesAt {
		if m.BlockHashes == nil {
			m.BlockHashes = d.hashes[hashesAt:k:k]
		} else {
			m.BlockHashes = append(m.BlockHashes, d.hashes[hashesAt:k]...)
		}
	}
	return nil
}
