package bench

import (
	"context"
	"log/slog"
	"strings"
	"testing"

	"github.com/kvrelay/kvrelay/sim/fleetsim"
)

// TestPolicyQuick runs the policy part's quick form: every policy on both
// workloads, the placement and replica policies too, and the tables have a
// row for each.
func TestPolicyQuick(t *testing.T) {
	res, err := runPolicy(context.Background(), &environment{quick: true, log: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	rows := 2 * len(fleetsim.StandardPolicies())
	if len(res.Runs) != 1 || len(res.Runs[0]) != rows {
		t.Fatalf("runs %d × %d, want 1 × %d", len(res.Runs), len(res.Runs[0]), rows)
	}
	placementRows := 2 * len(fleetsim.PlacementPolicies())
	if len(res.PlacementRuns) != 1 || len(res.PlacementRuns[0]) != placementRows {
		t.Fatalf("placement runs %d × %d, want 1 × %d", len(res.PlacementRuns), len(res.PlacementRuns[0]), placementRows)
	}
	rows += placementRows
	replicaRows := 2 * len(fleetsim.ReplicaPolicies())
	if len(res.ReplicaRuns) != 1 || len(res.ReplicaRuns[0]) != replicaRows {
		t.Fatalf("replica runs %d × %d, want 1 × %d", len(res.ReplicaRuns), len(res.ReplicaRuns[0]), replicaRows)
	}
	rows += replicaRows
	var b strings.Builder
	writePolicy(&b, res)
	if n := strings.Count(b.String(), "\n| chat |") + strings.Count(b.String(), "\n| agentic |"); n != rows {
		t.Errorf("%d table rows, want %d:\n%s", n, rows, b.String())
	}
}

func TestSpread(t *testing.T) {
	s := spreadOf([]float64{3, 1, 2})
	if s != (spread{med: 2, lo: 1, hi: 3}) {
		t.Errorf("%+v", s)
	}
	if got := s.format(1000, "", 0); got != "2000 (1000–3000)" {
		t.Errorf("format %q", got)
	}
	if got := spreadOf([]float64{0.5}).format(100, "%", 1); got != "50.0%" {
		t.Errorf("format %q", got)
	}
}
