package record

import (
	"encoding/binary"
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

// fieldReader reads one message's fields off its wire bytes; every reader below loops over its
// message with one. A failure (a value cut short or longer than protowire takes, a field the
// fast path leaves to proto.Unmarshal) is sticky: it moves to the end, so that the reader's
// `for r.more()` loop ends, and marks the reader failed, which the reader returns. The failing
// call returns a zero value that the reader may still store: the scratch it lands in is thrown
// away with the batch, which goes to proto.Unmarshal. So each field is one call, with no check
// of its own.
//
// The reader keeps an offset into the message rather than re-slicing it: the methods that are
// not inlined (tag, varint, bytes; too big for the compiler's budget) would store the slice's
// pointer through r, each store with a write barrier check, and a re-sliced b[n:] takes a pointer
// mask; together they made a block's varints cost about a third more instructions. at and short,
// which are inlined, read the one-byte tags and lengths of the fields every block has.
type fieldReader struct {
	b      []byte // the message's bytes
	i      int    // how many of them are read; at most len(b)
	failed bool
}

// more reports whether a field is left to read; false after a failure.
func (r *fieldReader) more() bool { return r.i < len(r.b) }

// ok reports whether every field read so far was read without failing.
func (r *fieldReader) ok() bool { return !r.failed }

// fail stops the reading: see fieldReader.
func (r *fieldReader) fail() { r.i, r.failed = len(r.b), true }

// rest is the bytes not read yet.
func (r *fieldReader) rest() []byte { return r.b[r.i:] }

// took moves past a value of n bytes and returns it; n < 0 (protowire's refusal) fails.
func (r *fieldReader) took(v uint64, n int) uint64 {
	if n < 0 {
		r.fail()
		return 0
	}
	r.i += n
	return v
}

// tag reads a field's tag (field number and wire type), one byte for field numbers below 16.
func (r *fieldReader) tag() uint64 {
	if i := r.i; uint(i) < uint(len(r.b)) && r.b[i] < 0x80 {
		r.i = i + 1
		return uint64(r.b[i])
	}
	return r.took(protowire.ConsumeVarint(r.rest()))
}

// at moves past the one-byte tag next, if it is the next byte: for fields that come in the
// order proto.Marshal writes them, read without the switch on tags.
func (r *fieldReader) at(tag byte) bool {
	if i := r.i; uint(i) < uint(len(r.b)) && r.b[i] == tag {
		r.i = i + 1
		return true
	}
	return false
}

// short reads the field next if its tag is the one byte tag and its value is length-delimited
// with a one-byte length (below 128), as bytes would; false, with nothing read, if not. It is at
// and bytes in one, small enough to be inlined, for the fields read for every block: tag and
// bytes are calls.
func (r *fieldReader) short(tag byte) ([]byte, bool) {
	b := r.rest()
	if len(b) < 2 || b[0] != tag || b[1] >= 0x80 || 2+int(b[1]) > len(b) {
		return nil, false
	}
	end := 2 + int(b[1])
	r.i += end
	return b[2:end:end], true
}

// varint reads a varint value, as protowire.ConsumeVarint does (same values, same refusals),
// with a fast way for the 9 and 10-byte varints of block hashes: their first eight bytes' 7-bit
// groups are gathered in three steps instead of a byte at a time.
func (r *fieldReader) varint() uint64 {
	b, i := r.b, r.i // indexed, not re-sliced: a slice b[i:] that may be empty costs a pointer mask
	if uint(i) < uint(len(b)) && b[i] < 0x80 {
		r.i = i + 1
		return uint64(b[i])
	}
	if len(b)-i >= 10 {
		h := b[i : i+10 : i+10]
		if x := binary.LittleEndian.Uint64(h); ^x&wordHigh == 0 { // not ending within eight bytes
			v := gather7(x)
			if c := h[8]; c < 0x80 {
				r.i = i + 9
				return v | uint64(c)<<56
			}
			if c := h[9]; c < 2 {
				r.i = i + 10
				return v | uint64(h[8]&0x7f)<<56 | uint64(c)<<63
			}
			// Longer than ten bytes: protowire refuses it.
		}
	}
	return r.took(protowire.ConsumeVarint(r.rest()))
}

// bytes reads a length-delimited value; its length is checked against what is left. The value
// aliases the message's bytes and is capped at its length. Lengths of one and two bytes (below
// 16384: blocks of up to a few thousand tokens, strings) are read here, without varint.
func (r *fieldReader) bytes() []byte {
	b, i := r.b, r.i
	var m uint64
	switch {
	case uint(i) < uint(len(b)) && b[i] < 0x80:
		m, i = uint64(b[i]), i+1
	case uint(i+1) < uint(len(b)) && b[i+1] < 0x80: // and b[i] >= 0x80
		m, i = uint64(b[i]&0x7f)|uint64(b[i+1])<<7, i+2
	default:
		m = r.varint()
		i = r.i
	}
	if m > uint64(len(b)-i) {
		r.fail()
		return nil
	}
	end := i + int(m)
	r.i = end
	return b[i:end:end]
}

// str reads a string value aliasing the batch's bytes; invalid UTF-8, which proto.Unmarshal
// refuses in a proto3 string, fails.
func (r *fieldReader) str() string {
	v := r.bytes()
	if !utf8.Valid(v) {
		r.fail()
		return ""
	}
	return unsafe.String(unsafe.SliceData(v), len(v))
}

// skipFixed64 moves past a fixed64 value.
func (r *fieldReader) skipFixed64() {
	if len(r.b)-r.i < 8 {
		r.fail()
		return
	}
	r.i += 8
}

// skipOther moves past a field that the reader's switch does not expect, of a message that
// declares the field numbers in declared: an unknown field is skipped, its value checked as
// proto.Unmarshal checks it. A declared field of another wire type (to proto, an unknown
// field), a group (which nests) or an invalid tag fails: the fast path leaves the batch to
// proto.Unmarshal.
func (r *fieldReader) skipOther(tag, declared uint64) {
	num, typ := tag>>3, protowire.Type(tag&7)
	if num < uint64(protowire.MinValidNumber) || num > uint64(protowire.MaxValidNumber) ||
		num < 64 && declared>>num&1 != 0 ||
		typ == protowire.StartGroupType || typ == protowire.EndGroupType {
		r.fail()
		return
	}
	r.took(0, protowire.ConsumeFieldValue(protowire.Number(num), typ, r.rest()))
}

// read reads enc into the scratch. false: the fast path does not read this batch exactly (or it
// is not valid protobuf); the caller falls back to proto.Unmarshal.
//
// Each reader switches on whole tags (field number and wire type) of the fields it expects: one
// byte each, as every field number below 16 takes. Anything else goes to skipOther.
func (w *wireBatch) read(enc []byte) bool {
	w.hasRank = false
	r := fieldReader{b: enc}
	for r.more() {
		switch tag := r.tag(); tag {
		case 3<<3 | wBytes: // events
			if !w.readEvent(r.bytes()) {
				return false
			}
		case 4<<3 | wVarint: // dp_rank; the last one counts
			w.rank, w.hasRank = int32(r.varint()), true
		case 1<<3 | wVarint, 17<<3 | wVarint: // sequence_number, live_blocks: not the record's
			r.varint()
		case 2<<3 | wFixed64, 16<<3 | wFixed64: // timestamp, live_digest
			r.skipFixed64()
		default: // snapshot and load (messages whose contents would need checking) among others
			r.skipOther(tag, batchFields)
		}
	}
	if !r.ok() {
		return false
	}
	if len(w.keys) > 0 {
		for _, k := range w.keyOf {
			w.blocks[k.block].extraKeys = w.keys[k.from:k.to:k.to]
		}
	}
	return true
}

// Wire types, short for the readers' tag constants.
const (
	wVarint  = 0 // protowire.VarintType
	wFixed64 = 1 // protowire.Fixed64Type
	wBytes   = 2 // protowire.BytesType
)

// The field numbers each message declares, a bit each.
const (
	batchFields   = 1<<1 | 1<<2 | 1<<3 | 1<<4 | 1<<7 | 1<<8 | 1<<16 | 1<<17
	eventFields   = 1<<5 - 2  // 1-4
	storedFields  = 1<<13 - 2 // 1-12
	blockFields   = 1<<7 - 2  // 1-6
	removedFields = 1<<8 - 2  // 1-7
	clearedFields = 1 << 1
)

// gather7 packs the low 7 bits of x's eight bytes (little endian) into 56 bits.
func gather7(x uint64) uint64 {
	x &= wordLow
	x = x&0x007f007f007f007f | x&0x7f007f007f007f00>>1
	x = x&0x00003fff00003fff | x&0x3fff00003fff0000>>2
	return x&0x000000000fffffff | x&0x0fffffff00000000>>4
}

// readEvent reads one KvCacheEvent.
func (w *wireBatch) readEvent(b []byte) bool {
	var data []byte
	kind := uint8(wireNone)
	r := fieldReader{b: b}
	for r.more() {
		switch tag := r.tag(); tag {
		case 2<<3 | wBytes, 3<<3 | wBytes, 4<<3 | wBytes: // stored, removed, cleared
			if kind != wireNone {
				return false // the oneof set twice: proto merges or replaces
			}
			data, kind = r.bytes(), uint8(tag>>3)-1 // wireStored, wireRemoved, wireCleared
		case 1<<3 | wVarint: // event_id
			r.varint()
		default:
			r.skipOther(tag, eventFields)
		}
	}
	if !r.ok() {
		return false
	}
	w.events = append(w.events, wireEvent{kind: kind})
	ev := &w.events[len(w.events)-1]
	switch kind {
	case wireStored:
		ev.from = int32(len(w.blocks))
		ok := w.readStored(data, ev)
		ev.to = int32(len(w.blocks))
		return ok
	case wireRemoved:
		ev.from = int32(len(w.hashes))
		ok := w.readRemoved(data, ev)
		ev.to = int32(len(w.hashes))
		return ok
	case wireCleared:
		return readCleared(data)
	}
	return true
}

// readStored reads one KvBlocksStored; singular fields repeated count by their last value, as
// proto.Unmarshal has it.
func (w *wireBatch) readStored(b []byte, ev *wireEvent) bool {
	k := &ev.tail
	r := fieldReader{b: b}
	for r.more() {
		if v, ok := r.short(1<<3 | wBytes); ok {
			// A block of fewer than 128 bytes (16-token blocks), the common case read inline.
			if !w.readBlock(v) {
				return false
			}
			continue
		}
		switch tag := r.tag(); tag {
		case 1<<3 | wBytes: // blocks
			if !w.readBlock(r.bytes()) {
				return false
			}
		case 2<<3 | wVarint, 3<<3 | wVarint, 5<<3 | wVarint, 7<<3 | wVarint, 8<<3 | wVarint:
			v := r.varint()
			switch tag >> 3 {
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
			}
		case 4<<3 | wBytes, 6<<3 | wBytes, 9<<3 | wBytes, 10<<3 | wBytes, 11<<3 | wBytes, 12<<3 | wBytes:
			s := r.str()
			switch tag >> 3 {
			case 4:
				k.medium, k.has = s, k.has|hasMedium
			case 6:
				k.kind, k.has = s, k.has|hasKind
			case 9:
				k.ownership, k.has = s, k.has|hasOwnership
			case 10:
				k.sessionID, k.has = s, k.has|hasSession
			case 11:
				k.loraName, k.has = s, k.has|hasLoraName
			case 12:
				k.cacheSalt, k.has = s, k.has|hasSalt
			}
		default:
			r.skipOther(tag, storedFields)
		}
	}
	return r.ok()
}

// readBlock reads one KvBlock. Its token ids are taken packed only when they are one packed field
// of minimal varints below 2^32, the bytes packing the ids writes again; anything else (one field
// per id, several fields, padded or wider varints) is left to proto.Unmarshal.
//
// The fields proto.Marshal writes (hash, tokens, block size, LoRA id, cache level, in field
// order, each once) are read straight through, without the loop's switch: every block of the
// relay's own batches ends there. Whatever is left (extra keys, unknown fields, fields out of
// order or repeated) goes on through readBlockFields, which reads any order: the straight part
// is the loop unrolled for one order, so reading on from it gives the same block.
func (w *wireBatch) readBlock(b []byte) bool {
	w.blocks = append(w.blocks, blockOp{})
	blk := &w.blocks[len(w.blocks)-1]
	r := fieldReader{b: b}
	if r.at(1<<3 | wVarint) {
		blk.hash = int64(r.varint())
	}
	if v, ok := r.short(2<<3 | wBytes); ok || r.at(2<<3|wBytes) { // token_ids, packed
		if !ok {
			v = r.bytes() // a length of two bytes or more: blocks of about 40 tokens and more
		}
		if blk.packed = v; !minimalPacked32(v) {
			return false
		}
	}
	if r.at(3<<3 | wVarint) {
		blk.blockSize = int32(r.varint())
	}
	if r.at(4<<3 | wVarint) {
		blk.loraID, blk.has = int64(r.varint()), blk.has|hasLoraID
	}
	if r.at(5<<3 | wVarint) {
		blk.cacheLevel, blk.has = int32(r.varint()), blk.has|hasCacheLevel
	}
	if r.more() {
		return w.readBlockFields(r.rest(), blk, len(w.blocks)-1)
	}
	return r.ok()
}

// setVarint sets a KvBlock varint field.
func (blk *blockOp) setVarint(field uint8, v uint64) {
	switch field {
	case 1:
		blk.hash = int64(v)
	case 3:
		blk.blockSize = int32(v)
	case 4:
		blk.loraID, blk.has = int64(v), blk.has|hasLoraID
	case 5:
		blk.cacheLevel, blk.has = int32(v), blk.has|hasCacheLevel
	}
}

// readBlockFields reads KvBlock fields in any order into blk, block i of the batch.
func (w *wireBatch) readBlockFields(b []byte, blk *blockOp, i int) bool {
	keysFrom := int32(len(w.keys))
	r := fieldReader{b: b}
	for r.more() {
		switch tag := r.tag(); tag {
		case 1<<3 | wVarint, 3<<3 | wVarint, 4<<3 | wVarint, 5<<3 | wVarint:
			blk.setVarint(uint8(tag>>3), r.varint())
		case 2<<3 | wBytes: // token_ids, packed
			if blk.packed != nil {
				return false // a second field: proto appends, the record would keep one
			}
			if blk.packed = r.bytes(); !minimalPacked32(blk.packed) {
				return false
			}
		case 6<<3 | wBytes:
			// Extra keys are rare; the record keeps them as proto.Marshal writes the message
			// (extraTable), so they are read as messages, with proto's checks.
			key := &kvpb.KvBlockExtraKey{}
			if err := proto.Unmarshal(r.bytes(), key); err != nil {
				return false
			}
			w.keys = append(w.keys, key)
		default:
			r.skipOther(tag, blockFields)
		}
	}
	if !r.ok() {
		return false
	}
	if to := int32(len(w.keys)); to > keysFrom {
		w.keyOf = append(w.keyOf, keyRange{int32(i), keysFrom, to})
	}
	return true
}

// minimalPacked32 reports whether p is packed varints each below 2^32 and in its fewest bytes (no
// 0x80 padding), the form packTokens writes. It reads p in overlapping 8-byte windows, 6 bytes
// apart, and looks, in all of them at once, for the two things that can be wrong with varints of
// up to three bytes (ids below 2^21, a whole vocabulary): a zero byte ending a longer varint
// (padding), and a third continuation byte in a row (four bytes or more). Each byte is judged in
// a window that also holds the two bytes before it; a window's first two bytes, judged as if a
// varint started there, can only be missed faults, never false ones, and the window before
// judged them whole. Only p with either (ids of 4 or 5 bytes, or not the fast path's anyway) is
// checked again a byte at a time.
func minimalPacked32(p []byte) bool {
	n := len(p)
	if n < 8 {
		return minimalPackedBytes(p)
	}
	if p[n-1] >= 0x80 {
		return false // the last varint is cut short
	}
	// The last window first: bytes past the others' are judged there.
	bad := packedFaults(binary.LittleEndian.Uint64(p[n-8:]))
	q := p
	for ; len(q) >= 14; q = q[12:] { // two windows a turn
		bad |= packedFaults(binary.LittleEndian.Uint64(q)) | packedFaults(binary.LittleEndian.Uint64(q[6:]))
	}
	if len(q) >= 8 {
		bad |= packedFaults(binary.LittleEndian.Uint64(q))
	}
	if bad != 0 {
		return minimalPackedBytes(p)
	}
	return true
}

const (
	wordHigh = 0x8080808080808080
	wordLow  = 0x7f7f7f7f7f7f7f7f
)

// packedFaults marks the bytes of window x (little endian) that are padding or a third
// continuation byte in a row, as far as the window shows.
func packedFaults(x uint64) uint64 {
	c := x & wordHigh
	c1, c2 := c<<8, c<<16 // the continuation bits of each byte's one and two predecessors
	zero := ^(x&wordLow + wordLow | x) & wordHigh
	return zero&c1 | c&c1&c2
}

// minimalPackedBytes is minimalPacked32 a byte at a time.
func minimalPackedBytes(p []byte) bool {
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
	r := fieldReader{b: b}
	for r.more() {
		switch tag := r.tag(); tag {
		case 1<<3 | wBytes: // block_hashes, packed
			hashes := fieldReader{b: r.bytes()}
			for hashes.more() {
				w.hashes = append(w.hashes, int64(hashes.varint()))
			}
			if !hashes.ok() {
				return false
			}
		case 1<<3 | wVarint, 2<<3 | wVarint, 3<<3 | wVarint, 5<<3 | wVarint, 6<<3 | wVarint:
			v := r.varint()
			switch tag >> 3 {
			case 1:
				w.hashes = append(w.hashes, int64(v))
			case 2:
				level, hasLevel = int32(v), true
			case 3:
				tier, hasTier = kvpb.KvCacheTier(int32(v)), true
			}
			// 5 group_idx, 6 locality: not the record's.
		case 4<<3 | wBytes, 7<<3 | wBytes: // medium, ownership: checked, not kept
			r.str()
		default:
			r.skipOther(tag, removedFields)
		}
	}
	ev.removalTier = tierFrom(hasTier, tier, hasLevel, level)
	return r.ok()
}

// readCleared checks one KvCacheCleared, whose only field the record does not use.
func readCleared(b []byte) bool {
	r := fieldReader{b: b}
	for r.more() {
		switch tag := r.tag(); tag {
		case 1<<3 | wBytes: // ownership: checked, not kept
			r.str()
		default:
			r.skipOther(tag, clearedFields)
		}
	}
	return r.ok()
}
