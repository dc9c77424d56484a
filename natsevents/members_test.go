package natsevents

import (
	"context"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
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
