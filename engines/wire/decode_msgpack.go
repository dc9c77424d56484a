package wire

import (
	"errors"
	"fmt"
	"io"
	"math"
)

// The decoder's msgpack reader: positions, lengths checked against the
// bytes left before anything is sized by them, skipping without recursion,
// integers, hashes (ints or bytes folded) and interned strings.

func (x *decoder) pos() int { return int(x.r.Size()) - x.r.Len() }

func (x *decoder) remaining() int { return x.r.Len() }

func (x *decoder) seek(pos int) { _, _ = x.r.Seek(int64(pos), io.SeekStart) }

// undecodable wraps a structural failure with the byte offset it happened at.
func (x *decoder) undecodable(at int, format string, args ...any) error {
	return fmt.Errorf("%w: at byte %d: %s", ErrUndecodable, at, fmt.Sprintf(format, args...))
}

// structural turns an error from the msgpack library or from a guard into
// the package's error; io errors mean the payload ended early.
func (x *decoder) structural(at int, what string, err error) error {
	if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
		err = errTruncated
	}
	return x.undecodable(at, "%s: %v", what, err)
}

// peek returns the next value's msgpack code without consuming it. It reads
// the payload directly: Decoder.PeekCode costs two interface calls, and
// this runs once per value.
func (x *decoder) peek() (byte, error) {
	at := x.pos()
	if at >= len(x.p) {
		return 0, x.undecodable(at, "reading a value: %v", errTruncated)
	}
	return x.p[at], nil
}

// skip passes over one value of any shape. It is iterative, not recursive,
// so a hostile payload of deeply nested arrays cannot exhaust the stack.
func (x *decoder) skip() error {
	at := x.pos()
	end, err := skipAt(x.p, at)
	if err != nil {
		return x.structural(at, "skipping a value", err)
	}
	x.seek(end)
	return nil
}

func skipAt(p []byte, pos int) (int, error) {
	pending := 1
	for pending > 0 {
		if pos >= len(p) {
			return pos, errTruncated
		}
		c := p[pos]
		pos++
		pending--
		var body, items int
		var ok bool
		switch {
		case c <= 0x7f, c >= 0xe0, c == 0xc0, c == 0xc2, c == 0xc3:
		case c <= 0x8f:
			items = 2 * int(c&0x0f)
		case c <= 0x9f:
			items = int(c & 0x0f)
		case c <= 0xbf:
			body = int(c & 0x1f)
		case c == 0xc1:
			return pos - 1, errInvalidCode
		case c == 0xc4, c == 0xd9:
			body, pos, ok = lenAt(p, pos, 1)
		case c == 0xc5, c == 0xda:
			body, pos, ok = lenAt(p, pos, 2)
		case c == 0xc6, c == 0xdb:
			body, pos, ok = lenAt(p, pos, 4)
		case c == 0xc7:
			body, pos, ok = lenAt(p, pos, 1)
			body++
		case c == 0xc8:
			body, pos, ok = lenAt(p, pos, 2)
			body++
		case c == 0xc9:
			body, pos, ok = lenAt(p, pos, 4)
			body++
		case c == 0xca, c == 0xce, c == 0xd2:
			body = 4
		case c == 0xcb, c == 0xcf, c == 0xd3:
			body = 8
		case c == 0xcc, c == 0xd0:
			body = 1
		case c == 0xcd, c == 0xd1:
			body = 2
		case c == 0xd4:
			body = 2
		case c == 0xd5:
			body = 3
		case c == 0xd6:
			body = 5
		case c == 0xd7:
			body = 9
		case c == 0xd8:
			body = 17
		case c == 0xdc:
			items, pos, ok = lenAt(p, pos, 2)
		case c == 0xdd:
			items, pos, ok = lenAt(p, pos, 4)
		case c == 0xde:
			items, pos, ok = lenAt(p, pos, 2)
			items *= 2
		case c == 0xdf:
			items, pos, ok = lenAt(p, pos, 4)
			items *= 2
		}
		if (c >= 0xc4 && c <= 0xc9) || (c >= 0xd9 && c <= 0xdf) {
			if !ok {
				return pos, errTruncated
			}
		}
		if body > len(p)-pos {
			return pos, errTruncated
		}
		pos += body
		pending += items
		// Every pending value needs at least one byte: a count beyond what
		// is left is a lie, caught here before it can drive any work.
		if pending > len(p)-pos {
			return pos, errTruncated
		}
	}
	return pos, nil
}

