package wire

import (
	"bytes"
	"encoding/binary"
	"math"
)

// The lists inside an event: block hashes, token ids (flat or per block)
// and vLLM's per-block extra_keys.

func (x *decoder) hashList() (off, n int, ok bool, err error) {
	c, err := x.peek()
	if err != nil {
		return 0, 0, false, err
	}
	if !isArray(c) {
		return 0, 0, false, x.skip()
	}
	count, err := x.arrayLen()
	if err != nil {
		return 0, 0, false, err
	}
	off = len(x.hashes)
	ok = true
	p, pos := x.p, x.pos()
	for i := 0; i < count; i++ {
		// The common 64-bit hash, straight from the payload; every other
		// form goes through hash.
		if q := p[pos:]; len(q) >= 9 && (q[0] == 0xcf || q[0] == 0xd3) {
			if ok {
				x.hashes = append(x.hashes, int64(binary.BigEndian.Uint64(q[1:9])))
			}
			pos += 9
			continue
		}
		x.seek(pos)
		v, good, err := x.hash()
		pos = x.pos()
		if err != nil {
			return 0, 0, false, err
		}
		if !good {
			ok = false
			continue
		}
		if ok {
			x.hashes = append(x.hashes, v)
		}
	}
	x.seek(pos)
	if !ok {
		x.hashes = x.hashes[:off]
		return 0, 0, false, nil
	}
	return off, count, true, nil
}

// tokenList reads token_ids (N7): every cell a uint32, or every cell a
// [u32, u32] bigram folded to its first word. It walks the payload bytes
// directly: this loop is most of the decoding work, and the generic
// Decoder calls cost several times more per token.
func (x *decoder) tokenList() (off, n int, bigram, ok bool, err error) {
	c, err := x.peek()
	if err != nil {
		return 0, 0, false, false, err
	}
	if !isArray(c) {
		return 0, 0, false, false, x.skip()
	}
	count, err := x.arrayLen()
	if err != nil {
		return 0, 0, false, false, err
	}
	off = len(x.tokens)
	if cap(x.tokens)-off < count {
		grown := make([]uint32, off, 2*cap(x.tokens)+count)
		copy(grown, x.tokens)
		x.tokens = grown
	}
	out := x.tokens[off : off+count]
	p := x.p
	pos := x.pos()
	ok = true
	// Every cell that is not a pair and not bad is plain, so the mix check
	// needs only the pairs counted.
	pairs := 0
	for i := range out {
		// A uint16 or uint32 cell, most ids of a real vocabulary and about
		// evenly split between the two: one branch for both, the value and
		// width then computed from the code (0xcd or 0xce) without a
		// branch on which, as that branch mispredicts on about every other
		// id. Four bytes are read either way, so this needs five left.
		if q := p[pos:]; len(q) >= 5 && q[0]-0xcd <= 1 {
			ce := int(q[0] - 0xcd) // 0 for uint16, 1 for uint32
			out[i] = binary.BigEndian.Uint32(q[1:5]) >> (16 - 16*ce)
			pos += 3 + 2*ce
			continue
		}
		// The other widths token ids use, inline; everything else below.
		if pos < len(p) {
			switch c := p[pos]; {
			case c <= 0x7f:
				out[i] = uint32(c)
				pos++
				continue
			case c == 0xcd:
				if q := p[pos:]; len(q) >= 3 {
					out[i] = uint32(q[1])<<8 | uint32(q[2])
					pos += 3
					continue
				}
			case c == 0xce:
				if q := p[pos:]; len(q) >= 5 {
					out[i] = binary.BigEndian.Uint32(q[1:5])
					pos += 5
					continue
				}
			}
		}
		if pos >= len(p) {
			return 0, 0, false, false, x.undecodable(pos, "token_ids: %v", errTruncated)
		}
		c := p[pos]
		if c == 0x92 {
			first, next, good, gerr := uint32At(p, pos+1)
			if gerr == nil && good {
				_, next2, good2, gerr2 := uint32At(p, next)
				if gerr2 == nil {
					if good2 {
						out[i] = first
						pairs++
						pos = next2
						continue
					}
				}
			}
			// fall through to the generic skip below
		} else {
			v, next, good, gerr := uint32At(p, pos)
			if gerr == nil && good {
				out[i] = v
				pos = next
				continue
			}
		}
		ok = false
		end, serr := skipAt(p, pos)
		if serr != nil {
			return 0, 0, false, false, x.undecodable(pos, "token_ids: %v", serr)
		}
		pos = end
	}
	x.seek(pos)
	if !ok || (pairs > 0 && pairs < count) {
		return 0, 0, false, false, nil
	}
	x.tokens = x.tokens[:off+count]
	return off, count, pairs > 0, true, nil
}

