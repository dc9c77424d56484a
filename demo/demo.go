// Package demo is `kvrelay demo`, the README's one-command run: a whole
// kvrelay deployment in one process, driven, faulted and checked.
//
// It starts three simulated engines (one vLLM, two SGLang, two DP ranks each,
// publishing over loopback ZeroMQ exactly as the real engines do), a relay
// and gRPC server for each, and the gateway, whose workers are the
// relays. Then:
//
//  1. Comparison. One request sequence from the simulator's workload model
//     (multi-turn chats over shared system prompts) is served twice, in
//     lockstep: once routed by the gateway (cache-aware, on the index the
//     relays feed) on the live engines, once round-robin on twin
//     engines that start just as empty and have the same capacity. Inside an
//     engine both arms pick the DP rank the same way (session mod DP size,
//     the simulator's own choice), so the hit-rate difference comes only
//     from the choice of engine.
//  2. Load. Each relay reads its engine's load from the engine's HTTP
//     server (engines/load, as serve --engine-metrics-url) and stamps it on
//     its stream; another client's traffic, sent straight to one engine,
//     then loads it, and the same prompt is routed idle and loaded: overlap
//     decay and the balance and overload thresholds must act (loads.go).
//  3. Faults. One of each kind, with routed traffic flowing: dropped live
//     batches, publisher restarts, pause/resume, truncated replays, a relay
//     restart on the same port, a gateway stream drop (connections cut under
//     open streams) and a gateway restart. After each the demo waits until
//     every rank's gateway cursor has reached the engine's last published
//     sequence, then compares the gateway's index with each engine's true
//     live set, row by row.
//
// Every number in the final table is measured: hit tokens come from the
// simulated caches, relay figures from the relays' own Prometheus series,
// exactness from the comparison.
package demo

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"slices"
	"strings"
	"time"

	"github.com/kvrelay/kvrelay/gateway"
	"github.com/kvrelay/kvrelay/gateway/index"
	"github.com/kvrelay/kvrelay/gateway/monitor"
	"github.com/kvrelay/kvrelay/sim"
	"github.com/kvrelay/kvrelay/sim/prefixcache"
	"github.com/kvrelay/kvrelay/sim/workload"
)

// Traffic model.
const (
	// stepInterval is the engines' scheduler step: requests due within one
	// interval are routed one by one, then served as one step.
	stepInterval = 20 * time.Millisecond
	// decodeSteps is how long a request stays in flight after its step, the
	// load the gateway's spill gate weighs against cache affinity.
	decodeSteps = 10
	// Spill gate: a worker holding the prefix is passed over when it has
	// more than mean×spillRel and mean+spillAbs requests in flight. SMG's
	// defaults (1.5, 64) suit fleets of dozens of engines with hundreds of
	// requests in flight; with two engines and a couple of dozen in flight,
	// an absolute margin of 64 would never trip.
	spillRel = 1.5
	spillAbs = 4
	// capacityBlocks is each rank's device cache. It is small enough that
	// a policy which copies every chat onto both engines evicts what it
	// will need again.
	capacityBlocks = 512
	// quiesceTimeout bounds the wait after a fault.
	quiesceTimeout = 20 * time.Second
	// refreshEvery is how often every rank publishes while the demo waits
	// for the gateway to catch up (see quiesce).
	// It is longer than a truncated replay's recovery takes (a reply
	// timeout or two).
	refreshEvery = 5 * time.Second
)

// Defaults for Options' zero fields.
const (
	DefaultDuration = 15 * time.Second
	DefaultRate     = 120.0
)

// Options configures a run.
type Options struct {
	// Requests is the comparison phase's length in requests; 0 runs it
	// for Duration instead.
	Requests int
	// Duration is the comparison phase's length when Requests is 0.
	Duration time.Duration
	// Rate is the request rate in requests per second.
	Rate float64
	// Seed makes the request sequence reproducible.
	Seed uint64
	// Progress receives the live progress line; nil prints none.
	Progress io.Writer
	// Terminal rewrites the progress line in place (\r) instead of printing
	// a line every few seconds.
	Terminal bool
	// Logger receives the components' logs (default: discarded).
	Logger *slog.Logger
}

