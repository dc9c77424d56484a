package bench

import (
	"context"
	"fmt"
	"io"
	"slices"
	"strings"
	"sync/atomic"
	"time"

	"github.com/kvrelay/kvrelay/internal/latencyprobe"
)

// LatencyResults is issue 19 item 2: the latency kvrelay adds over the
// no-relay control, measured in interleaved rounds (the control and each
// kvrelay build take turns, one short ramp each, so that a change of load on
// the shared machine hits all of them alike), under two publisher pacings,
// and where it goes: the stage breakdown of an in-process relay.
type LatencyResults struct {
	Rates   []float64 `json:"rates"`
	Seconds float64   `json:"seconds_per_step"`
	Rounds  int       `json:"rounds"`
	// Runs are every ramp, in the order they ran.
	Runs []LatencyRun `json:"runs"`
	// Added is, per kvrelay build, pacing and rate, the added median and
	// p99 of every round: the build's figure minus the control's of the
	// same round.
	Added []AddedLatency `json:"added"`
	// Breakdown is the in-process relay's stage table, per pacing and
	// rate, every round's samples pooled.
	Breakdown []StageBreakdown `json:"breakdown"`
}

// LatencyRun is one relay's ramp in one round.
type LatencyRun struct {
	Round  int    `json:"round"`
	Relay  string `json:"relay"`
	Pacing string `json:"pacing"`
	Reason string `json:"reason,omitempty"`
	Steps  []Step `json:"steps"`
	Load   string `json:"load"` // /proc/loadavg when the ramp started
}

// AddedLatency is one build's added latency at one rate and pacing.
type AddedLatency struct {
	Relay  string  `json:"relay"`
	Pacing string  `json:"pacing"`
	Rate   float64 `json:"rate"`
	// Per round, in ms: the build's median and p99 minus the control's.
	P50ms []float64 `json:"added_p50_ms"`
	P99ms []float64 `json:"added_p99_ms"`
	// Per round, the control's own median and p99, for scale.
	ControlP50ms []float64 `json:"control_p50_ms"`
	ControlP99ms []float64 `json:"control_p99_ms"`
}

// StageBreakdown is where an in-process relay's latency went, stage by
// stage, at one pacing and rate.
type StageBreakdown struct {
	Pacing  string       `json:"pacing"`
	Rate    float64      `json:"rate"`
	Batches int          `json:"batches"` // batches with every stage marked
	Stages  []StageDelta `json:"stages"`
}

// StageDelta is the time from the previous stage to this one.
type StageDelta struct {
	Stage string  `json:"stage"`
	P50ms float64 `json:"p50_ms"`
	P99ms float64 `json:"p99_ms"`
}

// pacing is how the publisher spaces a step's batches.
type pacing struct {
	name  string
	burst int
}

var (
	evenPacing    = pacing{"even (1 batch per 1/rate)", 1}
	burstyPacing  = pacing{"bursts of 32 (the bench before 2026-12-03)", 32}
	latencyRates  = []float64{250, 1000, 10000}
	latencyRounds = 3
	latencyStep   = 3.0 // seconds
)

const controlName = "no relay (control)"

