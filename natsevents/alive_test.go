package natsevents

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/kvrelay/kvrelay/gateway/monitor"
)

// startSinkStoppable is startSink whose stop the test calls itself (the
// sink alone: the relay, its gRPC server and NATS stay up).
func (w *worker) startSinkStoppable(url string, tweak ...func(*SinkOptions)) (stop func()) {
	w.t.Helper()
	w.startSink(url, tweak...)
	last := w.stops[len(w.stops)-1]
	w.stops = w.stops[:len(w.stops)-1]
	var once sync.Once
	stop = func() { once.Do(last) }
	w.t.Cleanup(stop)
	return stop
}

// TestSinkSilentFallsBackToGRPC: a replica follows a worker from
// JetStream; the worker's sink stops (its relay and NATS stay up, the
// replica stays connected), so the stream stops moving while the engine
// goes on. The replica must notice the silence, move the worker to its
// gRPC stream and stay exact; when the sink is back it returns to
// JetStream, exact. Without the announcements the replica stays on the
// frozen stream and the second exact check times out.
func TestSinkSilentFallsBackToGRPC(t *testing.T) {
	js := startJetStream(t)
	a := startWorker(t, "a", 2)
	// 500 ms: a bound of 1.5 s, far above a loaded machine's timer lag.
	sinkOpts := func(o *SinkOptions) { o.SnapshotEvery = 100 * time.Millisecond; o.AliveEvery = 500 * time.Millisecond }
	stopSink := a.startSinkStoppable(js.URL(), sinkOpts)
	a.run(15)
	a.snapshotsWritten(1, "the first snapshot object")
	r := startReplica(t, js.URL(), monitor.Worker{ID: a.name, Addr: a.addr})
	eventually(t, "the replica on JetStream", func() bool { return r.mode(a.name, "nats") == 1 })
	eventually(t, "an announcement of the sink", func() bool {
		r.src.alive.mu.Lock()
		defer r.src.alive.mu.Unlock()
		return r.src.alive.sinks[WorkerToken(a.name)] != nil
	})
	a.run(10)
	r.exact(a.name, a.eng, "on JetStream")
	assertAnnouncementsNotStored(t, js.URL())
	silences := func() float64 {
		return r.counter("kvrelay_gateway_events_sink_silent_total", map[string]string{"worker": a.name})
	}
	if n := silences(); n != 0 {
		t.Fatalf("a publishing sink was called silent %v times", n)
	}

	stopSink()
	eventually(t, "the fallback to gRPC", func() bool { return r.mode(a.name, "grpc") == 1 })
	if !r.src.nc.IsConnected() {
		t.Fatal("the replica lost NATS: the test is about a silent sink, not an outage")
	}
	if n := silences(); n != 1 {
		t.Errorf("kvrelay_gateway_events_sink_silent_total = %v after one silence, want 1", n)
	}
	a.run(20)
	r.exact(a.name, a.eng, "sink stopped, NATS up")

	a.startSink(js.URL(), sinkOpts)
	// The new pass re-publishes what the stream holds; its snapshot waits
	// for a new batch on every rank, so the engine goes on meanwhile.
	eventually(t, "the return to JetStream", func() bool {
		a.run(1)
		return r.mode(a.name, "nats") == 1
	})
	a.run(20)
	r.exact(a.name, a.eng, "sink back")
	if n := silences(); n != 1 {
		t.Errorf("kvrelay_gateway_events_sink_silent_total = %v, want 1", n)
	}
}

// assertAnnouncementsNotStored checks that the stream holds the worker's
// rank subjects and none of the announcements.
func assertAnnouncementsNotStored(t *testing.T, url string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), patience)
	defer cancel()
	st, err := openDefaultStream(ctx, t, url)
	if err != nil {
		t.Fatal(err)
	}
	info, err := st.Info(ctx, jetstream.WithSubjectFilter(">"))
	if err != nil {
		t.Fatal(err)
	}
	if len(info.State.Subjects) == 0 {
		t.Fatal("the stream lists no subjects")
	}
	for subj := range info.State.Subjects {
		if strings.Contains(subj, "-alive") {
			t.Errorf("the stream stored announcements: %s", subj)
		}
	}
}

