package natsevents

import (
	"context"
	"errors"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

// memberLog records what a MemberWatcher delivers.
type memberLog struct {
	mu   sync.Mutex
	last []string
	n    int
}

func (l *memberLog) set(specs []string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.last, l.n = specs, l.n+1
}

func (l *memberLog) get() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.last
}

func TestMembersFollowTheSinksAnnouncements(t *testing.T) {
	srv := startJetStream(t)
	a := startWorker(t, "a", 1)
	b := startWorker(t, "b", 1)
	memberA := "grpc://" + a.addr + ",model=llama,service=vllm"
	memberB := "grpc://" + b.addr + ",model=llama,service=sglang"
	fast := func(member string) func(*SinkOptions) {
		return func(o *SinkOptions) { o.AliveEvery, o.Member = 20*time.Millisecond, member }
	}
	var got memberLog
	w, err := WatchMembers(MemberOptions{URL: srv.URL(), LeaveAfter: 400 * time.Millisecond, OnChange: got.set, Logger: testLogger()})
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); w.Run(ctx) }()
	defer func() { cancel(); <-done }()

	a.startSink(srv.URL(), fast(memberA))
	stopB := b.startSinkStoppable(srv.URL(), fast(memberB))
	// A relay announcing no member (as before members) is no member.
	c := startWorker(t, "c", 1)
	c.startSink(srv.URL(), func(o *SinkOptions) { o.AliveEvery = 20 * time.Millisecond })

	want := []string{memberA, memberB}
	slices.Sort(want)
	eventually(t, "both members", func() bool { return slices.Equal(got.get(), want) })
	stopB()
	eventually(t, "b leaves once silent", func() bool { return slices.Equal(got.get(), []string{memberA}) })
}

func TestMemberAnnouncementStaysReadableWithoutTheHeader(t *testing.T) {
	srv := startJetStream(t)
	a := startWorker(t, "a", 1)
	nc, err := nats.Connect(srv.URL())
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	msgs := make(chan *nats.Msg, 4)
	sub, err := nc.ChanSubscribe(aliveFilter(DefaultSubjectPrefix), msgs)
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Unsubscribe()
	a.startSink(srv.URL(), func(o *SinkOptions) {
		o.AliveEvery, o.Member = 20*time.Millisecond, "grpc://"+a.addr
	})
	select {
	case m := <-msgs:
		// What a gateway from before members reads: the payload alone.
		if _, err := decodeAnnouncement(m.Data); err != nil {
			t.Fatalf("the payload changed: %v", err)
		}
		if got := m.Header.Get(MemberHeader); got != "grpc://"+a.addr {
			t.Fatalf("member header %q", got)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("no announcement")
	}
}

func TestSinkMemberOption(t *testing.T) {
	for _, tc := range []struct {
		name string
		o    SinkOptions
		err  string
	}{
		{"two lines", SinkOptions{Worker: "w", Member: "grpc://h:1\ngrpc://h:2"}, "one line"},
		{"too long", SinkOptions{Worker: "w", Member: "grpc://h:1,model=" + strings.Repeat("m", 2000)}, "one line of at most 1024"},
		{"announcements off", SinkOptions{Worker: "w", Member: "grpc://h:1", AliveEvery: -1}, "needs announcements"},
	} {
		if _, err := tc.o.withDefaults(); err == nil || !strings.Contains(err.Error(), tc.err) {
			t.Errorf("%s: %v, want %q", tc.name, err, tc.err)
		}
	}
}

// memberHistory records every set a MemberWatcher delivers.
type memberHistory struct {
	mu  sync.Mutex
	all [][]string
}

func (h *memberHistory) set(specs []string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.all = append(h.all, specs)
}

func (h *memberHistory) last() []string {
	h.mu.Lock()
	defer h.mu.Unlock()
	if len(h.all) == 0 {
		return nil
	}
	return h.all[len(h.all)-1]
}

// ever says whether spec was ever a member.
func (h *memberHistory) ever(spec string) bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	for _, specs := range h.all {
		if slices.Contains(specs, spec) {
			return true
		}
	}
	return false
}

