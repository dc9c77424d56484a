package relay

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/vmihailenco/msgpack/v5"
	"go.uber.org/goleak"

	"github.com/kvrelay/kvrelay/engines"
	"github.com/kvrelay/kvrelay/engines/wire"
	"github.com/kvrelay/kvrelay/proto/kvpb"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m,
		// The exactness tests run sim, a Go PUB: zmq4 v0.17.0's PUB writer
		// goroutine never exits, even after Close (go-ecosystem.md §1.3 #5).
		goleak.IgnoreAnyFunction("github.com/go-zeromq/zmq4.(*pubMWriter).run"),
	)
}

// --- payloads (vLLM's tag-first array form) ---

// payload is a batch envelope [ts, events, rank].
func payload(rank int32, events ...[]any) []byte {
	evs := make([]any, len(events))
	for i, e := range events {
		evs[i] = e
	}
	b, err := msgpack.Marshal([]any{1700000000.5, evs, rank})
	if err != nil {
		panic(err)
	}
	return b
}

// stored is a BlockStored of hashes, each block 2 tokens; parent < 0: none.
func stored(parent int64, hashes ...int64) []any {
	var par any
	if parent >= 0 {
		par = parent
	}
	tokens := make([]any, 0, 2*len(hashes))
	for i := range hashes {
		tokens = append(tokens, 2*i+1, 2*i+2)
	}
	hs := make([]any, len(hashes))
	for i, h := range hashes {
		hs[i] = h
	}
	return []any{"BlockStored", hs, par, tokens, 2, nil, "GPU", nil}
}

func removed(hashes ...int64) []any {
	hs := make([]any, len(hashes))
	for i, h := range hashes {
		hs[i] = h
	}
	return []any{"BlockRemoved", hs, "GPU"}
}

func cleared() []any { return []any{"AllBlocksCleared"} }

// --- a scripted in-memory publisher per rank, with the engines' replay ring ---

type fakePub struct {
	rank int32

	mu        sync.Mutex
	next      uint64
	ring      []Message
	ringSize  int
	live      chan Message
	down      bool            // the replay ROUTER does not answer
	truncate  int             // replies per request before the "HWM" cuts the answer (and its end marker)
	dropOnce  map[uint64]bool // replies lost once in the middle of an answer (send-HWM drops)
	asked     []uint64
	connected atomic.Bool

	// noEnd makes answers lose their end marker (the replay times out
	// waiting for it).
	noEnd bool
	// gates holds a replay request from a sequence until its channel is
	// closed (or the relay gives up on it), to look at the relay mid-replay.
	gates map[uint64]chan struct{}
	// unanswered makes the next requests bring nothing: an error (the
	// connection timed out) or, with silent, no reply before the timeout.
	unanswered int
	silent     bool
	// afterAnswer runs after each replay request is answered, outside the
	// lock: the engine publishing while the relay is between requests.
	afterAnswer func(from uint64)
	// upTo records the reply limit of each ReplayUpTo request.
	upTo []int
}

func newFakePub(rank int32) *fakePub {
	p := &fakePub{rank: rank, ringSize: 10_000, live: make(chan Message, 100_000)}
	p.connected.Store(true)
	return p
}

// publish sends the next batch live and keeps it in the ring.
func (p *fakePub) publish(payload []byte) uint64 { return p.emit(payload, true, true) }

// hide keeps the next batch in the ring only: the live socket lost it.
func (p *fakePub) hide(payload []byte) uint64 { return p.emit(payload, false, true) }

// burn consumes a sequence that neither the live stream nor the ring has.
func (p *fakePub) burn() uint64 { return p.emit(nil, false, false) }

func (p *fakePub) emit(payload []byte, live, ring bool) uint64 {
	p.mu.Lock()
	seq := p.next
	p.next++
	m := Message{Seq: seq, Payload: payload}
	if ring {
		p.ring = append(p.ring, m)
		if len(p.ring) > p.ringSize {
			p.ring = p.ring[len(p.ring)-p.ringSize:]
		}
	}
	p.mu.Unlock()
	if live {
		p.live <- m
	}
	return seq
}

// send puts a batch on the live socket under an explicit sequence.
func (p *fakePub) send(seq uint64, payload []byte) { p.live <- Message{Seq: seq, Payload: payload} }

// restart is a new incarnation: empty ring, counter at start.
func (p *fakePub) restart(start uint64) {
	p.mu.Lock()
	p.ring, p.next = nil, start
	p.mu.Unlock()
}

func (p *fakePub) set(f func(p *fakePub)) {
	p.mu.Lock()
	f(p)
	p.mu.Unlock()
}

func (p *fakePub) upToLimits() []int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]int(nil), p.upTo...)
}

func (p *fakePub) askedFrom() []uint64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]uint64(nil), p.asked...)
}

