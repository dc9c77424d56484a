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
