package placementsync

import (
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
	id, load, err := decodeLoad(LoadSnapshotMessage("r1", counts))
	if err != nil || id != "r1" || !maps.Equal(load, map[string]int{"w1": 2, "w3": 7}) {
		t.Errorf("load snapshot: %q %v %v", id, load, err)
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
