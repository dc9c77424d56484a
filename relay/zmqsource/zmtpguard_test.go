package zmqsource

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvrelay/kvrelay/testkit/zmtppeer"
)

func TestZMTPGuard(t *testing.T) {
	const limit = 1000
	small := zmtppeer.Frame(flagMore, make([]byte, 300), 0)
	last := zmtppeer.Frame(0, make([]byte, 300), 0)
	tests := []struct {
		name    string
		stream  []byte
		refused bool
	}{
		{"handshake and messages within the limit", concat(zmtppeer.Greeting(), zmtppeer.Ready("PUB"), small, small, last, small, last), false},
		{"a long frame header of 1 TiB", concat(zmtppeer.Greeting(), zmtppeer.Ready("PUB"), zmtppeer.Frame(flagLong, nil, 1<<40)), true},
		{"a short header is at most 255", concat(zmtppeer.Greeting(), zmtppeer.Frame(0, nil, 255)), false},
		{"a frame one over", concat(zmtppeer.Greeting(), zmtppeer.Frame(0, make([]byte, limit+1), 0)), true},
		{"a frame at the limit", concat(zmtppeer.Greeting(), zmtppeer.Frame(0, make([]byte, limit), 0)), false},
		{"a message of small frames over the limit", concat(zmtppeer.Greeting(), small, small, small, last), true},
		{"a huge command", concat(zmtppeer.Greeting(), zmtppeer.Frame(flagCommand|flagLong, nil, 1<<62)), true},
		{"a size with the top bit set", concat(zmtppeer.Greeting(), zmtppeer.Frame(flagLong, nil, 1<<63)), true},
		{"too many empty frames", concat(zmtppeer.Greeting(), bytes.Repeat(zmtppeer.Frame(flagMore, []byte{}, 0), maxFramesPerMessage+1)), true},
		{"many empty messages", concat(zmtppeer.Greeting(), bytes.Repeat(zmtppeer.Frame(0, []byte{}, 0), 10*maxFramesPerMessage)), false},
		{"a greeting that looks like a header", concat(bytes.Repeat([]byte{0xff}, zmtppeer.GreetingBytes), last), false},
	}
	for _, tc := range tests {
		for _, chunk := range []int{1, 3, 64, len(tc.stream)} {
			var refused atomic.Uint64
			g := newZMTPGuard("tcp://peer:1", connLimits{maxMessageBytes: limit, refused: &refused})
			var err error
			for b := tc.stream; len(b) > 0 && err == nil; {
				n := min(chunk, len(b))
				err = g.observe(b[:n])
				b = b[n:]
			}
			if got := err != nil; got != tc.refused || (err != nil && !errors.Is(err, ErrMessageTooLarge)) {
				t.Errorf("%s, chunks of %d: err %v, want refused %v", tc.name, chunk, err, tc.refused)
			}
			if want := map[bool]uint64{true: 1}[tc.refused]; refused.Load() != want {
				t.Errorf("%s, chunks of %d: counted %d refusals, want %d", tc.name, chunk, refused.Load(), want)
			}
			if err != nil && g.observe([]byte{0}) == nil {
				t.Errorf("%s: the guard accepted bytes after refusing", tc.name)
			}
		}
	}
}

func concat(parts ...[]byte) []byte { return bytes.Join(parts, nil) }

// FuzzZMTPGuard: any stream, in any chunking, gets the same verdict, and a
// stream it accepts declares no frame over the limit.
func FuzzZMTPGuard(f *testing.F) {
	f.Add(concat(zmtppeer.Greeting(), zmtppeer.Ready("PUB"), zmtppeer.Frame(0, []byte("x"), 0)), uint8(1))
	f.Add(concat(zmtppeer.Greeting(), zmtppeer.Frame(flagLong, nil, 1<<40)), uint8(7))
	f.Fuzz(func(t *testing.T, stream []byte, chunk uint8) {
		whole := newZMTPGuard("p", connLimits{maxMessageBytes: 512}).observe(stream)
		g := newZMTPGuard("p", connLimits{maxMessageBytes: 512})
		step := int(chunk)%16 + 1
		var err error
		for b := stream; len(b) > 0 && err == nil; {
			n := min(step, len(b))
			err = g.observe(b[:n])
			b = b[n:]
		}
		if (err == nil) != (whole == nil) {
			t.Fatalf("whole: %v; in chunks of %d: %v", whole, step, err)
		}
	})
}

