package bench

import (
	"context"
	"math"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvrelay/kvrelay/gateway/placementsync"
	"github.com/kvrelay/kvrelay/testkit/pyenv"
)

// runFleetScaleQuick runs `kvrelay bench --quick --only fleetscale` and
// checks that its outputs are sane: every figure measured and non-zero,
// the ones that must grow with the fleet growing, the fits and the
// projection present. It asserts no timing.
func runFleetScaleQuick(tb testing.TB) *Results {
	out := tb.TempDir()
	// A backstop against a hang; the quick study takes well under a second.
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	res, err := Run(ctx, Options{Quick: true, Out: out, Repo: pyenv.RepoRoot(), Parts: []string{"fleetscale"}})
	if err != nil {
		tb.Fatal(err)
	}
	if res.SideBySide != nil || res.Scale != nil || res.Route != nil || res.Policy != nil {
		tb.Errorf("--only fleetscale ran other parts too")
	}
	checkFleetScale(tb, res.FleetScale)
	back, err := ReadResults(out)
	if err != nil {
		tb.Fatal(err)
	}
	if back.FleetScale == nil || len(back.FleetScale.Gateway) != len(res.FleetScale.Gateway) {
		tb.Errorf("results.json lost the fleet scale study")
	}
	var md strings.Builder
	WriteMarkdown(&md, res)
	if !strings.Contains(md.String(), "### Fleet scale study") || !strings.Contains(md.String(), "Events over JetStream") {
		tb.Errorf("results.md lacks the fleet scale tables:\n%s", md.String())
	}
	return res
}

