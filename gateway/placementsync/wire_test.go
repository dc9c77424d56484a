package placementsync

import (
	"bytes"
	"errors"
	"math"
	"slices"
	"testing"
)

func TestWireRoundTrip(t *testing.T) {
	for _, tc := range []struct {
		worker string
		hashes []uint64
	}{
		{"grpc://10.0.0.1:50051", []uint64{1, math.MaxUint64, 0x0123456789abcdef}},
		{"w", []uint64{}},
	} {
		b := encode(nil, tc.worker, tc.hashes)
		w, hs, err := decode(b)
		if err != nil || w != tc.worker || !slices.Equal(hs, tc.hashes) {
			t.Errorf("decode(encode(%q, %v)) = %q, %v, %v", tc.worker, tc.hashes, w, hs, err)
		}
	}
	// Size: 1 + 1 + 21 + 1 + 16 × 8.
	if n := len(encode(nil, "grpc://10.0.0.1:50051", make([]uint64, 16))); n != 152 {
		t.Errorf("a 16-block placement is %d bytes", n)
	}
}

func TestWireRejects(t *testing.T) {
	good := encode(nil, "w0", []uint64{1, 2})
	huge := encode(nil, "w0", nil)
	huge = append(huge[:len(huge)-1], 0xff, 0xff, 0xff, 0xff, 0x0f) // count 2^32-1, no hashes
	for _, tc := range []struct {
		name string
		in   []byte
		want error
	}{
		{"empty", nil, ErrTruncated},
		{"version", append([]byte{2}, good[1:]...), ErrVersion},
		{"no name length", []byte{1}, ErrTruncated},
		{"name over the limit", append([]byte{1}, 0x81, 0x10), ErrTooLarge}, // 2049
		{"name cut", []byte{1, 5, 'w'}, ErrTruncated},
		{"no count", []byte{1, 2, 'w', '0'}, ErrTruncated},
		{"count over the limit", huge, ErrTooLarge},
		{"hashes cut", good[:len(good)-1], ErrTruncated},
		{"trailing", append(bytes.Clone(good), 0), ErrTrailing},
	} {
		if _, _, err := decode(tc.in); !errors.Is(err, tc.want) {
			t.Errorf("%s: %v, want %v", tc.name, err, tc.want)
		}
	}
	if _, _, err := decode([]byte{1, 0, 0}); err == nil {
		t.Error("empty worker name accepted")
	}
}

func TestSubjectToken(t *testing.T) {
	for _, m := range []string{"llama", "Qwen3-8B_fp8", "meta-llama/Llama-3.1-8B", "a.b", "*", ">", "x y", ""} {
		tok := subjectToken(m)
		for _, c := range tok {
			if c == '.' || c == '*' || c == '>' || c == ' ' {
				t.Errorf("token %q of %q is not one subject token", tok, m)
			}
		}
		if got, err := modelOf(tok); m != "" && (err != nil || got != m) {
			t.Errorf("modelOf(%q) = %q, %v; want %q", tok, got, err, m)
		}
	}
	if subjectToken("llama") != "llama" {
		t.Error("a plain model name is not kept readable")
	}
	if _, err := modelOf("~!!"); err == nil {
		t.Error("bad base64 accepted")
	}
}

func FuzzDecode(f *testing.F) {
	f.Add(encode(nil, "grpc://w:1", []uint64{1, 2, 3}))
	f.Add([]byte{1, 0x81, 0x10})
	f.Add([]byte{})
	f.Fuzz(func(t *testing.T, b []byte) {
		w, hs, err := decode(b)
		if err != nil {
			return
		}
		// What decodes survives a round trip (the input's varints need not
		// be minimal, so its bytes may differ).
		w2, hs2, err := decode(encode(nil, w, hs))
		if err != nil || w2 != w || !slices.Equal(hs2, hs) {
			t.Fatalf("round trip of %q, %v: %q, %v, %v", w, hs, w2, hs2, err)
		}
		if len(w) > MaxWorkerName || len(hs) > MaxHashes || len(hs)*8 > len(b) {
			t.Fatalf("decoded past the limits or the input: %d-byte name, %d hashes from %d bytes", len(w), len(hs), len(b))
		}
	})
}
