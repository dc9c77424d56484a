// Package charts draws a bench run's curves as PNGs. It is kept out of the
// bench package so that the kvrelay daemon binary does not link the
// plotting stack (gonum/plot, golang.org/x/image): cmd/kvrelay-plot draws
// them from results.json after `kvrelay bench`.
package charts

import (
	"fmt"
	"math"
	"path/filepath"
	"slices"
	"sort"
	"strconv"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/plotutil"
	"gonum.org/v1/plot/vg"

	"github.com/kvrelay/kvrelay/bench"
)

// series is one named line.
type series struct {
	name string
	xy   plotter.XYs
}

type chart struct {
	file, title, x, y string
	logX, logY        bool
	lines             []series
}

// Draw renders the curves present in res as PNGs under out and returns
// their paths.
func Draw(out string, res *bench.Results) ([]string, error) {
	var charts []chart
	if sb := res.SideBySide; sb != nil {
		lat := chart{file: "latency.png", title: "Publisher-to-subscriber latency", x: "published batches/s (target)", y: "ms", logX: true, logY: true}
		thr := chart{file: "throughput.png", title: "Delivered vs published rate", x: "published batches/s (target)", y: "delivered batches/s", logX: true, logY: true}
		for _, r := range sb.Relays {
			var p50, p99, del plotter.XYs
			for _, s := range r.Steps {
				p50 = append(p50, plotter.XY{X: s.Target, Y: s.P50ms})
				p99 = append(p99, plotter.XY{X: s.Target, Y: s.P99ms})
				del = append(del, plotter.XY{X: s.Target, Y: s.DeliveredRate})
			}
			short := bench.ShortName(r.Name)
			lat.lines = append(lat.lines, series{short + " p50", p50}, series{short + " p99", p99})
			thr.lines = append(thr.lines, series{short, del})
		}
		charts = append(charts, lat, thr)
	}
	if sc := res.Scale; sc != nil {
		snap := chart{file: "snapshot.png", title: "Snapshot time vs live blocks", x: "live blocks", y: "ms", logX: true, logY: true}
		mem := chart{file: "memory.png", title: "Relay heap vs live blocks", x: "live blocks", y: "MiB", logX: true, logY: true}
		var lock, total, heap plotter.XYs
		for _, p := range sc.Snapshot {
			lock = append(lock, plotter.XY{X: float64(p.Blocks), Y: p.LockMs})
			total = append(total, plotter.XY{X: float64(p.Blocks), Y: p.TotalMs})
			heap = append(heap, plotter.XY{X: float64(p.Blocks), Y: float64(p.HeapBytes) / (1 << 20)})
		}
		snap.lines = []series{{"under the admission lock", lock}, {"whole snapshot (cut, order, encode)", total}}
		mem.lines = []series{{"heap after GC", heap}}
		res := chart{file: "resume.png", title: "Resume from a cursor a whole window back (gRPC)", x: "history window (batches)", y: "ms", logX: true, logY: true}
		var rs plotter.XYs
		for _, p := range sc.Resume {
			rs = append(rs, plotter.XY{X: float64(p.Window), Y: p.Ms})
		}
		res.lines = []series{{"call to last batch", rs}}
		fan := chart{file: "fanout.png", title: "Fan-out throughput vs gRPC subscribers", x: "subscribers", y: "batches/s", logX: true}
		var agg, per plotter.XYs
		for _, p := range sc.Fanout {
			if p.Subscribers == 0 {
				continue
			}
			agg = append(agg, plotter.XY{X: float64(p.Subscribers), Y: p.Aggregate})
			per = append(per, plotter.XY{X: float64(p.Subscribers), Y: p.PerSubscriber})
		}
		fan.lines = []series{{"aggregate", agg}, {"per subscriber", per}}
		charts = append(charts, snap, mem, res, fan)
	}
	if rt := res.Route; rt != nil {
		route := chart{file: "route.png", title: "Gateway route latency (lookup + pick), median", x: "prompt tokens", y: "µs", logX: true, logY: true}
		byWorkers := map[int]plotter.XYs{}
		var order []int
		for _, p := range rt.Points {
			if _, ok := byWorkers[p.Workers]; !ok {
				order = append(order, p.Workers)
			}
			byWorkers[p.Workers] = append(byWorkers[p.Workers], plotter.XY{X: float64(p.PromptTokens), Y: p.RouteP50us})
		}
		for _, w := range order {
			route.lines = append(route.lines, series{fmt.Sprintf("%d workers", w), byWorkers[w]})
		}
		charts = append(charts, route)
	}
	if fs := res.FleetScale; fs != nil {
		charts = append(charts, fleetCharts(fs)...)
	}
	var files []string
	for _, c := range charts {
		path := filepath.Join(out, c.file)
		ok, err := c.draw(path)
		if err != nil {
			return nil, fmt.Errorf("plot %s: %w", c.file, err)
		}
		if ok {
			files = append(files, path)
		}
	}
	return files, nil
}

