package record

import (
	"fmt"
	"unicode/utf8"
	"unsafe"

	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	"github.com/kvrelay/kvrelay/proto/kvpb"
)

// Applied is what ApplyEncoded did with a batch.
type Applied struct {
	// Reannounced are the indexes of the stored events taken for report-mode re-announcements,
	// as Apply returns them.
	Reannounced []int
	// Events is the batch's events; StoredBlocks the blocks its stored events list
	// (re-announcements included), for the relay's metrics.
	Events, StoredBlocks int
	// Unmarshalled: the fast path did not read the batch, which went through proto.Unmarshal
	// and Apply (never for the relay's own bytes; worth a metric if it ever happens).
	Unmarshalled bool
}

// ApplyEncoded folds one batch given as the protobuf wire bytes of a KvEventBatch into the
// record. For every enc that proto.Unmarshal accepts, it leaves the record as Apply of the
// unmarshalled batch would, and returns the same re-announced indexes. For enc that
// proto.Unmarshal refuses, it returns an error wrapping proto's and leaves the record unchanged.
//
// Why: the relay encodes its batches straight from the engine's payload (wire.Normalizer's
// AppendNormalized) without building messages, and the record can take a stored block's token
// ids in their packed form, as the arena keeps them, instead of unpacking and packing them again.
//
// The fast path reads batches written as proto.Marshal writes them (the relay's own): it reads
// the whole batch into reused scratch first, checking what proto.Unmarshal checks, and only then
// changes the record. Any batch it does not read exactly (a singular message field split in two,
// a oneof set twice, token ids that are not packed or not packed minimally, a group, a snapshot
// or load field, a field of the wrong wire type) goes through proto.Unmarshal and Apply instead,
// as does every batch that proto.Unmarshal would refuse, so that its error is proto's.
func (r *Record) ApplyEncoded(enc []byte) (Applied, error) {
	w := &r.wire
	defer w.release()
	if !w.read(enc) {
		return r.applyUnmarshalled(enc)
	}
	if !r.shared() {
		r.tails.settle()
		r.extras.settle()
	}
	rank := NoRank
	if w.hasRank {
		rank = w.rank
	}
	a := Applied{Events: len(w.events)}
	for i := range w.events {
		ev := &w.events[i]
		switch ev.kind {
		case wireStored:
			op := storeOp{
				tail: ev.tail, parent: ev.parent, hasParent: ev.hasParent, borrowed: true,
				blocks: w.blocks[ev.from:ev.to], listed: int(ev.to - ev.from),
			}
			a.StoredBlocks += op.listed
			if r.applyStore(rank, &op) {
				a.Reannounced = append(a.Reannounced, i)
			}
		case wireRemoved:
			r.remove(rank, ev.removalTier, w.hashes[ev.from:ev.to])
		case wireCleared:
			r.dropRank(rank)
			r.cleared++
		}
	}
	return a, nil
}

// applyUnmarshalled is ApplyEncoded's way for batches its fast path does not read.
func (r *Record) applyUnmarshalled(enc []byte) (Applied, error) {
	var b kvpb.KvEventBatch
	if err := proto.Unmarshal(enc, &b); err != nil {
		return Applied{}, fmt.Errorf("record: decoding an encoded batch of %d bytes: %w", len(enc), err)
	}
	a := Applied{Events: len(b.Events), Unmarshalled: true}
	for _, ev := range b.Events {
		a.StoredBlocks += len(ev.GetStored().GetBlocks())
	}
	a.Reannounced = r.Apply(&b)
	return a, nil
}

// Kinds of wireEvent.
const (
	wireNone = iota // an event with no data: applied as nothing, like Apply does
	wireStored
	wireRemoved
	wireCleared
)

// wireEvent is one event of a read batch. A store's blocks are wireBatch.blocks[from:to], a
// removal's hashes wireBatch.hashes[from:to].
type wireEvent struct {
	kind        uint8
	removalTier uint8
	hasParent   bool
	parent      int64
	from, to    int32
	tail        tailKey // a store's own fields; strings alias the batch's bytes
}

// wireBatch is ApplyEncoded's reused reading of one batch. Every slice grows by what the batch
// holds, never by a length it declares.
type wireBatch struct {
	rank    int32
	hasRank bool
	events  []wireEvent
	blocks  []blockOp
	hashes  []int64
	keys    []*kvpb.KvBlockExtraKey
	keyOf   []keyRange // per block with extra keys, where its keys sit in keys
}