// A peer that passes the handshake as an engine's PUB and declares a huge
// frame: the subscriber refuses it before anything is allocated, counts it,
// and reconnects.
func TestSubscriberRefusesOversizedMessages(t *testing.T) {
	tests := []struct {
		name  string
		limit int64 // 0: the default
		send  []byte
	}{
		{"one frame declaring 1 TiB", 0, zmtppeer.Frame(flagLong, nil, 1<<40)},
		{"three frames of 600 KiB under a 1 MiB limit", 1 << 20, concat(
			zmtppeer.Frame(flagMore, []byte("kv"), 0), zmtppeer.Frame(flagMore, make([]byte, 8), 0),
			zmtppeer.Frame(flagMore, make([]byte, 600<<10), 0), zmtppeer.Frame(flagMore, make([]byte, 600<<10), 0),
			zmtppeer.Frame(0, make([]byte, 600<<10), 0))},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			peer := zmtppeer.Start(t, "PUB", func(c net.Conn) error {
				_, err := c.Write(tc.send)
				return err
			})
			var before, after runtime.MemStats
			runtime.ReadMemStats(&before)
			s := NewSubscriber(SubscriberOptions{Endpoint: peer.Endpoint, MaxMessageBytes: tc.limit, Logger: quietLogger(),
				MinBackoff: 20 * time.Millisecond, MaxBackoff: 100 * time.Millisecond})
			defer s.Close()
			// Refused, the connection closed by the subscriber, and a new
			// one made: twice, to see the reconnect loop keep going.
			waitFor(t, "two refusals and a third connection", 30*time.Second, func() bool {
				return s.Stats().Oversized >= 2 && peer.Ended() >= 2 && peer.Accepted() >= 3
			})
			runtime.ReadMemStats(&after)
			if grew := after.TotalAlloc - before.TotalAlloc; grew > 32<<20 {
				t.Errorf("%d bytes allocated while refusing", grew)
			}
			if st := s.Stats(); st.Received != 0 || st.QueuedBytes != 0 {
				t.Errorf("stats %+v: an oversized message got through", st)
			}
		})
	}
}

// The same from a replay ROUTER answering with a huge frame: the replay
// fails with an error naming the endpoint and the size, and counts it.
func TestReplayRefusesOversizedReply(t *testing.T) {
	peer := zmtppeer.Start(t, "ROUTER", func(c net.Conn) error {
		for i := 0; i < 2; i++ { // the request: "" and the start seq
			if _, err := zmtppeer.ReadFrame(c); err != nil {
				return err
			}
		}
		_, err := c.Write(concat(zmtppeer.Frame(flagMore, []byte{}, 0), zmtppeer.Frame(flagLong, nil, 1<<40)))
		return err
	})
	r := &Replayer{Endpoint: peer.Endpoint, PerReply: 5 * time.Second, Logger: quietLogger()}
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	msgs, complete, err := r.Replay(context.Background(), 0)
	runtime.ReadMemStats(&after)
	if !errors.Is(err, ErrMessageTooLarge) || complete || len(msgs) != 0 {
		t.Fatalf("got %d msgs, complete %v, err %v; want ErrMessageTooLarge", len(msgs), complete, err)
	}
	for _, want := range []string{peer.Endpoint, "1099511627776 bytes"} {
		if !bytes.Contains([]byte(err.Error()), []byte(want)) {
			t.Errorf("error %q does not name %q", err, want)
		}
	}
	if bytes.Contains([]byte(err.Error()), []byte("kvrelay-")) {
		t.Errorf("error %q names the internal transport", err)
	}
	if st := r.Stats(); st.Oversized != 1 {
		t.Errorf("stats %+v, want one oversized", st)
	}
	if grew := after.TotalAlloc - before.TotalAlloc; grew > 32<<20 {
		t.Errorf("%d bytes allocated while refusing", grew)
	}
}

func seqFrame(seq uint64) []byte { return binary.BigEndian.AppendUint64(nil, seq) }

// A subscriber whose consumer stalls holds at most QueueBytes of messages
// and counts the rest as dropped.
func TestSubscriberQueueBoundedByBytes(t *testing.T) {
	const n, size = 10, 300 << 10
	peer := zmtppeer.Start(t, "PUB", func(c net.Conn) error {
		for i := uint64(0); i < n; i++ {
			if _, err := c.Write(zmtppeer.Message([]byte("kv"), seqFrame(i), make([]byte, size))); err != nil {
				return err
			}
		}
		return nil
	})
	s := NewSubscriber(SubscriberOptions{Endpoint: peer.Endpoint, MaxMessageBytes: 512 << 10, QueueBytes: 1 << 20,
		Logger: quietLogger(), MinBackoff: 20 * time.Millisecond})
	defer s.Close()
	waitFor(t, "every message read off the socket", 30*time.Second, func() bool { return s.Stats().Received == n })
	st := s.Stats()
	if st.Dropped != n-3 || st.QueuedBytes != 3*(size+2) {
		t.Fatalf("stats %+v; want 3 messages (%d bytes) queued within 1 MiB and %d dropped", st, 3*(size+2), n-3)
	}
	for i := uint64(0); i < 3; i++ {
		if m, ok := recvWithin(t, s, 5*time.Second); !ok || m.Seq != i {
			t.Fatalf("message %d: %+v, %v", i, m.Seq, ok)
		}
	}
	if st := s.Stats(); st.QueuedBytes != 0 {
		t.Errorf("%d bytes still accounted after the queue emptied", st.QueuedBytes)
	}
}

