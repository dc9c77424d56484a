// Package zmqsource reads an engine's KV-event stream over ZeroMQ with the
// pure-Go github.com/go-zeromq/zmq4: a Subscriber for one rank's live PUB
// socket and a Replayer for its replay ROUTER.
//
// zmq4 differs from libzmq in ways this package hides (go-ecosystem.md §1.3):
// Dial is synchronous and gives up, a socket is dead after its first EOF,
// Recv has no timeout and a 10-slot queue whose back-pressure makes the
// engine's PUB drop silently, ZMTP heartbeats reach the application, and
// Close can leak a reader goroutine. The Subscriber therefore redials with
// backoff on a fresh socket, reads continuously into its own bounded queue,
// and drains every socket it closes.
//
// Endpoints are connect endpoints (tcp://127.0.0.1:5557, ipc:///path).
// inproc:// is accepted but only reaches sockets inside this process, so it
// never reaches an engine. zmq4 allocates whatever frame size a peer
// declares, so every connection goes through a transport that refuses a
// frame or message over MaxMessageBytes before zmq4 reads its size.
package zmqsource

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-zeromq/zmq4"
)

// ErrClosed is returned by Recv after Close.
var ErrClosed = errors.New("zmqsource: subscriber closed")

// Message is one live batch: [topic, seq (big-endian), payload].
type Message struct {
	Seq     uint64
	Topic   []byte
	Payload []byte
}

// SubscriberOptions configure a Subscriber.
type SubscriberOptions struct {
	Endpoint string // connect endpoint of one rank's PUB
	Topic    string // subscription prefix; "" receives everything
	// RcvHWM bounds the queue between the socket reader and Recv, in
	// messages (default 100000, the engines' hwm). When it is full, new
	// messages are dropped and counted; the consumer sees a seq gap.
	RcvHWM int
	// QueueBytes bounds the same queue by the bytes of the messages it
	// holds (default DefaultQueueBytes; raised to MaxMessageBytes if
	// smaller, so that one message of the largest size always fits).
	QueueBytes int64
	// MaxMessageBytes is the largest message (all frames) and frame
	// accepted; a peer that declares more is disconnected and redialed
	// (default DefaultMaxMessageBytes).
	MaxMessageBytes int64
	// UnreachableWarnAfter is how long the publisher may stay unreachable
	// before a warning is logged, once per outage (default 10 s).
	UnreachableWarnAfter time.Duration
	Logger               *slog.Logger // default slog.Default()

	// MinBackoff and MaxBackoff bound the wait between connection attempts
	// (defaults 100 ms and 2 s); it doubles per failure, with jitter.
	MinBackoff, MaxBackoff time.Duration
	// DialTimeout bounds one connection attempt, TCP connect and ZMTP
	// handshake (default 5 s).
	DialTimeout time.Duration
	// DisableReadBuffer reads the connection directly, as stock zmq4 does.
	// It exists for benchmarks; the buffered default is faster.
	DisableReadBuffer bool
}

// SubscriberStats are cumulative counters.
type SubscriberStats struct {
	// Received counts well-formed messages read off the socket, including
	// those later dropped because the queue was full.
	Received uint64
	// Short counts messages skipped for having fewer than 3 frames.
	Short uint64
	// BadSequence counts messages skipped because their sequence frame is
	// empty or wider than 8 bytes with a non-zero high part.
	BadSequence uint64
	// Dropped counts messages discarded because the queue held RcvHWM
	// messages or had no room for their bytes within QueueBytes.
	Dropped uint64
	// Oversized counts connections closed because the peer declared a
	// frame or message over MaxMessageBytes.
	Oversized uint64
	// Reconnects counts connections made after the first one.
	Reconnects uint64
	// QueuedBytes is what the queue holds now (payload and topic bytes).
	QueuedBytes int64
}

// DefaultQueueBytes bounds a subscriber's queue by bytes: two messages of
// the largest default size. Real batches are kilobytes, so the 100,000
// messages of the engines' HWM fit in it at up to 1.3 KiB each.
const DefaultQueueBytes int64 = 2 * DefaultMaxMessageBytes

