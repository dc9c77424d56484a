package demo

import (
	"context"
	"fmt"
	"strings"
	"time"

	"github.com/kvrelay/kvrelay/sim"
)

// counters is what a fault's description is computed from: before and
// after, per worker.
type counters struct {
	relay   []RelayCounters
	dropped []uint64 // batches the simulator withheld from the live stream
	pending []int    // batches a pause holds back right now
}

func (d *demo) counters() counters {
	var c counters
	for _, w := range d.workers {
		c.relay = append(c.relay, readRelayCounters(w.regs))
		var dropped uint64
		var pending int
		for _, ps := range w.eng.PublisherStats() {
			dropped += ps.Dropped
			pending += ps.Pending
		}
		c.dropped = append(c.dropped, dropped)
		c.pending = append(c.pending, pending)
	}
	return c
}

// delta is after minus before, summed over workers.
type delta struct {
	RelayCounters
	dropped uint64
}

func diff(before, after counters) delta {
	var d delta
	for i := range after.relay {
		d.RelayCounters = d.RelayCounters.plus(after.relay[i].minus(before.relay[i]))
		d.dropped += after.dropped[i] - before.dropped[i]
	}
	return d
}

// fault is one scripted fault: inject does it (with traffic) and lifts it,
// describe turns the measured counters into the table's explanation, and
// cleanup runs after the check.
type fault struct {
	name     string
	inject   func(ctx context.Context, f *faultRun) error
	describe func(f *faultRun, d delta) string
	cleanup  func() error
}

// faultRun carries what an injection observed for its description.
type faultRun struct {
	staleRows int // rows the index lagged by while the fault was on
	held      int
	cut       int
	down      time.Duration
}

func ptr(i int) *int { return &i }

// The truncated-replay fault: the engine withholds every batch for
// truncateSteps steps, so the relay must replay a run of them, and cuts each
// replay answer after truncateAfter messages. Each cut answer costs the
// relay one reply timeout (no end marker arrives), so the run is kept short.
const (
	truncateSteps = 6
	truncateAfter = 3
)

func (d *demo) faults() []fault {
	a, b := d.workers[0], d.workers[1]
	faultAll := func(f sim.Fault) error {
		for _, w := range d.workers {
			if err := w.eng.Fault(f); err != nil {
				return err
			}
		}
		return nil
	}
	return []fault{
		{
			name: "dropped live batches",
			inject: func(ctx context.Context, f *faultRun) error {
				if err := faultAll(sim.Fault{Kind: sim.FaultDropEvery, N: 3}); err != nil {
					return err
				}
				if err := d.traffic(ctx, 30); err != nil {
					return err
				}
				return faultAll(sim.Fault{Kind: sim.FaultDropEvery, N: 0})
			},
			describe: func(_ *faultRun, x delta) string {
				return fmt.Sprintf("every 3rd batch withheld from the live stream on all %d ranks: %d dropped; relays saw %d gaps and recovered %d batches by replay, %d lost", len(d.workers)*dpSize,
					x.dropped, x.Gaps, x.Recovered, x.Lost)
			},
		},
		{
			name: "publisher restart",
			inject: func(ctx context.Context, f *faultRun) error {
				// vLLM loses its cache silently on restart; SGLang announces
				// the empty cache with its startup clear.
				if err := a.eng.Fault(sim.Fault{Kind: sim.FaultRestart, Rank: ptr(0)}); err != nil {
					return err
				}
				if err := b.eng.Fault(sim.Fault{Kind: sim.FaultRestart, Rank: ptr(1)}); err != nil {
					return err
				}
				return d.traffic(ctx, 20)
			},
			describe: func(_ *faultRun, x delta) string {
				return fmt.Sprintf("%s rank 0 and %s rank 1 restarted (sequence back to 0, cache emptied); relays detected %d restarts and recovered %d batches; gateway resynced (snapshots: %d, history resumes: %d)",
					a.id, b.id, x.Restarts, x.Recovered, x.Snapshots, x.HistoryResumes)
			},
		},
		{
			name: "pause/resume",
			inject: func(ctx context.Context, f *faultRun) error {
				if err := b.eng.Fault(sim.Fault{Kind: sim.FaultPause}); err != nil {
					return err
				}
				if err := d.traffic(ctx, 25); err != nil {
					return err
				}
				// While paused the index must lag: the engine's cache moved
				// on, its events did not go out.
				for _, c := range d.compareIndex() {
					f.staleRows += c.Missing + c.Extra + c.WrongCopies
				}
				f.held = d.counters().pending[1]
				return b.eng.Fault(sim.Fault{Kind: sim.FaultResume})
			},
			describe: func(f *faultRun, x delta) string {
				return fmt.Sprintf("%s held %d batches back for 25 steps (the index was %d rows off meanwhile), then sent them in order",
					b.id, f.held, f.staleRows)
			},
		},
		{
			name: "truncated replay",
			inject: func(ctx context.Context, f *faultRun) error {
				if err := a.eng.Fault(sim.Fault{Kind: sim.FaultTruncateReplay, N: truncateAfter}); err != nil {
					return err
				}
				if err := a.eng.Fault(sim.Fault{Kind: sim.FaultDropEvery, N: 1}); err != nil {
					return err
				}
				if err := d.traffic(ctx, truncateSteps); err != nil {
					return err
				}
				// Every rank withholds at least two batches, so with the
				// batch that reveals the gap each replay answer would hold
				// three or more and is surely cut.
				for range 2 {
					if err := d.flush(); err != nil {
						return err
					}
				}
				return a.eng.Fault(sim.Fault{Kind: sim.FaultDropEvery, N: 0})
			},
			describe: func(_ *faultRun, x delta) string {
				return fmt.Sprintf("%s withheld every batch for %d steps (%d batches) and cut replay answers after %d messages; relays resumed %d cut replays and recovered %d batches, %d lost",
					a.id, truncateSteps+2, x.dropped, truncateAfter, x.ReplaysTrunc, x.Recovered, x.Lost)
			},
			cleanup: func() error { return a.eng.Fault(sim.Fault{Kind: sim.FaultTruncateReplay, N: -1}) },
		},
		{
			name: "relay restart",
			inject: func(ctx context.Context, f *faultRun) error {
				start := time.Now()
				b.stopRelay()
				if err := d.traffic(ctx, 15); err != nil {
					return err
				}
				if err := b.startRelay(ctx); err != nil {
					return err
				}
				f.down = time.Since(start)
				return nil
			},
			describe: func(f *faultRun, x delta) string {
				return fmt.Sprintf("%s's relay and gRPC server stopped for %s and restarted on %s; the new relay recovered %d batches from the engine's replay; gateway resynced (snapshots: %d, history resumes: %d, cursors refused: %d)",
					b.id, f.down.Round(10*time.Millisecond), b.relayAddr, x.Recovered, x.Snapshots, x.HistoryResumes, x.OutOfRange)
			},
		},
		{
			name: "gateway stream drop",
			inject: func(ctx context.Context, f *faultRun) error {
				for _, w := range d.workers {
					f.cut += w.proxy.cut()
				}
				return d.traffic(ctx, 10)
			},
			describe: func(f *faultRun, x delta) string {
				return fmt.Sprintf("%d gateway connections reset under open streams; the gateway resubscribed with its cursors (history resumes: %d, snapshots: %d)",
					f.cut, x.HistoryResumes, x.Snapshots)
			},
		},
		{
			name: "gateway restart",
			inject: func(ctx context.Context, f *faultRun) error {
				d.gw.close()
				gw, err := startGateway(ctx, d.workers, d.log)
				if err != nil {
					return err
				}
				d.gw = gw
				// The new gateway's index is empty; routing on it right
				// away is what a restarted gateway does.
				return d.traffic(ctx, 10)
			},
			describe: func(f *faultRun, x delta) string {
				return fmt.Sprintf("a new gateway with an empty index subscribed from zero (snapshots: %d, history replays from sequence 0: %d)",
					x.Snapshots, x.HistoryResumes)
			},
		},
		d.membershipFault(),
	}
}