// runLatency measures the added latency. Each round runs, per pacing, the
// control and every kvrelay build (env.serveCommand, then
// env.compareCommand; or the in-process relay when there is no binary) in
// an order that rotates by round, then the in-process relay with the probe
// installed for the breakdown.
func runLatency(ctx context.Context, env *environment) (*LatencyResults, error) {
	res := &LatencyResults{Rates: latencyRates, Seconds: latencyStep, Rounds: latencyRounds}
	if env.quick {
		res.Rates, res.Seconds, res.Rounds = []float64{1000}, 0.5, 1
	}
	if env.python == "" {
		return nil, fmt.Errorf("bench: latency: the publisher needs Python: %v", env.pythonErr)
	}
	type contender struct {
		name     string
		start    func(context.Context, *publisher) (relayProc, error)
		measured bool // its own process: CPU time per step
	}
	contenders := []contender{{name: controlName, start: func(ctx context.Context, pub *publisher) (relayProc, error) { return startDirect(ctx, env, pub) }}}
	if env.serveCommand != nil {
		contenders = append(contenders, contender{"kvrelay", func(ctx context.Context, pub *publisher) (relayProc, error) {
			return startKvrelay(ctx, env, pub)
		}, true})
	} else {
		contenders = append(contenders, contender{"kvrelay (in-process)", func(ctx context.Context, pub *publisher) (relayProc, error) {
			return startInProcessRelay(ctx, env, pub)
		}, false})
	}
	if env.compareCommand != nil {
		other := *env
		other.serveCommand = env.compareCommand
		contenders = append(contenders, contender{"kvrelay (compared build)", func(ctx context.Context, pub *publisher) (relayProc, error) {
			return startKvrelay(ctx, &other, pub)
		}, true})
	}
	pacings := []pacing{evenPacing, burstyPacing}
	plan := func(p pacing) []rampStep {
		var steps []rampStep
		for _, r := range res.Rates {
			steps = append(steps, rampStep{rate: r, seconds: res.Seconds, mandatory: true, burst: p.burst})
		}
		return steps
	}
	var probe *stageProbe
	pooled := map[string][]stageSample{} // by pacing and rate
	for round := 1; round <= res.Rounds; round++ {
		for _, p := range pacings {
			for i := range contenders {
				c := contenders[(i+round-1)%len(contenders)]
				if ctx.Err() != nil {
					return nil, ctx.Err()
				}
				run := RelayRun{Name: c.name, Measured: c.measured}
				load := loadAverage()
				rampRelayPlan(ctx, env, &run, plan(p), c.start)
				res.Runs = append(res.Runs, LatencyRun{Round: round, Relay: c.name, Pacing: p.name, Reason: run.Reason, Steps: run.Steps, Load: load})
				env.log.Info("latency round", "round", round, "relay", c.name, "pacing", p.name, "steps", len(run.Steps))
			}
			// The breakdown: an in-process relay with the probe installed,
			// at 1,000 and 10,000 batches/s.
			run := RelayRun{Name: "kvrelay (in-process, probed)"}
			var steps []rampStep
			for _, rs := range plan(p) {
				if rs.rate == 1000 || rs.rate == 10000 || env.quick {
					steps = append(steps, rs)
				}
			}
			run.onSamples = func(rs rampStep, samples []sample) {
				key := breakdownKey(p.name, rs.rate)
				pooled[key] = append(pooled[key], probe.collect(samples)...)
			}
			probe = newStageProbe() // a new publisher counts from 0 again
			restore := latencyprobe.Install(probe.mark)
			rampRelayPlan(ctx, env, &run, steps, func(ctx context.Context, pub *publisher) (relayProc, error) {
				return startInProcessRelay(ctx, env, pub)
			})
			restore()
			if run.Reason != "" {
				env.log.Warn("latency breakdown ramp", "reason", run.Reason)
			}
		}
	}
	res.Added = addedLatency(res.Runs, contenders[0].name)
	for _, p := range pacings {
		for _, r := range res.Rates {
			if s := pooled[breakdownKey(p.name, r)]; len(s) > 0 {
				res.Breakdown = append(res.Breakdown, breakdown(p.name, r, s))
			}
		}
	}
	return res, nil
}

func breakdownKey(pacing string, rate float64) string { return fmt.Sprintf("%s@%g", pacing, rate) }

// addedLatency pairs every kvrelay run with the control's run of the same
// round and pacing.
func addedLatency(runs []LatencyRun, control string) []AddedLatency {
	type key struct {
		relay, pacing string
		rate          float64
	}
	controls := map[key]map[int]*Step{} // relay field unused: the control's steps by round
	for _, r := range runs {
		if r.Relay != control {
			continue
		}
		for i := range r.Steps {
			st := &r.Steps[i]
			k := key{"", r.Pacing, st.Target}
			if controls[k] == nil {
				controls[k] = map[int]*Step{}
			}
			if prev, ok := controls[k][r.Round]; !ok || prev.Attempt < st.Attempt {
				controls[k][r.Round] = st
			}
		}
	}
	byKey := map[key]*AddedLatency{}
	var order []key
	for _, r := range runs {
		if r.Relay == control {
			continue
		}
		for i, st := range r.Steps {
			if i+1 < len(r.Steps) && r.Steps[i+1].Target == st.Target {
				continue // measured again after a failure: the last attempt counts
			}
			c, ok := controls[key{"", r.Pacing, st.Target}][r.Round]
			if !ok || st.Received == 0 || c.Received == 0 {
				continue
			}
			k := key{r.Relay, r.Pacing, st.Target}
			a := byKey[k]
			if a == nil {
				a = &AddedLatency{Relay: r.Relay, Pacing: r.Pacing, Rate: st.Target}
				byKey[k] = a
				order = append(order, k)
			}
			a.P50ms = append(a.P50ms, st.P50ms-c.P50ms)
			a.P99ms = append(a.P99ms, st.P99ms-c.P99ms)
			a.ControlP50ms = append(a.ControlP50ms, c.P50ms)
			a.ControlP99ms = append(a.ControlP99ms, c.P99ms)
		}
	}
	out := make([]AddedLatency, 0, len(order))
	for _, k := range order {
		out = append(out, *byKey[k])
	}
	return out
}

