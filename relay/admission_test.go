package relay

import (
	"runtime"
	"runtime/debug"
	"testing"

	"github.com/vmihailenco/msgpack/v5"
)

func mustMarshal(t testing.TB, v any) []byte {
	t.Helper()
	b, err := msgpack.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func TestStartsWithClearReadsEveryEnvelopeForm(t *testing.T) {
	tests := []struct {
		name    string
		payload []byte
		want    bool
	}{
		{"array event", payload(0, cleared(), stored(-1, 1)), true},
		{"array store first", payload(0, stored(-1, 1), cleared()), false},
		{"map event", mustMarshal(t, []any{1.5, []any{map[string]any{"type": "AllBlocksCleared"}}, nil}), true},
		{"map store", mustMarshal(t, []any{1.5, []any{map[string]any{"type": "BlockStored", "block_hashes": []int{1}}}}), false},
		{"map envelope", mustMarshal(t, map[string]any{"ts": 1.5, "events": []any{[]any{"AllBlocksCleared"}}}), true},
		{"two-element envelope", mustMarshal(t, []any{1.5, []any{[]any{"AllBlocksCleared"}}}), true},
		{"no events", payload(0), false},
		{"bytes tag", mustMarshal(t, []any{1.5, []any{[]any{[]byte("AllBlocksCleared")}}}), true},
		{"not msgpack", []byte{0xc1}, false},
		{"empty", nil, false},
		{"truncated", payload(0, cleared())[:5], false},
		{"scalar", mustMarshal(t, 7), false},
	}
	for _, tc := range tests {
		if got := startsWithClear(tc.payload); got != tc.want {
			t.Errorf("%s: %v, want %v", tc.name, got, tc.want)
		}
	}
}

// deepMsgpack builds a hostile payload from a few fuzzer-chosen numbers:
// depth nested containers of the chosen kind (arrays, maps, or a tagged
// event whose first field nests), placed where shape says (the envelope's
// ts, its events list or the first event), or a container or string whose
// header declares declared elements or bytes that never follow. tail ends
// the payload.
func deepMsgpack(shape uint8, depth uint32, declared uint32, tail []byte) []byte {
	depth %= 1 << 22
	var b []byte
	nest := func(code byte) {
		for i := uint32(0); i < depth; i++ {
			b = append(b, code)
			if code == 0x81 { // a map of one pair: a key, then the nested value
				b = append(b, 0xa1, 'k')
			}
		}
		b = append(b, 0x00)
	}
	header := func(code byte) {
		b = append(b, code, byte(declared>>24), byte(declared>>16), byte(declared>>8), byte(declared))
	}
	switch shape % 8 {
	case 0: // [ts nested, events]
		b = append(b, 0x92)
		nest(0x91)
		b = append(b, 0x90)
	case 1: // [ts, [nested event]]
		b = append(b, 0x92, 0x00, 0x91)
		nest(0x91)
	case 2: // {ts: nested maps, events: []}
		b = append(b, 0x82, 0xa2, 't', 's')
		nest(0x81)
		b = append(b, 0xa6, 'e', 'v', 'e', 'n', 't', 's', 0x90)
	case 3: // [ts, [{other: nested, type: tag}]]
		b = append(b, 0x92, 0x00, 0x91, 0x82, 0xa1, 'x')
		nest(0x91)
		b = append(b, 0xa4, 't', 'y', 'p', 'e', 0xb0)
		b = append(b, clearTag...)
	case 4: // an envelope declaring a huge array
		header(0xdd)
	case 5: // [ts, events declaring a huge array]
		b = append(b, 0x92, 0x00)
		header(0xdd)
	case 6: // [ts, [[tag declared as a huge string]]]
		b = append(b, 0x92, 0x00, 0x91, 0x91)
		header(0xdb)
	case 7: // a map envelope whose first key is a huge binary
		b = append(b, 0x81)
		header(0xc6)
	}
	return append(b, tail...)
}

func TestStartsWithClearSurvivesDeepNesting(t *testing.T) {
	// The message: 0x92, 0x91 x 10,000,000, 0x00, 0x90 (9.5 MiB).
	// msgpack/v5's recursive Skip overflowed the goroutine stack on it.
	// Stack growth is not counted in TotalAlloc, so cap the stack instead:
	// a walk that recurses per level needs hundreds of MiB here and dies.
	defer debug.SetMaxStack(debug.SetMaxStack(16 << 20))
	const depth = 10_000_000
	for shape := uint8(0); shape < 4; shape++ {
		p := deepMsgpack(shape, depth, 0, nil)
		var before, after runtime.MemStats
		runtime.ReadMemStats(&before)
		got := startsWithClear(p)
		runtime.ReadMemStats(&after)
		if want := shape == 3; got != want { // shape 3's event is a clear
			t.Errorf("shape %d: clear %v, want %v", shape, got, want)
		}
		// One pass, no allocation that grows with the depth.
		if alloc := after.TotalAlloc - before.TotalAlloc; alloc > 1<<20 {
			t.Errorf("shape %d: %d bytes allocated for a %d-byte payload", shape, alloc, len(p))
		}
	}
}

func TestStartsWithClearRefusesDeclaredSizes(t *testing.T) {
	for shape := uint8(4); shape < 8; shape++ {
		p := deepMsgpack(shape, 0, 0xffffffff, []byte{0x00})
		var before, after runtime.MemStats
		runtime.ReadMemStats(&before)
		ok, err := peekFirstEventIsClear(p)
		runtime.ReadMemStats(&after)
		if ok || (err == nil && shape != 7) {
			t.Errorf("shape %d: %v, %v; want no clear and an error", shape, ok, err)
		}
		if alloc := after.TotalAlloc - before.TotalAlloc; alloc > 64<<10 {
			t.Errorf("shape %d: %d bytes allocated for a 4 GiB declaration", shape, alloc)
		}
	}
}

func FuzzStartsWithClear(f *testing.F) {
	for _, b := range [][]byte{
		payload(0, cleared()),
		payload(1, stored(-1, 1, 2), removed(1)),
		mustMarshal(f, map[string]any{"events": []any{map[string]any{"type": "AllBlocksCleared"}}}),
		{0x93, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0xdd, 0xff, 0xff, 0xff, 0xff},
		{0x92, 0xc0, 0x91, 0x91, 0xdb, 0xff, 0xff, 0xff, 0xff},
	} {
		f.Add(b, uint8(0), uint32(0), uint32(0))
	}
	f.Add([]byte{}, uint8(0), uint32(1<<20), uint32(0))
	f.Add([]byte{0x90}, uint8(3), uint32(100_000), uint32(0))
	f.Add([]byte{0xc1}, uint8(6), uint32(0), uint32(1<<31))
	f.Fuzz(func(t *testing.T, b []byte, shape uint8, depth, declared uint32) {
		// Any input, as given and as a deep or lying structure built from
		// the fuzzer's numbers: an answer, no panic, and the same answer
		// twice.
		for _, p := range [][]byte{b, deepMsgpack(shape, depth, declared, b)} {
			if startsWithClear(p) != startsWithClear(p) {
				t.Fatal("not deterministic")
			}
		}
	})
}
