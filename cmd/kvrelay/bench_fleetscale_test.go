package main

import (
	"bytes"
	"context"
	"strings"
	"testing"

	"github.com/kvrelay/kvrelay/bench"
)

// `kvrelay bench --only fleetscale` runs the fleet scale study and nothing
// else; its quick form takes well under a second.
func TestBenchOnlyFleetScale(t *testing.T) {
	out := t.TempDir()
	var stdout, stderr bytes.Buffer
	code := dispatch(context.Background(), []string{"bench", "--quick", "--in-process", "--only", "fleetscale", "--out", out},
		strings.NewReader(""), &stdout, &stderr)
	if code != 0 {
		t.Fatalf("exit %d; stderr:\n%s", code, stderr.String())
	}
	res, err := bench.ReadResults(out)
	if err != nil {
		t.Fatal(err)
	}
	if res.FleetScale == nil || len(res.FleetScale.Gateway) == 0 || res.SideBySide != nil || res.Route != nil {
		t.Fatalf("results hold fleet scale %v, side by side %v, route %v", res.FleetScale != nil, res.SideBySide != nil, res.Route != nil)
	}
	if !strings.Contains(stdout.String(), "### Fleet scale study") {
		t.Errorf("stdout lacks the fleet scale tables:\n%s", stdout.String())
	}
}