type keyRange struct{ block, from, to int32 }

// maxKeptScratch bounds the blocks and hashes a wireBatch keeps between batches: one huge batch
// should not pin its scratch for ever.
const maxKeptScratch = 1 << 16

// release drops what the scratch holds of the last batch: its bytes (tokens, strings) and extra
// keys must not stay reachable from the record.
func (w *wireBatch) release() {
	clear(w.events)
	clear(w.blocks)
	clear(w.keys)
	w.events, w.blocks, w.hashes, w.keys, w.keyOf = w.events[:0], w.blocks[:0], w.hashes[:0], w.keys[:0], w.keyOf[:0]
	if cap(w.blocks) > maxKeptScratch {
		w.blocks = nil
	}
	if cap(w.hashes) > maxKeptScratch {
		w.hashes = nil
	}
	if cap(w.events) > maxKeptScratch {
		w.events = nil
	}
}

// read reads enc into the scratch. false: the fast path does not read this batch exactly (or it
// is not valid protobuf); the caller falls back to proto.Unmarshal.
func (w *wireBatch) read(enc []byte) bool {
	w.hasRank = false
	b := enc
	for len(b) > 0 {
		num, typ, n := consumeTag(b)
		if n < 0 {
			return false
		}
		b = b[n:]
		switch {
		case num == 3 && typ == protowire.BytesType: // events
			v, n := protowire.ConsumeBytes(b)
			if n < 0 || !w.readEvent(v) {
				return false
			}
			b = b[n:]
		case num == 4 && typ == protowire.VarintType: // dp_rank; the last one counts
			v, n := protowire.ConsumeVarint(b)
			if n < 0 {
				return false
			}
			w.rank, w.hasRank = int32(v), true
			b = b[n:]
		case num == 1 && typ == protowire.VarintType, num == 2 && typ == protowire.Fixed64Type,
			num == 16 && typ == protowire.Fixed64Type, num == 17 && typ == protowire.VarintType:
			// sequence_number, timestamp, live_digest, live_blocks: not the record's.
			if b, n = skipValue(num, typ, b); n < 0 {
				return false
			}
		case isKnown(num, batchFields):
			return false // snapshot, load (messages whose contents would need checking), a wrong wire type
		default:
			if b, n = skipValue(num, typ, b); n < 0 {
				return false
			}
		}
	}
	if len(w.keys) > 0 {
		for _, k := range w.keyOf {
			w.blocks[k.block].extraKeys = w.keys[k.from:k.to:k.to]
		}
	}
	return true
}

// Field numbers each message declares: a declared field of an unexpected wire type is, to
// proto.Unmarshal, an unknown field; the fast path leaves such batches to it.
var (
	batchFields   = []protowire.Number{1, 2, 3, 4, 7, 8, 16, 17}
	eventFields   = []protowire.Number{1, 2, 3, 4}
	storedFields  = []protowire.Number{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12}
	blockFields   = []protowire.Number{1, 2, 3, 4, 5, 6}
	removedFields = []protowire.Number{1, 2, 3, 4, 5, 6, 7}
	clearedFields = []protowire.Number{1}
)

func isKnown(num protowire.Number, fields []protowire.Number) bool {
	for _, f := range fields {
		if f == num {
			return true
		}
	}
	return false
}

// consumeTag is protowire.ConsumeTag with proto.Unmarshal's bound on field numbers.
func consumeTag(b []byte) (protowire.Number, protowire.Type, int) {
	num, typ, n := protowire.ConsumeTag(b)
	if n < 0 || num > protowire.MaxValidNumber {
		return 0, 0, -1
	}
	return num, typ, n
}

// skipValue skips an unknown field's value; groups (which nest) are left to proto.Unmarshal.
func skipValue(num protowire.Number, typ protowire.Type, b []byte) ([]byte, int) {
	if typ == protowire.StartGroupType || typ == protowire.EndGroupType {
		return b, -1
	}
	n := protowire.ConsumeFieldValue(num, typ, b)
	if n < 0 {
		return b, n
	}
	return b[n:], n
}