// TestAliveTracker: when a sink counts as silent, that it is counted once
// per silence.
func TestAliveTracker(t *testing.T) {
	t0 := time.Unix(1000, 0)
	msg := func(token string, every time.Duration) *nats.Msg {
		return &nats.Msg{Subject: aliveSubject(DefaultSubjectPrefix, token), Data: encodeAnnouncement(announcement{Incarnation: 7, Pass: 1, LastSeq: 3, Every: every})}
	}
	type step struct {
		at       time.Duration // since t0
		announce string        // token announcing (with a 100 ms interval)
		garbage  string        // token sending an undecodable announcement
		reconn   bool
		check    string // token checked
		silent   bool   // the check's expected answer
		count    float64
	}
	tests := []struct {
		name        string
		silentAfter time.Duration
		steps       []step
	}{
		{"never announced: today's behaviour", 0, []step{
			{at: time.Hour, check: "old", silent: false},
			{at: time.Hour, garbage: "old"},
			{at: 2 * time.Hour, check: "old", silent: false},
		}},
		{"3 intervals, then silent once, then back", 0, []step{
			{at: 0, announce: "a"},
			{at: 300 * time.Millisecond, check: "a", silent: false},
			{at: 301 * time.Millisecond, check: "a", silent: true, count: 1},
			{at: time.Second, check: "a", silent: true, count: 1},
			{at: time.Second, announce: "a"},
			{at: time.Second, check: "a", silent: false, count: 1},
			{at: 2 * time.Second, check: "a", silent: true, count: 2},
		}},
		{"another sink's announcements do not count", 0, []step{
			{at: 0, announce: "a"},
			{at: time.Second, announce: "b"},
			{at: time.Second, check: "a", silent: true, count: 1},
			{at: time.Second, check: "b", silent: false, count: 1},
		}},
		{"a reconnect of the replica restarts the clocks", 0, []step{
			{at: 0, announce: "a"},
			{at: time.Second, reconn: true},
			{at: 1200 * time.Millisecond, check: "a", silent: false},
			{at: 1400 * time.Millisecond, check: "a", silent: true, count: 1},
		}},
		{"SilentAfter overrides the interval", 2 * time.Second, []step{
			{at: 0, announce: "a"},
			{at: 2 * time.Second, check: "a", silent: false},
			{at: 2*time.Second + 1, check: "a", silent: true, count: 1},
		}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			tr := newAliveTracker(tc.silentAfter, slog.New(slog.DiscardHandler))
			for i, s := range tc.steps {
				tr.now = func() time.Time { return t0.Add(s.at) }
				switch {
				case s.announce != "":
					tr.handle(msg(s.announce, 100*time.Millisecond))
				case s.garbage != "":
					tr.handle(&nats.Msg{Subject: aliveSubject(DefaultSubjectPrefix, s.garbage), Data: []byte("alive")})
				case s.reconn:
					tr.reconnected()
				default:
					err := tr.check(s.check, "w-"+s.check)
					if got := errors.Is(err, errSinkSilent); got != s.silent {
						t.Fatalf("step %d: check(%s) = %v, want silent=%v", i, s.check, err, s.silent)
					}
					if got := testutil.ToFloat64(tr.silences.WithLabelValues("w-a")); got != s.count {
						t.Fatalf("step %d: silences of a = %v, want %v", i, got, s.count)
					}
				}
			}
		})
	}
}

