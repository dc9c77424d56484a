package natsevents

import (
	"fmt"
	"math/rand/v2"
	"os"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrelay/kvrelay/gateway/monitor"
	"github.com/kvrelay/kvrelay/sim"
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
// without it, one run (it takes a few seconds), skipped with -short.

const (
	drillAliveEvery = 100 * time.Millisecond // silence bound: 3 of these
	drillRelayKills = 4
)

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

// sumMetric adds every series of name in reg whose labels include the
// given pairs.
func sumMetric(t *testing.T, reg prometheus.Gatherer, name string, labels ...string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var sum float64
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	metric:
		for _, m := range mf.GetMetric() {
			for i := 0; i+1 < len(labels); i += 2 {
				found := false
				for _, l := range m.GetLabel() {
					found = found || (l.GetName() == labels[i] && l.GetValue() == labels[i+1])
				}
				if !found {
					continue metric
				}
			}
			sum += m.GetCounter().GetValue() + m.GetGauge().GetValue()
		}
	}
	return sum
}

func jetStreamDrill(t *testing.T) {
	js := startJetStream(t)
	sinkOpts := func(o *SinkOptions) {
		o.AliveEvery = drillAliveEvery
		o.SnapshotEvery = 30 * time.Second // the default: a wrong object would last
	}
	a := startWorker(t, "a", 2)
	b := startWorker(t, "b", 2)
	workers := []*worker{a, b}
	for _, w := range workers {
		w.startSink(js.URL(), sinkOpts)
	}
	g1 := startReplica(t, js.URL(), monitor.Worker{ID: a.name, Addr: a.addr}, monitor.Worker{ID: b.name, Addr: b.addr})
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
				for _, w := range workers {
					r.exact(w.name, w.eng, when)
				}
			}
		})
		healthy(when)
	}
	onNATS := func(when string) {
		t.Helper()
		for _, r := range replicas {
			for _, w := range workers {
				eventually(t, when+": "+w.name+" back on JetStream", func() bool { return r.mode(w.name, "nats") == 1 })
			}
		}
	}
	for _, w := range workers {
		eventually(t, w.name+"'s first snapshot object", func() bool {
			return w.sinkCount("kvrelay_nats_events_snapshots_total", "result", "written") >= 1
		})
	}
	onNATS("start")
	exact("start")

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
		eventually(t, when+": the sink found silent", func() bool {
			return g1.counter("kvrelay_gateway_events_sink_silent_total", map[string]string{"worker": w.name}) > silences
		})
		w.startRelay()
		w.startSink(js.URL(), sinkOpts)
		w.primed()
		if err := w.eng.Fault(sim.Fault{Kind: sim.FaultReplayDelay, Rank: &one, N: 0}); err != nil {
			t.Fatal(err)
		}
		healthy(when)
		onNATS(when)
		exact(when)
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
	g2 := startReplica(t, js.URL(), monitor.Worker{ID: a.name, Addr: deadAddr}, monitor.Worker{ID: b.name, Addr: deadAddr})
	replicas = append(replicas, g2)
	onNATS("late replica")
	exact("late replica")
	// And everyone follows what comes next.
	next := a.eng.PublisherStats()[0].NextSeq
	eventually(t, "more batches", func() bool { return a.eng.PublisherStats()[0].NextSeq > next+20 })
	exact("end")
}