// draw saves the chart; it draws nothing (false) when no line has a point
// a log axis can show.
func (c chart) draw(path string) (bool, error) {
	p := plot.New()
	p.Title.Text = c.title
	p.X.Label.Text = c.x
	p.Y.Label.Text = c.y
	p.Legend.Top = true
	p.Legend.Left = true
	p.Legend.Padding = vg.Points(4)
	if c.logX {
		p.X.Scale = plot.LogScale{}
		// Decade ticks leave a one-decade axis unlabelled: label the
		// measured points instead.
		p.X.Tick.Marker = pointTicks(c.lines)
	}
	if c.logY {
		p.Y.Scale = plot.LogScale{}
		p.Y.Tick.Marker = plot.LogTicks{Prec: -1}
	}
	var args []any
	for _, s := range c.lines {
		var xy plotter.XYs
		for _, pt := range s.xy {
			if (c.logX && pt.X <= 0) || (c.logY && pt.Y <= 0) {
				continue
			}
			xy = append(xy, pt)
		}
		if len(xy) > 0 {
			args = append(args, s.name, xy)
		}
	}
	if len(args) == 0 {
		return false, nil
	}
	if err := plotutil.AddLinePoints(p, args...); err != nil {
		return false, err
	}
	p.Add(plotter.NewGrid())
	return true, p.Save(7*vg.Inch, 4.5*vg.Inch, path)
}

// pointTicks labels every x value that some line has.
func pointTicks(lines []series) plot.ConstantTicks {
	seen := map[float64]bool{}
	var ticks plot.ConstantTicks
	for _, l := range lines {
		for _, pt := range l.xy {
			if pt.X > 0 && !seen[pt.X] {
				seen[pt.X] = true
				ticks = append(ticks, plot.Tick{Value: pt.X, Label: shortNumber(pt.X)})
			}
		}
	}
	sort.Slice(ticks, func(i, j int) bool { return ticks[i].Value < ticks[j].Value })
	return ticks
}

// shortNumber writes 1000 as 1k and 1000000 as 1M.
func shortNumber(v float64) string {
	switch {
	case v >= 1e6 && math.Mod(v, 1e5) == 0:
		return strconv.FormatFloat(v/1e6, 'f', -1, 64) + "M"
	case v >= 1e3 && math.Mod(v, 100) == 0:
		return strconv.FormatFloat(v/1e3, 'f', -1, 64) + "k"
	}
	return strconv.FormatFloat(v, 'f', -1, 64)
}