// ArmResult is one routing policy's outcome on the comparison sequence.
type ArmResult struct {
	Policy string `json:"policy"`
	// Requests is the number served; PerWorker splits it by worker, in
	// Report.Workers order.
	Requests  int   `json:"requests"`
	PerWorker []int `json:"per_worker"`
	// PromptBlocks counts the full prompt blocks requested; HitBlocks
	// those served from a device prefix cache.
	PromptBlocks int `json:"prompt_blocks"`
	HitBlocks    int `json:"hit_blocks"`
}

// HitRate is HitBlocks / PromptBlocks.
func (a ArmResult) HitRate() float64 {
	if a.PromptBlocks == 0 {
		return 0
	}
	return float64(a.HitBlocks) / float64(a.PromptBlocks)
}

// PrefillTokens is the prompt tokens the engines computed: the full
// blocks not served from a cache (partial tail blocks, never cached, are
// left out of both arms alike).
func (a ArmResult) PrefillTokens() int { return (a.PromptBlocks - a.HitBlocks) * blockSize }

// SavedTokens is the prompt tokens served from a prefix cache instead of
// prefilled.
func (a ArmResult) SavedTokens() int { return a.HitBlocks * blockSize }

func (a *ArmResult) add(worker int, res sim.StepResult) {
	for _, r := range res.Results {
		a.Requests++
		a.PerWorker[worker]++
		a.PromptBlocks += r.TotalBlocks
		a.HitBlocks += r.DeviceHits
	}
}

// WorkerCheck compares one worker's index rows with its engine's live set.
// A row is one (DP rank, tier, engine block hash) with its copy count.
type WorkerCheck struct {
	Worker     string `json:"worker"`
	EngineRows int    `json:"engine_rows"`
	IndexRows  int    `json:"index_rows"`
	// Missing rows are live in the engine but absent from the index; Extra
	// rows are in the index but not live; WrongCopies are in both with
	// different copy counts.
	Missing     int `json:"missing"`
	Extra       int `json:"extra"`
	WrongCopies int `json:"wrong_copies"`
}

// Exact reports whether the index equals the live set.
func (c WorkerCheck) Exact() bool { return c.Missing == 0 && c.Extra == 0 && c.WrongCopies == 0 }

// Check is one exactness check, after one fault (or none).
type Check struct {
	Name string `json:"name"`
	// Detail says what the fault did and how the system recovered, from
	// the simulator's and the relays' counters.
	Detail string `json:"detail"`
	// Quiescent is false when the gateway's cursors did not reach the
	// engines' last sequences within the timeout; the check ran anyway.
	Quiescent bool          `json:"quiescent"`
	Settle    time.Duration `json:"settle"`
	// Refreshes counts the rounds of one request per rank served while
	// waiting, because the gateway had not caught up after refreshEvery.
	Refreshes int           `json:"refreshes"`
	Workers   []WorkerCheck `json:"workers"`
	// StaleRows is how many rows the index was off while the fault was
	// still on (measured for pause/resume only): proof that the comparison
	// sees a difference when there is one.
	StaleRows int `json:"stale_rows,omitempty"`
	// Err is set when the fault itself could not be carried out.
	Err string `json:"error,omitempty"`
}

// Exact reports whether every worker's index was exact.
func (c Check) Exact() bool {
	if c.Err != "" || len(c.Workers) == 0 {
		return false
	}
	for _, w := range c.Workers {
		if !w.Exact() {
			return false
		}
	}
	return true
}

// RelayTotals are one worker's relay counters over every relay incarnation.
type RelayTotals struct {
	Worker string `json:"worker"`
	RelayCounters
}

