package bench

import (
	"context"
	"os"
	"runtime"
	"slices"
	"testing"
	"time"

	"github.com/kvrelay/kvrelay/internal/latencyprobe"
	"github.com/kvrelay/kvrelay/proto/kvpb"
	"github.com/kvrelay/kvrelay/relay"
	"github.com/kvrelay/kvrelay/testkit/pyenv"
)

// probedPath is a relay fed from memory, served over gRPC on loopback, and
// the bench's subscriber reading it: kvrelay's path from the feed on, the
// part the no-relay control does not have.
type probedPath struct {
	mem    *memRelay
	served *servedRelay
	sub    *subscriber
	cancel context.CancelFunc
	enc    *payloadEncoder
	next   []uint64
}

func newProbedPath(t testing.TB) *probedPath {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	m, err := newMemRelay(dpSize, 1024)
	if err != nil {
		t.Fatal(err)
	}
	sr, err := serveRelay(ctx, m.relay)
	if err != nil {
		t.Fatal(err)
	}
	s := newSubscriber(dpSize)
	s.startStep(make([]uint64, dpSize))
	opened := make(chan error, 1)
	go s.runRequest(ctx, sr.addr(), &kvpb.SubscribeKvEventsRequest{}, opened)
	p := &probedPath{mem: m, served: sr, sub: s, cancel: cancel, enc: newPayloadEncoder(), next: make([]uint64, dpSize)}
	t.Cleanup(func() {
		cancel()
		<-s.done
		sr.stop()
	})
	if err := <-opened; err != nil {
		t.Fatal(err)
	}
	return p
}

// publish feeds rank's next batch, stamped now, and returns its sequence.
func (p *probedPath) publish(rank int) uint64 {
	seq := p.next[rank]
	p.next[rank]++
	p.mem.feeds[rank].ch <- relay.Message{Seq: seq, Payload: p.enc.batch(rank, seq, evictWindow, time.Now())}
	return seq
}

// waitReceived waits, on the subscriber's count, until n batches of the
// step arrived; it fails the test if the stream ends first.
func (p *probedPath) waitReceived(t testing.TB, n uint64) {
	t.Helper()
	for p.sub.received() < n {
		if ended, err := p.sub.status(); ended {
			t.Fatalf("stream ended after %d of %d batches: %v", p.sub.received(), n, err)
		}
		time.Sleep(100 * time.Microsecond)
	}
}

// TestProbeMarksEveryStage checks that a batch relayed over gRPC is marked
// at every stage of latencyprobe, once each and in order, so that the
// bench's breakdown covers the whole path: without a mark (or with two
// stages swapped) collect leaves the batch out.
func TestProbeMarksEveryStage(t *testing.T) {
	probe := newStageProbe()
	counts := make([]int, latencyprobe.NumStages)
	countCh := make(chan latencyprobe.Stage, 1024)
	defer latencyprobe.Install(func(stage latencyprobe.Stage, rank int32, seq uint64) {
		probe.mark(stage, rank, seq)
		countCh <- stage
	})()
	p := newProbedPath(t)
	const perRank = 5
	for range perRank {
		for rank := range dpSize {
			p.publish(rank)
		}
	}
	p.waitReceived(t, perRank*dpSize)
	samples := p.sub.stepSamples(make([]uint64, dpSize), []uint64{perRank - 1, perRank - 1})
	if len(samples) != perRank*dpSize {
		t.Fatalf("subscriber sampled %d batches, want %d", len(samples), perRank*dpSize)
	}
	// Written is marked after SendMsg returns, which can be after the
	// client read the batch: wait for every mark before counting.
	backstop := time.After(time.Minute) // only against a hang: a missing mark
	for range int(latencyprobe.NumStages) * perRank * dpSize {
		select {
		case st := <-countCh:
			counts[st]++
		case <-backstop:
			t.Fatalf("marks so far per stage %v; some never came", counts)
		}
	}
	select {
	case st := <-countCh:
		t.Errorf("an extra mark at stage %v", st)
	default:
	}
	got := probe.collect(samples)
	if len(got) != len(samples) {
		t.Errorf("%d of %d batches have every stage marked in order", len(got), len(samples))
		for _, x := range samples {
			var at []int64
			for st := latencyprobe.Stage(0); st < latencyprobe.NumStages; st++ {
				at = append(at, probe.slot(st, int32(x.rank), x.seq).Load()-int64(x.sentAt*1e9))
			}
			t.Logf("rank %d seq %d: stages at %v ns after publish, client at %d", x.rank, x.seq, at, x.latency)
		}
	}
	for st, n := range counts {
		if n != perRank*dpSize {
			t.Errorf("stage %v marked %d times, want %d", latencyprobe.Stage(st), n, perRank*dpSize)
		}
	}
	b := breakdown("test", 0, got)
	if len(b.Stages) != len(breakdownStages) {
		t.Errorf("breakdown has %d rows, want %d", len(b.Stages), len(breakdownStages))
	}
}

