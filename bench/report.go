package bench

import (
	"fmt"
	"io"
	"math"
	"path/filepath"
	"strings"
)

// WriteMarkdown writes res as the tables of BENCHMARKS.md.
func WriteMarkdown(w io.Writer, res *Results) {
	m := res.Machine
	fmt.Fprintf(w, "## Run of %s (%s)\n\n", res.Started.UTC().Format("2006-01-02 15:04 MST"), res.Duration)
	if res.Quick {
		fmt.Fprintf(w, "**Quick mode: a smoke run; these figures mean nothing.**\n\n")
	}
	fmt.Fprintf(w, "Machine: %d CPUs (%s), %s RAM, Linux %s, %s; Python %s. Load average %s before, %s after.\n\n",
		m.CPUs, m.CPUModel, m.MemTotal, m.Kernel, m.GoVersion, orNA(m.Python), m.LoadBefore, m.LoadAfter)
	if sb := res.SideBySide; sb != nil {
		writeSideBySide(w, sb)
	}
	writeGoals(w, res)
	if sc := res.Scale; sc != nil {
		writeScale(w, sc)
	}
	if rt := res.Route; rt != nil {
		writeRoute(w, rt)
	}
	if pr := res.Policy; pr != nil {
		writePolicy(w, pr)
	}
	if fs := res.FleetScale; fs != nil {
		writeFleetScale(w, fs)
	}
	if lt := res.Latency; lt != nil {
		writeLatency(w, lt)
	}
	if pr := res.Pacing; pr != nil {
		writePacing(w, pr)
	}
	if len(res.Plots) > 0 || len(res.Profiles) > 0 {
		fmt.Fprintf(w, "Plots: %s. CPU profiles: %s.\n\n", baseNames(res.Plots), baseNames(res.Profiles))
	}
}

func baseNames(paths []string) string {
	if len(paths) == 0 {
		return "none"
	}
	out := make([]string, len(paths))
	for i, p := range paths {
		out[i] = filepath.Base(p)
	}
	return strings.Join(out, ", ")
}

func orNA(s string) string {
	if s == "" {
		return "n/a"
	}
	return s
}

// step is the last attempt at target.
func (r *RelayRun) step(target float64) *Step {
	for i := len(r.Steps) - 1; i >= 0; i-- {
		if r.Steps[i].Target == target {
			return &r.Steps[i]
		}
	}
	return nil
}

// figure is one row of the summary: a value per relay, or none.
type figure struct {
	name   string
	kv     float64
	py     float64
	ctl    float64 // the control without a relay, for latency rows
	hasKV  bool
	hasPy  bool
	hasCtl bool
	fmt    string
	note   string
}

func summaryFigures(sb *SideBySide) []figure {
	if len(sb.Relays) < 2 {
		return nil
	}
	kv, py := &sb.Relays[0], &sb.Relays[1]
	var out []figure
	add := func(name, format string, get func(r *RelayRun) (float64, bool)) {
		f := figure{name: name, fmt: format}
		if kv.Available {
			f.kv, f.hasKV = get(kv)
		}
		if py.Available {
			f.py, f.hasPy = get(py)
		}
		if len(sb.Relays) > 2 && sb.Relays[2].Available && strings.HasPrefix(name, "latency") {
			f.ctl, f.hasCtl = get(&sb.Relays[2])
		}
		out = append(out, f)
	}
	sustained := func(r *RelayRun) (float64, bool) { return r.Sustained, r.Sustained > 0 }
	add("sustained batches/s", "%.0f", sustained)
	add("sustained blocks/s", "%.0f", func(r *RelayRun) (float64, bool) { v, ok := sustained(r); return v * storeBlocks, ok })
	// What one fully used core would carry at the measured CPU cost: derived,
	// not measured, but it does not depend on how busy the host was.
	add("blocks/s per CPU core at 1000 batches/s (derived: 10⁶ / CPU s per M blocks)", "%.0f", func(r *RelayRun) (float64, bool) {
		s := r.step(1000)
		if s == nil || !r.Measured || s.CPUPerMBlocks == 0 {
			return 0, false
		}
		return 1e6 / s.CPUPerMBlocks, true
	})
	for _, rate := range []float64{1000, 10000} {
		for _, q := range []struct {
			name string
			get  func(*Step) float64
		}{{"p50", func(s *Step) float64 { return s.P50ms }}, {"p99", func(s *Step) float64 { return s.P99ms }}, {"p99.9", func(s *Step) float64 { return s.P999ms }}} {
			add(fmt.Sprintf("latency %s at %.0f batches/s (ms)", q.name, rate), "%.2f", func(r *RelayRun) (float64, bool) {
				s := r.step(rate)
				if s == nil || s.Received == 0 {
					return 0, false
				}
				return q.get(s), true
			})
		}
	}
	for _, rate := range []float64{1000, 10000} {
		add(fmt.Sprintf("CPU s per million blocks at %.0f batches/s", rate), "%.2f", func(r *RelayRun) (float64, bool) {
			s := r.step(rate)
			if s == nil || !r.Measured || s.Received == 0 {
				return 0, false
			}
			return s.CPUPerMBlocks, true
		})
	}
	add("peak RSS while keeping up (MiB)", "%.1f", func(r *RelayRun) (float64, bool) {
		return float64(r.SteadyRSS) / (1 << 20), r.Measured && r.SteadyRSS > 0
	})
	add("peak RSS over the whole ramp, overload included (MiB)", "%.1f", func(r *RelayRun) (float64, bool) {
		return float64(r.PeakRSS) / (1 << 20), r.Measured && r.PeakRSS > 0
	})
	// Annotate figures taken where a relay did not keep up.
	for i := range out {
		for _, rate := range []float64{1000, 10000} {
			if !strings.Contains(out[i].name, fmt.Sprintf("at %.0f ", rate)) {
				continue
			}
			var notes []string
			for _, r := range []*RelayRun{kv, py} {
				if s := r.step(rate); s != nil && !s.Pass {
					notes = append(notes, ShortName(r.Name)+" fell behind")
				}
			}
			out[i].note = strings.Join(notes, "; ")
		}
	}
	if kv.PublisherBound {
		out[0].note, out[1].note = "kvrelay: publisher-bound, a lower bound", "kvrelay: publisher-bound, a lower bound"
	}
	return out
}

