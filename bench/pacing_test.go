package bench

import (
	"slices"
	"testing"
)

func TestPacingRatios(t *testing.T) {
	step := func(perM float64, pass bool) *Step { return &Step{CPUPerMBlocks: perM, Pass: pass} }
	const w = "engine pacing"
	tests := []struct {
		name string
		runs []PacingRun
		want []PacingRatioSeen
	}{
		{"paired by round", []PacingRun{
			{Round: 1, Workload: w, Relay: pythonRelayName, Step: step(20, true)},
			{Round: 1, Workload: w, Relay: "kvrelay", Step: step(5, true)},
			{Round: 2, Workload: w, Relay: "kvrelay", Step: step(4, true)},
			{Round: 2, Workload: w, Relay: pythonRelayName, Step: step(40, true)},
		}, []PacingRatioSeen{{Relay: "kvrelay", Workload: w, Ratios: []float64{0.25, 0.1}}}},
		{"a round where either fell behind is left out", []PacingRun{
			{Round: 1, Workload: w, Relay: pythonRelayName, Step: step(20, false)},
			{Round: 1, Workload: w, Relay: "kvrelay", Step: step(5, true)},
			{Round: 2, Workload: w, Relay: pythonRelayName, Step: step(20, true)},
			{Round: 2, Workload: w, Relay: "kvrelay", Step: step(5, false)},
			{Round: 3, Workload: w, Relay: pythonRelayName, Step: step(10, true)},
			{Round: 3, Workload: w, Relay: "kvrelay", Step: step(5, true)},
		}, []PacingRatioSeen{{Relay: "kvrelay", Workload: w, Ratios: []float64{0.5}}}},
		{"no Python run, no ratio", []PacingRun{
			{Round: 1, Workload: w, Relay: "kvrelay", Step: step(5, true)},
		}, nil},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got := pacingRatios(tc.runs)
			if !slices.EqualFunc(got, tc.want, func(a, b PacingRatioSeen) bool {
				return a.Relay == b.Relay && a.Workload == b.Workload && slices.Equal(a.Ratios, b.Ratios)
			}) {
				t.Errorf("got %+v, want %+v", got, tc.want)
			}
		})
	}
}
