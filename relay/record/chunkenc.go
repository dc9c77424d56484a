package record

import (
	"encoding/binary"
	"math"
	"math/bits"

	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
)

// NextEncoded is Next in wire form: the chunk's KvEventBatch encoding, byte for byte what
// proto.Marshal makes of the batch Next would have built, written straight from the Cut's entries
// without the million small messages Next allocates (building and marshalling them was most of a
// 1 M-block snapshot's cost). nil once all were handed out, or once the Cut was released.
func (st *ChunkStream) NextEncoded() []byte {
	if st.c.released.Load() {
		return nil
	}
	if st.total == 0 {
		if st.emitted > 0 {
			return nil
		}
		st.emitted++
		// Only the clear: rare and tiny, so the generic encoder will do.
		b, err := proto.Marshal(st.c.emptyChunk(st.cursors, st.unknownBefore, st.timestamp))
		if err != nil {
			panic("record: encoding an empty snapshot chunk: " + err.Error()) // it has no field that can fail
		}
		return b
	}
	p := st.nextPlan()
	if p == nil {
		return nil
	}
	h := st.head(p)
	if st.enc == nil {
		st.enc = &chunkEncoder{cut: st.c, tails: map[uint32]*tailWire{}}
	}
	w := st.enc
	w.cr = p.cr
	// Size the buffer from the previous chunk: chunks of a rank hold the same number of units.
	w.buf = make([]byte, 0, max(st.lastLen+st.lastLen/8, 4096))
	w.buf = appendBatchHead(w.buf, h.seq, st.timestamp)
	if h.index == 0 {
		w.buf = append(w.buf, clearEventWire...)
	}
	st.fillEncoded(p, w)
	w.close()
	w.buf = appendBatchTail(w.buf, h)
	out := w.buf
	w.buf, w.cr, w.last = nil, nil, nil
	st.lastLen = len(out)
	st.finish(p)
	return out
}

// Field numbers and wire types of the messages a snapshot chunk is made of (proto/smg/common.proto).
// protowire.EncodeTag of each, as single bytes.
const (
	tagBatchSeq       = 1<<3 | byte(protowire.VarintType)  // KvEventBatch.sequence_number
	tagBatchTimestamp = 2<<3 | byte(protowire.Fixed64Type) // KvEventBatch.timestamp
	tagBatchEvent     = 3<<3 | byte(protowire.BytesType)   // KvEventBatch.events
	tagBatchRank      = 4<<3 | byte(protowire.VarintType)  // KvEventBatch.dp_rank
	tagBatchSnapshot  = 7<<3 | byte(protowire.BytesType)   // KvEventBatch.snapshot
	tagEventStored    = 2<<3 | byte(protowire.BytesType)   // KvCacheEvent.stored
	tagEventCleared   = 4<<3 | byte(protowire.BytesType)   // KvCacheEvent.cleared
	tagStoredBlock    = 1<<3 | byte(protowire.BytesType)   // KvBlocksStored.blocks
	tagStoredParent   = 2<<3 | byte(protowire.VarintType)  // KvBlocksStored.parent_block_hash
	tagBlockHash      = 1<<3 | byte(protowire.VarintType)  // KvBlock.block_hash
	tagBlockTokens    = 2<<3 | byte(protowire.BytesType)   // KvBlock.token_ids, packed
	tagBlockSize      = 3<<3 | byte(protowire.VarintType)  // KvBlock.block_size
	tagBlockLoraID    = 4<<3 | byte(protowire.VarintType)  // KvBlock.lora_id
	tagBlockCacheLvl  = 5<<3 | byte(protowire.VarintType)  // KvBlock.cache_level
	tagBlockExtraKey  = 6<<3 | byte(protowire.BytesType)   // KvBlock.extra_keys
)

// clearEventWire is an event holding an empty KvCacheCleared.
var clearEventWire = []byte{tagBatchEvent, 2, tagEventCleared, 0}

// appendBatchHead writes the batch fields that come before its events, leaving out zeros as
// proto3 does (a timestamp of -0 is not zero to it).
func appendBatchHead(b []byte, seq uint64, ts float64) []byte {
	if seq != 0 {
		b = append(b, tagBatchSeq)
		b = protowire.AppendVarint(b, seq)
	}
	if bits := math.Float64bits(ts); bits != 0 {
		b = append(b, tagBatchTimestamp)
		b = protowire.AppendFixed64(b, bits)
	}
	return b
}

