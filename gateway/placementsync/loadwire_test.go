package placementsync

import (
	"bytes"
	"errors"
	"fmt"
	"maps"
	"strconv"
	"strings"
	"testing"
)

// joinSnapshot decodes encodeSnapshot's messages into one snapshot,
// checking that the parts agree on their replica, generation and count.
func joinSnapshot(t testing.TB, msgs [][]byte) (string, map[string]int) {
	t.Helper()
	counts := map[string]int{}
	var id string
	for i, b := range msgs {
		m, err := decodeLoad(b)
		if err != nil {
			t.Fatalf("part %d: %v", i, err)
		}
		if len(b) > 1<<20 || len(m.counts) > MaxLoadWorkers {
			t.Fatalf("part %d: %d bytes, %d workers", i, len(b), len(m.counts))
		}
		if i == 0 {
			id = m.id
		}
		if m.id != id || m.part != i || m.parts != len(msgs) || len(msgs) > 1 && m.gen != 7 {
			t.Fatalf("part %d of %d: %+v", i, len(msgs), m)
		}
		for w, n := range m.counts {
			if _, dup := counts[w]; dup {
				t.Fatalf("worker %q in two parts", w)
			}
			counts[w] = n
		}
	}
	return id, counts
}

func TestLoadWireRoundTrip(t *testing.T) {
	many := func(n, nameLen int) map[string]int {
		m := map[string]int{}
		for i := range n {
			w := "w" + strconv.Itoa(i)
			m[w+strings.Repeat("x", max(nameLen-len(w), 0))] = 1 + i%5
		}
		return m
	}
	for _, tc := range []struct {
		name   string
		counts map[string]int
		parts  int
	}{
		{"small", map[string]int{"grpc://10.0.0.1:50051": 3, "w1": 1, "w2": MaxLoadCount}, 1},
		{"idle", map[string]int{}, 1},
		{"MaxLoadWorkers", many(MaxLoadWorkers, 0), 1},
		{"one over", many(MaxLoadWorkers+1, 0), 2},
		{"10,000", many(10000, 0), 3},
		{"10,000 long names: split by bytes", many(10000, 1000), 10},
	} {
		msgs, cut := encodeSnapshot("abc", 7, tc.counts, 1<<20)
		id, got := joinSnapshot(t, msgs)
		if id != "abc" || !maps.Equal(got, tc.counts) || cut != 0 || len(msgs) != tc.parts {
			t.Errorf("%s: round trip: %q, %d of %d workers, %d parts (want %d), %d cut", tc.name, id, len(got), len(tc.counts), len(msgs), tc.parts, cut)
		}
	}
	// Zero counts are left out; counts past the limit are capped.
	_, got := joinSnapshot(t, must(encodeSnapshot("abc", 7, map[string]int{"a": 0, "b": MaxLoadCount + 5}, 1<<20)))
	if !maps.Equal(got, map[string]int{"b": MaxLoadCount}) {
		t.Errorf("zero and huge counts: %v", got)
	}
	// Past MaxLoadParts parts (a tiny payload limit: one 600-byte name a
	// part), the least loaded are cut.
	huge := many(MaxLoadParts+3, 600)
	hot := ""
	for w := range huge {
		hot = w
		break
	}
	huge[hot] = 99
	msgs, cut := encodeSnapshot("abc", 7, huge, 1000)
	_, got = joinSnapshot(t, msgs)
	if len(msgs) != MaxLoadParts || cut != 3 || len(got) != MaxLoadParts || got[hot] != 99 {
		t.Errorf("over MaxLoadParts: %d parts, %d cut, %d workers, hot=%d", len(msgs), cut, len(got), got[hot])
	}
}

func must(msgs [][]byte, _ int) [][]byte { return msgs }

