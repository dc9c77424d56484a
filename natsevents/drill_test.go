package natsevents

import (
	"fmt"
	"math/rand/v2"
	"os"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrelay/kvrelay/gateway/monitor"
	"github.com/kvrelay/kvrelay/sim"
	"github.com/kvrelay/kvrelay/testkit/testrelay"
)

// The restart drill of issue 30, on a real (embedded) nats-server with a
// JetStream store on disk: two relays of 2 ranks each under steady
// traffic, their engines answering one rank's replay late (so the ranks of
// a restarted relay prime at different times), a relay stopped and
// restarted past the replicas' sink-silence bound several times, the
// nats-server stopped and restarted on its store once, and a replica
// started late. A replica follows from the start. Asserted all along: no
// digest divergence on any replica (each checks the relays' live digests
// once a second), no repair, and an exact index (every replica holds each
// engine's live set) after every fault and at the end.
//
// KVRELAY_JETSTREAM_DRILL=N runs it N times in a row (make test-long);
// without it, one run (it takes a few seconds), skipped with -short. The
// timings are short ones (announcements every 100 ms, switch-back checks
// every 50 ms, a 200 ms backoff cap) unless KVRELAY_JETSTREAM_DRILL_DEFAULTS
// is set: then the commands' defaults (1 s, 2 s, 5 s), for measuring the
// time to exact after a relay restart as deployed (README).

const drillRelayKills = 4

// drillTimings are the drill's announcement interval, and its replicas'
// switch-back period and backoff cap.
func drillTimings() (alive, switchBack, maxBackoff time.Duration) {
	if os.Getenv("KVRELAY_JETSTREAM_DRILL_DEFAULTS") != "" {
		return DefaultAliveEvery, 2 * time.Second, monitor.DefaultMaxBackoff
	}
	return 100 * time.Millisecond, 50 * time.Millisecond, 200 * time.Millisecond
}

func TestJetStreamRestartDrill(t *testing.T) {
	runs := 1
	if v := os.Getenv("KVRELAY_JETSTREAM_DRILL"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 {
			t.Fatalf("KVRELAY_JETSTREAM_DRILL=%q: want a run count ≥ 1", v)
		}
		runs = n
	} else if testing.Short() {
		t.Skip("the JetStream restart drill; KVRELAY_JETSTREAM_DRILL=N runs it N times")
	}
	for i := range runs {
		t.Run(fmt.Sprintf("run%d", i+1), func(t *testing.T) {
			begin := time.Now()
			jetStreamDrill(t)
			t.Logf("run %d took %v", i+1, time.Since(begin).Round(time.Millisecond))
		})
	}
}

// traffic runs the engines' workload in the background until paused.
type traffic struct {
	mu      sync.Mutex // held by the loop while it steps; pause takes it
	stop    chan struct{}
	done    chan struct{}
	errOnce sync.Once
	err     error
}

func startTraffic(t *testing.T, workers ...*worker) *traffic {
	tr := &traffic{stop: make(chan struct{}), done: make(chan struct{})}
	go func() {
		defer close(tr.done)
		for {
			select {
			case <-tr.stop:
				return
			default:
			}
			tr.mu.Lock()
			for _, w := range workers {
				if _, err := w.eng.RunWorkload(1); err != nil {
					tr.errOnce.Do(func() { tr.err = err })
				}
			}
			tr.mu.Unlock()
			time.Sleep(5 * time.Millisecond)
		}
	}()
	t.Cleanup(func() {
		close(tr.stop)
		<-tr.done
		if tr.err != nil {
			t.Errorf("traffic: %v", tr.err)
		}
	})
	return tr
}

// quiet runs f with the engines still.
func (tr *traffic) quiet(f func()) {
	tr.mu.Lock()
	defer tr.mu.Unlock()
	f()
}

// sumMetric adds every series of name in reg.
func sumMetric(t *testing.T, reg prometheus.Gatherer, name string) float64 {
	t.Helper()
	v, err := metricValue(reg, name)
	if err != nil {
		t.Fatal(err)
	}
	return v
}