func (p *fakePub) Recv(ctx context.Context) (Message, error) {
	select {
	case m := <-p.live:
		return m, nil
	case <-ctx.Done():
		return Message{}, ctx.Err()
	}
}
func (p *fakePub) Connected() bool { return p.connected.Load() }
func (p *fakePub) Close() error    { return nil }

type fakeReplayer struct{ p *fakePub }

func (f fakeReplayer) Replay(ctx context.Context, from uint64) ([]Message, bool, error) {
	msgs, complete, err := f.answer(ctx, from)
	f.p.mu.Lock()
	after := f.p.afterAnswer
	f.p.mu.Unlock()
	if after != nil {
		after(from)
	}
	return msgs, complete, err
}

// ReplayUpTo answers as Replay does, cut after n replies, and records n.
func (f fakeReplayer) ReplayUpTo(ctx context.Context, from uint64, n int) ([]Message, bool, error) {
	f.p.mu.Lock()
	f.p.upTo = append(f.p.upTo, n)
	f.p.mu.Unlock()
	msgs, complete, err := f.Replay(ctx, from)
	if len(msgs) >= n {
		return msgs[:n], true, err
	}
	return msgs, complete, err
}

func (f fakeReplayer) answer(ctx context.Context, from uint64) ([]Message, bool, error) {
	p := f.p
	p.mu.Lock()
	gate := p.gates[from]
	p.mu.Unlock()
	if gate != nil {
		select {
		case <-gate:
		case <-ctx.Done():
			return nil, false, ctx.Err()
		}
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.down {
		return nil, false, errors.New("connection refused")
	}
	p.asked = append(p.asked, from)
	if p.unanswered > 0 {
		p.unanswered--
		if p.silent {
			return nil, false, nil
		}
		return nil, false, errors.New("connect timed out")
	}
	var out []Message
	complete := true
	for _, m := range p.ring {
		if m.Seq >= from {
			if p.truncate > 0 && len(out) == p.truncate {
				return out, false, nil
			}
			if p.dropOnce[m.Seq] {
				delete(p.dropOnce, m.Seq)
				complete = false // the end marker is lost with it
				continue
			}
			out = append(out, m)
		}
	}
	return out, complete && !p.noEnd, nil
}

// --- the relay under test ---

type lab struct {
	t      *testing.T
	r      *Relay
	pubs   []*fakePub
	reg    *prometheus.Registry
	cancel context.CancelFunc
	done   chan error
}

type labOpts struct {
	ranks      int
	noReplay   bool
	history    int
	histBytes  int64
	subBuffer  int
	beforeRun  func(l *lab)
	skipPrimed bool // do not wait for the start replay
	noCatchUp  bool // no catch-up replays, to count every request
	// reportModeFull and suppress set Config.ReportModeFull and
	// Config.SuppressReannounced.
	reportModeFull, suppress bool
	// bufferSteps sets the engine's replay ring (KV.BufferSteps; 0: the
	// engines' default). Set the fake's ringSize to match.
	bufferSteps int
}

// patience bounds every wait of these tests for something the relay must
// do. It only decides how soon a failure is reported: the waits poll and end
// as soon as the condition holds, and a machine loaded by parallel builds
// and tests (CI on two cores) can take seconds for what takes milliseconds
// alone.
const patience = 30 * time.Second

// runRelay runs r until the test ends, then stops it and fails the test if
// Run returned an error; it returns a lab around r for the waits.
func runRelay(t *testing.T, r *Relay) *lab {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Error(err)
		}
	})
	return &lab{t: t, r: r}
}

func quietLogger() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

