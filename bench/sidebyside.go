package bench

import (
	"context"
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"runtime/pprof"
	"slices"
	"time"
)

// SideBySide is part 1 of issue 7: the same stream through each relay.
type SideBySide struct {
	Shape string `json:"shape"`
	// kvrelay, the Python relay, then the control without a relay.
	Relays []RelayRun `json:"relays"`
	// Profile is the CPU profile of kvrelay's ramp, when it ran in-process.
	Profile string `json:"profile,omitempty"`
}

// RelayRun is one relay's ramp.
type RelayRun struct {
	Name      string `json:"name"`
	Available bool   `json:"available"`
	Reason    string `json:"reason,omitempty"` // why not available, or why the ramp stopped
	// Measured is false when the relay ran inside the bench process: its
	// CPU and RSS are then not its own and are left out.
	Measured bool   `json:"measured"`
	Steps    []Step `json:"steps"`
	// PeakRSS is the high-water mark over the whole ramp, overload steps
	// included; SteadyRSS only up to the last step that kept up before the
	// ramp stopped.
	PeakRSS   int64 `json:"peak_rss_bytes"`
	SteadyRSS int64 `json:"steady_peak_rss_bytes"`
	// Sustained is the highest passing step's delivered rate (batches/s).
	// PublisherBound: that step was limited by the publisher, so the
	// relay's own limit lies higher.
	Sustained      float64 `json:"sustained_batches_per_s"`
	PublisherBound bool    `json:"publisher_bound"`
	// onSamples, when set, sees every step's samples (the latency part's
	// stage breakdown).
	onSamples func(rampStep, []sample)
}

// Step is one rate of the ramp.
type Step struct {
	Target        float64 `json:"target_batches_per_s"`
	Published     int     `json:"published"`
	PublishedRate float64 `json:"published_batches_per_s"`
	Received      int     `json:"received"`
	Missing       int     `json:"missing"`
	DeliveredRate float64 `json:"delivered_batches_per_s"`
	P50ms         float64 `json:"p50_ms"`
	P99ms         float64 `json:"p99_ms"`
	P999ms        float64 `json:"p999_ms"`
	MaxMs         float64 `json:"max_ms"`
	TailP50ms     float64 `json:"tail_p50_ms"` // the last tenth of the step, by publish time
	CPUSeconds    float64 `json:"cpu_seconds"`
	CPUPerMBlocks float64 `json:"cpu_seconds_per_million_blocks"`
	CPUUtil       float64 `json:"cpu_util"` // CPU seconds per wall second
	PeakRSS       int64   `json:"peak_rss_bytes"`
	// Context switches of the relay's threads per batch received, over the
	// step (issue 19: thread wake-ups per batch).
	VoluntaryCtxPerBatch    float64 `json:"voluntary_ctxt_switches_per_batch"`
	NonvoluntaryCtxPerBatch float64 `json:"nonvoluntary_ctxt_switches_per_batch"`
	// The other two processes on the machine, to tell who was short of CPU:
	// the publisher, and the bench process (the gRPC subscriber; with an
	// in-process kvrelay, the relay too).
	PublisherCPUUtil  float64 `json:"publisher_cpu_util"`
	SubscriberCPUUtil float64 `json:"subscriber_cpu_util"`
	Attempt           int     `json:"attempt"` // 2: the same rate measured again after a failure
	Pass              bool    `json:"pass"`
	PublisherLow      bool    `json:"publisher_low"` // published < 90 % of the target
	Verdict           string  `json:"verdict"`
}

type rampStep struct {
	rate      float64
	seconds   float64
	mandatory bool // latency points of issue 7: run even after a failure
	burst     int  // batches the publisher sends back to back; 0 or 1: each at its own time
}

func rampPlan(quick bool) []rampStep {
	if quick {
		return []rampStep{{rate: 1000, seconds: 1, mandatory: true}, {rate: 10000, seconds: 0.5, mandatory: true}}
	}
	var plan []rampStep
	for _, r := range []float64{250, 500, 1000, 2000, 5000, 10000, 15000, 20000, 30000, 40000, 60000} {
		plan = append(plan, rampStep{rate: r, seconds: 5, mandatory: r == 1000 || r == 10000})
	}
	return plan
}

// A step falls behind when, at its end, the latency's median has grown past
// both of these: an absolute floor (scheduling hiccups on a busy host stay
// below it) and a multiple of the step's start.
// A step also fails when its median latency is over saturatedLag: a relay
// that holds a steady backlog of that size is at its limit even if the
// backlog does not grow.
const (
	behindFloor  = 100 * time.Millisecond
	behindGrowth = 3
	saturatedLag = 500 * time.Millisecond
)