// uint32At reads an integer cell at pos. good is false for a value that is
// not an integer in [0, 2^32); err reports a truncated cell.
func uint32At(p []byte, pos int) (v uint32, next int, good bool, err error) {
	if pos >= len(p) {
		return 0, pos, false, errTruncated
	}
	c := p[pos]
	var width int
	signed := false
	switch {
	case c <= 0x7f:
		return uint32(c), pos + 1, true, nil
	case c >= 0xe0:
		return 0, pos + 1, false, nil
	case c == 0xcc:
		width = 1
	case c == 0xcd:
		width = 2
	case c == 0xce:
		width = 4
	case c == 0xcf:
		width = 8
	case c == 0xd0:
		width, signed = 1, true
	case c == 0xd1:
		width, signed = 2, true
	case c == 0xd2:
		width, signed = 4, true
	case c == 0xd3:
		width, signed = 8, true
	default:
		return 0, pos, false, nil
	}
	if width > len(p)-pos-1 {
		return 0, pos, false, errTruncated
	}
	var u uint64
	for i := 1; i <= width; i++ {
		u = u<<8 | uint64(p[pos+i])
	}
	next = pos + 1 + width
	if signed && p[pos+1]&0x80 != 0 {
		return 0, next, false, nil
	}
	if u > math.MaxUint32 {
		return 0, next, false, nil
	}
	return uint32(u), next, true, nil
}

// extraKeys reads vLLM's per-block extra_keys (N9). A value that is not a
// list reads as absent; a block entry that is not a list gives that block
// none.
func (x *decoder) extraKeys() ([][]extraKey, error) {
	c, err := x.peek()
	if err != nil {
		return nil, err
	}
	if !isArray(c) {
		return nil, x.skip()
	}
	n, err := x.arrayLen()
	if err != nil {
		return nil, err
	}
	// The keys and the per-block lists live in the decoder's slabs, reused
	// batch after batch (vLLM puts a LoRA name on every block of an
	// adapter's store: two allocations a block were most of a vLLM batch's
	// decoding allocations). A slab that grows leaves earlier lists
	// pointing at its old array, whose contents never change.
	start := len(x.keyLists)
	present := false
	// lastRaw is the previous block's list as msgpack bytes. A block whose
	// next bytes repeat them holds the same list (a msgpack value ends
	// where its bytes say, so equal leading bytes are an equal value), and
	// vLLM repeats a LoRA store's list on every block: it gets the
	// previous block's keys, not a parse of its own.
	var lastRaw []byte
	for i := 0; i < n; i++ {
		at := x.pos()
		if len(lastRaw) > 0 && len(x.p)-at >= len(lastRaw) && bytes.Equal(x.p[at:at+len(lastRaw)], lastRaw) {
			x.seek(at + len(lastRaw))
			x.keyLists = append(x.keyLists, x.keyLists[len(x.keyLists)-1])
			continue
		}
		c, err := x.peek()
		if err != nil {
			return nil, err
		}
		if !isArray(c) {
			if err := x.skip(); err != nil {
				return nil, err
			}
			x.keyLists = append(x.keyLists, nil)
			lastRaw = nil
			continue
		}
		items, err := x.arrayLen()
		if err != nil {
			return nil, err
		}
		present = true
		off := len(x.keys)
		shareable := true // a blob is copied per block: callers own each
		for j := 0; j < items; j++ {
			key, ok, err := x.extraKey()
			if err != nil {
				return nil, err
			}
			if ok {
				x.keys = append(x.keys, key)
				shareable = shareable && key.kind != extraBlob
			}
		}
		x.keyLists = append(x.keyLists, x.keys[off:len(x.keys):len(x.keys)])
		lastRaw = nil
		if shareable {
			lastRaw = x.p[at:x.pos()]
		}
	}
	if !present {
		// Absent, or every block said nil: nothing to carry.
		x.keyLists = x.keyLists[:start]
		return nil, nil
	}
	return x.keyLists[start:len(x.keyLists):len(x.keyLists)], nil
}

// extraKey reads one item: text, an int64, bytes, or [text, int] as a
// multimodal key. Other shapes (bools, floats, maps, nil) are not modelled
// and dropped, as both smg relays do in the end.
func (x *decoder) extraKey() (extraKey, bool, error) {
	c, err := x.peek()
	if err != nil {
		return extraKey{}, false, err
	}
	switch {
	case isStr(c):
		s, err := x.text(true)
		return extraKey{kind: extraText, text: s.s}, err == nil, err
	case isIntCode(c):
		v, ok, err := x.signed()
		return extraKey{kind: extraNumber, num: v}, ok, err
	case isBin(c):
		b, err := x.rawBytes()
		if err != nil {
			return extraKey{}, false, err
		}
		return extraKey{kind: extraBlob, blob: bytes.Clone(b)}, true, nil
	case c == 0x92:
		start := x.pos()
		if _, err := x.arrayLen(); err != nil {
			return extraKey{}, false, err
		}
		c, err := x.peek()
		if err != nil {
			return extraKey{}, false, err
		}
		if isStr(c) {
			id, err := x.text(true)
			if err != nil {
				return extraKey{}, false, err
			}
			u, neg, ok, err := x.intValue()
			if err != nil {
				return extraKey{}, false, err
			}
			if ok {
				offset := int64(u)
				if !neg && u > math.MaxInt64 {
					offset = math.MaxInt64 // as the Rust relay clamps it
				}
				return extraKey{kind: extraMultimodal, text: id.s, num: offset}, true, nil
			}
			return extraKey{}, false, nil
		}
		x.seek(start)
	}
	return extraKey{}, false, x.skip()
}

// mapKey reads one map key. A key that is not a string cannot name a field:
// it is skipped with its value, and ok is false.
func (x *decoder) mapKey() (key []byte, ok bool, err error) {
	c, err := x.peek()
	if err != nil {
		return nil, false, err
	}
	if !isStr(c) {
		if err := x.skip(); err != nil {
			return nil, false, err
		}
		return nil, false, x.skip()
	}
	key, err = x.rawBytes()
	return key, err == nil, err
}
