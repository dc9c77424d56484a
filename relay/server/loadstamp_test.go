package server_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	"github.com/kvrelay/kvrelay/engines/load"
	"github.com/kvrelay/kvrelay/proto/kvpb"
)

// loadTimeline is an engine's HTTP server serving SGLang's /v1/loads from
// figures the test moves.
type loadTimeline struct {
	mu      sync.Mutex
	running map[int]int
	served  int
}

func (l *loadTimeline) set(rank, running int) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.running[rank] = running
}

func (l *loadTimeline) servedCount() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.served
}

func (l *loadTimeline) ServeHTTP(w http.ResponseWriter, _ *http.Request) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.served++
	fmt.Fprint(w, `{"loads":[`)
	for rank := 0; rank < len(l.running); rank++ {
		if rank > 0 {
			fmt.Fprint(w, ",")
		}
		fmt.Fprintf(w, `{"dp_rank":%d,"num_running_reqs":%d,"num_waiting_reqs":1,"token_usage":0.5,"gen_throughput":10.0,"cache_hit_rate":0.25,"num_waiting_uncached_tokens":64}`,
			rank, l.running[rank])
	}
	fmt.Fprint(w, `]}`)
}

// startLoad serves the timeline on loopback and polls it every 20 ms.
func startLoad(t *testing.T, tl *loadTimeline) *load.Poller {
	t.Helper()
	hs := httptest.NewServer(tl)
	p, err := load.NewPoller(load.Options{
		Fetcher: load.NewV1Loads(hs.Client(), hs.URL+"/v1/loads"), Interval: 20 * time.Millisecond,
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil)),
	})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = p.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done; hs.Close() })
	waitFor(t, 10*time.Second, "the first load poll", func() bool {
		_, ok := p.Latest(0)
		return ok
	})
	return p
}

func TestEveryBatchCarriesItsRanksLoadAndQuietStreamsGetHeartbeats(t *testing.T) {
	tl := &loadTimeline{running: map[int]int{0: 3, 1: 7}}
	poller := startLoad(t, tl)
	s := startStack(t, stackOptions{dpSize: 2, load: poller})

	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	st, err := s.client.SubscribeKvEvents(ctx, &kvpb.SubscribeKvEventsRequest{})
	if err != nil {
		t.Fatal(err)
	}
	// No heartbeat before the stream's first batch: let the heartbeat
	// interval pass with the stream open and the load fresh, then publish.
	polled := tl.servedCount()
	waitFor(t, 20*time.Second, "more than a heartbeat interval of polls", func() bool {
		return tl.servedCount() > polled+int(load.HeartbeatInterval/(20*time.Millisecond))+5
	})
	// Each rank is its own socket, so the relay may take two ranks'
	// batches in either order, and the heartbeats below name the last
	// batch's rank: take each batch before publishing the next, so that
	// the last one is rank 0's.
	var got []*kvpb.KvEventBatch
	for _, b := range []struct {
		rank int
		hash uint64
	}{{0, 100}, {1, 200}, {0, 101}} {
		s.publish(t, b.rank, b.hash)
		got = append(got, recvN(t, st, 1)...)
	}
	if got[0].GetLoad().GetLoadOnly() || len(got[0].GetEvents()) == 0 {
		t.Fatalf("the stream's first message is %v, want the first real batch", got[0])
	}
	want := map[int32]uint32{0: 3, 1: 7}
	for i, b := range got {
		l := b.GetLoad()
		if l == nil {
			t.Fatalf("batch %d (rank %d seq %d) carries no load", i, b.GetDpRank(), b.GetSequenceNumber())
		}
		if l.GetRunningRequests() != want[b.GetDpRank()] || l.GetSample() != uint64(i+1) || l.GetLoadOnly() {
			t.Fatalf("batch %d of rank %d: load %v, want running %d, sample %d, not load_only", i, b.GetDpRank(), l, want[b.GetDpRank()], i+1)
		}
		if l.GetWaitingUncachedTokens() != 64 || l.WaitingUncachedTokens == nil {
			t.Fatalf("batch %d: queued token work %v, want 64", i, l.WaitingUncachedTokens)
		}
		if hasTelemetry := l.CacheHitRate != nil; hasTelemetry != (i == 0) {
			t.Fatalf("batch %d: telemetry %v, want it on the first record only", i, hasTelemetry)
		}
	}
	last := got[2]

	// Quiet: a heartbeat repeats the last batch's sequence and rank, with
	// telemetry.
	hb := recvN(t, st, 1)[0]
	if !hb.GetLoad().GetLoadOnly() || len(hb.GetEvents()) != 0 || hb.GetSequenceNumber() != last.GetSequenceNumber() ||
		hb.GetDpRank() != last.GetDpRank() || hb.GetLoad().GetSample() != 4 || hb.GetLoad().CacheHitRate == nil {
		t.Fatalf("heartbeat %v: want load_only, no events, seq %d rank %d, sample 4, telemetry", hb, last.GetSequenceNumber(), last.GetDpRank())
	}

	// A second unchanged heartbeat puts the stream on the 5 s backoff; a
	// change then goes out without waiting for it.
	if b := recvN(t, st, 1)[0]; !b.GetLoad().GetLoadOnly() || b.GetLoad().GetRunningRequests() != 3 {
		t.Fatalf("second heartbeat %v", b)
	}
	changedAt := time.Now()
	tl.set(0, 30)
	for {
		b := recvN(t, st, 1)[0]
		if !b.GetLoad().GetLoadOnly() {
			t.Fatalf("a real batch %v on a quiet stream", b)
		}
		if b.GetLoad().GetRunningRequests() == 30 {
			break
		}
	}
	if d := time.Since(changedAt); d >= load.HeartbeatBackoff {
		// Only heartbeat-only pacing (a change not checked) is this slow.
		t.Fatalf("the change took %v to go out: it waited for the backoff heartbeat", d)
	}
}