// readEvent reads one KvCacheEvent.
func (w *wireBatch) readEvent(b []byte) bool {
	var data []byte
	kind := uint8(wireNone)
	for len(b) > 0 {
		num, typ, n := consumeTag(b)
		if n < 0 {
			return false
		}
		b = b[n:]
		switch {
		case num >= 2 && num <= 4 && typ == protowire.BytesType:
			if kind != wireNone {
				return false // the oneof set twice: proto merges or replaces
			}
			v, n := protowire.ConsumeBytes(b)
			if n < 0 {
				return false
			}
			data, b = v, b[n:]
			kind = [...]uint8{2: wireStored, 3: wireRemoved, 4: wireCleared}[num]
		case num == 1 && typ == protowire.VarintType: // event_id
			if b, n = skipValue(num, typ, b); n < 0 {
				return false
			}
		case isKnown(num, eventFields):
			return false
		default:
			if b, n = skipValue(num, typ, b); n < 0 {
				return false
			}
		}
	}
	ev := wireEvent{kind: kind}
	ok := true
	switch kind {
	case wireStored:
		ev.from = int32(len(w.blocks))
		ok = w.readStored(data, &ev)
		ev.to = int32(len(w.blocks))
	case wireRemoved:
		ev.from = int32(len(w.hashes))
		ok = w.readRemoved(data, &ev)
		ev.to = int32(len(w.hashes))
	case wireCleared:
		ok = readCleared(data)
	}
	w.events = append(w.events, ev)
	return ok
}

// str is a string field's value aliasing the batch's bytes; ok is false for invalid UTF-8,
// which proto.Unmarshal refuses in a proto3 string.
func str(v []byte) (string, bool) {
	if !utf8.Valid(v) {
		return "", false
	}
	return unsafe.String(unsafe.SliceData(v), len(v)), true
}

// readStored reads one KvBlocksStored; singular fields repeated count by their last value, as
// proto.Unmarshal has it.
func (w *wireBatch) readStored(b []byte, ev *wireEvent) bool {
	k := &ev.tail
	for len(b) > 0 {
		num, typ, n := consumeTag(b)
		if n < 0 {
			return false
		}
		b = b[n:]
		switch typ {
		case protowire.BytesType:
			v, n := protowire.ConsumeBytes(b)
			if n < 0 {
				return false
			}
			b = b[n:]
			if num == 1 {
				if !w.readBlock(v) {
					return false
				}
				continue
			}
			var dst *string
			var bit uint16
			switch num {
			case 4:
				dst, bit = &k.medium, hasMedium
			case 6:
				dst, bit = &k.kind, hasKind
			case 9:
				dst, bit = &k.ownership, hasOwnership
			case 10:
				dst, bit = &k.sessionID, hasSession
			case 11:
				dst, bit = &k.loraName, hasLoraName
			case 12:
				dst, bit = &k.cacheSalt, hasSalt
			default:
				if isKnown(num, storedFields) {
					return false
				}
				continue // unknown
			}
			s, ok := str(v)
			if !ok {
				return false
			}
			*dst = s
			k.has |= bit
		case protowire.VarintType:
			v, n := protowire.ConsumeVarint(b)
			if n < 0 {
				return false
			}
			b = b[n:]
			switch num {
			case 2:
				ev.parent, ev.hasParent = int64(v), true
			case 3:
				k.tier, k.has = kvpb.KvCacheTier(int32(v)), k.has|hasTier
			case 5:
				k.groupIdx, k.has = uint32(v), k.has|hasGroup
			case 7:
				k.slidingWindow, k.has = uint32(v), k.has|hasWindow
			case 8:
				k.locality, k.has = kvpb.KvCacheLocality(int32(v)), k.has|hasLocality
			default:
				if isKnown(num, storedFields) {
					return false
				}
			}
		default:
			if isKnown(num, storedFields) {
				return false
			}
			if b, n = skipValue(num, typ, b); n < 0 {
				return false
			}
		}
	}
	return true
}

