package zmqsource

import (
	"context"
	"io"
	"log/slog"
	"net"
	"os"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/kvrelay/kvrelay/testkit/enginepeer"
)

// zmq4's own goroutines all end with the sockets this package closes and
// drains, and the engine peer's goroutines end at t.Cleanup, so no ignores
// are needed.
func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

func quietLogger() *slog.Logger {
	if testing.Verbose() {
		return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelInfo}))
	}
	return slog.New(slog.NewTextHandler(io.Discard, nil))
}

func newTestSubscriber(t testing.TB, endpoint, topic string, hwm int) *Subscriber {
	t.Helper()
	s := NewSubscriber(SubscriberOptions{
		Endpoint:   endpoint,
		Topic:      topic,
		RcvHWM:     hwm,
		Logger:     quietLogger(),
		MinBackoff: 20 * time.Millisecond,
		MaxBackoff: 200 * time.Millisecond,
	})
	t.Cleanup(func() { _ = s.Close() })
	return s
}

// recvWithin waits for one message.
func recvWithin(t testing.TB, s *Subscriber, d time.Duration) (Message, bool) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), d)
	defer cancel()
	m, err := s.Recv(ctx)
	if err != nil {
		return Message{}, false
	}
	return m, true
}

// attach publishes on rank until the subscriber receives something: PUB/SUB
// has no signal for "subscription applied", so the first messages may be
// lost (the slow-joiner effect). It returns the first message received.
func attach(t testing.TB, p *enginepeer.Peer, rank int, s *Subscriber) Message {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for time.Now().Before(deadline) {
		if !s.Connected() {
			time.Sleep(20 * time.Millisecond)
			continue
		}
		if _, err := p.Publish(rank, probe()); err != nil {
			t.Fatalf("probe publish: %v", err)
		}
		if m, ok := recvWithin(t, s, 100*time.Millisecond); ok {
			return m
		}
	}
	t.Fatalf("subscriber to %s never received a probe (connected=%v, stats=%+v)", p.PubEndpoint(rank), s.Connected(), s.Stats())
	return Message{}
}

func probe() enginepeer.Event {
	return enginepeer.Stored(nil, []int64{1, 2, 3, 4}, enginepeer.U64(42))
}

// drainQueued returns messages already queued or arriving within idle of
// each other.
func drainQueued(t testing.TB, s *Subscriber, idle time.Duration) []Message {
	t.Helper()
	var out []Message
	for {
		m, ok := recvWithin(t, s, idle)
		if !ok {
			return out
		}
		out = append(out, m)
	}
}

// freePort returns a loopback port nobody listens on right now.
func freePort(t testing.TB) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := l.Addr().(*net.TCPAddr).Port
	_ = l.Close()
	return port
}

func waitFor(t testing.TB, what string, d time.Duration, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", d, what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// silentListener accepts TCP connections and never writes a byte, like a
// wrong service on the port. It returns host:port and a count of accepted
// connections.
func silentListener(t testing.TB) (string, func() int64) {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	var accepted atomic.Int64
	go func() {
		defer close(done)
		var conns []net.Conn
		defer func() {
			for _, c := range conns {
				_ = c.Close()
			}
		}()
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			accepted.Add(1)
			conns = append(conns, c)
		}
	}()
	t.Cleanup(func() {
		_ = l.Close()
		<-done
	})
	return l.Addr().String(), accepted.Load
}
