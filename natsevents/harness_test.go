package natsevents

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/kvrelay/kvrelay/gateway/index"
	"github.com/kvrelay/kvrelay/gateway/monitor"
	relaypkg "github.com/kvrelay/kvrelay/relay"
	"github.com/kvrelay/kvrelay/sim"
	"github.com/kvrelay/kvrelay/testkit/testnats"
	"github.com/kvrelay/kvrelay/testkit/testrelay"
)

// patience bounds every wait for something that must happen; the waits
// poll and end as soon as it does, so a loaded machine only makes a
// failure slower to report.
const patience = 30 * time.Second

func itoa(n int) string { return fmt.Sprint(n) }

func eventually(t testing.TB, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(patience)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func testLogger() *slog.Logger {
	if os.Getenv("NATSEVENTS_TEST_LOG") != "" {
		return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))
	}
	return slog.New(slog.DiscardHandler)
}

// startJetStream is an embedded JetStream server on a random port, its
// max_payload large enough for a snapshot chunk (NATS's default 1 MiB is
// not); it can be stopped and restarted on the same port and store.
func startJetStream(t testing.TB) *testnats.Node {
	t.Helper()
	return startJetStreamOn(t, 0)
}

// startJetStreamOn starts the server on port (0: any free one).
func startJetStreamOn(t testing.TB, port int) *testnats.Node {
	t.Helper()
	return testnats.Start(t, testnats.Config{Port: port, MaxPayload: 8 << 20})
}

// worker is a simulated vLLM engine behind a real relay, its gRPC server
// and (when started) its JetStream sink, all over loopback.
type worker struct {
	t      testing.TB
	name   string
	eng    *sim.Engine
	dpSize int
	rel    *relaypkg.Relay
	addr   string
	reg    *prometheus.Registry // the sink's metrics

	stops []func()
}

func startWorker(t testing.TB, name string, dpSize int) *worker {
	t.Helper()
	w := &worker{t: t, name: name, eng: testrelay.StartEngine(t, dpSize, 128), dpSize: dpSize, addr: "127.0.0.1:0"}
	t.Cleanup(w.down)
	w.startRelay()
	return w
}

// startRelay starts a fresh relay and its gRPC server (on the same address
// as before, if there was one).
func (w *worker) startRelay() {
	w.t.Helper()
	rel, stopRelay := testrelay.StartRelay(w.t, w.eng, w.dpSize)
	w.rel = rel
	w.stops = append(w.stops, stopRelay)
	addr, stopServer := testrelay.Serve(w.t, rel, w.addr)
	w.addr = addr
	w.stops = append(w.stops, stopServer)
}

// startSink publishes the current relay to url.
func (w *worker) startSink(url string, tweak ...func(*SinkOptions)) *Sink {
	w.t.Helper()
	w.reg = prometheus.NewRegistry()
	opts := SinkOptions{URL: url, Worker: w.name, Registerer: w.reg, Logger: testLogger().With("sink", w.name),
		RetryWait: 50 * time.Millisecond, SnapshotEvery: time.Hour}
	for _, f := range tweak {
		f(&opts)
	}
	s, err := NewSink(w.rel, opts)
	if err != nil {
		w.t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = s.Run(ctx) }()
	w.stops = append(w.stops, func() { cancel(); <-done; s.Close() })
	return s
}

// down stops the sink, the server and the relay, newest first.
func (w *worker) down() {
	for i := len(w.stops) - 1; i >= 0; i-- {
		w.stops[i]()
	}
	w.stops = nil
}

func (w *worker) sinkCount(name string, labels ...string) float64 {
	w.t.Helper()
	v, err := metricValue(w.reg, name, labels...)
	if err != nil {
		w.t.Fatal(err)
	}
	return v
}

// startPublishing starts a JetStream server and worker "a" (2 ranks) with
// its sink, serves steps requests, and waits for the first snapshot
// object.
func startPublishing(t testing.TB, steps int) (*testnats.Node, *worker) {
	t.Helper()
	js := startJetStream(t)
	a := startWorker(t, "a", 2)
	a.startSink(js.URL())
	a.run(steps)
	a.snapshotsWritten(1, "the first snapshot object")
	return js, a
}

// snapshotsWritten waits until the current sink has written n snapshot
// objects.
func (w *worker) snapshotsWritten(n int, what string) {
	w.t.Helper()
	eventually(w.t, what, func() bool {
		return w.sinkCount("kvrelay_nats_events_snapshots_total", "result", "written") >= float64(n)
	})
}