// Subscriber keeps one SUB connection to an engine rank alive and queues
// what arrives. It is safe for concurrent use.
type Subscriber struct {
	opts     SubscriberOptions
	log      *slog.Logger
	zlog     zmq4.Option
	endpoint string // what zmq4 dials

	ctx    context.Context
	cancel context.CancelFunc
	done   chan struct{} // the connection loop has exited
	closed chan struct{}
	once   sync.Once

	queue     *queue
	connected atomic.Bool
	// connChanged is signalled (capacity 1) whenever connected changes, so
	// a consumer can wait for it instead of polling Connected.
	connChanged chan struct{}
	received    atomic.Uint64
	short       atomic.Uint64
	badSeq      atomic.Uint64
	dropped     atomic.Uint64
	oversized   atomic.Uint64
	reconns     atomic.Uint64
}

// NewSubscriber starts connecting in the background and returns at once; an
// engine that is not up yet is retried until Close. A malformed endpoint is
// logged and retried like an unreachable one, so check Connected for health.
func NewSubscriber(opts SubscriberOptions) *Subscriber {
	if opts.RcvHWM <= 0 {
		opts.RcvHWM = 100_000
	}
	if opts.Logger == nil {
		opts.Logger = slog.Default()
	}
	if opts.MinBackoff <= 0 {
		opts.MinBackoff = 100 * time.Millisecond
	}
	if opts.MaxBackoff < opts.MinBackoff {
		opts.MaxBackoff = max(2*time.Second, opts.MinBackoff)
	}
	if opts.DialTimeout <= 0 {
		opts.DialTimeout = 5 * time.Second
	}
	if opts.MaxMessageBytes <= 0 {
		opts.MaxMessageBytes = DefaultMaxMessageBytes
	}
	if opts.QueueBytes <= 0 {
		opts.QueueBytes = DefaultQueueBytes
	}
	opts.QueueBytes = max(opts.QueueBytes, opts.MaxMessageBytes)
	if opts.UnreachableWarnAfter <= 0 {
		opts.UnreachableWarnAfter = 10 * time.Second
	}
	log := opts.Logger.With("endpoint", opts.Endpoint)
	ctx, cancel := context.WithCancel(context.Background())
	s := &Subscriber{
		opts:   opts,
		log:    log,
		zlog:   zmq4.WithLogger(slog.NewLogLogger(log.Handler(), slog.LevelDebug)),
		ctx:    ctx,
		cancel: cancel,
		done:   make(chan struct{}),
		closed: make(chan struct{}),
		queue:  newQueue(opts.RcvHWM, opts.QueueBytes),

		connChanged: make(chan struct{}, 1),
	}
	go s.run()
	return s
}

// Recv returns the oldest queued message. It blocks until one arrives, ctx
// ends, or the Subscriber is closed (ErrClosed).
func (s *Subscriber) Recv(ctx context.Context) (Message, error) {
	for {
		select {
		case <-s.closed:
			return Message{}, ErrClosed
		default:
		}
		if m, ok := s.queue.pop(); ok {
			return m, nil
		}
		select {
		case <-ctx.Done():
			return Message{}, ctx.Err()
		case <-s.closed:
			return Message{}, ErrClosed
		case <-s.queue.ready:
		}
	}
}

// TryRecv returns the oldest queued message without waiting; ok is false
// when none is queued or the Subscriber is closed. With Ready it lets a
// consumer wait for messages in its own select, without a goroutine
// blocked in Recv and a hand-off per message.
func (s *Subscriber) TryRecv() (m Message, ok bool) {
	select {
	case <-s.closed:
		return Message{}, false
	default:
	}
	return s.queue.pop()
}

// Ready is signalled when a message may be queued: after a push, and after
// a TryRecv or Recv that left messages behind. A receive from it is a hint;
// TryRecv may still find nothing (another consumer took the message).
func (s *Subscriber) Ready() <-chan struct{} { return s.queue.ready }

// Connected reports whether a connection to the engine is up.
func (s *Subscriber) Connected() bool { return s.connected.Load() }

// ConnChanged is signalled (it holds at most one signal) after Connected
// changed; read Connected for the state.
func (s *Subscriber) ConnChanged() <-chan struct{} { return s.connChanged }

func (s *Subscriber) setConnected(up bool) {
	s.connected.Store(up)
	select {
	case s.connChanged <- struct{}{}:
	default:
	}
}

// Stats returns the counters so far.
func (s *Subscriber) Stats() SubscriberStats {
	return SubscriberStats{
		Received:    s.received.Load(),
		Short:       s.short.Load(),
		BadSequence: s.badSeq.Load(),
		Dropped:     s.dropped.Load(),
		Oversized:   s.oversized.Load(),
		Reconnects:  s.reconns.Load(),
		QueuedBytes: s.queue.queuedBytes(),
	}
}