// A quick run waits for a step's batches until no batch has arrived for
// quickStall (longer than a relay's 5 s replay timeout, which can hold a
// rank while it fills a gap), at most quickDrainLimit.
const (
	quickStall      = 10 * time.Second
	quickDrainLimit = time.Minute
)

func runSideBySide(ctx context.Context, env *environment) *SideBySide {
	sb := &SideBySide{Shape: fmt.Sprintf("%d-block stores, block size %d, %d DP ranks, vLLM msgpack; each batch also evicts the %d blocks its rank stored %d batches earlier",
		storeBlocks, blockSize, dpSize, storeBlocks, evictWindow)}
	kv := RelayRun{Name: "kvrelay", Measured: env.serveCommand != nil}
	py := RelayRun{Name: "python (smg_grpc_servicer.kv_relay)", Measured: true}
	if env.python == "" {
		direct := RelayRun{Name: "no relay (control: the bench reads the PUB sockets itself)"}
		for _, r := range []*RelayRun{&kv, &py, &direct} {
			r.Reason = fmt.Sprintf("not available: the publisher needs Python: %v", env.pythonErr)
		}
		sb.Relays = []RelayRun{kv, py, direct}
		return sb
	}
	start := func(ctx context.Context, pub *publisher) (relayProc, error) {
		if env.serveCommand != nil {
			return startKvrelay(ctx, env, pub)
		}
		return startInProcessRelay(ctx, env, pub)
	}
	if env.serveCommand == nil && !env.quick {
		// In-process, the relay's CPU can at least be profiled (with the
		// subscriber's, which the per-step table shows is small).
		path := filepath.Join(env.out, "sidebyside-kvrelay-inprocess.cpu.pprof")
		if f, err := os.Create(path); err == nil {
			if err := pprof.StartCPUProfile(f); err == nil {
				defer func() {
					pprof.StopCPUProfile()
					f.Close()
				}()
				sb.Profile = path
			} else {
				f.Close()
			}
		}
	}
	rampRelay(ctx, env, &kv, start)
	if sb.Profile != "" {
		pprof.StopCPUProfile()
	}
	rampRelay(ctx, env, &py, func(ctx context.Context, pub *publisher) (relayProc, error) { return startPyRelay(ctx, env, pub) })
	direct := RelayRun{Name: "no relay (control: the bench reads the PUB sockets itself)"}
	rampRelay(ctx, env, &direct, func(ctx context.Context, pub *publisher) (relayProc, error) { return startDirect(ctx, env, pub) })
	sb.Relays = []RelayRun{kv, py, direct}
	return sb
}

func rampRelay(ctx context.Context, env *environment, run *RelayRun, start func(context.Context, *publisher) (relayProc, error)) {
	rampRelayPlan(ctx, env, run, rampPlan(env.quick), start)
}

// rampRelayPlan is rampRelay over the given steps, with the stream's
// dpSize ranks.
func rampRelayPlan(ctx context.Context, env *environment, run *RelayRun, plan []rampStep, start func(context.Context, *publisher) (relayProc, error)) {
	rampRelayRanks(ctx, env, run, dpSize, plan, start)
}

