package kvdec

// The wire primitives every message's field loop uses: tags, varints,
// length-delimited fields, unknown fields kept or skipped, packed ids.

import (
	"encoding/binary"
	"fmt"
	"unicode/utf8"

	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/reflect/protoreflect"
)

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