func writeSideBySide(w io.Writer, sb *SideBySide) {
	fmt.Fprintf(w, "### kvrelay and SMG's Python relay, same stream\n\nStream: %s.\n\n", sb.Shape)
	for _, r := range sb.Relays {
		if !r.Available {
			fmt.Fprintf(w, "- %s: %s\n", r.Name, r.Reason)
		}
	}
	fmt.Fprintf(w, "\n| figure | kvrelay | Python relay | kvrelay / Python | no relay (host floor) | note |\n|---|---:|---:|---:|---:|---|\n")
	for _, f := range summaryFigures(sb) {
		kv, py, ratio := cellFor(&sb.Relays[0], f.name), cellFor(&sb.Relays[1], f.name), "–"
		if f.hasKV {
			kv = fmt.Sprintf(f.fmt, f.kv)
		}
		if f.hasPy {
			py = fmt.Sprintf(f.fmt, f.py)
		}
		if f.hasKV && f.hasPy && f.py != 0 {
			ratio = ratioText(f.kv / f.py)
		}
		ctl := "–"
		if f.hasCtl {
			ctl = fmt.Sprintf(f.fmt, f.ctl)
		}
		fmt.Fprintf(w, "| %s | %s | %s | %s | %s | %s |\n", f.name, kv, py, ratio, ctl, f.note)
	}
	fmt.Fprintln(w)
	for _, r := range sb.Relays {
		if !r.Available {
			continue
		}
		fmt.Fprintf(w, "#### %s, every step\n\n", r.Name)
		if r.Reason != "" {
			fmt.Fprintf(w, "%s.\n\n", r.Reason)
		}
		fmt.Fprintf(w, "| target/s | published/s | delivered/s | missing | p50 ms | p99 ms | p99.9 ms | max ms | end-of-step p50 ms | CPU s | CPU s/M blocks | CPU util | peak RSS MiB | publisher CPU | bench (subscriber) CPU | verdict |\n")
		fmt.Fprintf(w, "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|\n")
		for _, s := range r.Steps {
			cpu, per, util, rss := "n/a", "n/a", "n/a", "n/a"
			if r.Measured {
				cpu, per, util = fmt.Sprintf("%.2f", s.CPUSeconds), fmt.Sprintf("%.2f", s.CPUPerMBlocks), fmt.Sprintf("%.0f%%", 100*s.CPUUtil)
				rss = fmt.Sprintf("%.1f", float64(s.PeakRSS)/(1<<20))
			}
			target := fmt.Sprintf("%.0f", s.Target)
			if s.Attempt > 1 {
				target += " (again)"
			}
			fmt.Fprintf(w, "| %s | %.0f | %.0f | %d | %.2f | %.2f | %.2f | %.1f | %.2f | %s | %s | %s | %s | %.0f%% | %.0f%% | %s |\n",
				target, s.PublishedRate, s.DeliveredRate, s.Missing, s.P50ms, s.P99ms, s.P999ms, s.MaxMs, s.TailP50ms, cpu, per, util, rss,
				100*s.PublisherCPUUtil, 100*s.SubscriberCPUUtil, s.Verdict)
		}
		fmt.Fprintln(w)
	}
}