// eventsStream waits for the default stream on url and opens it, over one
// connection closed when the test ends.
func eventsStream(t *testing.T, url string) jetstream.Stream {
	t.Helper()
	_, js := jetStreamClient(t, url)
	var st jetstream.Stream
	eventually(t, "the events stream", func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), patience)
		defer cancel()
		var err error
		st, err = js.Stream(ctx, DefaultStream)
		return err == nil
	})
	return st
}

// newestOf is the stream's newest message under worker's token, nil if
// none.
func newestOf(t *testing.T, st jetstream.Stream, worker string) *jetstream.RawStreamMsg {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), patience)
	defer cancel()
	m, err := st.GetLastMsgForSubject(ctx, DefaultSubjectPrefix+"."+WorkerToken(worker)+".>")
	if errors.Is(err, jetstream.ErrMsgNotFound) {
		return nil
	}
	if err != nil {
		t.Fatal(err)
	}
	return m
}

func watchMembersForTest(t *testing.T, url string, got func([]string), tweak func(*MemberOptions)) *MemberWatcher {
	t.Helper()
	opts := MemberOptions{URL: url, OnChange: got, Logger: testLogger()}
	if tweak != nil {
		tweak(&opts)
	}
	w, err := WatchMembers(opts)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); w.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done; w.Close() })
	return w
}