// BenchmarkRelayPathLatency is the regression guard of issue 19 item 2:
// the latency kvrelay adds, measured as the time from a batch entering the
// relay's feed to the bench's gRPC client reading it (everything the
// control does not have), one isolated batch at a time, reported as
// p50-µs and p99-µs. Each iteration publishes one batch and waits for it;
// ns/op also counts that wait's polling, so read the custom metrics.
// Run: go test -run XXX -bench RelayPathLatency -benchtime 2000x ./bench/
func BenchmarkRelayPathLatency(b *testing.B) {
	p := newProbedPath(b)
	// Warm up the connection and the relay's first-batch paths.
	for rank := range dpSize {
		p.publish(rank)
	}
	p.waitReceived(b, dpSize)
	p.sub.startStep(p.next)
	first := slices.Clone(p.next)
	b.ResetTimer()
	for i := range b.N {
		p.publish(i % dpSize)
		p.waitReceived(b, uint64(i+1))
	}
	b.StopTimer()
	last := make([]uint64, dpSize)
	for r := range last {
		last[r] = p.next[r] - 1
	}
	samples := p.sub.stepSamples(first, last)
	lat := make([]time.Duration, len(samples))
	for i, s := range samples {
		lat[i] = s.latency
	}
	slices.Sort(lat)
	b.ReportMetric(float64(quantile(lat, 0.5))/1e3, "p50-µs")
	b.ReportMetric(float64(quantile(lat, 0.99))/1e3, "p99-µs")
}

// TestPublisherPacesEveryBatch checks the publisher's pacing, the cause of
// the 1.4 ms that the side-by-side bench used to show: with burst 1 every
// batch leaves at its own time on the schedule, with burst 32 the batches
// leave in back-to-back runs. At 200 batches/s a batch is due every 5 ms,
// and a publish takes tens of microseconds, so "back to back" (under
// 0.5 ms after the previous one) tells the two apart by a factor of ten
// even on a loaded host; the thresholds are halfway.
func TestPublisherPacesEveryBatch(t *testing.T) {
	if testing.Short() {
		t.Skip("starts the Python publisher")
	}
	env := &environment{out: t.TempDir(), repo: pyenv.RepoRoot(), python: pyenv.Python(t), log: quietLog}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	pub, err := startPublisher(ctx, env, dpSize)
	if err != nil {
		t.Fatal(err)
	}
	defer pub.stop()
	d := &directFeed{pub: pub}
	s := newSubscriber(dpSize)
	opened := make(chan error, 1)
	fctx, stopFeed := context.WithCancel(ctx)
	go d.feed(fctx, s, opened)
	defer func() {
		stopFeed()
		<-s.done
	}()
	if err := <-opened; err != nil {
		t.Fatal(err)
	}
	next := make([]uint64, dpSize)
	// The SUB sockets join asynchronously: publish until both ranks arrive.
	for !s.everyRankSeen() {
		s.startStep(next)
		res, err := pub.run(ctx, 400, 0.1, 1)
		if err != nil {
			t.Fatal(err)
		}
		copyNext(next, res.Last)
		s.waitFor(ctx, uint64(res.Sent), 500*time.Millisecond)
		if ctx.Err() != nil {
			t.Fatal("the control never received both ranks")
		}
	}
	backToBack := func(burst int) (float64, int) {
		s.settle(ctx, 200*time.Millisecond, 5*time.Second)
		s.startStep(next)
		res, err := pub.run(ctx, 200, 0.64, burst)
		if err != nil {
			t.Fatal(err)
		}
		first := slices.Clone(next)
		copyNext(next, res.Last)
		s.waitFor(ctx, uint64(res.Sent), 10*time.Second)
		samples := s.stepSamples(first, res.Last)
		sent := make([]float64, len(samples))
		for i, x := range samples {
			sent[i] = x.sentAt
		}
		slices.Sort(sent)
		n := 0
		for i := 1; i < len(sent); i++ {
			if sent[i]-sent[i-1] < 0.0005 {
				n++
			}
		}
		return float64(n) / float64(max(len(sent)-1, 1)), len(sent)
	}
	even, nEven := backToBack(1)
	bursty, nBursty := backToBack(32)
	t.Logf("back to back: %.0f%% of %d batches paced one by one, %.0f%% of %d in bursts of 32", 100*even, nEven, 100*bursty, nBursty)
	if nEven < 100 || nBursty < 100 {
		t.Fatalf("too few batches arrived to judge: %d and %d of 128", nEven, nBursty)
	}
	if even > 0.5 {
		t.Errorf("burst 1: %.0f%% of batches left back to back; want each at its own time", 100*even)
	}
	if bursty < 0.5 {
		t.Errorf("burst 32: only %.0f%% of batches left back to back; the knob does nothing", 100*bursty)
	}
}