// runChecks checks the index after the comparison, then after each fault.
func (d *demo) runChecks(ctx context.Context) {
	d.phase = "checking"
	d.report.Checks = append(d.report.Checks, d.checkAfter(ctx, fault{
		name:     "baseline (no fault)",
		inject:   func(context.Context, *faultRun) error { return nil },
		describe: func(*faultRun, delta) string { return "after the comparison traffic" },
	}))
	for _, f := range d.faults() {
		if ctx.Err() != nil {
			return
		}
		d.report.Checks = append(d.report.Checks, d.checkAfter(ctx, f))
	}
}

func (d *demo) checkAfter(ctx context.Context, f fault) Check {
	d.phase = f.name
	d.showProgress(d.prog.term)
	c := Check{Name: f.name}
	before := d.counters()
	var run faultRun
	err := f.inject(ctx, &run)
	if err == nil {
		err = d.flush()
	}
	if err != nil {
		c.Err = err.Error()
		c.Detail = "fault not carried out: " + err.Error()
		return c
	}
	c.Quiescent, c.Settle, c.Refreshes, err = d.quiesce(ctx)
	if err != nil {
		c.Err = err.Error()
	}
	c.Workers = d.compareIndex()
	c.StaleRows = run.staleRows
	c.Detail = f.describe(&run, diff(before, d.counters()))
	if c.Refreshes > 0 {
		c.Detail += fmt.Sprintf(" [not caught up after %s of quiet, so every rank published again (%d time(s)): a relay sees a rank's missing last batch only as a gap before the next]", refreshEvery, c.Refreshes)
	}
	if !c.Quiescent {
		c.Detail += fmt.Sprintf(" [gateway cursors did not reach the engines' last sequences within %s: %s]", quiesceTimeout, d.cursorReport())
	}
	if f.cleanup != nil {
		if err := f.cleanup(); err != nil {
			c.Err = err.Error()
		}
	}
	var sizes []string
	for _, w := range c.Workers {
		sizes = append(sizes, fmt.Sprintf("%s %d/%d", w.Worker, w.IndexRows, w.EngineRows))
	}
	d.prog.log("[%5.1fs] %-20s index exact: %s (%s; %.2f s)",
		time.Since(d.started).Seconds(), f.name, yesNo(c.Exact()), strings.Join(sizes, ", "), c.Settle.Seconds())
	return c
}