// TestForgedMembersDoNotJoin: relay a announces its member and joins
// (its engine idle: the stream holds only its sink's marker); relay b
// announced member b and stopped before the gateway started, so its
// incarnation, member and sequences are in the stream for a forger to
// read. A forger then announces, every 10 ms, one of: b with a made-up
// incarnation; b with its real incarnation and member and a sequence the
// stream lacks; a worker whose token the stream holds nothing of; a with
// its real incarnation and sequence but another member (a re-pointed).
// None of them may ever be a member, a must stay one, and the refusal
// is counted under its reason, with no series per forged token. Without
// the stream's check every case adds the forger's member (or b's).
func TestForgedMembersDoNotJoin(t *testing.T) {
	const evil = "grpc://203.0.113.7:50051,model=m"
	for _, tc := range []struct {
		name   string
		reason string
		// forge returns the announcement's subject token, member and body.
		forge func(a, b *jetstream.RawStreamMsg, memberA, memberB string, i int) (string, string, announcement)
	}{
		{"a made-up incarnation", mismatchIncarnation, func(_, b *jetstream.RawStreamMsg, _, memberB string, _ int) (string, string, announcement) {
			inc, _ := strconv.ParseUint(b.Header.Get(IncarnationHeader), 16, 64)
			return WorkerToken("b"), memberB, announcement{Incarnation: inc ^ 0x5eed, Pass: 1, LastSeq: b.Sequence, Every: 20 * time.Millisecond}
		}},
		{"the real incarnation and a sequence the stream lacks", mismatchSequence, func(_, b *jetstream.RawStreamMsg, _, memberB string, _ int) (string, string, announcement) {
			inc, _ := strconv.ParseUint(b.Header.Get(IncarnationHeader), 16, 64)
			return WorkerToken("b"), memberB, announcement{Incarnation: inc, Pass: 1, LastSeq: b.Sequence + 1000, Every: 20 * time.Millisecond}
		}},
		{"a worker with no stream", mismatchNoMessage, func(_, _ *jetstream.RawStreamMsg, _, _ string, i int) (string, string, announcement) {
			// A new token each time: none may make a metric series.
			return WorkerToken("ghost-" + strconv.Itoa(i)), evil, announcement{Incarnation: uint64(i) + 1, Pass: 1, LastSeq: 1, Every: 20 * time.Millisecond}
		}},
		{"a real member re-pointed", mismatchMember, func(a, _ *jetstream.RawStreamMsg, _, _ string, _ int) (string, string, announcement) {
			inc, _ := strconv.ParseUint(a.Header.Get(IncarnationHeader), 16, 64)
			// A new incarnation would fail on it; this one is a's own.
			return WorkerToken("a"), evil, announcement{Incarnation: inc, Pass: 1, LastSeq: a.Sequence, Every: 20 * time.Millisecond}
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			srv := startJetStream(t)
			a := startWorker(t, "a", 1)
			b := startWorker(t, "b", 1)
			memberA := "grpc://" + a.addr + ",model=m"
			memberB := "grpc://" + b.addr + ",model=m"
			fast := func(member string) func(*SinkOptions) {
				return func(o *SinkOptions) { o.AliveEvery, o.Member = 20*time.Millisecond, member }
			}
			stopB := b.startSinkStoppable(srv.URL(), fast(memberB))
			st := eventsStream(t, srv.URL())
			eventually(t, "b's marker stored", func() bool { return newestOf(t, st, "b") != nil })
			stopB()
			newestB := newestOf(t, st, "b")
			a.startSink(srv.URL(), fast(memberA))

			var got memberHistory
			// Leaving is not what this is about: a bound no loaded
			// machine's pause between a's announcements reaches.
			w := watchMembersForTest(t, srv.URL(), got.set, func(o *MemberOptions) { o.LeaveAfter = patience })
			eventually(t, "a joins", func() bool { return slices.Equal(got.last(), []string{memberA}) })
			newestA := newestOf(t, st, "a")

			nc, err := nats.Connect(srv.URL())
			if err != nil {
				t.Fatal(err)
			}
			defer nc.Close()
			ctx, stop := context.WithCancel(context.Background())
			done := make(chan struct{})
			go func() {
				defer close(done)
				for i := 0; sleep(ctx, 10*time.Millisecond); i++ {
					token, member, ann := tc.forge(newestA, newestB, memberA, memberB, i)
					_ = nc.PublishMsg(&nats.Msg{Subject: aliveSubject(DefaultSubjectPrefix, token), Data: encodeAnnouncement(ann),
						Header: nats.Header{MemberHeader: []string{member}}})
				}
			}()
			defer func() { stop(); <-done }()
			refused := func() float64 { return testutil.ToFloat64(w.refused.WithLabelValues(tc.reason)) }
			joined := func() bool { return got.ever(evil) || got.ever(memberB) }
			eventually(t, "20 forged announcements refused", func() bool { return refused() >= 20 || joined() })
			if joined() {
				t.Fatalf("a forged member joined: %v", got.all)
			}
			if !slices.Equal(got.last(), []string{memberA}) {
				t.Errorf("members %v, want a's alone", got.last())
			}
			if n := testutil.CollectAndCount(w.refused); n != len(memberRefusals) {
				t.Errorf("kvrelay_gateway_members_refused_total has %d series, want %d (one per reason)", n, len(memberRefusals))
			}
		})
	}
}