func jetStreamDrill(t *testing.T) {
	js := startJetStream(t)
	aliveEvery, switchBack, maxBackoff := drillTimings()
	newReplica := func(workers ...monitor.Worker) *replica {
		return startReplicaWith(t, js.URL(), func(m *monitor.Options, s *SourceOptions) {
			m.MaxBackoff, s.SwitchBackEvery = maxBackoff, switchBack
		}, workers...)
	}
	sinkOpts := func(o *SinkOptions) {
		o.AliveEvery = aliveEvery
		o.SnapshotEvery = 30 * time.Second // the default: a wrong object would last
	}
	a := startWorker(t, "a", 2)
	b := startWorker(t, "b", 2)
	workers := []*worker{a, b}
	for _, w := range workers {
		w.startSink(js.URL(), sinkOpts)
	}
	g1 := newReplica(monitor.Worker{ID: a.name, Addr: a.addr}, monitor.Worker{ID: b.name, Addr: b.addr})
	replicas := []*replica{g1}
	tr := startTraffic(t, a, b)

	// healthy checks what must hold at every point: no divergence, no
	// repair, on every replica.
	healthy := func(when string) {
		t.Helper()
		for i, r := range replicas {
			if d := sumMetric(t, r.reg, "kvrelay_gateway_digest_divergences_total"); d != 0 {
				t.Fatalf("%s: replica %d counted %v digest divergences", when, i+1, d)
			}
			if n := sumMetric(t, r.reg, "kvrelay_gateway_events_repairs_total"); n != 0 {
				t.Fatalf("%s: replica %d repaired %v times", when, i+1, n)
			}
		}
	}
	phase := time.Now()
	exact := func(when string) {
		t.Helper()
		defer func() {
			t.Logf("%s: exact, %v since the last check", when, time.Since(phase).Round(time.Millisecond))
			phase = time.Now()
		}()
		tr.quiet(func() {
			for _, r := range replicas {
				for _, w := range r.follows(workers) {
					r.exact(w.name, w.eng, when)
				}
			}
		})
		healthy(when)
	}
	onNATS := func(when string) {
		t.Helper()
		for _, r := range replicas {
			for _, w := range r.follows(workers) {
				eventually(t, when+": "+w.name+" back on JetStream", func() bool { return r.mode(w.name, "nats") == 1 })
			}
		}
	}
	for _, w := range workers {
		w.snapshotsWritten(1, w.name+"'s first snapshot object")
	}
	onNATS("start")
	exact("start")
	// A sink a replica never heard is never called silent (an older
	// relay's, as far as it knows): the kills below come once g1 heard
	// every sink.
	for _, w := range workers {
		eventually(t, "g1 heard "+w.name+"'s sink", func() bool {
			return g1.src.alive.describe(WorkerToken(w.name)) != neverHeard
		})
	}

	one := 1
	for k := range drillRelayKills {
		w := workers[k%2]
		when := fmt.Sprintf("relay %s killed (%d of %d)", w.name, k+1, drillRelayKills)
		silences := g1.counter("kvrelay_gateway_events_sink_silent_total", map[string]string{"worker": w.name})
		w.down()
		// The restarted relay's rank 1 primes late, rank 0 at once.
		delay := 100 + rand.IntN(400)
		if err := w.eng.Fault(sim.Fault{Kind: sim.FaultReplayDelay, Rank: &one, N: delay}); err != nil {
			t.Fatal(err)
		}
		// Restarted past the silence bound, as the operator did.
		// (Asked of the tracker, not the counter: on a loaded machine an
		// announcement can come late, and a silence already counted just
		// before the kill does not count again.)
		for deadline := time.Now().Add(patience); g1.src.alive.check(WorkerToken(w.name), w.name) == nil; {
			if time.Now().After(deadline) {
				t.Fatalf("%s: the sink not found silent in %v; the tracker: %s", when, patience, g1.src.alive.describe(WorkerToken(w.name)))
			}
			time.Sleep(5 * time.Millisecond)
		}
		if g1.counter("kvrelay_gateway_events_sink_silent_total", map[string]string{"worker": w.name}) <= silences {
			t.Logf("%s: the silence began before the kill (a late announcement)", when)
		}
		restarted := time.Now()
		w.startRelay()
		w.startSink(js.URL(), sinkOpts)
		// Time to exact: the first moment the following replica holds
		// the engine's live set, checked with the traffic going on.
		for tries := 0; ; tries++ {
			done := false
			tr.quiet(func() { done = slicesEqualLive(g1, w) })
			if done {
				break
			}
			if time.Since(restarted) > patience {
				t.Fatalf("%s: the replica not exact %v after the restart", when, patience)
			}
			time.Sleep(5 * time.Millisecond)
		}
		t.Logf("%s: time to exact %v after the relay's restart (rank 1's replay %d ms late)", when, time.Since(restarted).Round(time.Millisecond), delay)
		w.primed()
		if err := w.eng.Fault(sim.Fault{Kind: sim.FaultReplayDelay, Rank: &one, N: 0}); err != nil {
			t.Fatal(err)
		}
		healthy(when)
		onNATS(when)
		t.Logf("%s: back on JetStream %v after the relay's restart", when, time.Since(restarted).Round(time.Millisecond))
		// A replica started on the restarted relay's first snapshot
		// object, as a gateway started then would read it (issue 30: it
		// held one rank only), with nothing but JetStream to go by.
		// It is left out of the later checks: with NATS down it has no
		// source at all.
		w.snapshotsWritten(1, when+": the restarted relay's first snapshot object")
		replicas = append(replicas, newReplica(monitor.Worker{ID: w.name, Addr: deadAddr}))
		exact(when)
		replicas = replicas[:len(replicas)-1]
		if k == 1 {
			// nats-server down and back on its store.
			js.Stop()
			for _, w := range workers {
				eventually(t, "NATS down: "+w.name+" on gRPC", func() bool { return g1.mode(w.name, "grpc") == 1 })
			}
			exact("NATS down")
			js.Restart()
			onNATS("NATS restarted")
			exact("NATS restarted")
		}
	}
	// A replica started late reads the snapshots and the tails alone.
	g2 := newReplica(monitor.Worker{ID: a.name, Addr: deadAddr}, monitor.Worker{ID: b.name, Addr: deadAddr})
	replicas = append(replicas, g2)
	onNATS("late replica")
	exact("late replica")
	// And everyone follows what comes next.
	next := a.eng.PublisherStats()[0].NextSeq
	eventually(t, "more batches", func() bool { return a.eng.PublisherStats()[0].NextSeq > next+20 })
	exact("end")
}

// slicesEqualLive says whether r holds w's engine's live set now.
func slicesEqualLive(r *replica, w *worker) bool {
	return slices.Equal(r.ix.LiveSet(w.name), testrelay.EngineLive(w.eng))
}

// follows lists the workers of ws that r follows.
func (r *replica) follows(ws []*worker) []*worker {
	var out []*worker
	for _, w := range ws {
		for _, mw := range r.mon.Workers() {
			if mw.ID == w.name {
				out = append(out, w)
				break
			}
		}
	}
	return out
}
