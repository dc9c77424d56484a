package placementsync

import (
	"fmt"
	"maps"
	"slices"
	"testing"
)

// The exported sizing encoders must be the wire: what they return decodes
// as the receivers decode it, and they cut as the publishers cut.
func TestSizingEncodersAreTheWire(t *testing.T) {
	hashes := []uint64{1, 2, 3, 1 << 63}
	w, got, err := decode(PlacementMessage("grpc://10.0.0.1:50051", hashes))
	if err != nil || w != "grpc://10.0.0.1:50051" || !slices.Equal(got, hashes) {
		t.Errorf("placement: %q %v %v", w, got, err)
	}
	long := make([]uint64, MaxHashes+3)
	if _, got, err := decode(PlacementMessage("w", long)); err != nil || len(got) != MaxHashes {
		t.Errorf("a placement over MaxHashes: %d hashes, %v (want it cut to %d)", len(got), err, MaxHashes)
	}
	counts := map[string]int{"w1": 2, "w2": 0, "w3": 7}
	msgs, cut := LoadSnapshotMessages("r1", counts, 0)
	if len(msgs) != 1 || cut != 0 {
		t.Fatalf("a 3-worker load snapshot: %d messages, %d cut (want 1, 0)", len(msgs), cut)
	}
	m, err := decodeLoad(msgs[0])
	if err != nil || m.id != "r1" || !maps.Equal(m.counts, map[string]int{"w1": 2, "w3": 7}) {
		t.Errorf("load snapshot: %q %v %v", m.id, m.counts, err)
	}
	big := map[string]int{}
	for i := range MaxLoadWorkers + 10 {
		big[fmt.Sprintf("grpc://10.0.%d.%d:50051", i/256, i%256)] = 1
	}
	msgs, cut = LoadSnapshotMessages("r1", big, 0)
	seen := 0
	for _, b := range msgs {
		m, err := decodeLoad(b)
		if err != nil || m.parts != len(msgs) {
			t.Fatalf("a part of a %d-worker snapshot: %v, parts %d of %d messages", len(big), err, m.parts, len(msgs))
		}
		seen += len(m.counts)
	}
	if len(msgs) < 2 || cut != 0 || seen != len(big) {
		t.Errorf("a %d-worker snapshot: %d messages, %d workers in them, %d cut (want parts carrying every worker)", len(big), len(msgs), seen, cut)
	}
	for _, tc := range []struct{ prefix, model, want string }{
		{"", "llama", "kvrelay.placements.llama"},
		{"fleet-a", "meta/llama", "fleet-a.~bWV0YS9sbGFtYQ"},
	} {
		if got := PlacementSubject(tc.prefix, tc.model); got != tc.want {
			t.Errorf("PlacementSubject(%q, %q) = %q, want %q", tc.prefix, tc.model, got, tc.want)
		}
	}
}
