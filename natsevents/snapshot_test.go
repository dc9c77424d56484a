package natsevents

import (
	"bytes"
	"errors"
	"testing"
)

func TestSnapshotObjectRoundTrip(t *testing.T) {
	for _, o := range []snapshotObject{
		{StreamSeq: 0, Chunks: [][]byte{}},
		{StreamSeq: 1 << 40, Chunks: [][]byte{{1, 2, 3}, {}, bytes.Repeat([]byte{7}, 300)}},
	} {
		got, err := decodeSnapshot(encodeSnapshot(o))
		if err != nil {
			t.Fatal(err)
		}
		if got.StreamSeq != o.StreamSeq || len(got.Chunks) != len(o.Chunks) {
			t.Fatalf("round trip of %d chunks at %d: %d chunks at %d", len(o.Chunks), o.StreamSeq, len(got.Chunks), got.StreamSeq)
		}
		for i := range o.Chunks {
			if !bytes.Equal(got.Chunks[i], o.Chunks[i]) {
				t.Fatalf("chunk %d differs", i)
			}
		}
	}
}

func TestSnapshotObjectRejects(t *testing.T) {
	good := encodeSnapshot(snapshotObject{StreamSeq: 5, Chunks: [][]byte{{1, 2}}})
	for name, data := range map[string][]byte{
		"empty":                 nil,
		"wrong magic":           append([]byte("KVRSNAP2"), good[8:]...),
		"truncated chunk":       good[:len(good)-1],
		"trailing bytes":        append(append([]byte{}, good...), 0),
		"huge chunk count":      append([]byte(snapshotMagic), 5, 0xff, 0xff, 0xff, 0xff, 0x0f),
		"huge chunk length":     append([]byte(snapshotMagic), 5, 1, 0xff, 0xff, 0xff, 0xff, 0x0f),
		"bad varint":            append([]byte(snapshotMagic), 0xff),
		"chunks over the bound": manyEmptyChunks(maxSnapshotChunks + 1),
	} {
		if _, err := decodeSnapshot(data); !errors.Is(err, errSnapshotFormat) {
			t.Errorf("%s: err = %v, want a format error", name, err)
		}
	}
}

// manyEmptyChunks is a well-formed object of n empty chunks: one byte each
// in the object, a slice header each once decoded.
func manyEmptyChunks(n int) []byte {
	return encodeSnapshot(snapshotObject{StreamSeq: 1, Chunks: make([][]byte, n)})
}

func TestSnapshotObjectAtTheChunkBound(t *testing.T) {
	o, err := decodeSnapshot(manyEmptyChunks(maxSnapshotChunks))
	if err != nil || len(o.Chunks) != maxSnapshotChunks {
		t.Fatalf("%d chunks, %v; want the bound itself taken", len(o.Chunks), err)
	}
}

func TestWorkerToken(t *testing.T) {
	for in, want := range map[string]string{
		"a-b_C9":         "a-b_C9",
		"10.0.0.1:50061": "10%2E0%2E0%2E1%3A50061",
		"a.b":            "a%2Eb",
		"a%2Eb":          "a%252Eb", // the escape itself is escaped: no two names meet
		"x*>y z":         "x%2A%3Ey%20z",
	} {
		if got := WorkerToken(in); got != want {
			t.Errorf("WorkerToken(%q) = %q, want %q", in, got, want)
		}
	}
}

// FuzzSnapshotObject: any bytes decode to an error or to an object that
// encodes back to the same bytes, without a panic (allocation is bounded by
// decodeSnapshot's checks: TestSnapshotObjectRejects).
func FuzzSnapshotObject(f *testing.F) {
	f.Add(encodeSnapshot(snapshotObject{StreamSeq: 9, Chunks: [][]byte{{1}, {2, 3}}}))
	f.Add([]byte(snapshotMagic))
	f.Add(append([]byte(snapshotMagic), 1, 0xff, 0xff, 0xff, 0xff, 0x0f))
	f.Fuzz(func(t *testing.T, data []byte) {
		o, err := decodeSnapshot(data)
		if err != nil {
			return
		}
		if again := encodeSnapshot(o); !bytes.Equal(again, data) {
			// Varints have one shortest form, and the encoder writes it;
			// a longer form that decodes is accepted, so compare by value.
			o2, err := decodeSnapshot(again)
			if err != nil || o2.StreamSeq != o.StreamSeq || len(o2.Chunks) != len(o.Chunks) {
				t.Fatalf("re-encoding a decoded object changed it: %v", err)
			}
		}
	})
}