// Report is a run's measured outcome.
type Report struct {
	Seed    uint64   `json:"seed"`
	Workers []string `json:"workers"`
	// KVRelay is the gateway-routed arm, RoundRobin the baseline.
	KVRelay    ArmResult `json:"kvrelay"`
	RoundRobin ArmResult `json:"round_robin"`
	// Decisions counts the gateway's routing reasons (event_hit,
	// event_spill, no_overlap) over the comparison.
	Decisions map[string]int `json:"decisions"`
	// Loads are the routing decisions on engine load that came through
	// kvrelay (loads.go).
	Loads   []LoadCheck   `json:"loads"`
	Relays  []RelayTotals `json:"relays"`
	Checks  []Check       `json:"checks"`
	Elapsed time.Duration `json:"elapsed"`
}

// OK reports whether every check passed: the index was exact after every
// fault and kvrelay routing hit the cache more often than round-robin.
func (r *Report) OK() bool {
	if len(r.Checks) == 0 || r.KVRelay.HitRate() <= r.RoundRobin.HitRate() {
		return false
	}
	for _, c := range r.Loads {
		if !c.Pass() {
			return false
		}
	}
	for _, c := range r.Checks {
		if !c.Exact() {
			return false
		}
	}
	return true
}

type demo struct {
	opts    Options
	log     *slog.Logger
	workers []*worker
	gw      *gatewayRun
	gen     *workload.Generator
	prog    *progress

	step     int
	credit   float64
	inflight [][]inflightRequest // per worker
	routed   []int               // requests routed, per worker (membership.go)
	rr       int
	arms     [2]ArmResult // kvrelay, round-robin
	flushes  uint32
	report   Report
	started  time.Time
	phase    string
}

// Run runs the demo. It returns an error only when the deployment could not
// be set up or ctx ended; failed checks are in the report (see Report.OK).
func Run(ctx context.Context, opts Options) (*Report, error) {
	if opts.Duration <= 0 {
		opts.Duration = DefaultDuration
	}
	if opts.Rate <= 0 {
		opts.Rate = DefaultRate
	}
	if opts.Requests < 0 {
		return nil, fmt.Errorf("demo: requests %d: must not be negative", opts.Requests)
	}
	if opts.Logger == nil {
		opts.Logger = slog.New(slog.DiscardHandler)
	}
	d := &demo{opts: opts, log: opts.Logger, started: time.Now(), prog: newProgress(opts.Progress, opts.Terminal)}
	d.report.Decisions = map[string]int{}
	defer d.close()
	if err := d.setUp(ctx); err != nil {
		return nil, err
	}
	if err := d.compare(ctx); err != nil {
		return nil, err
	}
	d.runLoadChecks(ctx)
	d.runChecks(ctx)
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	d.report.Seed = opts.Seed
	d.report.KVRelay, d.report.RoundRobin = d.arms[0], d.arms[1]
	for _, w := range d.workers {
		d.report.Workers = append(d.report.Workers, w.id)
		d.report.Relays = append(d.report.Relays, RelayTotals{Worker: w.id, RelayCounters: readRelayCounters(w.regs)})
	}
	d.report.Elapsed = time.Since(d.started)
	d.prog.finish()
	return &d.report, nil
}

func (d *demo) close() {
	if d.gw != nil {
		d.gw.close()
	}
	for _, w := range d.workers {
		w.close()
	}
}