// rampRelayRanks is rampRelayPlan with the publisher's rank count given:
// the engine-pacing workload runs 8 ranks, each at its own slow rate.
func rampRelayRanks(ctx context.Context, env *environment, run *RelayRun, ranks int, plan []rampStep, start func(context.Context, *publisher) (relayProc, error)) {
	log := env.log.With("relay", run.Name)
	pub, err := startPublisher(ctx, env, ranks)
	if err != nil {
		run.Reason = fmt.Sprintf("not available: %v", err)
		return
	}
	defer pub.stop()
	rel, err := start(ctx, pub)
	if err != nil {
		run.Reason = fmt.Sprintf("not available: %v", err)
		return
	}
	defer rel.stop()
	run.Available = true

	next := make([]uint64, ranks) // the publisher's next sequence per rank
	var sub *subscriber
	var subCancel context.CancelFunc
	stopSub := func() {
		if sub != nil {
			subCancel()
			<-sub.done
			sub = nil
		}
	}
	defer stopSub()
	subscribe := func() error {
		stopSub()
		sctx, cancel := context.WithCancel(ctx)
		s := newSubscriber(ranks)
		opened := make(chan error, 1)
		if d, ok := rel.(interface {
			feed(context.Context, *subscriber, chan<- error)
		}); ok {
			go d.feed(sctx, s, opened)
		} else {
			go s.run(sctx, rel.addr(), opened)
		}
		if err := <-opened; err != nil {
			cancel()
			<-s.done
			return err
		}
		sub, subCancel = s, cancel
		// The relay's SUB sockets join the publisher asynchronously: warm up
		// until a batch of every rank has come through.
		for attempt := 0; attempt < 40; attempt++ {
			s.startStep(next)
			res, err := pub.run(ctx, 400, 0.25, 1)
			if err != nil {
				return err
			}
			copyNext(next, res.Last)
			s.waitFor(ctx, uint64(res.Sent), 500*time.Millisecond)
			if s.everyRankSeen() {
				return nil
			}
			if ended, err := s.status(); ended {
				return fmt.Errorf("stream ended during warm-up: %v", err)
			}
		}
		return errors.New("warm-up: the relay delivered nothing from some rank")
	}
	if err := subscribe(); err != nil {
		run.Reason = fmt.Sprintf("subscribe: %v", err)
		return
	}

	// A busy shared host stalls every process now and then; one stall must
	// not end a ramp. A failed step is measured again once (not in quick
	// mode), and the ramp stops only when both attempts fail. Steps after the stop (the
	// mandatory latency points) do not count toward the sustained rate.
	failed, publisherCapped := false, false
	measure := func(rs rampStep, attempt int) (Step, bool) {
		if ended, _ := sub.status(); ended {
			if err := subscribe(); err != nil {
				run.Reason = fmt.Sprintf("resubscribe: %v", err)
				return Step{}, false
			}
		}
		st, err := measureStep(ctx, env, run, rel, pub, sub, next, rs)
		if err != nil {
			run.Reason = fmt.Sprintf("step %.0f/s: %v", rs.rate, err)
			return Step{}, false
		}
		st.Attempt = attempt
		log.Info("step", "target", rs.rate, "attempt", attempt, "delivered", math.Round(st.DeliveredRate), "p99_ms", st.P99ms, "verdict", st.Verdict)
		run.Steps = append(run.Steps, st)
		run.PeakRSS = max(run.PeakRSS, st.PeakRSS)
		return st, true
	}
	for _, rs := range plan {
		if ctx.Err() != nil {
			return
		}
		stopped := failed || publisherCapped
		if stopped && !rs.mandatory {
			continue
		}
		st, ok := measure(rs, 1)
		if !ok {
			return
		}
		if !st.Pass && !stopped && !env.quick {
			if st, ok = measure(rs, 2); !ok {
				return
			}
		}
		if stopped {
			continue
		}
		if st.Pass {
			run.SteadyRSS = max(run.SteadyRSS, st.PeakRSS)
		}
		if st.Pass && st.DeliveredRate > run.Sustained {
			run.Sustained = st.DeliveredRate
			run.PublisherBound = st.PublisherLow
		}
		failed = !st.Pass
		publisherCapped = st.PublisherLow
	}
	switch {
	case failed:
		run.Reason = "ramp stopped at the first rate that failed twice (the mandatory latency steps still ran after it)"
	case publisherCapped:
		run.Reason = "ramp stopped where the publisher could not reach its target: the relay kept up with everything published"
	}
}

func copyNext(next, last []uint64) {
	for r := range next {
		next[r] = last[r] + 1
	}
}

// settle waits until no batch has arrived for quiet, at most limit.
func (s *subscriber) settle(ctx context.Context, quiet, limit time.Duration) {
	deadline := time.Now().Add(limit)
	last := s.total()
	lastChange := time.Now()
	for time.Now().Before(deadline) && ctx.Err() == nil {
		time.Sleep(50 * time.Millisecond)
		if ended, _ := s.status(); ended {
			return
		}
		if n := s.total(); n != last {
			last, lastChange = n, time.Now()
		} else if time.Since(lastChange) >= quiet {
			return
		}
	}
}

func (s *subscriber) total() uint64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.batches
}

func (s *subscriber) everyRankSeen() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, c := range s.inStep {
		if c == 0 {
			return false
		}
	}
	return true
}

