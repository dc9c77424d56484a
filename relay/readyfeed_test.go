package relay

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrelay/kvrelay/engines"
)

// queuedFeed is a readyFeed, as zmqsource's subscriber is: a queue with a
// one-slot signal. Its Recv counts the calls, so a test can tell whether the
// rank loop took batches straight from the queue or through a reader
// goroutine.
type queuedFeed struct {
	mu      sync.Mutex
	q       []Message
	ready   chan struct{}
	recvers atomic.Int32
}

func newQueuedFeed() *queuedFeed { return &queuedFeed{ready: make(chan struct{}, 1)} }

func (f *queuedFeed) push(m Message) {
	f.mu.Lock()
	f.q = append(f.q, m)
	f.mu.Unlock()
	select {
	case f.ready <- struct{}{}:
	default:
	}
}

func (f *queuedFeed) Ready() <-chan struct{} { return f.ready }

func (f *queuedFeed) TryRecv() (Message, bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if len(f.q) == 0 {
		return Message{}, false
	}
	m := f.q[0]
	f.q = f.q[1:]
	if len(f.q) > 0 {
		select {
		case f.ready <- struct{}{}:
		default:
		}
	}
	return m, true
}

func (f *queuedFeed) Recv(ctx context.Context) (Message, error) {
	f.recvers.Add(1)
	<-ctx.Done()
	return Message{}, ctx.Err()
}

func (f *queuedFeed) Connected() bool { return true }
func (f *queuedFeed) Close() error    { return nil }

// TestReadyFeedSkipsTheReaderGoroutine checks that a feed with its own
// ready signal is read by the rank loop itself: no reader goroutine calls
// Recv, so a batch costs one goroutine hand-off less between the socket and
// admission (issue 19 item 2), and batches queued in a burst still come
// out in order, each once.
func TestReadyFeedSkipsTheReaderGoroutine(t *testing.T) {
	feed := newQueuedFeed()
	r, err := New(Config{
		Engine: engineForTest(), DPSize: 1, Logger: quietLogger(), Registerer: prometheus.NewRegistry(),
		KV: engines.Config{Enabled: true, Publisher: "zmq", Endpoint: "tcp://*:5557"},
		Transport: func(int32, string, string, time.Duration) (Feed, Replayer, error) {
			return feed, nil, nil
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	l := runRelay(t, r)
	sub := l.subscribe(0)
	// A burst queued before the loop looks, then batches one at a time.
	for seq := range uint64(5) {
		feed.push(Message{Seq: seq, Payload: payload(0, stored(-1, int64(seq+1)))})
	}
	for seq := range uint64(5) {
		if got, want := describe(next(t, sub)), fmt.Sprintf("0:%d", seq); got != want {
			t.Fatalf("got batch %s, want %s", got, want)
		}
	}
	for seq := uint64(5); seq < 8; seq++ {
		feed.push(Message{Seq: seq, Payload: payload(0, stored(-1, int64(seq+1)))})
		if got, want := describe(next(t, sub)), fmt.Sprintf("0:%d", seq); got != want {
			t.Fatalf("got batch %s, want %s", got, want)
		}
	}
	quiet(t, sub)
	if n := feed.recvers.Load(); n != 0 {
		t.Errorf("Recv was called %d times: the rank loop read a ready feed through a reader goroutine", n)
	}
}