// TestAddedLatencyPairsRounds checks the arithmetic of the latency table:
// a build's step is set against the control's step of the same round,
// pacing and rate, and of a step measured twice only the last attempt
// counts, for the control as for the build.
func TestAddedLatencyPairsRounds(t *testing.T) {
	step := func(rate, p50, p99 float64, attempt int) Step {
		return Step{Target: rate, P50ms: p50, P99ms: p99, Attempt: attempt, Received: 1}
	}
	runs := []LatencyRun{
		{Round: 1, Relay: controlName, Pacing: "even", Steps: []Step{step(1000, 0.2, 2, 1)}},
		{Round: 1, Relay: "kvrelay", Pacing: "even", Steps: []Step{step(1000, 0.5, 3, 1)}},
		{Round: 1, Relay: controlName, Pacing: "bursty", Steps: []Step{step(1000, 1, 5, 1), step(1000, 0.8, 4, 2)}},
		{Round: 1, Relay: "kvrelay", Pacing: "bursty", Steps: []Step{step(1000, 9, 90, 1), step(1000, 3, 10, 2)}},
		{Round: 2, Relay: "kvrelay", Pacing: "even", Steps: []Step{step(1000, 0.4, 2.5, 1)}},
		{Round: 2, Relay: controlName, Pacing: "even", Steps: []Step{step(1000, 0.1, 1, 1)}},
		// No control ran at 250/s: nothing to pair with.
		{Round: 2, Relay: "kvrelay", Pacing: "even", Steps: []Step{step(250, 0.3, 1, 1)}},
	}
	got := addedLatency(runs, controlName)
	want := []AddedLatency{
		{Relay: "kvrelay", Pacing: "even", Rate: 1000, P50ms: []float64{0.3, 0.3}, P99ms: []float64{1, 1.5},
			ControlP50ms: []float64{0.2, 0.1}, ControlP99ms: []float64{2, 1}},
		{Relay: "kvrelay", Pacing: "bursty", Rate: 1000, P50ms: []float64{2.2}, P99ms: []float64{6},
			ControlP50ms: []float64{0.8}, ControlP99ms: []float64{4}},
	}
	if len(got) != len(want) {
		t.Fatalf("got %d rows %+v, want %d", len(got), got, len(want))
	}
	near := func(a, b []float64) bool {
		if len(a) != len(b) {
			return false
		}
		for i := range a {
			if d := a[i] - b[i]; d > 1e-9 || d < -1e-9 {
				return false
			}
		}
		return true
	}
	for i := range want {
		g, w := got[i], want[i]
		if g.Relay != w.Relay || g.Pacing != w.Pacing || g.Rate != w.Rate || !near(g.P50ms, w.P50ms) || !near(g.P99ms, w.P99ms) ||
			!near(g.ControlP50ms, w.ControlP50ms) || !near(g.ControlP99ms, w.ControlP99ms) {
			t.Errorf("row %d: got %+v, want %+v", i, g, w)
		}
	}
}

// readProcUsage counts context switches over every thread: a thread that
// sleeps ten times adds at least ten voluntary ones to its process.
func TestProcUsageCountsThreadContextSwitches(t *testing.T) {
	before, err := readProcUsage(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		// This thread sleeps in the kernel each time; unlocked before the
		// goroutine ends, or the runtime would end the thread and its counts.
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
		for range 10 {
			time.Sleep(time.Millisecond)
		}
	}()
	<-done
	after, err := readProcUsage(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	if got := after.VoluntaryCtx - before.VoluntaryCtx; got < 10 {
		t.Fatalf("voluntary context switches grew by %d over ten sleeps, want at least 10", got)
	}
}