// lenAt reads a big-endian length of width bytes at pos.
func lenAt(p []byte, pos, width int) (int, int, bool) {
	if width > len(p)-pos {
		return 0, pos, false
	}
	var n int
	for i := 0; i < width; i++ {
		n = n<<8 | int(p[pos+i])
	}
	return n, pos + width, true
}

// arrayLen reads an array header and checks the declared count against the
// bytes left before anyone allocates for it.
func (x *decoder) arrayLen() (int, error) {
	at := x.pos()
	// A fixarray (up to 15 elements: events, their slots, extra keys)
	// straight from the payload; the library's Decoder call costs more
	// than the rest of reading a short array.
	if at < len(x.p) && x.p[at]&0xf0 == 0x90 {
		n, left := int(x.p[at]&0x0f), len(x.p)-at-1
		if n > left {
			return 0, x.undecodable(at, "array declares %d elements, %d bytes left", n, left)
		}
		x.seek(at + 1)
		return n, nil
	}
	n, err := x.d.DecodeArrayLen()
	if err != nil {
		return 0, x.structural(at, "reading an array length", err)
	}
	if n > x.remaining() {
		return 0, x.undecodable(at, "array declares %d elements, %d bytes left", n, x.remaining())
	}
	return n, nil
}

func (x *decoder) mapLen() (int, error) {
	at := x.pos()
	if at < len(x.p) && x.p[at]&0xf0 == 0x80 { // a fixmap, as arrayLen's fixarray
		n, left := int(x.p[at]&0x0f), len(x.p)-at-1
		if n > left/2 {
			return 0, x.undecodable(at, "map declares %d entries, %d bytes left", n, left)
		}
		x.seek(at + 1)
		return n, nil
	}
	n, err := x.d.DecodeMapLen()
	if err != nil {
		return 0, x.structural(at, "reading a map length", err)
	}
	if n > x.remaining()/2 {
		return 0, x.undecodable(at, "map declares %d entries, %d bytes left", n, x.remaining())
	}
	return n, nil
}

// rawBytes reads a str or bin value and returns its bytes, aliasing the
// payload (callers copy what they keep).
func (x *decoder) rawBytes() ([]byte, error) {
	at := x.pos()
	// A fixstr (up to 31 bytes: tags, keys, media, LoRA names) straight
	// from the payload, as arrayLen reads a fixarray.
	if at < len(x.p) && x.p[at]&0xe0 == 0xa0 {
		n, start := int(x.p[at]&0x1f), at+1
		if n > len(x.p)-start {
			return nil, x.undecodable(at, "string declares %d bytes, %d left", n, len(x.p)-start)
		}
		x.seek(start + n)
		return x.p[start : start+n], nil
	}
	n, err := x.d.DecodeBytesLen()
	if err != nil {
		return nil, x.structural(at, "reading a string length", err)
	}
	if n < 0 {
		return nil, nil
	}
	start := x.pos()
	if n > len(x.p)-start {
		return nil, x.undecodable(at, "string declares %d bytes, %d left", n, len(x.p)-start)
	}
	x.seek(start + n)
	return x.p[start : start+n], nil
}

func isStr(c byte) bool { return (c >= 0xa0 && c <= 0xbf) || (c >= 0xd9 && c <= 0xdb) }
func isBin(c byte) bool { return c >= 0xc4 && c <= 0xc6 }
func isUnsignedCode(c byte) bool {
	return c <= 0x7f || (c >= 0xcc && c <= 0xcf)
}
func isSignedCode(c byte) bool { return c >= 0xe0 || (c >= 0xd0 && c <= 0xd3) }
func isIntCode(c byte) bool    { return isUnsignedCode(c) || isSignedCode(c) }
func isArray(c byte) bool      { return (c >= 0x90 && c <= 0x9f) || c == 0xdc || c == 0xdd }
func isMap(c byte) bool        { return (c >= 0x80 && c <= 0x8f) || c == 0xde || c == 0xdf }