func TestLoadWireRejects(t *testing.T) {
	good := encodeLoad(nil, "id", []string{"w0"}, []int{2})
	part := func(gen, part, parts uint64) []byte {
		b := []byte{2, 2, 'i', 'd'}
		for _, v := range []uint64{gen, part, parts} {
			b = fmt.Appendf(b, "%c", v) // all under 0x80: one-byte uvarints
		}
		return append(b, 1, 1, 'w', 1)
	}
	if m, err := decodeLoad(part(5, 1, 3)); err != nil || m.gen != 5 || m.part != 1 || m.parts != 3 || m.counts["w"] != 1 {
		t.Fatalf("a good part: %+v, %v", m, err)
	}
	for _, tc := range []struct {
		name string
		in   []byte
		want error
	}{
		{"empty", nil, ErrTruncated},
		{"version", append([]byte{3}, good[1:]...), ErrVersion},
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
		{"part: no generation", []byte{2, 2, 'i', 'd'}, ErrTruncated},
		{"part: no index", []byte{2, 2, 'i', 'd', 5}, ErrTruncated},
		{"part: no count", []byte{2, 2, 'i', 'd', 5, 0}, ErrTruncated},
		{"part: count over the limit", []byte{2, 2, 'i', 'd', 5, 0, 0x81, 0x02, 0}, ErrTooLarge}, // 258
		{"part: no worker count", []byte{2, 2, 'i', 'd', 5, 0, 2}, ErrTruncated},
		{"part: trailing", append(part(5, 0, 2), 0), ErrTrailing},
	} {
		if _, err := decodeLoad(tc.in); !errors.Is(err, tc.want) {
			t.Errorf("%s: %v, want %v", tc.name, err, tc.want)
		}
	}
	for name, in := range map[string][]byte{
		"empty id":            {1, 0, 0},
		"empty worker":        {1, 1, 'i', 1, 0, 1, 0, 0},
		"duplicate":           encodeLoad(nil, "id", []string{"w", "w"}, []int{1, 2}),
		"part: index = count": part(5, 2, 2),
		"part: one part":      part(5, 0, 1),
		"part: zero parts":    part(5, 0, 0),
	} {
		if _, err := decodeLoad(in); err == nil {
			t.Errorf("%s accepted", name)
		}
	}
}

func FuzzDecodeLoad(f *testing.F) {
	f.Add(encodeLoad(nil, "abc", []string{"w0", "w1"}, []int{1, 2}))
	f.Add(encodeLoadPart(nil, "abc", 1<<40, 1, 3, []string{"w0", "w1"}, []int{1, 2}))
	f.Add([]byte{1, 2, 'i', 'd', 0x81, 0x40})
	f.Add([]byte{2, 2, 'i', 'd', 5, 0, 0x81, 0x02, 0})
	f.Add([]byte{})
	f.Fuzz(func(t *testing.T, b []byte) {
		m, err := decodeLoad(b)
		if err != nil {
			return
		}
		if len(m.id) > MaxReplicaID || len(m.counts) > MaxLoadWorkers || 3*len(m.counts) > len(b) ||
			m.parts < 1 || m.parts > MaxLoadParts || m.part < 0 || m.part >= m.parts {
			t.Fatalf("decoded past the limits or the input: %d-byte id, part %d of %d, %d workers from %d bytes", len(m.id), m.part, m.parts, len(m.counts), len(b))
		}
		// Re-encoded in the message's own version, it decodes the same.
		names := make([]string, 0, len(m.counts))
		vals := make([]int, 0, len(m.counts))
		for w, n := range m.counts {
			names, vals = append(names, w), append(vals, n)
		}
		var again []byte
		if b[0] == loadWireVersion {
			again = encodeLoad(nil, m.id, names, vals)
		} else {
			again = encodeLoadPart(nil, m.id, m.gen, m.part, m.parts, names, vals)
		}
		m2, err := decodeLoad(again)
		if err != nil || m2.id != m.id || m2.gen != m.gen || m2.part != m.part || m2.parts != m.parts || !maps.Equal(m2.counts, m.counts) {
			t.Fatalf("round trip of %+v: %+v, %v", m, m2, err)
		}
		// As a snapshot, zero counts are left out.
		id, counts := joinSnapshot(t, must(encodeSnapshot(m.id, 7, m.counts, 1<<20)))
		maps.DeleteFunc(m.counts, func(_ string, n int) bool { return n == 0 })
		if id != m.id || !maps.Equal(counts, m.counts) {
			t.Fatalf("snapshot round trip of %q, %v: %q, %v", m.id, m.counts, id, counts)
		}
	})
}