func newLab(t *testing.T, o labOpts) *lab {
	t.Helper()
	if o.ranks == 0 {
		o.ranks = 1
	}
	l := &lab{t: t, reg: prometheus.NewRegistry(), done: make(chan error, 1)}
	for i := 0; i < o.ranks; i++ {
		l.pubs = append(l.pubs, newFakePub(int32(i)))
	}
	kv := engines.Config{Enabled: true, Publisher: "zmq", Endpoint: "tcp://*:5557", ReplayEndpoint: "tcp://*:5657"}
	if o.noReplay {
		kv.ReplayEndpoint = ""
	}
	kv.BufferSteps = o.bufferSteps
	catchUp := time.Duration(0) // the defaults
	if o.noCatchUp {
		catchUp = -1
	}
	r, err := New(Config{
		CatchUpDelay:        catchUp,
		IdleProbe:           catchUp,
		Engine:              engineForTest(),
		KV:                  kv,
		DPSize:              o.ranks,
		HistoryBatches:      o.history,
		HistoryBytes:        o.histBytes,
		ReplayTimeout:       200 * time.Millisecond,
		PrimeRetry:          20 * time.Millisecond,
		SubscriberBuffer:    o.subBuffer,
		ReportModeFull:      o.reportModeFull,
		SuppressReannounced: o.suppress,
		Logger:              quietLogger(),
		Registerer:          l.reg,
		Transport: func(rank int32, endpoint, replay string, _ time.Duration) (Feed, Replayer, error) {
			p := l.pubs[rank]
			if replay == "" {
				return p, nil, nil
			}
			return p, fakeReplayer{p}, nil
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	l.r = r
	if o.beforeRun != nil {
		o.beforeRun(l)
	}
	ctx, cancel := context.WithCancel(context.Background())
	l.cancel = cancel
	go func() { l.done <- r.Run(ctx) }()
	t.Cleanup(l.stop)
	if !o.noReplay && !o.skipPrimed {
		for _, p := range l.pubs {
			l.waitFor("the start replay", func() bool { return len(p.askedFrom()) > 0 })
		}
	}
	return l
}

func (l *lab) stop() {
	if l.cancel == nil {
		return
	}
	l.cancel()
	l.cancel = nil
	select {
	case err := <-l.done:
		if err != nil {
			l.t.Errorf("Run: %v", err)
		}
	case <-time.After(patience):
		l.t.Error("Run did not return")
	}
}

func (l *lab) waitFor(what string, cond func() bool) {
	l.t.Helper()
	deadline := time.Now().Add(patience)
	for !cond() {
		if time.Now().After(deadline) {
			l.t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(time.Millisecond)
	}
}

// cursor waits until rank's cursor reaches seq.
func (l *lab) cursor(rank int32, seq uint64) {
	l.t.Helper()
	l.waitFor(fmt.Sprintf("rank %d cursor %d", rank, seq), func() bool {
		l.r.mu.Lock()
		defer l.r.mu.Unlock()
		rk := l.r.ranks[rank]
		return rk.hasCursor && rk.cursor >= seq
	})
}

func (l *lab) subscribe(start uint64) *Subscription {
	l.t.Helper()
	s, err := l.r.Subscribe(context.Background(), &kvpb.SubscribeKvEventsRequest{StartSequenceNumber: start})
	if err != nil {
		l.t.Fatalf("subscribe at %d: %v", start, err)
	}
	l.t.Cleanup(s.Close)
	return s
}

func (l *lab) subscribeErr(req *kvpb.SubscribeKvEventsRequest) error {
	s, err := l.r.Subscribe(context.Background(), req)
	if err == nil {
		s.Close()
	}
	return err
}

func next(t *testing.T, s *Subscription) *kvpb.KvEventBatch {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), patience)
	defer cancel()
	b, err := s.Next(ctx)
	if err != nil {
		t.Fatalf("Next: %v", err)
	}
	return b
}

// quiet asserts nothing more is delivered for a short while.
func quiet(t *testing.T, s *Subscription) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Millisecond)
	defer cancel()
	if b, err := s.Next(ctx); err == nil {
		t.Fatalf("unexpected batch %s", describe(b))
	}
}

// describe names a batch "rank:seq" ("rank:seq snap i/n" for chunks).
func describe(b *kvpb.KvEventBatch) string {
	s := fmt.Sprintf("%d:%d", b.GetDpRank(), b.GetSequenceNumber())
	if sn := b.GetSnapshot(); sn != nil {
		s += fmt.Sprintf(" snap %d/%d", sn.GetIndex(), sn.GetCount())
	}
	return s
}

// take reads n batches and names them.
func take(t *testing.T, s *Subscription, n int) string {
	t.Helper()
	var out []string
	for i := 0; i < n; i++ {
		out = append(out, describe(next(t, s)))
	}
	return strings.Join(out, " ")
}

// storedHashes lists each Stored event's hashes, e.g. "[10 11 12] [21 22]".
func storedHashes(bs ...*kvpb.KvEventBatch) string {
	var out []string
	for _, b := range bs {
		for _, ev := range b.GetEvents() {
			if st := ev.GetStored(); st != nil {
				var hs []string
				for _, blk := range st.GetBlocks() {
					hs = append(hs, fmt.Sprint(blk.GetBlockHash()))
				}
				out = append(out, "["+strings.Join(hs, " ")+"]")
			}
		}
	}
	return strings.Join(out, " ")
}

func counter(c prometheus.Collector) float64 { return testutil.ToFloat64(c) }

func (l *lab) m() *metrics { return l.r.metrics }

// counts waits until each collector reads its wanted value: metrics are
// updated just after a batch is handed to subscribers.
func (l *lab) counts(what string, want []float64, cs ...prometheus.Collector) {
	l.t.Helper()
	var got []float64
	ok := func() bool {
		got = got[:0]
		for _, c := range cs {
			got = append(got, counter(c))
		}
		return fmt.Sprint(got) == fmt.Sprint(want)
	}
	deadline := time.Now().Add(patience)
	for !ok() {
		if time.Now().After(deadline) {
			l.t.Fatalf("%s: got %v, want %v", what, got, want)
		}
		time.Sleep(time.Millisecond)
	}
}

func engineForTest() engines.Engine {
	return engines.Engine{Name: "vllm", DisabledMessage: "KV cache events not enabled. Start vLLM with --kv-events-config", Dialect: wire.VLLM}
}