// A replay server that misbehaves is cut off by the replay's bounds.
func TestReplayBounds(t *testing.T) {
	reply := func(seq uint64, size int) []byte {
		return zmtppeer.Message([]byte{}, seqFrame(seq), bytes.Repeat([]byte{0x93}, size))
	}
	// forever answers with increasing sequences until the client hangs up.
	forever := func(c net.Conn, size int) error {
		for seq := uint64(10); ; seq++ {
			if _, err := c.Write(reply(seq, size)); err != nil {
				return err
			}
		}
	}
	tests := []struct {
		name      string
		bounds    func(r *Replayer)
		serve     func(c net.Conn) error
		wantMsgs  int
		wantErr   error
		wantStats ReplayerStats
	}{
		{"a reply below the start", func(*Replayer) {}, func(c net.Conn) error {
			_, err := c.Write(concat(reply(10, 1), reply(11, 1), reply(5, 1), reply(12, 1)))
			return err
		}, 2, ErrReplayOutOfBounds, ReplayerStats{OutOfRange: 1}},
		{"a reply not after the previous", func(*Replayer) {}, func(c net.Conn) error {
			_, err := c.Write(concat(reply(10, 1), reply(12, 1), reply(12, 1)))
			return err
		}, 2, ErrReplayOutOfBounds, ReplayerStats{OutOfRange: 1}},
		{"more replies than any ring", func(r *Replayer) { r.MaxReplies = 100 }, func(c net.Conn) error { return forever(c, 1) },
			100, ErrReplayOutOfBounds, ReplayerStats{TooMany: 1}},
		{"more bytes than the bound", func(r *Replayer) { r.MaxBytes = 100 << 10 }, func(c net.Conn) error { return forever(c, 1<<10) },
			100, nil, ReplayerStats{TooBig: 1}},
		{"longer than the bound", func(r *Replayer) { r.MaxTime = 300 * time.Millisecond }, func(c net.Conn) error {
			for seq := uint64(10); ; seq++ {
				if _, err := c.Write(reply(seq, 1)); err != nil {
					return err
				}
				time.Sleep(20 * time.Millisecond) // within PerReply each time
			}
		}, -1, nil, ReplayerStats{TooLong: 1}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			peer := zmtppeer.Start(t, "ROUTER", func(c net.Conn) error {
				for i := 0; i < 2; i++ {
					if _, err := zmtppeer.ReadFrame(c); err != nil {
						return err
					}
				}
				return tc.serve(c)
			})
			r := &Replayer{Endpoint: peer.Endpoint, PerReply: 5 * time.Second, Logger: quietLogger()}
			tc.bounds(r)
			msgs, complete, err := r.Replay(context.Background(), 10)
			if complete || !errors.Is(err, tc.wantErr) || (tc.wantErr == nil && err != nil) {
				t.Fatalf("complete %v, err %v; want incomplete and %v", complete, err, tc.wantErr)
			}
			if tc.wantMsgs >= 0 && len(msgs) != tc.wantMsgs {
				t.Errorf("%d replies kept, want %d", len(msgs), tc.wantMsgs)
			}
			for i, m := range msgs {
				if m.Seq < 10 || (i > 0 && m.Seq <= msgs[i-1].Seq) {
					t.Fatalf("reply %d: seq %d kept", i, m.Seq)
				}
			}
			if st := r.Stats(); st != tc.wantStats {
				t.Errorf("stats %+v, want %+v", st, tc.wantStats)
			}
		})
	}
}

func TestQueueBoundedByBytes(t *testing.T) {
	q := newQueue(100, 1000)
	m := Message{Topic: []byte("kv"), Payload: make([]byte, 398)}
	if !q.push(m) || !q.push(m) || q.push(m) {
		t.Fatal("want two 400-byte messages in 1000 bytes and a third refused")
	}
	if q.queuedBytes() != 800 {
		t.Fatalf("%d bytes accounted, want 800", q.queuedBytes())
	}
	if _, ok := q.pop(); !ok || !q.push(m) || q.queuedBytes() != 800 {
		t.Fatalf("after a pop and a push: %d bytes accounted, want 800", q.queuedBytes())
	}
}