// appendBatchTail writes the fields after the events: dp_rank (none for NoRank) and the snapshot
// marker.
func appendBatchTail(b []byte, h chunkHead) []byte {
	if h.rank != NoRank {
		b = append(b, tagBatchRank)
		b = protowire.AppendVarint(b, uint64(int64(h.rank)))
	}
	var snap [4 * (1 + binary.MaxVarintLen64)]byte
	s := snap[:0]
	for i, v := range [...]uint64{uint64(h.index), uint64(h.count), h.blocks, h.unknownBefore} {
		if v != 0 {
			s = append(s, byte(i+1)<<3|byte(protowire.VarintType))
			s = protowire.AppendVarint(s, v)
		}
	}
	b = append(b, tagBatchSnapshot)
	b = protowire.AppendVarint(b, uint64(len(s)))
	return append(b, s...)
}

// tailWire is an interned tail in wire form: the KvBlocksStored fields after the parent, and the
// KvBlock fields every block of the tail carries after its tokens.
type tailWire struct {
	stored []byte
	block  []byte
}

func newTailWire(k *tailKey) *tailWire {
	t := &tailWire{}
	// The store's own fields, through the generic encoder: once per tail, not per block.
	s := k.storedEvent()
	stored, err := proto.Marshal(s)
	if err != nil {
		panic("record: encoding a store's fields: " + err.Error()) // strings were valid UTF-8 when received
	}
	t.stored = stored
	if k.blockSize != 0 {
		t.block = append(t.block, tagBlockSize)
		t.block = protowire.AppendVarint(t.block, uint64(int64(k.blockSize)))
	}
	if k.has&hasLoraID != 0 {
		t.block = append(t.block, tagBlockLoraID)
		t.block = protowire.AppendVarint(t.block, uint64(k.loraID))
	}
	if k.has&hasCacheLevel != 0 {
		t.block = append(t.block, tagBlockCacheLvl)
		t.block = protowire.AppendVarint(t.block, uint64(int64(k.cacheLevel)))
	}
	return t
}

// eventHeadRoom is what an event's header takes when both its lengths fit in two bytes (events
// under 16 KiB, nearly all): the tag and length of the event, then of its Stored message.
const eventHeadRoom = 1 + 2 + 1 + 2

// chunkEncoder writes units into a chunk's wire form, grouping them into events exactly as
// chunkWriter does (see add).
type chunkEncoder struct {
	cut *Cut
	cr  *cutRank
	buf []byte
	// The open event: where its header room starts, its first entry (for the parent) and tail.
	evStart int
	first   *entry
	last    *entry
	tail    *tailWire
	// Wire forms of the tails met so far in this stream.
	tails    map[uint32]*tailWire
	lastTail uint32
	lastWire *tailWire
}

func (w *chunkEncoder) tailOf(id uint32) *tailWire {
	if w.lastWire != nil && w.lastTail == id {
		return w.lastWire
	}
	t, ok := w.tails[id]
	if !ok {
		t = newTailWire(w.cut.tails[id])
		w.tails[id] = t
	}
	w.lastTail, w.lastWire = id, t
	return t
}

// extraOf is an extra-key list as the KvBlock fields that carry it: the record keeps it so.
func (w *chunkEncoder) extraOf(id uint32) []byte { return w.cut.extras[id] }

// fillEncoded is fill for the encoder: the same units in the same order, handed to w.add by a
// direct call instead of through a func value, and the entry add reads gives the slot's copies
// (fill reads it again): a tenth of the encoder's instructions per block were this hand-off.
func (st *ChunkStream) fillEncoded(p *chunkPlan, w *chunkEncoder) {
	for n := uint64(0); n < p.size && st.pos < len(p.order); n++ {
		e := w.add(p.order[st.pos], st.slotCopy)
		st.done++
		st.slotCopy++
		if st.slotCopy == uint64(e.copies) {
			st.pos++
			st.slotCopy = 0
		}
	}
}

// add is chunkWriter.add in wire form; it returns the slot's entry.
func (w *chunkEncoder) add(slot uint32, copyIdx uint64) *entry {
	e := w.cr.entry(slot)
	if copyIdx > 0 || w.last == nil || e.flags&flagParent == 0 || e.parent != w.last.hash ||
		e.tier != w.last.tier || e.tail != w.last.tail {
		w.close()
		w.evStart = len(w.buf)
		w.buf = append(w.buf, make([]byte, eventHeadRoom)...)
		w.first = e
		w.tail = w.tailOf(e.tail)
	}
	w.last = e
	seg := w.cr.segs[slot>>segShift]
	w.appendBlock(seg, e, packedTokens(seg, e))
	if copyIdx > 0 {
		w.close()
	}
	return e
}