// readBlock reads one KvBlock. Its token ids are taken packed only when they are one packed field
// of minimal varints below 2^32, the bytes packing the ids writes again; anything else (one field
// per id, several fields, padded or wider varints) is left to proto.Unmarshal.
func (w *wireBatch) readBlock(b []byte) bool {
	blk := blockOp{}
	sawTokens := false
	keysFrom := int32(len(w.keys))
	for len(b) > 0 {
		num, typ, n := consumeTag(b)
		if n < 0 {
			return false
		}
		b = b[n:]
		switch {
		case num == 2 && typ == protowire.BytesType:
			v, n := protowire.ConsumeBytes(b)
			if n < 0 || sawTokens || !minimalPacked32(v) {
				return false
			}
			sawTokens = true
			blk.packed = v[:len(v):len(v)]
			b = b[n:]
		case num == 6 && typ == protowire.BytesType:
			v, n := protowire.ConsumeBytes(b)
			if n < 0 {
				return false
			}
			b = b[n:]
			// Extra keys are rare; the record keeps them as proto.Marshal writes the message
			// (extraTable), so they are read as messages, with proto's checks.
			key := &kvpb.KvBlockExtraKey{}
			if err := proto.Unmarshal(v, key); err != nil {
				return false
			}
			w.keys = append(w.keys, key)
		case typ == protowire.VarintType && num != 2 && num != 6 && isKnown(num, blockFields):
			v, n := protowire.ConsumeVarint(b)
			if n < 0 {
				return false
			}
			b = b[n:]
			switch num {
			case 1:
				blk.hash = int64(v)
			case 3:
				blk.blockSize = int32(v)
			case 4:
				blk.loraID, blk.has = int64(v), blk.has|hasLoraID
			case 5:
				blk.cacheLevel, blk.has = int32(v), blk.has|hasCacheLevel
			}
		case isKnown(num, blockFields):
			return false
		default:
			if b, n = skipValue(num, typ, b); n < 0 {
				return false
			}
		}
	}
	if to := int32(len(w.keys)); to > keysFrom {
		w.keyOf = append(w.keyOf, keyRange{int32(len(w.blocks)), keysFrom, to})
	}
	w.blocks = append(w.blocks, blk)
	return true
}

// minimalPacked32 reports whether p is packed varints each below 2^32 and in its fewest bytes (no
// 0x80 padding), the form packTokens writes.
func minimalPacked32(p []byte) bool {
	n := 0 // bytes of the varint being read
	for _, c := range p {
		n++
		if c < 0x80 {
			if n > 1 && c == 0 || n > 5 || n == 5 && c > 0x0f {
				return false
			}
			n = 0
		}
	}
	return n == 0
}

// readRemoved reads one KvBlocksRemoved; block hashes may come packed or one field each, as
// proto.Unmarshal takes them.
func (w *wireBatch) readRemoved(b []byte, ev *wireEvent) bool {
	var tier kvpb.KvCacheTier
	var level int32
	hasTier, hasLevel := false, false
	for len(b) > 0 {
		num, typ, n := consumeTag(b)
		if n < 0 {
			return false
		}
		b = b[n:]
		switch {
		case num == 1 && typ == protowire.BytesType:
			v, n := protowire.ConsumeBytes(b)
			if n < 0 {
				return false
			}
			b = b[n:]
			for len(v) > 0 {
				h, n := protowire.ConsumeVarint(v)
				if n < 0 {
					return false
				}
				w.hashes = append(w.hashes, int64(h))
				v = v[n:]
			}
		case typ == protowire.VarintType && isKnown(num, removedFields) && num != 4 && num != 7:
			v, n := protowire.ConsumeVarint(b)
			if n < 0 {
				return false
			}
			b = b[n:]
			switch num {
			case 1:
				w.hashes = append(w.hashes, int64(v))
			case 2:
				level, hasLevel = int32(v), true
			case 3:
				tier, hasTier = kvpb.KvCacheTier(int32(v)), true
			}
			// 5 group_idx, 6 locality: not the record's.
		case (num == 4 || num == 7) && typ == protowire.BytesType: // medium, ownership
			v, n := protowire.ConsumeBytes(b)
			if n < 0 || !utf8.Valid(v) {
				return false
			}
			b = b[n:]
		case isKnown(num, removedFields):
			return false
		default:
			if b, n = skipValue(num, typ, b); n < 0 {
				return false
			}
		}
	}
	ev.removalTier = tierFrom(hasTier, tier, hasLevel, level)
	return true
}

// readCleared checks one KvCacheCleared, whose only field the record does not use.
func readCleared(b []byte) bool {
	for len(b) > 0 {
		num, typ, n := consumeTag(b)
		if n < 0 {
			return false
		}
		b = b[n:]
		switch {
		case num == 1 && typ == protowire.BytesType: // ownership
			v, n := protowire.ConsumeBytes(b)
			if n < 0 || !utf8.Valid(v) {
				return false
			}
			b = b[n:]
		case num == 1:
			return false
		default:
			if b, n = skipValue(num, typ, b); n < 0 {
				return false
			}
		}
	}
	return true
}