func checkFleetScale(tb testing.TB, fs *FleetScaleResults) {
	tb.Helper()
	if fs == nil {
		tb.Fatal("no fleet scale results")
	}
	wl := fs.Workload
	if len(fs.Gateway) != len(wl.Workers)*wl.Reps || len(fs.Fanout) != len(wl.Subscribers)*wl.Reps {
		tb.Fatalf("%d gateway and %d fan-out points for %d sizes, %d subscriber counts, %d reps",
			len(fs.Gateway), len(fs.Fanout), len(wl.Workers), len(wl.Subscribers), wl.Reps)
	}
	for _, p := range fs.Gateway {
		if p.HeapBytes <= 0 || p.CPUPerBatchUs <= 0 || p.SteadyBatches == 0 || p.RouteP50us <= 0 || p.RouteP99us < p.RouteP50us || p.Holders == 0 {
			tb.Errorf("gateway point not sane: %+v", p)
		}
		if p.Memberships != int64(p.Workers)*int64(wl.CacheBlocks) {
			tb.Errorf("%d workers: %d (worker, block) pairs, want %d", p.Workers, p.Memberships, p.Workers*wl.CacheBlocks)
		}
	}
	// Past the sweep: each point holds its own size's pairs, and its route
	// CPU is its parts'.
	past := append(slices.Clone(fs.Larger), fs.Partition...)
	if len(fs.Larger) != len(wl.Larger)*wl.Reps || len(fs.Partition) != len(wl.Partitions)*wl.PartitionReps {
		tb.Fatalf("%d larger and %d group points for %d larger sizes × %d reps and %d tiers × %d reps",
			len(fs.Larger), len(fs.Partition), len(wl.Larger), wl.Reps, len(wl.Partitions), wl.PartitionReps)
	}
	for _, p := range past {
		want := int64(p.Workers) * int64(p.CacheBlocks)
		if p.Partitions > 0 && (p.Workers != wl.TargetWorkers/p.Partitions || p.CacheBlocks > wl.RealCacheBlocks || p.CacheBlocks <= wl.RealCacheBlocks-wl.StoreBlocks) {
			tb.Errorf("group of %d: %d workers × %d blocks, want %d × %d less under a store", p.Partitions, p.Workers, p.CacheBlocks, wl.TargetWorkers/p.Partitions, wl.RealCacheBlocks)
		}
		if p.Memberships != want || p.HeapBytes <= 0 || p.CPUPerBatchUs <= 0 || p.LookupCPUMeanUs <= 0 || p.PickCPUMeanUs <= 0 {
			tb.Errorf("point past the sweep not sane: %+v", p)
		}
		if parts := p.HashCPUMeanUs + p.LookupCPUMeanUs + p.PickCPUMeanUs; math.Abs(parts-p.RouteCPUMeanUs) > 1e-6*max(1, p.RouteCPUMeanUs) {
			tb.Errorf("route CPU mean %.3f µs is not its parts' sum %.3f: %+v", p.RouteCPUMeanUs, parts, p)
		}
	}
	// Tiers: the sums add up, and a group's replica holds less than a full
	// copy, so a tier of groups holds less than the tier of full copies.
	var fullTier *TierRow
	for i, r := range fs.Tier {
		if r.Replicas != r.Partitions*r.Copies || r.ReplicaCPULow > r.ReplicaCPUHigh || r.ReplicaHeapLow <= 0 ||
			math.Abs(r.ReplicaCPULow-(r.EventsCPULow+r.LookupCPU+r.FrontCPU)) > 1e-9 ||
			math.Abs(r.TierCPUHigh-float64(r.Replicas)*r.ReplicaCPUHigh) > 1e-9 || math.Abs(r.TierHeapHigh-float64(r.Replicas)*r.ReplicaHeapHigh) > 1 {
			tb.Errorf("tier row not sane: %+v", r)
		}
		if r.Partitions == 1 && r.Copies == wl.TargetReplicas {
			fullTier = &fs.Tier[i]
		}
	}
	if fullTier == nil {
		tb.Fatalf("no tier of %d full copies: %+v", wl.TargetReplicas, fs.Tier)
	}
	groups := 0
	for _, r := range fs.Tier {
		if r.Partitions > 1 {
			groups++
			if r.ReplicaHeapHigh >= fullTier.ReplicaHeapLow || r.TierHeapHigh/float64(r.Copies) >= fullTier.TierHeapLow {
				tb.Errorf("%d groups × %d: replica heap %.0f, tier %.0f, against a full copy's %.0f and %d copies' %.0f",
					r.Partitions, r.Copies, r.ReplicaHeapHigh, r.TierHeapHigh, fullTier.ReplicaHeapLow, wl.TargetReplicas, fullTier.TierHeapLow)
			}
		}
	}
	if groups == 0 {
		tb.Errorf("no partitioned tier priced: %+v", fs.Tier)
	}
	// Grows with the fleet: memory, the event rate to apply, the holders of
	// a shared prompt (one document in SharedDocs per worker).
	for _, f := range []struct {
		name string
		get  func(GatewayScalePoint) float64
	}{
		{"index heap", func(p GatewayScalePoint) float64 { return float64(p.HeapBytes) }},
		{"event rate", func(p GatewayScalePoint) float64 { return p.EventsPerSecond }},
		{"holders", func(p GatewayScalePoint) float64 { return float64(p.Holders) }},
	} {
		xs, ys := FleetMedians(fs, f.get)
		for i := 1; i < len(ys); i++ {
			if ys[i] <= ys[i-1] {
				tb.Errorf("%s does not grow with the workers: %v at %v", f.name, ys, xs)
			}
		}
	}
	for _, p := range fs.Fanout {
		if p.CPUSeconds <= 0 || p.CPUPerDeliveryUs <= 0 || p.CPUPerBatchUs < p.CPUPerDeliveryUs {
			tb.Errorf("fan-out point not sane: %+v", p)
		}
	}
	pr := fs.Projection
	for _, figure := range []string{FitIndexHeap, FitApplyCPU, FitRouteP50, FitRouteP99, FitRelayCPU} {
		b := pr.Band(figure)
		if b == nil {
			tb.Errorf("no projection band for %s", figure)
			continue
		}
		c := fs.ChosenFit(figure)
		switch {
		case b.Low > b.High || b.MeasuredLow > b.MeasuredHigh:
			tb.Errorf("%s: band not ordered: %+v", figure, b)
		case b.Basis == BasisFits && (c == nil || !c.Accepted || c.R2 < MinFitR2 || c.At < b.Low || c.At > b.High):
			tb.Errorf("%s: band from fits %+v, chosen fit %+v", figure, b, c)
		case b.Basis == BasisMeasured && (c != nil || b.Low != b.MeasuredLow || b.High != b.MeasuredHigh):
			tb.Errorf("%s: no accepted fit, band %+v, chosen fit %+v", figure, b, c)
		case b.Basis != BasisFits && b.Basis != BasisMeasured:
			tb.Errorf("%s: band basis %q", figure, b.Basis)
		}
	}
	if pr.CPUPerSecondLow <= 0 || pr.CPUPerSecondLow > pr.CPUPerSecondHigh || pr.IndexBytesLow <= 0 || pr.IndexBytesLow > pr.IndexBytesHigh {
		tb.Errorf("projection bands not sane: %+v", pr)
	}
	maxHeap := int64(0)
	for _, p := range fs.Gateway {
		maxHeap = max(maxHeap, p.HeapBytes)
	}
	if pr.IndexBytes <= float64(maxHeap) || pr.EventsPerSecond != float64(wl.TargetWorkers)*wl.BatchesPerWorkerPerSec {
		tb.Errorf("projection not sane (largest measured heap %d): %+v", maxHeap, pr)
	}
	if len(fs.NATS) != 5 || fs.NATS[len(fs.NATS)-1].Replicas != wl.TargetReplicas {
		tb.Fatalf("NATS rows for 1..%d replicas: %+v", wl.TargetReplicas, fs.NATS)
	}
	for i, r := range fs.NATS {
		if r.PlacementBytes <= 0 || r.LoadBytes <= 0 || r.PlacementsOut != r.PlacementsIn*float64(r.Replicas-1) {
			tb.Errorf("NATS row not sane: %+v", r)
		}
		if i > 0 && (r.PlacementBytesOut <= fs.NATS[i-1].PlacementBytesOut || r.LoadOut <= fs.NATS[i-1].LoadOut) {
			tb.Errorf("NATS egress does not grow with replicas: %+v after %+v", r, fs.NATS[i-1])
		}
	}
	j := fs.JetStream
	if j.BatchBytes <= 0 || j.MsgsPerSec != float64(wl.TargetWorkers)*wl.BatchesPerWorkerPerSec ||
		math.Abs(j.StorageBytes-j.MsgsPerSec*wl.RetentionSeconds*float64(j.RecordBytes)*float64(wl.StreamReplicas)) > 1 {
		tb.Errorf("JetStream sizing not sane: %+v", j)
	}
}