// appendBlock writes one block; toks are its token ids packed as the wire packs them (the
// record keeps them so).
func (w *chunkEncoder) appendBlock(seg *segment, e *entry, toks []byte) {
	tokBytes := len(toks)
	n := len(w.tail.block)
	if e.hash != 0 {
		n += 1 + protowire.SizeVarint(uint64(e.hash))
	}
	if len(toks) > 0 {
		n += 1 + protowire.SizeVarint(uint64(tokBytes)) + tokBytes
	}
	var extra []byte
	if e.flags&flagExtra != 0 {
		extra = w.extraOf(seg.extraOf(e))
		n += len(extra)
	}
	// Room for the whole block at once, then plain stores: append's capacity check per byte was
	// most of the encoding's time.
	need := 1 + protowire.SizeVarint(uint64(n)) + n
	if cap(w.buf)-len(w.buf) < need {
		w.buf = append(w.buf[:cap(w.buf)], make([]byte, max(need, cap(w.buf)/2))...)[:len(w.buf)]
	}
	i := len(w.buf)
	// w.buf is resliced in place, here and at the end: storing another slice into it would be a
	// pointer write, with the collector's write barrier while it marks.
	w.buf = w.buf[:i+need]
	b := w.buf
	b[i] = tagStoredBlock
	i = putVarint(b, i+1, uint64(n))
	if e.hash != 0 {
		b[i] = tagBlockHash
		i = putVarint(b, i+1, uint64(e.hash))
	}
	if len(toks) > 0 {
		b[i] = tagBlockTokens
		i = putVarint(b, i+1, uint64(tokBytes))
		i += copy(b[i:], toks)
	}
	if tb := w.tail.block; len(tb) <= 8 {
		// A few bytes (block_size, lora_id, cache_level): a call of memmove costs more.
		for _, c := range tb {
			b[i] = c
			i++
		}
	} else {
		i += copy(b[i:], tb)
	}
	if len(extra) > 0 {
		i += copy(b[i:], extra)
	}
	w.buf = w.buf[:i]
}

// packedTokens is seg.tokensOf(e) for a snapshot's reader: a record's length takes one byte
// when its tokens take under 128 (16 tokens of any vocabulary do), read here without the
// general varint loop of segment.record, which was a tenth of the snapshot's ordering and
// encoding (each reads every live record once).
func packedTokens(seg *segment, e *entry) []byte {
	off := int(e.tokOff)
	if n := int(seg.tokens[off]); n < 0x80 {
		return seg.tokens[off+1 : off+1+n : off+1+n]
	}
	return seg.tokensOf(e)
}

// putVarint writes v at b[i:], which has room, and returns the index after it.
func putVarint(b []byte, i int, v uint64) int {
	for v >= 0x80 {
		b[i] = byte(v) | 0x80
		v >>= 7
		i++
	}
	b[i] = byte(v)
	return i + 1
}

// close ends the open event: the Stored message's parent and tail fields, then the two lengths
// in front, moving the body when they do not take exactly eventHeadRoom bytes.
func (w *chunkEncoder) close() {
	if w.first == nil {
		return
	}
	if w.first.flags&flagParent != 0 {
		w.buf = append(w.buf, tagStoredParent)
		w.buf = protowire.AppendVarint(w.buf, uint64(w.first.parent))
	}
	w.buf = append(w.buf, w.tail.stored...)
	body := w.evStart + eventHeadRoom
	storedLen := len(w.buf) - body
	eventLen := 1 + protowire.SizeVarint(uint64(storedLen)) + storedLen
	head := 1 + protowire.SizeVarint(uint64(eventLen)) + 1 + protowire.SizeVarint(uint64(storedLen))
	if head != eventHeadRoom {
		end := w.evStart + head + storedLen
		if end > len(w.buf) {
			w.buf = append(w.buf, make([]byte, end-len(w.buf))...)
		}
		copy(w.buf[w.evStart+head:end], w.buf[body:body+storedLen])
		w.buf = w.buf[:end]
	}
	h := w.buf[w.evStart : w.evStart : w.evStart+head]
	h = append(h, tagBatchEvent)
	h = protowire.AppendVarint(h, uint64(eventLen))
	h = append(h, tagEventStored)
	_ = protowire.AppendVarint(h, uint64(storedLen))
	w.first, w.last, w.tail = nil, nil, nil
}

// varintLen32 is protowire.SizeVarint for a token id, without the 64-bit arithmetic.
func varintLen32(v uint32) int {
	return int(9*uint32(bits.Len32(v|1))+64) / 64
}