// fleetCharts are the fleet scale study's curves: measured medians and the
// chosen fit, drawn on to the target fleet so that the extrapolated part
// is visibly a line beyond the points.
func fleetCharts(fs *bench.FleetScaleResults) []chart {
	wl := fs.Workload
	target := float64(wl.TargetWorkers)
	along := func(xs []float64, f func(x float64) float64) plotter.XYs {
		var out plotter.XYs
		for _, x := range append(slices.Clone(xs), target) {
			out = append(out, plotter.XY{X: x, Y: f(x)})
		}
		return out
	}
	points := func(xs, ys []float64, scale float64) plotter.XYs {
		var out plotter.XYs
		for i := range xs {
			out = append(out, plotter.XY{X: xs[i], Y: ys[i] * scale})
		}
		return out
	}
	blocks := float64(wl.CacheBlocks)
	mem := chart{file: "fleet-memory.png", title: fmt.Sprintf("Gateway index heap vs workers (%d-block caches)", wl.CacheBlocks), x: "workers", y: "MiB", logX: true, logY: true}
	xs, heap := bench.FleetMedians(fs, func(p bench.GatewayScalePoint) float64 { return float64(p.HeapBytes) })
	mem.lines = append(mem.lines, series{"measured (median)", points(xs, heap, 1.0/(1<<20))})
	if f := fs.ChosenFit(bench.FitIndexHeap); f != nil {
		mem.lines = append(mem.lines, series{"fit (" + f.Model + "), extrapolated", along(xs, func(x float64) float64 { return f.Eval(x*blocks) / (1 << 20) })})
	}
	cpu := chart{file: "fleet-cpu.png", title: fmt.Sprintf("Gateway CPU applying events at %.0f batches/s a worker", wl.BatchesPerWorkerPerSec), x: "workers", y: "CPU-s per s", logX: true, logY: true}
	xs, cps := bench.FleetMedians(fs, func(p bench.GatewayScalePoint) float64 { return p.CPUPerSecond })
	cpu.lines = append(cpu.lines, series{"measured (median)", points(xs, cps, 1)})
	if f := fs.ChosenFit(bench.FitApplyCPU); f != nil {
		cpu.lines = append(cpu.lines, series{"fit (" + f.Model + " per batch), extrapolated", along(xs, func(x float64) float64 {
			return x * wl.BatchesPerWorkerPerSec * f.Eval(x*blocks) / 1e6
		})})
	}
	route := chart{file: "fleet-route.png", title: "Gateway route (lookup + pick) vs workers", x: "workers", y: "µs", logX: true, logY: true}
	for _, q := range []struct {
		name, fit string
		get       func(bench.GatewayScalePoint) float64
	}{
		{"p50", bench.FitRouteP50, func(p bench.GatewayScalePoint) float64 { return p.RouteP50us }},
		{"CPU p99", bench.FitRouteP99, func(p bench.GatewayScalePoint) float64 { return p.RouteCPUP99us }},
	} {
		xs, ys := bench.FleetMedians(fs, q.get)
		route.lines = append(route.lines, series{q.name + " measured", points(xs, ys, 1)})
		if f := fs.ChosenFit(q.fit); f != nil {
			route.lines = append(route.lines, series{q.name + " fit (" + f.Model + ")", along(xs, f.Eval)})
		}
	}
	fan := chart{file: "fleet-fanout.png", title: "Relay CPU per batch vs gateway subscribers", x: "gateway subscribers", y: "µs per batch", logX: true}
	var fx, fy []float64
	for _, n := range wl.Subscribers {
		var v []float64
		for _, p := range fs.Fanout {
			if p.Subscribers == n {
				v = append(v, p.CPUPerBatchUs)
			}
		}
		if len(v) > 0 {
			slices.Sort(v)
			fx, fy = append(fx, float64(n)), append(fy, v[len(v)/2])
		}
	}
	fan.lines = append(fan.lines, series{"measured (median)", points(fx, fy, 1)})
	if f := fs.ChosenFit(bench.FitRelayCPU); f != nil {
		var line plotter.XYs
		for _, x := range fx {
			line = append(line, plotter.XY{X: x, Y: f.Eval(x)})
		}
		fan.lines = append(fan.lines, series{"fit (" + f.Model + ")", line})
	}
	return []chart{mem, cpu, route, fan}
}