// TestSlowLoadSourceNeverStallsTheStream: the engine's load endpoint stops
// answering. Batches keep flowing at once, carrying the last record while
// it is fresh and none once it is past the max age; no heartbeat repeats a
// stale record.
func TestSlowLoadSourceNeverStallsTheStream(t *testing.T) {
	tl := &loadTimeline{running: map[int]int{0: 3}}
	block := make(chan struct{})
	var once sync.Once
	var hang sync.Mutex
	hanging := false
	hs := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		hang.Lock()
		h := hanging
		hang.Unlock()
		if h {
			select { // a source that accepts and never answers
			case <-block:
			case <-r.Context().Done():
			}
			return
		}
		tl.ServeHTTP(w, r)
	}))
	defer func() { once.Do(func() { close(block) }); hs.Close() }()
	const maxAge = 600 * time.Millisecond
	p, err := load.NewPoller(load.Options{
		Fetcher: load.NewV1Loads(hs.Client(), hs.URL+"/v1/loads"), Interval: 20 * time.Millisecond,
		Timeout: 5 * time.Second, MaxAge: maxAge, Logger: slog.New(slog.NewTextHandler(io.Discard, nil)),
	})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = p.Run(ctx) }()
	defer func() { cancel(); once.Do(func() { close(block) }); <-done }()
	waitFor(t, 10*time.Second, "the first load poll", func() bool { _, ok := p.Latest(0); return ok })

	s := startStack(t, stackOptions{load: p})
	sctx, scancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer scancel()
	st, err := s.client.SubscribeKvEvents(sctx, &kvpb.SubscribeKvEventsRequest{})
	if err != nil {
		t.Fatal(err)
	}
	s.publish(t, 0, 1)
	if b := recvN(t, st, 1)[0]; b.GetLoad().GetRunningRequests() != 3 {
		t.Fatalf("first batch carries %v, want the engine's record", b.GetLoad())
	}
	hang.Lock()
	hanging = true
	hang.Unlock()
	// The poller is now stuck in a read for up to 5 s. Past the max age,
	// a batch goes without a record, at once.
	waitFor(t, 10*time.Second, "the record to age out", func() bool { _, ok := p.Latest(0); return !ok })
	seq := s.publish(t, 0, 2)
	for {
		b := recvN(t, st, 1)[0]
		if b.GetLoad().GetLoadOnly() {
			if age := time.Duration(b.GetLoad().GetAgeMs()) * time.Millisecond; age > maxAge {
				t.Fatalf("a heartbeat repeats a record %v old, past the %v max age", age, maxAge)
			}
			continue
		}
		if b.GetSequenceNumber() != seq {
			t.Fatalf("batch seq %d, want %d", b.GetSequenceNumber(), seq)
		}
		if b.GetLoad() != nil {
			t.Fatalf("a batch past the max age carries %v, want no record", b.GetLoad())
		}
		break
	}
}