// The case at the default bound: 32 MiB messages while the consumer
// stalls. The queue accounts at most DefaultQueueBytes (one backing array
// stands for every payload, so the test itself stays small).
func TestQueueDefaultByteBound(t *testing.T) {
	q := newQueue(100_000, DefaultQueueBytes)
	big := make([]byte, 32<<20)
	pushed := 0
	for i := 0; i < 24; i++ {
		if q.push(Message{Payload: big}) {
			pushed++
		}
	}
	if pushed != 4 || q.queuedBytes() != 4*int64(len(big)) || q.queuedBytes() > DefaultQueueBytes {
		t.Fatalf("%d of 24 messages of 32 MiB queued, %d bytes accounted; want 4 within %d", pushed, q.queuedBytes(), DefaultQueueBytes)
	}
}

// A replay server that never stops answering is cut at the default count.
func TestReplayDefaultCountBound(t *testing.T) {
	peer := zmtppeer.Start(t, "ROUTER", func(c net.Conn) error {
		for i := 0; i < 2; i++ {
			if _, err := zmtppeer.ReadFrame(c); err != nil {
				return err
			}
		}
		for seq := uint64(0); ; seq++ {
			if _, err := c.Write(zmtppeer.Message([]byte{}, seqFrame(seq), []byte{0x93})); err != nil {
				return err
			}
		}
	})
	r := &Replayer{Endpoint: peer.Endpoint, PerReply: 5 * time.Second, Logger: quietLogger()}
	msgs, complete, err := r.Replay(context.Background(), 0)
	if !errors.Is(err, ErrReplayOutOfBounds) || complete || len(msgs) != DefaultReplayMaxReplies {
		t.Fatalf("%d replies, complete %v, err %v; want %d and ErrReplayOutOfBounds", len(msgs), complete, err, DefaultReplayMaxReplies)
	}
}

// An engine that is not there is warned about once, after a while, and its
// arrival is logged.
func TestSubscriberWarnsOnceWhileThePublisherIsUnreachable(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	_ = l.Close() // nothing listens there now
	rec := &recordingHandler{}
	s := NewSubscriber(SubscriberOptions{Endpoint: "tcp://" + addr, Logger: slog.New(rec),
		MinBackoff: 10 * time.Millisecond, MaxBackoff: 20 * time.Millisecond, UnreachableWarnAfter: 100 * time.Millisecond})
	defer s.Close()
	waitFor(t, "the warning", 30*time.Second, func() bool { return rec.count(slog.LevelWarn, "engine publisher unreachable") == 1 })
	// Many more failed dials, still one warning.
	before := rec.count(slog.LevelDebug, "zmq subscriber dial failed")
	waitFor(t, "ten more dials", 30*time.Second, func() bool { return rec.count(slog.LevelDebug, "zmq subscriber dial failed") >= before+10 })
	if n := rec.count(slog.LevelWarn, "engine publisher unreachable"); n != 1 {
		t.Fatalf("%d warnings for one outage, want 1", n)
	}
	for _, r := range rec.all() {
		if strings.Contains(fmt.Sprint(r), "kvrelay-") {
			t.Fatalf("a log line names the internal transport: %v", r)
		}
	}
	// The publisher appears.
	zmtppeer.StartOn(t, addr, "PUB", func(net.Conn) error { return nil })
	waitFor(t, "the recovery logged", 30*time.Second, func() bool { return rec.count(slog.LevelInfo, "engine publisher reachable again") == 1 })
}

// recordingHandler keeps every record, with its attributes as text.
type recordingHandler struct {
	mu      sync.Mutex
	records []string
	levels  []slog.Level
	msgs    []string
}

func (h *recordingHandler) Enabled(context.Context, slog.Level) bool { return true }
func (h *recordingHandler) Handle(_ context.Context, r slog.Record) error {
	var b strings.Builder
	b.WriteString(r.Message)
	r.Attrs(func(a slog.Attr) bool { fmt.Fprintf(&b, " %s=%v", a.Key, a.Value); return true })
	h.mu.Lock()
	h.records, h.levels, h.msgs = append(h.records, b.String()), append(h.levels, r.Level), append(h.msgs, r.Message)
	h.mu.Unlock()
	return nil
}
func (h *recordingHandler) WithAttrs([]slog.Attr) slog.Handler { return h }
func (h *recordingHandler) WithGroup(string) slog.Handler      { return h }

func (h *recordingHandler) count(level slog.Level, prefix string) int {
	h.mu.Lock()
	defer h.mu.Unlock()
	n := 0
	for i, m := range h.msgs {
		if h.levels[i] == level && strings.HasPrefix(m, prefix) {
			n++
		}
	}
	return n
}

func (h *recordingHandler) all() []string {
	h.mu.Lock()
	defer h.mu.Unlock()
	return append([]string(nil), h.records...)
}