func TestFleetScaleQuick(t *testing.T) { runFleetScaleQuick(t) }

// BenchmarkFleetScaleQuick is the fleet scale study's quick path in
// `make bench-smoke`, so that the driver does not rot; the real study is
// `kvrelay bench --only fleetscale` (BENCHMARKS.md).
func BenchmarkFleetScaleQuick(b *testing.B) {
	for b.Loop() {
		runFleetScaleQuick(b)
	}
}

func TestFitCurve(t *testing.T) {
	for _, tc := range []struct {
		model string
		a, b  float64
	}{
		{"linear", 3, 2},
		{"n log n", 10, 0.5},
		{"log", -1, 4},
	} {
		var pts []xy
		for _, x := range []float64{250, 500, 1000, 2000, 4000} {
			pts = append(pts, xy{x, tc.a + tc.b*transform(tc.model, x)})
		}
		c, err := fitCurve(pts, tc.model)
		if err != nil {
			t.Fatal(err)
		}
		if math.Abs(c.A-tc.a) > 1e-6*math.Max(1, math.Abs(tc.a)) || math.Abs(c.B-tc.b) > 1e-9*math.Max(1, math.Abs(tc.b)) ||
			c.R2 < 0.999999 || c.MaxResidualPct > 1e-6 {
			t.Errorf("%s: fitted A=%g B=%g R²=%g residual %g%%, want A=%g B=%g exactly", tc.model, c.A, c.B, c.R2, c.MaxResidualPct, tc.a, tc.b)
		}
	}
	// Noisy points: the residual is reported.
	c, err := fitCurve([]xy{{1, 1}, {2, 3}, {3, 2}}, "linear")
	if err != nil || c.MaxResidualPct == 0 || c.R2 >= 1 {
		t.Errorf("noisy fit: %+v, %v", c, err)
	}
	// Noise with no trend is refused (R² below MinFitR2) and projects as
	// the measured range, never as an extrapolated line.
	flat := []xy{{250, 21}, {500, 27}, {1000, 19}, {2000, 26}, {4000, 20}, {8000, 28}}
	var fits []CurveFit
	for _, model := range []string{"log", "linear"} {
		c, err := fitCurve(flat, model)
		if err != nil {
			t.Fatal(err)
		}
		if c.Accepted || c.R2 >= MinFitR2 {
			t.Errorf("flat noise: %s fit accepted with R² %.3f", model, c.R2)
		}
		c.At = c.Eval(10 * 8000)
		fits = append(fits, c)
	}
	if b := projectBand(fits, flat); b.Basis != BasisMeasured || b.Low != 19 || b.High != 28 || b.MeasuredMaxX != 8000 || len(b.Models) != 0 {
		t.Errorf("flat noise: band %+v, want the measured range 19–28", b)
	}
	if bestAccepted(fits, flat) != nil {
		t.Errorf("flat noise: a fit was chosen")
	}
	// Two accepted models give a band between their values.
	var lines []CurveFit
	for _, model := range []string{"linear", "n log n"} {
		var pts []xy
		for _, x := range []float64{250, 500, 1000, 2000, 4000} {
			pts = append(pts, xy{x, 5 + 2*x})
		}
		c, err := fitCurve(pts, model)
		if err != nil {
			t.Fatal(err)
		}
		c.At = c.Eval(10_000)
		lines = append(lines, c)
	}
	if b := projectBand(lines, []xy{{250, 505}, {4000, 8005}}); b.Basis != BasisFits || len(b.Models) != 2 ||
		b.Low != min(lines[0].At, lines[1].At) || b.High != max(lines[0].At, lines[1].At) {
		t.Errorf("two accepted fits: band %+v from %+v", b, lines)
	}
	// One size only cannot make a curve.
	if _, err := fitCurve([]xy{{5, 1}, {5, 2}}, "linear"); err == nil || !strings.Contains(err.Error(), "two sizes") {
		t.Errorf("one size: %v, want an error naming the need for two sizes", err)
	}
}

// The NATS figures come from placementsync's own encoders: a placement of
// n blocks is n·8 bytes of hashes plus its framing and subject.
func TestNATSLoadUsesTheWire(t *testing.T) {
	wl := fleetWorkload(true)
	rows := natsLoad(&wl)
	hashes := make([]uint64, wl.NewBlocksPerRequest)
	want := len(placementsync.PlacementSubject("", "meta-llama-3-8b")) + len(placementsync.PlacementMessage(workerName(wl.TargetWorkers-1), hashes))
	if rows[0].PlacementBytes != want || want < 8*wl.NewBlocksPerRequest {
		t.Errorf("placement bytes %d, want %d", rows[0].PlacementBytes, want)
	}
	// One replica shares nothing.
	if rows[0].PlacementsOut != 0 || rows[0].LoadIn != 0 {
		t.Errorf("one replica: %+v", rows[0])
	}
}