// countingFetcher reports rank 0 running the figure the test sets.
type countingFetcher struct {
	mu      sync.Mutex
	running uint32
}

func (f *countingFetcher) Name() string { return "test" }
func (f *countingFetcher) Fetch(context.Context, int64) (map[int32]*kvpb.EngineLoad, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return map[int32]*kvpb.EngineLoad{0: {RunningRequests: f.running}}, nil
}

// racingSource publishes a change right after the stream reads the record,
// once armed: the window between a read and the wait that follows it.
type racingSource struct {
	*load.Poller
	f       *countingFetcher
	mu      sync.Mutex
	armed   bool
	firedAt time.Time
}

func (s *racingSource) LatestAt(rank int32, now time.Time) (*load.Reading, bool) {
	r, ok := s.Poller.LatestAt(rank, now)
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.armed {
		s.armed = false
		s.f.mu.Lock()
		s.f.running = 30
		s.f.mu.Unlock()
		s.Poller.PollOnce(context.Background())
		s.firedAt = time.Now()
	}
	return r, ok
}

// TestLoadChangeRightAfterAReadIsNotMissed: a change published between the
// stream's read of the record (a heartbeat) and its wait must wake the
// stream, not wait for the 5 s backoff heartbeat.
func TestLoadChangeRightAfterAReadIsNotMissed(t *testing.T) {
	f := &countingFetcher{running: 3}
	p, err := load.NewPoller(load.Options{
		Fetcher: f, MaxAge: time.Hour, Logger: slog.New(slog.NewTextHandler(io.Discard, nil)),
	})
	if err != nil {
		t.Fatal(err)
	}
	p.PollOnce(context.Background())
	src := &racingSource{Poller: p, f: f}
	s := startStack(t, stackOptions{load: src})

	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	st, err := s.client.SubscribeKvEvents(ctx, &kvpb.SubscribeKvEventsRequest{})
	if err != nil {
		t.Fatal(err)
	}
	s.publish(t, 0, 100)
	recvN(t, st, 1)
	// Two unchanged heartbeats put the stream on the backoff.
	for i := 0; i < 2; i++ {
		if b := recvN(t, st, 1)[0]; !b.GetLoad().GetLoadOnly() || b.GetLoad().GetRunningRequests() != 3 {
			t.Fatalf("heartbeat %d: %v", i+1, b)
		}
	}
	src.mu.Lock()
	src.armed = true
	src.mu.Unlock()
	// The read that publishes the change may be a heartbeat's: that one
	// carries the old figure, the change goes out after it.
	for {
		b := recvN(t, st, 1)[0]
		if !b.GetLoad().GetLoadOnly() {
			t.Fatalf("a real batch %v on a quiet stream", b)
		}
		if b.GetLoad().GetRunningRequests() == 30 {
			break
		}
	}
	src.mu.Lock()
	firedAt := src.firedAt
	src.mu.Unlock()
	if d := time.Since(firedAt); d >= load.HeartbeatBackoff {
		t.Fatalf("the change took %v to go out: the stream waited for the backoff heartbeat", d)
	}
}