// TestMembersOutliveAJetStreamOutage: relay a is a member; its relay
// restarts (a new incarnation, the same member) and JetStream goes away
// while core NATS stays up, so the stream can bear nothing out. a stays
// a member for 3 times its leave bound; a worker announced
// meanwhile does not join (counted as unverifiable); once a falls silent
// it still leaves.
func TestMembersOutliveAJetStreamOutage(t *testing.T) {
	srv := startJetStream(t)
	a := startWorker(t, "a", 1)
	memberA := "grpc://" + a.addr + ",model=m"
	const other = "grpc://127.0.0.1:9,model=m"
	// Disabling JetStream holds the server up for a while (its stores
	// shut down): a bound well above that pause.
	const bound = 3 * time.Second
	stopA := a.startSinkStoppable(srv.URL(), func(o *SinkOptions) { o.AliveEvery, o.Member = 20*time.Millisecond, memberA })
	var got memberHistory
	w := watchMembersForTest(t, srv.URL(), got.set, func(o *MemberOptions) { o.LeaveAfter = bound })
	eventually(t, "a joins", func() bool { return slices.Equal(got.last(), []string{memberA}) })
	// a's relay restarts: the stand-in announces as its new incarnation
	// (from before the old one stops, as a restart is quicker than the
	// bound), then JetStream goes. Disabling it can cut the server's
	// clients off: the stand-in is back at once, as the sink would be
	// within its bound.
	var cut atomic.Int32
	nc, err := nats.Connect(srv.URL(), nats.ReconnectWait(10*time.Millisecond),
		nats.DisconnectErrHandler(func(*nats.Conn, error) { cut.Add(1) }))
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	ctx, stop := context.WithCancel(context.Background())
	done := make(chan struct{})
	var mu sync.Mutex
	var firstSent, lastSent time.Time
	go func() {
		defer close(done)
		for sleep(ctx, 20*time.Millisecond) {
			_ = nc.PublishMsg(MemberAnnouncement("", "a", memberA, 0xa2, 7, 20*time.Millisecond))
			_ = nc.PublishMsg(MemberAnnouncement("", "c", other, 0xc1, 7, 20*time.Millisecond))
			mu.Lock()
			if firstSent.IsZero() {
				firstSent = time.Now()
			}
			lastSent = time.Now()
			mu.Unlock()
		}
	}()
	eventually(t, "the stand-in announcing", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return !firstSent.IsZero()
	})
	stopA()
	disabling := time.Now()
	if err := srv.Server().DisableJetStream(); err != nil {
		t.Fatal(err)
	}
	t.Logf("disabling JetStream took %v", time.Since(disabling).Round(time.Millisecond))
	mu.Lock()
	firstSent = time.Now() // the outage's start
	mu.Unlock()
	unverifiable := func() float64 { return testutil.ToFloat64(w.refused.WithLabelValues(mismatchUnverifiable)) }
	eventually(t, "c unverifiable, and 3 leave bounds of the outage", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return (unverifiable() >= 1 && lastSent.Sub(firstSent) > 3*bound) || !slices.Equal(got.last(), []string{memberA})
	})
	if !slices.Equal(got.last(), []string{memberA}) || got.ever(other) {
		counts := map[string]float64{}
		for _, r := range memberRefusals {
			counts[r] = testutil.ToFloat64(w.refused.WithLabelValues(r))
		}
		t.Fatalf("members during the outage: %v, want a's alone throughout (refused: %v; the stand-in cut off %d times)", got.all, counts, cut.Load())
	}
	stop()
	<-done
	eventually(t, "a leaves once silent", func() bool { return len(got.last()) == 0 })
}

// TestIdleMemberJoinsAfterItsFirstMarkerAgedOut: a relay whose engine
// never works, on a stream keeping messages 2 s; once the marker of its
// start aged out, a gateway starting then still takes its member, from
// the marker the sink stored again meanwhile (every quarter of the age
// limit). Without the refresh the stream holds nothing of the worker and
// the member never joins.
func TestIdleMemberJoinsAfterItsFirstMarkerAgedOut(t *testing.T) {
	srv := startJetStream(t)
	a := startWorker(t, "a", 1)
	memberA := "grpc://" + a.addr + ",model=m"
	a.startSink(srv.URL(), func(o *SinkOptions) {
		o.AliveEvery, o.Member, o.MaxAge, o.Duplicates = 20*time.Millisecond, memberA, 2*time.Second, time.Second
	})
	st := eventsStream(t, srv.URL())
	var first *jetstream.RawStreamMsg
	eventually(t, "the first marker", func() bool { first = newestOf(t, st, "a"); return first != nil })
	ctx, cancel := context.WithTimeout(context.Background(), patience)
	defer cancel()
	eventually(t, "the first marker aged out", func() bool {
		_, err := st.GetMsg(ctx, first.Sequence)
		return errors.Is(err, jetstream.ErrMsgNotFound)
	})
	var got memberHistory
	watchMembersForTest(t, srv.URL(), got.set, nil)
	eventually(t, "a joins", func() bool { return slices.Equal(got.last(), []string{memberA}) })
}
