package relay

import (
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

func FuzzStartsWithClear(f *testing.F) {
	f.Add(payload(0, cleared()))
	f.Add(payload(1, stored(-1, 1, 2), removed(1)))
	f.Add(mustMarshal(f, map[string]any{"events": []any{map[string]any{"type": "AllBlocksCleared"}}}))
	f.Add([]byte{0x93, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0xdd, 0xff, 0xff, 0xff, 0xff})
	f.Add([]byte{0x92, 0xc0, 0x91, 0x91, 0xdb, 0xff, 0xff, 0xff, 0xff})
	f.Fuzz(func(t *testing.T, b []byte) {
		// Any input: an answer, no panic, and the same answer twice.
		if startsWithClear(b) != startsWithClear(b) {
			t.Fatal("not deterministic")
		}
	})
}