// cellFor is what a summary cell says when the relay has no figure.
func cellFor(r *RelayRun, figure string) string {
	switch {
	case !r.Available:
		return "not available"
	case strings.HasPrefix(figure, "sustained") && len(r.Steps) > 0:
		return fmt.Sprintf("< %.0f batches/s (behind at every step)", r.Steps[0].Target)
	case !r.Measured && (strings.Contains(figure, "CPU") || strings.Contains(figure, "RSS")):
		return "n/a (in-process)"
	}
	return "–"
}

func ratioText(r float64) string {
	if math.IsInf(r, 0) || math.IsNaN(r) {
		return "–"
	}
	if r >= 10 {
		return fmt.Sprintf("%.0f×", r)
	}
	return fmt.Sprintf("%.2f×", r)
}

// Goal is one target of issue 7 and what was measured against it.
type Goal struct {
	Goal     string
	Measured string
	Status   string // met, not met, not measured
}

// Goals compares res with the goals of issue 7.
func Goals(res *Results) []Goal {
	var out []Goal
	status := func(ok bool) string {
		if ok {
			return "met"
		}
		return "not met"
	}
	notMeasured := func(goal, why string) Goal { return Goal{goal, why, "not measured"} }
	var kv, py *RelayRun
	if sb := res.SideBySide; sb != nil && len(sb.Relays) >= 2 && sb.Relays[0].Available && sb.Relays[1].Available {
		kv, py = &sb.Relays[0], &sb.Relays[1]
	}
	const gThr, gCPU, gP99, gSnap, gRoute = "≥ 20× the Python relay's sustained throughput", "≤ 1/10 of the Python relay's CPU per block",
		"p99 ≤ 2 ms at 10,000 batches/s", "snapshot lock ≤ 5 ms at 1M live blocks", "route ≤ 20 µs median at 8k tokens × 128 workers"
	const gRoute512 = "route ≤ 25 µs median at 8k tokens × 512 workers"
	if kv != nil && py.Sustained > 0 && kv.Sustained > 0 {
		r := kv.Sustained / py.Sustained
		g := Goal{gThr, fmt.Sprintf("%s (%.0f vs %.0f batches/s)", ratioText(r), kv.Sustained, py.Sustained), status(r >= 20)}
		if kv.PublisherBound {
			g.Measured += "; kvrelay's figure is the publisher's ceiling, a lower bound"
			if r < 20 {
				g.Status = "not shown (publisher-bound)"
			}
		}
		out = append(out, g)
	} else {
		out = append(out, notMeasured(gThr, "side-by-side not run or a relay unavailable"))
	}
	cpuGoal := notMeasured(gCPU, "side-by-side not run, a relay unavailable, or kvrelay in-process")
	if kv != nil && kv.Measured {
		var parts []string
		worst := 0.0
		for _, rate := range []float64{1000, 10000} {
			a, b := kv.step(rate), py.step(rate)
			if a == nil || b == nil || b.CPUPerMBlocks == 0 || a.Received == 0 {
				continue
			}
			r := a.CPUPerMBlocks / b.CPUPerMBlocks
			worst = max(worst, r)
			note := ""
			if !b.Pass {
				note = ", Python behind"
			}
			parts = append(parts, fmt.Sprintf("%s at %.0f/s (%.2f vs %.2f s/M blocks%s)", ratioText(r), rate, a.CPUPerMBlocks, b.CPUPerMBlocks, note))
		}
		if len(parts) > 0 {
			cpuGoal = Goal{gCPU, strings.Join(parts, "; "), status(worst <= 0.1)}
		}
	}
	out = append(out, cpuGoal)
	if res.SideBySide != nil && len(res.SideBySide.Relays) > 0 {
		if s := res.SideBySide.Relays[0].step(10000); s != nil && s.Received > 0 {
			out = append(out, Goal{gP99, fmt.Sprintf("%.2f ms (p50 %.2f, p99.9 %.2f)", s.P99ms, s.P50ms, s.P999ms), status(s.P99ms <= 2 && s.Pass)})
		} else {
			out = append(out, notMeasured(gP99, "no 10,000 batches/s step"))
		}
	} else {
		out = append(out, notMeasured(gP99, "side-by-side not run"))
	}
	snap := notMeasured(gSnap, "no 1M-block point")
	if res.Scale != nil {
		for _, p := range res.Scale.Snapshot {
			if p.Blocks == 1_000_000 {
				snap = Goal{gSnap, fmt.Sprintf("%.2f ms median, %.2f ms worst of %d", p.LockMs, p.LockMaxMs, p.Reps), status(p.LockMs <= 5)}
			}
		}
	}
	out = append(out, snap)
	for _, rg := range []struct {
		goal    string
		workers int
		limitUs float64
	}{{gRoute, 128, 20}, {gRoute512, 512, 25}} {
		route := notMeasured(rg.goal, fmt.Sprintf("no 8k-token × %d-worker point", rg.workers))
		if res.Route != nil {
			for _, p := range res.Route.Points {
				if p.Workers == rg.workers && p.PromptTokens == 8192 {
					route = Goal{rg.goal, fmt.Sprintf("%.1f µs median wall (lookup %.1f µs), %.1f µs median thread CPU (pick %.2f µs), p99 %.1f µs; "+
						"with placements (the default) %.1f µs wall, %.1f µs CPU",
						p.RouteP50us, p.FindP50us, p.RouteCPUP50us, p.PickCPUP50us, p.RouteP99us, p.PlacedRouteP50us, p.PlacedRouteCPUP50us),
						status(max(p.RouteP50us, p.PlacedRouteP50us) <= rg.limitUs)}
				}
			}
		}
		out = append(out, route)
	}
	return out
}