func measureStep(ctx context.Context, env *environment, run *RelayRun, rel relayProc, pub *publisher, sub *subscriber, next []uint64, rs rampStep) (Step, error) {
	st := Step{Target: rs.rate}
	// Start from a quiet relay: what an earlier step left queued is
	// delivered (or lost) before this one is timed.
	settleLimit := 15 * time.Second
	if env.quick {
		settleLimit = 2 * time.Second
	}
	sub.settle(ctx, 500*time.Millisecond, settleLimit)
	var before procUsage
	pid := 0
	if run.Measured {
		pid = rel.pid()
	}
	if pid != 0 {
		u, err := readProcUsage(pid)
		if err != nil {
			return st, err
		}
		before = u
	}
	pubBefore, _ := readProcUsage(pub.pid())
	selfBefore, _ := readProcUsage(os.Getpid())
	sub.startStep(next)
	t0 := time.Now()
	res, err := pub.run(ctx, rs.rate, rs.seconds, rs.burst)
	if err != nil {
		return st, err
	}
	copyNext(next, res.Last)
	var got uint64
	drain := "3s"
	if env.quick {
		// A quick run checks that every relay delivers every step; its
		// figures mean nothing. On a loaded machine (CI running other
		// tests) a relay can be seconds behind, so it waits for the step
		// while the stream progresses instead of for a fixed time.
		got = sub.waitProgressing(ctx, uint64(res.Sent), quickStall, quickDrainLimit)
		drain = fmt.Sprintf("the stream stalled for %v (or %v passed)", quickStall, quickDrainLimit)
	} else {
		got = sub.waitFor(ctx, uint64(res.Sent), 3*time.Second)
	}
	wall := time.Since(t0)
	if u, err := readProcUsage(pub.pid()); err == nil {
		st.PublisherCPUUtil = (u.CPU - pubBefore.CPU).Seconds() / wall.Seconds()
	}
	if u, err := readProcUsage(os.Getpid()); err == nil {
		st.SubscriberCPUUtil = (u.CPU - selfBefore.CPU).Seconds() / wall.Seconds()
	}
	st.Published = res.Sent
	st.PublishedRate = res.Achieved
	st.PublisherLow = res.Achieved < 0.9*rs.rate
	st.Received = int(got)
	st.Missing = res.Sent - int(got)
	if res.Elapsed > 0 {
		st.DeliveredRate = float64(got) / res.Elapsed
	}
	samples := sub.stepSamples(res.First, res.Last)
	if run.onSamples != nil {
		run.onSamples(rs, samples)
	}
	lat := make([]time.Duration, len(samples))
	for i, s := range samples {
		lat[i] = s.latency
	}
	slices.Sort(lat)
	st.P50ms, st.P99ms, st.P999ms = ms(quantile(lat, 0.5)), ms(quantile(lat, 0.99)), ms(quantile(lat, 0.999))
	if len(lat) > 0 {
		st.MaxMs = ms(lat[len(lat)-1])
	}
	head, tail := headTail(samples)
	st.TailP50ms = ms(tail)
	if pid != 0 {
		after, err := readProcUsage(pid)
		if err != nil {
			return st, err
		}
		cpu := (after.CPU - before.CPU).Seconds()
		st.CPUSeconds = cpu
		st.CPUUtil = cpu / wall.Seconds()
		if got > 0 {
			st.CPUPerMBlocks = cpu / (float64(got) * storeBlocks) * 1e6
			st.VoluntaryCtxPerBatch = float64(after.VoluntaryCtx-before.VoluntaryCtx) / float64(got)
			st.NonvoluntaryCtxPerBatch = float64(after.NonvoluntaryCtx-before.NonvoluntaryCtx) / float64(got)
		}
		st.PeakRSS = after.PeakRSS
	}
	ended, streamErr := sub.status()
	behind := tail > behindFloor && tail > behindGrowth*head
	switch {
	case ended:
		st.Verdict = fmt.Sprintf("stream ended: %v", streamErr)
	case st.Missing > 0:
		st.Verdict = fmt.Sprintf("fell behind: %d of %d batches missing after %s", st.Missing, st.Published, drain)
	case behind:
		st.Verdict = fmt.Sprintf("fell behind: median latency grew from %.1f ms to %.0f ms", ms(head), ms(tail))
	case quantile(lat, 0.5) > saturatedLag:
		st.Verdict = fmt.Sprintf("saturated: a steady median latency of %.0f ms", st.P50ms)
	default:
		st.Pass = true
		st.Verdict = "kept up"
		if st.PublisherLow {
			st.Verdict = fmt.Sprintf("kept up; publisher reached only %.0f/s", res.Achieved)
		}
	}
	return st, nil
}

// headTail returns the median latency of the first and the last tenth of
// the samples, ordered by publish time.
func headTail(samples []sample) (head, tail time.Duration) {
	if len(samples) == 0 {
		return 0, 0
	}
	byTime := slices.Clone(samples)
	slices.SortFunc(byTime, func(a, b sample) int {
		switch {
		case a.sentAt < b.sentAt:
			return -1
		case a.sentAt > b.sentAt:
			return 1
		}
		return 0
	})
	n := max(1, len(byTime)/10)
	med := func(xs []sample) time.Duration {
		l := make([]time.Duration, len(xs))
		for i, x := range xs {
			l[i] = x.latency
		}
		slices.Sort(l)
		return quantile(l, 0.5)
	}
	return med(byTime[:n]), med(byTime[len(byTime)-n:])
}

// quantile of sorted durations, nearest rank.
func quantile(sorted []time.Duration, q float64) time.Duration {
	if len(sorted) == 0 {
		return 0
	}
	i := int(math.Ceil(q*float64(len(sorted)))) - 1
	return sorted[min(max(i, 0), len(sorted)-1)]
}

func ms(d time.Duration) float64 { return float64(d) / 1e6 }