func (d *demo) setUp(ctx context.Context) error {
	d.phase = "starting"
	d.prog.show(true, "starting %d engines × %d DP ranks, %d relays and the gateway", len(fleet), dpSize, len(fleet))
	wl := workload.Config{Seed: d.opts.Seed}
	gen, err := workload.New(wl)
	if err != nil {
		return fmt.Errorf("demo: %w", err)
	}
	d.gen = gen
	run := runIDs.Add(1)
	for i, kind := range fleet {
		id := fmt.Sprintf("%c-%s", 'A'+i, kind.name)
		w := &worker{id: id, kind: kind, log: d.log.With("worker", id)}
		d.workers = append(d.workers, w)
		if w.eng, err = startEngine(ctx, kind, wl, capacityBlocks, w.log.With("component", "engine")); err != nil {
			return fmt.Errorf("demo: %w", err)
		}
		if w.shadow, err = startShadow(ctx, kind, id, wl, capacityBlocks, run, w.log.With("component", "round-robin-engine")); err != nil {
			return fmt.Errorf("demo: %w", err)
		}
		if err := w.startLoad(ctx); err != nil {
			return fmt.Errorf("demo: %w", err)
		}
		if err := w.startRelay(ctx); err != nil {
			return fmt.Errorf("demo: %w", err)
		}
		if w.proxy, err = startProxy(w.relayAddr); err != nil {
			return fmt.Errorf("demo: %w", err)
		}
	}
	d.inflight = make([][]inflightRequest, len(d.workers))
	d.routed = make([]int, len(d.workers))
	for i := range d.arms {
		d.arms[i].PerWorker = make([]int, len(d.workers))
	}
	d.arms[0].Policy, d.arms[1].Policy = "kvrelay", "round-robin"
	if d.gw, err = startGateway(ctx, d.workers, d.log); err != nil {
		return fmt.Errorf("demo: %w", err)
	}
	// Routing starts once the relays follow every rank and the gateway
	// streams from both; before that the index would be blind.
	if !d.waitFor(ctx, 15*time.Second, func() bool {
		for _, w := range d.workers {
			if !w.rel.Ready() {
				return false
			}
		}
		return d.allStreaming()
	}) {
		if err := ctx.Err(); err != nil {
			return err
		}
		return errors.New("demo: the relays and the gateway did not connect within 15 s")
	}
	return nil
}

func (d *demo) allStreaming() bool {
	sts := d.gw.gw.Workers()
	if len(sts) != len(d.workers) {
		return false
	}
	for _, st := range sts {
		if st.State != monitor.StateStreaming || st.Snapshot {
			return false
		}
	}
	return true
}

// waitFor polls cond every few milliseconds until it holds, the timeout
// passes or ctx ends, keeping the progress line alive.
func (d *demo) waitFor(ctx context.Context, timeout time.Duration, cond func() bool) bool {
	deadline := time.Now().Add(timeout)
	for {
		if cond() {
			return true
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			return false
		}
		d.showProgress(false)
		select {
		case <-ctx.Done():
			return false
		case <-time.After(10 * time.Millisecond):
		}
	}
}

func (d *demo) workerIndex(id string) int {
	for i, w := range d.workers {
		if w.id == id {
			return i
		}
	}
	return -1
}

// inflightRequest is a routed request until it finishes decoding: the
// gateway tracks it (RouteRequest.Track) until done is called, as an
// embedder does when the request's response ends.
type inflightRequest struct {
	end  int // the step it finishes
	done func()
}

