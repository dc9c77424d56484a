package placementsync

import (
	"bytes"
	"errors"
	"maps"
	"strconv"
	"testing"
)

func TestLoadWireRoundTrip(t *testing.T) {
	for _, counts := range []map[string]int{
		{"grpc://10.0.0.1:50051": 3, "w1": 1, "w2": MaxLoadCount},
		{},
	} {
		id, got, err := decodeLoad(encodeSnapshot("abc", counts))
		if err != nil || id != "abc" || !maps.Equal(got, counts) {
			t.Errorf("round trip of %v: %q, %v, %v", counts, id, got, err)
		}
	}
	// Zero counts are left out; counts past the limit are capped.
	_, got, err := decodeLoad(encodeSnapshot("abc", map[string]int{"a": 0, "b": MaxLoadCount + 5}))
	if err != nil || !maps.Equal(got, map[string]int{"b": MaxLoadCount}) {
		t.Errorf("zero and huge counts: %v, %v", got, err)
	}
	// Too many workers: the most loaded MaxLoadWorkers are sent.
	many := map[string]int{}
	for i := range MaxLoadWorkers + 10 {
		many["w"+strconv.Itoa(i)] = 1
	}
	many["hot"] = 99
	_, got, err = decodeLoad(encodeSnapshot("abc", many))
	if err != nil || len(got) != MaxLoadWorkers || got["hot"] != 99 {
		t.Errorf("capped snapshot: %d workers, hot=%d, %v", len(got), got["hot"], err)
	}
}

func TestLoadWireRejects(t *testing.T) {
	good := encodeLoad(nil, "id", []string{"w0"}, []int{2})
	for _, tc := range []struct {
		name string
		in   []byte
		want error
	}{
		{"empty", nil, ErrTruncated},
		{"version", append([]byte{2}, good[1:]...), ErrVersion},
		{"no id length", []byte{1}, ErrTruncated},
		{"id over the limit", []byte{1, 65}, ErrTooLarge},
		{"id cut", []byte{1, 2, 'i'}, ErrTruncated},
		{"no worker count", []byte{1, 2, 'i', 'd'}, ErrTruncated},
		{"worker count over the limit", []byte{1, 2, 'i', 'd', 0x81, 0x40}, ErrTooLarge}, // 8193
		{"worker count past the bytes", []byte{1, 2, 'i', 'd', 100, 1, 'w', 1}, ErrTruncated},
		{"name over the limit", []byte{1, 2, 'i', 'd', 1, 0x81, 0x10, 0}, ErrTooLarge},
		{"count cut", good[:len(good)-1], ErrTruncated},
		{"count over the limit", encodeLoad(nil, "id", []string{"w0"}, []int{MaxLoadCount + 1}), ErrTooLarge},
		{"trailing", append(bytes.Clone(good), 0), ErrTrailing},
	} {
		if _, _, err := decodeLoad(tc.in); !errors.Is(err, tc.want) {
			t.Errorf("%s: %v, want %v", tc.name, err, tc.want)
		}
	}
	for name, in := range map[string][]byte{
		"empty id":     {1, 0, 0},
		"empty worker": {1, 1, 'i', 1, 0, 1, 0, 0},
		"duplicate":    encodeLoad(nil, "id", []string{"w", "w"}, []int{1, 2}),
	} {
		if _, _, err := decodeLoad(in); err == nil {
			t.Errorf("%s accepted", name)
		}
	}
}

func FuzzDecodeLoad(f *testing.F) {
	f.Add(encodeLoad(nil, "abc", []string{"w0", "w1"}, []int{1, 2}))
	f.Add([]byte{1, 2, 'i', 'd', 0x81, 0x40})
	f.Add([]byte{})
	f.Fuzz(func(t *testing.T, b []byte) {
		id, counts, err := decodeLoad(b)
		if err != nil {
			return
		}
		if len(id) > MaxReplicaID || len(counts) > MaxLoadWorkers || 3*len(counts) > len(b) {
			t.Fatalf("decoded past the limits or the input: %d-byte id, %d workers from %d bytes", len(id), len(counts), len(b))
		}
		id2, counts2, err := decodeLoad(encodeSnapshot(id, counts))
		// Zero counts are left out of a snapshot.
		maps.DeleteFunc(counts, func(_ string, n int) bool { return n == 0 })
		if err != nil || id2 != id || !maps.Equal(counts2, counts) {
			t.Fatalf("round trip of %q, %v: %q, %v, %v", id, counts, id2, counts2, err)
		}
	})
}