func writeGoals(w io.Writer, res *Results) {
	fmt.Fprintf(w, "### Goals of issue 7\n\n| goal | measured | status |\n|---|---|---|\n")
	for _, g := range Goals(res) {
		fmt.Fprintf(w, "| %s | %s | %s |\n", g.Goal, g.Measured, g.Status)
	}
	fmt.Fprintln(w)
}

func writeScale(w io.Writer, sc *ScaleResults) {
	fmt.Fprintf(w, "### Relay memory and snapshot time vs live blocks\n\n| live blocks | heap MiB | heap B/block | lock ms (median) | lock ms (worst) | snapshot ms (median) | chunks |\n|---:|---:|---:|---:|---:|---:|---:|\n")
	for _, p := range sc.Snapshot {
		fmt.Fprintf(w, "| %d | %.1f | %.0f | %.3f | %.3f | %.1f | %d |\n", p.Blocks, float64(p.HeapBytes)/(1<<20), p.BytesPerBlock, p.LockMs, p.LockMaxMs, p.TotalMs, p.Chunks)
	}
	fmt.Fprintf(w, "\n### Resume from a cursor vs history window (gRPC, loopback)\n\n| window (batches) | relay heap MiB (window full) | heap KiB/batch | batches resumed | ms (median) | batches/s |\n|---:|---:|---:|---:|---:|---:|\n")
	for _, p := range sc.Resume {
		fmt.Fprintf(w, "| %d | %.1f | %.1f | %d | %.1f | %.0f |\n", p.Window, float64(p.HeapBytes)/(1<<20), float64(p.HeapBytes)/1024/float64(p.Window), p.Batches, p.Ms, p.BatchesPerSec)
	}
	fmt.Fprintf(w, "\n### Fan-out vs gRPC subscribers (burst from memory, 2 ranks, 64-block stores)\n\n| subscribers | batches | seconds | per subscriber batches/s | aggregate batches/s | aggregate blocks/s | CPU s | deliveries per CPU s |\n|---:|---:|---:|---:|---:|---:|---:|---:|\n")
	for _, p := range sc.Fanout {
		name := fmt.Sprint(p.Subscribers)
		if p.Subscribers == 0 {
			name = "0 (ingest only)"
		}
		fmt.Fprintf(w, "| %s | %d | %.2f | %.0f | %.0f | %.0f | %.2f | %.0f |\n", name, p.Batches, p.Seconds, p.PerSubscriber, p.Aggregate, p.BlocksPerSec, p.CPUSeconds, p.BatchesPerCPU)
	}
	fmt.Fprintln(w)
}

func writeRoute(w io.Writer, rt *RouteResults) {
	fmt.Fprintf(w, "### Gateway route latency vs workers and prompt length\n\nWorkload: %s.\n\n| workers | prompt tokens | indexed blocks | lookup p50 µs | route p50 µs | route p99 µs | route CPU p50 µs | pick CPU p50 µs | with placements: route p50 µs | route CPU p50 µs |\n|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n", rt.Workload)
	for _, p := range rt.Points {
		fmt.Fprintf(w, "| %d | %d | %d | %.1f | %.1f | %.1f | %.1f | %.2f | %.1f | %.1f |\n", p.Workers, p.PromptTokens, p.IndexBlocks, p.FindP50us, p.RouteP50us, p.RouteP99us, p.RouteCPUP50us, p.PickCPUP50us,
			p.PlacedRouteP50us, p.PlacedRouteCPUP50us)
	}
	fmt.Fprintln(w)
}

// ShortName is a relay run's name as the tables and plots show it.
func ShortName(name string) string {
	switch {
	case strings.HasPrefix(name, "python"):
		return "python"
	case strings.HasPrefix(name, "no relay"):
		return "no relay"
	}
	return name
}