// serveStep routes and serves one scheduler step's worth of requests. With
// compare set, the same requests also go round-robin to the twin engines.
func (d *demo) serveStep(compare bool, limit int) (int, error) {
	d.step++
	for i := range d.inflight {
		d.inflight[i] = slices.DeleteFunc(d.inflight[i], func(r inflightRequest) bool {
			if r.end > d.step {
				return false
			}
			r.done()
			return true
		})
	}
	d.credit += d.opts.Rate * stepInterval.Seconds()
	n := int(d.credit)
	d.credit -= float64(n)
	if limit >= 0 {
		n = min(n, limit)
	}
	live := make([][]sim.Request, len(d.workers))
	twin := make([][]sim.Request, len(d.workers))
	for range n {
		req := d.gen.Next()
		// Inside an engine the rank is the engine's choice, identical in
		// both arms: the simulator's session-sticky rank.
		rank := req.Session % dpSize
		dec, err := d.gw.gw.Route(gateway.RouteRequest{Model: model, TokenIDs: req.Tokens, Track: true})
		if err != nil {
			return 0, fmt.Errorf("demo: route: %w", err)
		}
		wi := d.workerIndex(dec.Worker)
		if wi < 0 {
			return 0, fmt.Errorf("demo: the gateway chose unknown worker %q", dec.Worker)
		}
		if compare {
			d.report.Decisions[string(dec.Reason)]++
		}
		d.routed[wi]++
		live[wi] = append(live[wi], sim.Request{Rank: rank, Tokens: req.Tokens})
		d.inflight[wi] = append(d.inflight[wi], inflightRequest{end: d.step + decodeSteps, done: dec.Done})
		if compare {
			ri := d.rr % len(d.workers)
			d.rr++
			twin[ri] = append(twin[ri], sim.Request{Rank: rank, Tokens: slices.Clone(req.Tokens)})
		}
	}
	for i, w := range d.workers {
		if len(live[i]) > 0 {
			res, err := w.eng.Step(live[i]...)
			if err != nil {
				return 0, fmt.Errorf("demo: %s: %w", w.id, err)
			}
			if compare {
				d.arms[0].add(i, res)
			}
		}
		if len(twin[i]) > 0 {
			res, err := w.shadow.Step(twin[i]...)
			if err != nil {
				return 0, fmt.Errorf("demo: round-robin twin of %s: %w", w.id, err)
			}
			d.arms[1].add(i, res)
		}
	}
	return n, nil
}

// compare runs the comparison phase at the configured rate.
func (d *demo) compare(ctx context.Context) error {
	d.phase = "comparing"
	tick := time.NewTicker(stepInterval)
	defer tick.Stop()
	end := time.Now().Add(d.opts.Duration)
	for {
		limit := -1
		if d.opts.Requests > 0 {
			limit = d.opts.Requests - d.arms[0].Requests
			if limit <= 0 {
				break
			}
		} else if time.Now().After(end) {
			break
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-tick.C:
		}
		if _, err := d.serveStep(true, limit); err != nil {
			return err
		}
		d.showProgress(false)
	}
	d.showProgress(true)
	return nil
}

// traffic serves steps of routed traffic outside the comparison.
func (d *demo) traffic(ctx context.Context, steps int) error {
	tick := time.NewTicker(stepInterval)
	defer tick.Stop()
	for range steps {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-tick.C:
		}
		if _, err := d.serveStep(false, -1); err != nil {
			return err
		}
		d.showProgress(false)
	}
	return nil
}

// flush makes every rank of every engine publish one more batch: a fresh
// two-block prompt no workload request shares. A relay only notices that a
// live batch went missing when a later one arrives, so after a fault is
// lifted every rank must publish again before the demo can wait for the
// gateway to catch up.
func (d *demo) flush() error {
	for _, w := range d.workers {
		reqs := make([]sim.Request, dpSize)
		for r := range reqs {
			d.flushes++
			toks := make([]uint32, 2*blockSize)
			for i := range toks {
				// Above the workload's vocabulary, so never a shared prefix.
				toks[i] = 1<<24 + d.flushes<<8 + uint32(i)
			}
			reqs[r] = sim.Request{Rank: r, Tokens: toks}
		}
		if _, err := w.eng.Step(reqs...); err != nil {
			return fmt.Errorf("demo: %s: %w", w.id, err)
		}
	}
	return nil
}

// caughtUp reports whether the gateway has applied every batch each engine
// rank published: no batch held back by a pause, the stream open and no
// snapshot arriving, and every rank's cursor at the engine's last sequence.
func (d *demo) caughtUp() bool {
	sts := map[string]gateway.WorkerStatus{}
	for _, st := range d.gw.gw.Workers() {
		sts[st.ID] = st
	}
	for _, w := range d.workers {
		st, ok := sts[w.id]
		if !ok || st.State != monitor.StateStreaming || st.Snapshot {
			return false
		}
		cursors := map[int32]monitor.RankStatus{}
		for _, rs := range st.Ranks {
			cursors[rs.Rank] = rs
		}
		for _, ps := range w.eng.PublisherStats() {
			if ps.Pending > 0 {
				return false
			}
			if ps.NextSeq == 0 {
				continue
			}
			rs, ok := cursors[int32(ps.Rank)]
			if !ok || !rs.HasCursor || rs.ReplayPending || rs.Cursor != ps.NextSeq-1 {
				return false
			}
		}
	}
	return true
}