// TestAliveSilenceTaken: a silence is reported to takeSilence once (the
// source then marks the snapshot object of that moment stale), and not
// before it happens.
func TestAliveSilenceTaken(t *testing.T) {
	tr := newAliveTracker(0, slog.New(slog.DiscardHandler))
	t0 := time.Unix(1000, 0)
	tr.now = func() time.Time { return t0 }
	if tr.takeSilence("a") {
		t.Fatal("an unknown sink reported silenced")
	}
	tr.handle(&nats.Msg{Subject: aliveSubject(DefaultSubjectPrefix, "a"), Data: encodeAnnouncement(announcement{Every: time.Second})})
	if tr.takeSilence("a") {
		t.Fatal("silenced before any silence")
	}
	tr.now = func() time.Time { return t0.Add(time.Hour) }
	if err := tr.check("a", "a"); err == nil {
		t.Fatal("not silent after an hour")
	}
	if !tr.takeSilence("a") {
		t.Fatal("the silence not reported")
	}
	if tr.takeSilence("a") {
		t.Fatal("the silence reported twice")
	}
}

func TestDecodeAnnouncement(t *testing.T) {
	good := encodeAnnouncement(announcement{Incarnation: 1, Pass: 2, LastSeq: 3, Every: time.Second})
	a, err := decodeAnnouncement(good)
	if err != nil || a != (announcement{Incarnation: 1, Pass: 2, LastSeq: 3, Every: time.Second}) {
		t.Fatalf("decode(encode) = %+v, %v", a, err)
	}
	tests := []struct {
		name, want string
		data       []byte
	}{
		{"empty", "0 bytes", nil},
		{"short", "35 bytes", good[:len(good)-1]},
		{"long", "37 bytes", append(bytes.Clone(good), 0)},
		{"magic", "magic", append([]byte("KVA2"), good[4:]...)},
		{"zero interval", "interval 0 ms", encodeAnnouncement(announcement{})},
		{"interval above a minute", "interval 3600000 ms", encodeAnnouncement(announcement{Every: time.Hour})},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, err := decodeAnnouncement(tc.data)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("err = %v, want one naming %q", err, tc.want)
			}
		})
	}
}

func TestSinkAliveEveryOption(t *testing.T) {
	for _, tc := range []struct {
		every time.Duration
		want  string
	}{{time.Hour, "above"}, {time.Microsecond, "below"}} {
		_, err := (SinkOptions{Worker: "w", AliveEvery: tc.every}).withDefaults()
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("AliveEvery %s: err = %v, want one saying %q", tc.every, err, tc.want)
		}
	}
	o, err := (SinkOptions{Worker: "w"}).withDefaults()
	if err != nil || o.AliveEvery != DefaultAliveEvery {
		t.Errorf("default AliveEvery = %s, %v; want %s", o.AliveEvery, err, DefaultAliveEvery)
	}
}

// FuzzAnnouncement: any bytes decode to an error or to an announcement
// that encodes back to the same bytes, without a panic.
func FuzzAnnouncement(f *testing.F) {
	f.Add(encodeAnnouncement(announcement{Incarnation: 1, Pass: 2, LastSeq: 3, Every: time.Second}))
	f.Add([]byte(aliveMagic))
	f.Add(encodeAnnouncement(announcement{Every: time.Hour}))
	f.Fuzz(func(t *testing.T, data []byte) {
		a, err := decodeAnnouncement(data)
		if err != nil {
			return
		}
		if a.Every <= 0 || a.Every > maxAliveEvery {
			t.Fatalf("decoded an interval out of bounds: %s", a.Every)
		}
		if again := encodeAnnouncement(a); !bytes.Equal(again, data) {
			t.Fatalf("re-encoding changed the announcement: %x -> %x", data, again)
		}
	})
}

const neverHeard = "never heard"

// describe is what t knows of token's sink, for a test's failure message.
func (t *aliveTracker) describe(token string) string {
	t.mu.Lock()
	defer t.mu.Unlock()
	st := t.sinks[token]
	if st == nil {
		return neverHeard
	}
	return fmt.Sprintf("heard %v ago, %+v, silent %v", t.now().Sub(st.heard), st.last, st.silent)
}
