package wire

import (
	"errors"
	"runtime/debug"
	"testing"
)

// hostileBatch builds a payload from a few fuzzer-chosen numbers: depth
// nested arrays or maps in one of the places a decoder walks (the envelope's
// timestamp, an event, an event's field, its extra keys), or a header that
// declares declared elements or bytes that never follow. tail ends it.
func hostileBatch(shape uint8, depth, declared uint32, tail []byte) []byte {
	depth %= 1 << 22
	var b []byte
	nest := func(code byte) {
		for i := uint32(0); i < depth; i++ {
			b = append(b, code)
			if code == 0x81 {
				b = append(b, 0xa1, 'k')
			}
		}
		b = append(b, 0x00)
	}
	header := func(code byte) {
		b = append(b, code, byte(declared>>24), byte(declared>>16), byte(declared>>8), byte(declared))
	}
	switch shape % 8 {
	case 0: // [ts nested, []]
		b = append(b, 0x92)
		nest(0x91)
		b = append(b, 0x90)
	case 1: // [ts, [nested]]
		b = append(b, 0x92, 0x00, 0x91)
		nest(0x91)
	case 2: // [ts, [["BlockStored", nested hashes...]]]
		b = append(b, 0x92, 0x00, 0x91, 0x95, 0xab)
		b = append(b, "BlockStored"...)
		nest(0x91)
	case 3: // [ts, [{"type": "BlockRemoved", "x": nested maps}]]
		b = append(b, 0x92, 0x00, 0x91, 0x82, 0xa4, 't', 'y', 'p', 'e', 0xac)
		b = append(b, "BlockRemoved"...)
		b = append(b, 0xa1, 'x')
		nest(0x81)
	case 4: // an envelope declaring a huge array
		header(0xdd)
	case 5: // [ts, events declaring a huge array]
		b = append(b, 0x92, 0x00)
		header(0xdd)
	case 6: // [ts, [["BlockStored", hashes declaring a huge array]]]
		b = append(b, 0x92, 0x00, 0x91, 0x95, 0xab)
		b = append(b, "BlockStored"...)
		header(0xdd)
	case 7: // a map envelope whose first key is a huge string
		b = append(b, 0x81)
		header(0xdb)
	}
	return append(b, tail...)
}

func TestNormalizeSurvivesDeepNesting(t *testing.T) {
	// A decoder that recursed per level would need far more than this.
	defer debug.SetMaxStack(debug.SetMaxStack(16 << 20))
	for shape := uint8(0); shape < 8; shape++ {
		p := hostileBatch(shape, 10_000_000, 0xffffffff, nil)
		for d := VLLM; d <= TokenSpeed; d++ {
			if _, _, err := NewNormalizer(d).Normalize(p, 1, 0); err != nil && !errors.Is(err, ErrUndecodable) {
				t.Errorf("shape %d, dialect %v: %v", shape, d, err)
			}
		}
		if _, err := SkipValue(p, 0); err != nil && !errors.Is(err, ErrUndecodable) {
			t.Errorf("shape %d: skip: %v", shape, err)
		}
	}
}

// FuzzNormalizeHostile drives the normalizer with deep and lying structures
// built from the fuzzer's numbers, which random bytes almost never reach.
func FuzzNormalizeHostile(f *testing.F) {
	f.Add(uint8(VLLM), uint8(0), uint32(1<<20), uint32(0), []byte{})
	f.Add(uint8(SGLang), uint8(2), uint32(1000), uint32(0), []byte{0x90})
	f.Add(uint8(TokenSpeed), uint8(6), uint32(0), uint32(1<<31), []byte{0x01})
	f.Fuzz(func(t *testing.T, dialect, shape uint8, depth, declared uint32, tail []byte) {
		p := hostileBatch(shape, depth, declared, tail)
		b, _, err := NewNormalizer(Dialect(dialect%3)+1).Normalize(p, 1, 0)
		if err != nil && (!errors.Is(err, ErrUndecodable) || b != nil) {
			t.Fatalf("error %v (batch %v)", err, b)
		}
		if end, err := SkipValue(p, 0); err == nil && (end <= 0 || end > len(p)) {
			t.Fatalf("skip ended at %d of %d", end, len(p))
		}
	})
}