func (w *worker) run(steps int) {
	w.t.Helper()
	if _, err := w.eng.RunWorkload(steps); err != nil {
		w.t.Fatal(err)
	}
}

// replica is one gateway replica's event path: a monitor feeding an index,
// its subscriptions opened by a Source (nil: plain gRPC).
type replica struct {
	t   testing.TB
	ix  *index.Index
	mon *monitor.Monitor
	src *Source
	reg *prometheus.Registry
}

// startReplica follows the workers; a worker's Addr is dialled for gRPC, so
// a test that must prove the events came over NATS gives a dead address.
func startReplica(t testing.TB, natsURL string, workers ...monitor.Worker) *replica {
	t.Helper()
	return startReplicaWith(t, natsURL, nil, workers...)
}

// startReplicaWith is startReplica with the monitor's and the source's
// options changed by tweak (after the tests' short defaults are set).
func startReplicaWith(t testing.TB, natsURL string, tweak func(*monitor.Options, *SourceOptions), workers ...monitor.Worker) *replica {
	t.Helper()
	r := &replica{t: t, ix: index.New(index.Options{}), reg: prometheus.NewRegistry()}
	mopts := monitor.Options{Registerer: r.reg, Logger: testLogger().With("replica", "monitor"), MaxBackoff: 200 * time.Millisecond}
	names := map[string]string{}
	for _, w := range workers {
		names[w.ID] = w.ID
	}
	sopts := SourceOptions{URL: natsURL, Names: names, Registerer: r.reg, Logger: testLogger().With("replica", "source"), RetryWait: 50 * time.Millisecond, SwitchBackEvery: 50 * time.Millisecond}
	if tweak != nil {
		tweak(&mopts, &sopts)
	}
	if natsURL != "" {
		src, err := NewSource(sopts)
		if err != nil {
			t.Fatal(err)
		}
		r.src = src
		mopts.OpenStream = src.Open
	}
	mon, err := monitor.New(mopts)
	if err != nil {
		t.Fatal(err)
	}
	r.mon = mon
	for _, w := range workers {
		if err := mon.Add(w, r.ix); err != nil {
			t.Fatal(err)
		}
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = mon.Run(ctx) }()
	var once sync.Once
	t.Cleanup(func() {
		once.Do(func() {
			cancel()
			<-done
			if r.src != nil {
				r.src.Close()
			}
		})
	})
	return r
}

// exact waits until the replica's index holds exactly the engine's live
// set for worker id, copies included (a duplicate applied twice shows as
// a second copy).
func (r *replica) exact(id string, e *sim.Engine, when string) {
	r.t.Helper()
	want := testrelay.EngineLive(e)
	deadline := time.Now().Add(patience)
	for {
		got := r.ix.LiveSet(id)
		if slices.Equal(got, want) {
			return
		}
		if time.Now().After(deadline) {
			r.t.Fatalf("%s: the index holds %d rows for %s, the engine %d (%s); workers %+v", when, len(got), id, len(want), liveDiff(got, want), r.mon.Workers())
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func (r *replica) mode(id, source string) float64 {
	return testutil.ToFloat64(r.src.mode.WithLabelValues(id, source))
}

func (r *replica) counter(name string, labels map[string]string) float64 {
	r.t.Helper()
	var pairs []string
	for k, v := range labels {
		pairs = append(pairs, k, v)
	}
	v, err := metricValue(r.reg, name, pairs...)
	if err != nil {
		r.t.Fatal(err)
	}
	return v
}

// liveDiff says, per rank, how many rows only the index holds and how many
// only the engine.
func liveDiff(got, want []index.LiveBlock) string {
	type key struct {
		rank int32
		tier index.Tier
		hash uint64
	}
	count := func(rows []index.LiveBlock) map[key]int {
		m := map[key]int{}
		for _, r := range rows {
			m[key{r.Rank, r.Tier, r.EngineHash}] += r.Copies
		}
		return m
	}
	g, w := count(got), count(want)
	extra, missing := map[int32]int{}, map[int32]int{}
	for k, n := range g {
		if w[k] != n {
			extra[k.rank]++
		}
	}
	for k, n := range w {
		if g[k] != n {
			missing[k.rank]++
		}
	}
	return fmt.Sprintf("rows differing from the engine's, by rank: index side %v, engine side %v", extra, missing)
}

// jetStreamClient connects a plain client to url, closed when the test
// ends, and opens JetStream on it: what the tests that read, forge or
// spoil the stream behind a sink's back each need.
func jetStreamClient(t testing.TB, url string) (*nats.Conn, jetstream.JetStream) {
	t.Helper()
	nc, err := nats.Connect(url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	return nc, js
}