// probeSeqs is how many sequences per rank the probe keeps apart: more
// than one step publishes per rank (10,000/s for 3 s is 15,000 per rank).
const (
	probeSeqs  = 1 << 16
	probeRanks = dpSize
)

// stageProbe records, per rank and sequence (modulo probeSeqs), the time
// each stage was reached.
type stageProbe struct {
	at []atomic.Int64 // [stage][rank][seq % probeSeqs], unix ns
}

func newStageProbe() *stageProbe {
	return &stageProbe{at: make([]atomic.Int64, int(latencyprobe.NumStages)*probeRanks*probeSeqs)}
}

func (p *stageProbe) slot(stage latencyprobe.Stage, rank int32, seq uint64) *atomic.Int64 {
	return &p.at[(int(stage)*probeRanks+int(rank))*probeSeqs+int(seq%probeSeqs)]
}

func (p *stageProbe) mark(stage latencyprobe.Stage, rank int32, seq uint64) {
	if stage >= latencyprobe.NumStages || rank < 0 || int(rank) >= probeRanks {
		return
	}
	p.slot(stage, rank, seq).Store(time.Now().UnixNano())
}

// stageSample is one batch's times: published, every stage, received by
// the bench's gRPC subscriber.
type stageSample [latencyprobe.NumStages + 2]int64

// Indexes into a stageSample.
const (
	atPublish  = 0
	atWritten  = int(latencyprobe.Written) + 1
	atClient   = int(latencyprobe.NumStages) + 1
	atDequeued = int(latencyprobe.Dequeued) + 1
)

// chain is the order every batch passes the points of a stageSample in.
// Written is not on it: SendMsg returns once gRPC has queued the frame,
// and the client can read it before the pump's goroutine runs again.
var chain = []int{atPublish, 1, 2, 3, atDequeued, atClient}

// collect reads the stage times of the step's samples; a batch with a
// stage unmarked, or marked out of order (a slot left from an earlier
// sequence), is left out.
func (p *stageProbe) collect(samples []sample) []stageSample {
	out := make([]stageSample, 0, len(samples))
next:
	for _, x := range samples {
		var s stageSample
		s[atPublish] = int64(x.sentAt * 1e9)
		for st := latencyprobe.Stage(0); st < latencyprobe.NumStages; st++ {
			s[st+1] = p.slot(st, int32(x.rank), x.seq).Load()
		}
		s[atClient] = s[atPublish] + int64(x.latency)
		// Publisher and relay read the same clock, but the publisher's
		// time travels as a float: allow it a microsecond.
		const slack = int64(time.Microsecond)
		for i := 1; i < len(chain); i++ {
			if s[chain[i]] == 0 || s[chain[i]] < s[chain[i-1]]-slack {
				continue next
			}
		}
		if s[atWritten] < s[atDequeued] {
			continue
		}
		out = append(out, s)
	}
	return out
}

// breakdownStages names the rows of a breakdown: the intervals along
// chain, then SendMsg alone, then the total.
var breakdownStages = []string{
	"publish → relay's reader has it (ZeroMQ: the control's whole path)",
	"→ decoded (msgpack → protobuf; a batch that was queued also waited for the rank goroutine)",
	"→ admitted, going into subscribers' queues (encode, record, history)",
	"→ taken by the subscriber's gRPC pump (hand-off)",
	"→ read by the bench's gRPC client (SendMsg, HTTP/2 writer, loopback, client)",
	"(of the previous row: SendMsg until it returned)",
	"total, publish → client",
}

