package charts

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/kvrelay/kvrelay/bench"
)

// TestDrawWritesEveryPlot draws a small run's results (every part present)
// and checks that each expected PNG is written, listed and non-empty.
func TestDrawWritesEveryPlot(t *testing.T) {
	res := &bench.Results{
		SideBySide: &bench.SideBySide{Relays: []bench.RelayRun{
			{Name: "kvrelay (Go)", Steps: []bench.Step{{Target: 1000, P50ms: 0.4, P99ms: 1.2, DeliveredRate: 1000}, {Target: 10000, P50ms: 0.6, P99ms: 3, DeliveredRate: 9990}}},
			{Name: "python (smg_grpc_servicer.kv_relay)", Steps: []bench.Step{{Target: 1000, P50ms: 1, P99ms: 5, DeliveredRate: 1000}, {Target: 10000, P50ms: 9, P99ms: 40, DeliveredRate: 6000}}},
		}},
		Scale: &bench.ScaleResults{
			Snapshot: []bench.SnapshotPoint{{Blocks: 1000, LockMs: 0.1, TotalMs: 2, HeapBytes: 8 << 20}, {Blocks: 100000, LockMs: 3, TotalMs: 90, HeapBytes: 60 << 20}},
			Resume:   []bench.ResumePoint{{Window: 100, Ms: 2}, {Window: 10000, Ms: 40}},
			Fanout:   []bench.FanoutPoint{{Subscribers: 1, Aggregate: 9000, PerSubscriber: 9000}, {Subscribers: 16, Aggregate: 90000, PerSubscriber: 5600}},
		},
		Route: &bench.RouteResults{Points: []bench.RoutePoint{{Workers: 8, PromptTokens: 512, RouteP50us: 4}, {Workers: 8, PromptTokens: 8192, RouteP50us: 30}}},
	}
	out := t.TempDir()
	files, err := Draw(out, res)
	if err != nil {
		t.Fatal(err)
	}
	listed := map[string]bool{}
	for _, f := range files {
		listed[filepath.Base(f)] = true
	}
	for _, png := range []string{"latency.png", "throughput.png", "snapshot.png", "memory.png", "resume.png", "fanout.png", "route.png"} {
		if !listed[png] {
			t.Errorf("%s not in the returned list %v", png, files)
		}
		if fi, err := os.Stat(filepath.Join(out, png)); err != nil || fi.Size() == 0 {
			t.Errorf("plot %s: %v", png, err)
		}
	}
}

// The fleet scale study's four plots are drawn from its results, the fit
// lines reaching the target fleet.
func TestDrawFleetScale(t *testing.T) {
	fs := &bench.FleetScaleResults{
		Workload: bench.FleetWorkload{CacheBlocks: 100, BatchesPerWorkerPerSec: 20, TargetWorkers: 10000, Workers: []int{100, 200}, Subscribers: []int{1, 2}},
		Gateway: []bench.GatewayScalePoint{
			{Workers: 100, HeapBytes: 1 << 20, CPUPerSecond: 0.1, RouteP50us: 10, RouteCPUP99us: 20},
			{Workers: 200, HeapBytes: 2 << 20, CPUPerSecond: 0.2, RouteP50us: 15, RouteCPUP99us: 30},
		},
		Fanout: []bench.FanoutScalePoint{{Subscribers: 1, CPUPerBatchUs: 50}, {Subscribers: 2, CPUPerBatchUs: 60}},
		Fits: []bench.CurveFit{
			{Figure: bench.FitIndexHeap, Model: "linear", B: 100, Chosen: true},
			{Figure: bench.FitApplyCPU, Model: "log", A: 50, Chosen: true},
			{Figure: bench.FitRouteP50, Model: "linear", A: 5, B: 0.05, Chosen: true},
			{Figure: bench.FitRouteP99, Model: "linear", A: 10, B: 0.1, Chosen: true},
			{Figure: bench.FitRelayCPU, Model: "linear", A: 40, B: 10, Chosen: true},
		},
	}
	out := t.TempDir()
	files, err := Draw(out, &bench.Results{FleetScale: fs})
	if err != nil {
		t.Fatal(err)
	}
	want := []string{"fleet-memory.png", "fleet-cpu.png", "fleet-route.png", "fleet-fanout.png"}
	if len(files) != len(want) {
		t.Fatalf("drew %v, want %v", files, want)
	}
	for _, png := range want {
		if fi, err := os.Stat(filepath.Join(out, png)); err != nil || fi.Size() == 0 {
			t.Errorf("plot %s: %v", png, err)
		}
	}
}