// intValue reads any msgpack integer. neg is true for a negative value;
// otherwise u holds it (up to 2^64-1). ok is false (and the value skipped)
// for anything that is not an integer, bools included.
func (x *decoder) intValue() (u uint64, neg bool, ok bool, err error) {
	c, err := x.peek()
	if err != nil {
		return 0, false, false, err
	}
	if !isIntCode(c) {
		return 0, false, false, x.skip()
	}
	at := x.pos()
	if isUnsignedCode(c) {
		u, err = x.d.DecodeUint64()
	} else {
		var v int64
		v, err = x.d.DecodeInt64()
		u, neg = uint64(v), v < 0
	}
	if err != nil {
		return 0, false, false, x.structural(at, "reading an integer", err)
	}
	return u, neg, true, nil
}

// signed reads an integer that must fit int64 (block_size, lora_id).
func (x *decoder) signed() (int64, bool, error) {
	u, neg, ok, err := x.intValue()
	if err != nil || !ok {
		return 0, false, err
	}
	if !neg && u > math.MaxInt64 {
		return 0, false, nil
	}
	return int64(u), true, nil
}

// unsigned32 reads an integer in [0, 2^32) (group_idx, sliding window).
func (x *decoder) unsigned32() (optU32, error) {
	u, neg, ok, err := x.intValue()
	if err != nil || !ok || neg || u > math.MaxUint32 {
		return optU32{}, err
	}
	return optU32{v: uint32(u), ok: true}, nil
}

// hash folds one block hash to the proto's int64 identity (N6): an integer
// keeps its 64-bit pattern, bytes of any length keep their last eight bytes
// read big-endian. Anything else is unreadable.
func (x *decoder) hash() (int64, bool, error) {
	c, err := x.peek()
	if err != nil {
		return 0, false, err
	}
	switch {
	case c == 0xcf || c == 0xd3:
		// The common 64-bit hash, read straight from the payload.
		at := x.pos()
		if len(x.p)-at < 9 {
			return 0, false, x.undecodable(at, "hash: %v", errTruncated)
		}
		var u uint64
		for _, b := range x.p[at+1 : at+9] {
			u = u<<8 | uint64(b)
		}
		x.seek(at + 9)
		return int64(u), true, nil
	case isIntCode(c):
		u, _, _, err := x.intValue()
		return int64(u), err == nil, err
	case isBin(c):
		b, err := x.rawBytes()
		if err != nil {
			return 0, false, err
		}
		return foldBytes(b), true, nil
	}
	return 0, false, x.skip()
}

func foldBytes(b []byte) int64 {
	if len(b) > 8 {
		b = b[len(b)-8:]
	}
	var v uint64
	for _, c := range b {
		v = v<<8 | uint64(c)
	}
	return int64(v)
}

// text reads a str value; anything else (bin included, as msgspec hands
// Python bytes) is skipped and reads as absent.
func (x *decoder) text(intern bool) (optString, error) {
	c, err := x.peek()
	if err != nil {
		return optString{}, err
	}
	if !isStr(c) {
		return optString{}, x.skip()
	}
	b, err := x.rawBytes()
	if err != nil {
		return optString{}, err
	}
	if !intern {
		return optString{s: string(b), ok: true}, nil
	}
	return optString{s: x.internString(b), ok: true}, nil
}

// internString keeps one copy of the short strings every event repeats
// (media, kinds, LoRA names, salts), bounded so hostile input cannot grow it
// without limit.
func (x *decoder) internString(b []byte) string {
	// vLLM repeats a store's LoRA name in every block's extra keys: the
	// last string interned answers those without hashing it again.
	if string(b) == x.lastIntern {
		return x.lastIntern
	}
	if s, ok := x.intern[string(b)]; ok {
		x.lastIntern = s
		return s
	}
	s := string(b)
	if len(b) <= internMaxLen && len(x.intern) < internMaxEntries {
		x.intern[s] = s
	}
	x.lastIntern = s
	return s
}