func breakdown(pacing string, rate float64, samples []stageSample) StageBreakdown {
	b := StageBreakdown{Pacing: pacing, Rate: rate, Batches: len(samples)}
	var spans [][2]int
	for i := 1; i < len(chain); i++ {
		spans = append(spans, [2]int{chain[i-1], chain[i]})
	}
	spans = append(spans, [2]int{atDequeued, atWritten}, [2]int{atPublish, atClient})
	for i, sp := range spans {
		d := make([]time.Duration, len(samples))
		for j, s := range samples {
			d[j] = time.Duration(s[sp[1]] - s[sp[0]])
		}
		slices.Sort(d)
		b.Stages = append(b.Stages, StageDelta{Stage: breakdownStages[i], P50ms: ms(quantile(d, 0.5)), P99ms: ms(quantile(d, 0.99))})
	}
	return b
}

func writeLatency(w io.Writer, lt *LatencyResults) {
	fmt.Fprintf(w, "\n### Latency kvrelay adds over the no-relay control (issue 19 item 2)\n\n")
	fmt.Fprintf(w, "%d interleaved round(s); each relay ramps through %s batches/s, %.1f s a step; added = the relay's figure minus the control's in the same round. Per round, comma-separated, in ms.\n\n",
		lt.Rounds, joinFloats(lt.Rates, "%g"), lt.Seconds)
	fmt.Fprintf(w, "| relay | pacing | batches/s | added p50 ms | added p99 ms | control p50 ms | control p99 ms |\n|---|---|---:|---|---|---|---|\n")
	for _, a := range lt.Added {
		fmt.Fprintf(w, "| %s | %s | %g | %s | %s | %s | %s |\n", a.Relay, a.Pacing, a.Rate,
			joinFloats(a.P50ms, "%.2f"), joinFloats(a.P99ms, "%.2f"), joinFloats(a.ControlP50ms, "%.2f"), joinFloats(a.ControlP99ms, "%.2f"))
	}
	fmt.Fprintf(w, "\n#### Every ramp\n\nCPU s/M blocks and context switches per batch (voluntary/involuntary, every thread of the relay) only for a relay in its own process.\n\n| round | relay | pacing | load before | batches/s | published/s | received | p50 ms | p99 ms | p99.9 ms | CPU s/M blocks | ctx switches/batch | verdict |\n|---:|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|\n")
	for _, r := range lt.Runs {
		if len(r.Steps) == 0 {
			fmt.Fprintf(w, "| %d | %s | %s | %s | – | – | – | – | – | – | – | – | %s |\n", r.Round, r.Relay, r.Pacing, r.Load, r.Reason)
		}
		for _, s := range r.Steps {
			cpu, ctx := "–", "–"
			if s.CPUSeconds > 0 {
				cpu = fmt.Sprintf("%.2f", s.CPUPerMBlocks)
				ctx = fmt.Sprintf("%.2f/%.2f", s.VoluntaryCtxPerBatch, s.NonvoluntaryCtxPerBatch)
			}
			fmt.Fprintf(w, "| %d | %s | %s | %s | %g | %.0f | %d | %.2f | %.2f | %.2f | %s | %s | %s |\n", r.Round, r.Relay, r.Pacing, r.Load,
				s.Target, s.PublishedRate, s.Received, s.P50ms, s.P99ms, s.P999ms, cpu, ctx, s.Verdict)
		}
	}
	for _, b := range lt.Breakdown {
		fmt.Fprintf(w, "\n#### Where the in-process relay's latency goes: %g batches/s, %s (%d batches)\n\n| stage | p50 ms | p99 ms |\n|---|---:|---:|\n", b.Rate, b.Pacing, b.Batches)
		for _, s := range b.Stages {
			fmt.Fprintf(w, "| %s | %.3f | %.3f |\n", s.Stage, s.P50ms, s.P99ms)
		}
	}
	fmt.Fprintln(w)
}

func joinFloats(xs []float64, format string) string {
	parts := make([]string, len(xs))
	for i, x := range xs {
		parts[i] = fmt.Sprintf(format, x)
	}
	return strings.Join(parts, ", ")
}