// cursorReport says, per rank, where the engine, the relay and the gateway
// stand, for a check that timed out.
func (d *demo) cursorReport() string {
	sts := map[string]gateway.WorkerStatus{}
	for _, st := range d.gw.gw.Workers() {
		sts[st.ID] = st
	}
	var parts []string
	for _, w := range d.workers {
		st := sts[w.id]
		gwc := map[int32]string{}
		for _, rs := range st.Ranks {
			c := "none"
			if rs.HasCursor {
				c = fmt.Sprint(rs.Cursor)
			}
			if rs.ReplayPending {
				c += " replay pending"
			}
			gwc[rs.Rank] = c
		}
		relc := map[int32]string{}
		if w.rel != nil {
			for _, rs := range w.rel.Status().Ranks {
				c := "none"
				if rs.Cursor != nil {
					c = fmt.Sprint(*rs.Cursor)
				}
				relc[rs.Rank] = c
			}
		}
		for _, ps := range w.eng.PublisherStats() {
			r := int32(ps.Rank)
			parts = append(parts, fmt.Sprintf("%s rank %d: engine last %d, relay %s, gateway %s (%s)",
				w.id, r, int64(ps.NextSeq)-1, relc[r], gwc[r], st.State))
		}
	}
	return strings.Join(parts, "; ")
}

// quiesce waits until the gateway has caught up, twice in a row 10 ms apart
// (a cursor can match while a replay for a later gap is still due).
//
// While it waits, every rank publishes again each refreshEvery, as a serving
// engine would: a relay learns that a rank's last batch went missing (a
// batch published while its subscription was still being set up, say) only
// when that rank publishes again. The extra publishes are counted and
// reported, so a check that needed them says so.
func (d *demo) quiesce(ctx context.Context) (ok bool, waited time.Duration, refreshes int, err error) {
	start := time.Now()
	last := start
	streak := 0
	ok = d.waitFor(ctx, quiesceTimeout, func() bool {
		if d.caughtUp() {
			streak++
			return streak >= 2
		}
		streak = 0
		if err == nil && time.Since(last) >= refreshEvery {
			last = time.Now()
			refreshes++
			err = d.flush()
		}
		return false
	})
	return ok, time.Since(start), refreshes, err
}

// engineRows is an engine's true live set in the index's terms.
func engineRows(e *sim.Engine) map[index.LiveBlock]int {
	out := map[index.LiveBlock]int{}
	for _, rl := range e.LiveSet() {
		for _, b := range rl.Blocks {
			tier := index.TierDevice
			if b.Tier == prefixcache.Host {
				tier = index.TierHost
			}
			out[index.LiveBlock{Rank: int32(rl.Rank), Tier: tier, EngineHash: b.Hash}] = b.Copies
		}
	}
	return out
}

// compareIndex checks every worker's index rows against its engine.
func (d *demo) compareIndex() []WorkerCheck {
	var out []WorkerCheck
	for _, w := range d.workers {
		want := engineRows(w.eng)
		rows, _ := d.gw.gw.LiveSet(w.id)
		c := WorkerCheck{Worker: w.id, EngineRows: len(want), IndexRows: len(rows)}
		seen := map[index.LiveBlock]bool{}
		for _, r := range rows {
			copies := r.Copies
			r.Copies = 0
			seen[r] = true
			n, ok := want[r]
			switch {
			case !ok:
				c.Extra++
			case n != copies:
				c.WrongCopies++
			}
		}
		for k := range want {
			if !seen[k] {
				c.Missing++
			}
		}
		out = append(out, c)
	}
	return out
}