// Close stops the connection loop and waits for all its goroutines,
// including zmq4's, to exit. It is idempotent.
func (s *Subscriber) Close() error {
	s.once.Do(func() {
		close(s.closed)
		s.cancel()
	})
	<-s.done
	return nil
}

func (s *Subscriber) run() {
	defer close(s.done)
	ep, err := dialEndpoint(s.opts.Endpoint, !s.opts.DisableReadBuffer)
	if err != nil {
		s.log.Error("zmq subscriber cannot start", "err", err)
		<-s.ctx.Done()
		return
	}
	s.endpoint = ep
	backoff := s.opts.MinBackoff
	connections := 0
	// An engine that is down is retried quietly (at debug); one warning
	// per outage says so once it has lasted UnreachableWarnAfter.
	downSince, warned := time.Now(), false
	for s.ctx.Err() == nil {
		sock, cancelSock, err := s.dial()
		if err != nil {
			s.log.Debug("zmq subscriber dial failed", "err", err, "retry_in", backoff)
			if down := time.Since(downSince); !warned && down >= s.opts.UnreachableWarnAfter {
				warned = true
				s.log.Warn("engine publisher unreachable; still retrying", "for", down.Round(time.Second), "err", err)
			}
			if !s.sleep(backoff) {
				return
			}
			backoff = min(2*backoff, s.opts.MaxBackoff)
			continue
		}
		connections++
		if connections > 1 {
			s.reconns.Add(1)
		}
		if warned {
			s.log.Info("engine publisher reachable again", "after", time.Since(downSince).Round(time.Second))
		}
		s.log.Info("zmq subscriber connected", "topic", s.opts.Topic, "connection", connections)
		s.setConnected(true)
		err = s.read(sock)
		s.setConnected(false)
		closeAndDrain(sock)
		cancelSock()
		if s.ctx.Err() != nil {
			return
		}
		downSince, warned = time.Now(), false
		s.log.Warn("zmq subscriber connection lost; reconnecting", "err", err)
		// The engine is probably restarting: a short pause avoids a burst of
		// refused dials before its new socket binds. A peer that sent an
		// oversized message will do it again: its reconnects back off as
		// failed dials do, instead of looping at the short pause.
		pause := s.opts.MinBackoff
		if errors.Is(err, ErrMessageTooLarge) {
			pause = backoff
			backoff = min(2*backoff, s.opts.MaxBackoff)
		} else {
			backoff = s.opts.MinBackoff
		}
		if !s.sleep(pause) {
			return
		}
	}
}

// dial makes one connection attempt on a fresh socket. A socket is never
// reused: after EOF zmq4's Recv would block forever.
func (s *Subscriber) dial() (zmq4.Socket, context.CancelFunc, error) {
	ctx, cancel := context.WithCancel(withConnLimits(s.ctx,
		connLimits{maxMessageBytes: s.opts.MaxMessageBytes, refused: &s.oversized}))
	sock := zmq4.NewSub(ctx, s.zlog,
		zmq4.WithDialerMaxRetries(0), // we retry ourselves, with backoff and cancellation
		zmq4.WithDialerTimeout(s.opts.DialTimeout))
	// Topic must be a string: zmq4 type-asserts it and panics on []byte.
	// Subscribing before Dial sends it once, with the handshake.
	if err := sock.SetOption(zmq4.OptionSubscribe, s.opts.Topic); err != nil {
		closeAndDrain(sock)
		cancel()
		return nil, nil, fmt.Errorf("subscribe %q: %w", s.opts.Topic, err)
	}
	if err := dialBounded(s.ctx, cancel, sock, s.endpoint, s.opts.Endpoint, s.opts.DialTimeout); err != nil {
		closeAndDrain(sock)
		cancel()
		return nil, nil, fmt.Errorf("dial %s: %w", s.opts.Endpoint, err)
	}
	return sock, cancel, nil
}

// read moves messages from the socket to the queue until the connection
// ends. It never waits on the consumer: a full queue drops.
func (s *Subscriber) read(sock zmq4.Socket) error {
	topic := s.opts.Topic
	for {
		msg, err := sock.Recv()
		if err != nil {
			return err
		}
		if msg.Type == zmq4.CmdMsg {
			continue // ZMTP PING and friends; zmq4 hands them up
		}
		if len(msg.Frames) < 3 {
			s.short.Add(1)
			continue
		}
		seq, ok := parseSeq(msg.Frames[1])
		if !ok {
			s.badSeq.Add(1)
			continue
		}
		// libzmq's PUB filters by prefix already; this guards against a
		// publisher that does not.
		if len(msg.Frames[0]) < len(topic) || string(msg.Frames[0][:len(topic)]) != topic {
			continue
		}
		s.received.Add(1)
		// zmq4 allocates every frame afresh, so the slices can be kept.
		if !s.queue.push(Message{Seq: seq, Topic: msg.Frames[0], Payload: msg.Frames[2]}) {
			s.dropped.Add(1)
		}
	}
}

func (s *Subscriber) sleep(d time.Duration) bool {
	d += time.Duration(rand.Int64N(int64(d)/5 + 1)) // jitter: ranks restart together
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-s.ctx.Done():
		return false
	case <-t.C:
		return true
	}
}

// parseSeq reads a live sequence frame. Engines send exactly 8 bytes
// big-endian. Narrower frames are zero-extended, as the engines' own
// int.from_bytes and smg's Rust relay read them; wider frames are accepted
// only when the value still fits 64 bits. An empty frame is no sequence.
func parseSeq(b []byte) (uint64, bool) {
	switch {
	case len(b) == 8:
		return binary.BigEndian.Uint64(b), true
	case len(b) == 0:
		return 0, false
	case len(b) > 8:
		for _, c := range b[:len(b)-8] {
			if c != 0 {
				return 0, false
			}
		}
		return binary.BigEndian.Uint64(b[len(b)-8:]), true
	}
	var v uint64
	for _, c := range b {
		v = v<<8 | uint64(c)
	}
	return v, true
}

// closeAndDrain closes a zmq4 socket so that none of its goroutines outlive
// it. zmq4's per-connection reader can be parked sending into the socket's
// 10-slot channel; once the socket is closed, Recv picks randomly between the
// closed context and a queued message, so keep calling it until it has
// reported the closure many times in a row with nothing queued in between.
func closeAndDrain(sock zmq4.Socket) {
	_ = sock.Close()
	for misses := 0; misses < 64; {
		if _, err := sock.Recv(); err != nil {
			misses++
		} else {
			misses = 0
		}
	}
}

// queue is an unbounded-until-limit FIFO: memory grows with the backlog, not
// with the limit, so a 100000-message HWM costs nothing while idle.
type queue struct {
	mu         sync.Mutex
	buf        []Message // ring
	head       int
	n          int
	limit      int
	bytes      int64 // payload and topic bytes held
	limitBytes int64
	ready      chan struct{} // a push happened; capacity 1
}

func newQueue(limit int, limitBytes int64) *queue {
	return &queue{limit: limit, limitBytes: limitBytes, buf: make([]Message, min(limit, 64)), ready: make(chan struct{}, 1)}
}

// messageBytes is what a queued message is charged: the frames it keeps.
func messageBytes(m Message) int64 { return int64(len(m.Payload) + len(m.Topic)) }

func (q *queue) queuedBytes() int64 {
	q.mu.Lock()
	defer q.mu.Unlock()
	return q.bytes
}

func (q *queue) push(m Message) bool {
	size := messageBytes(m)
	q.mu.Lock()
	if q.n == q.limit || q.bytes+size > q.limitBytes {
		q.mu.Unlock()
		return false
	}
	q.bytes += size
	if q.n == len(q.buf) {
		grown := make([]Message, min(2*len(q.buf), q.limit))
		copied := copy(grown, q.buf[q.head:])
		copy(grown[copied:], q.buf[:q.head])
		q.buf = grown
		q.head = 0
	}
	q.buf[(q.head+q.n)%len(q.buf)] = m
	q.n++
	q.mu.Unlock()
	select {
	case q.ready <- struct{}{}:
	default:
	}
	return true
}

func (q *queue) pop() (Message, bool) {
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.n == 0 {
		return Message{}, false
	}
	m := q.buf[q.head]
	q.bytes -= messageBytes(m)
	q.buf[q.head] = Message{} // let the payload be collected
	q.head = (q.head + 1) % len(q.buf)
	q.n--
	if q.n > 0 {
		// Another Recv may be waiting; keep the signal up while work remains.
		select {
		case q.ready <- struct{}{}:
		default:
		}
	}
	return m, true
}
