package sim

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/go-zeromq/zmq4"

	"github.com/kvrelay/kvrelay/engines"
)

// endSeq is the replay end marker's sequence frame: -1 as 8 signed bytes.
var endSeq = []byte{0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff}

// connectHint explains a failed dial of a live endpoint. The simulator
// follows the engines' PUB rule (engines.PublisherBinds): an endpoint without
// a wildcard is dialled, not bound, so a user who wrote tcp://127.0.0.1:PORT
// expecting the simulator to listen for kvrelay gets "connection refused"
// instead. It states the rule in the words of the hint `kvrelay serve` logs
// for the same configuration (engines.BindRule).
const connectHint = "the simulator, as the engines do, connects its publisher to an endpoint without a wildcard instead of binding it, " +
	"and nothing listens there: " + engines.BindRule + "; to have the simulator listen for kvrelay, use tcp://*:PORT"

type ringEntry struct {
	seq     uint64
	payload []byte
}

// ring is the replay buffer: the last buffer_steps published batches.
type ring struct {
	buf   []ringEntry
	head  int // index of the oldest entry
	count int
}

func newRing(n int) ring { return ring{buf: make([]ringEntry, n)} }

func (r *ring) push(e ringEntry) {
	if len(r.buf) == 0 {
		return // buffer_steps 0: a deque(maxlen=0) keeps nothing
	}
	if r.count < len(r.buf) {
		r.buf[(r.head+r.count)%len(r.buf)] = e
		r.count++
		return
	}
	r.buf[r.head] = e
	r.head = (r.head + 1) % len(r.buf)
}

// from returns the entries with seq >= start, oldest first.
func (r *ring) from(start uint64) []ringEntry {
	var out []ringEntry
	for i := 0; i < r.count; i++ {
		e := r.buf[(r.head+i)%len(r.buf)]
		if e.seq >= start {
			out = append(out, e)
		}
	}
	return out
}

// rankPublisher is one DP rank's ZmqEventPublisher: a PUB for live batches
// and, when configured, a ROUTER serving replays from a ring.
type rankPublisher struct {
	rank                       int
	liveBind, replayBind       string
	liveConnect, replayConnect string
	topic                      []byte
	topicFrame                 bool // replay replies carry the topic (vLLM)
	bufferSteps                int
	log                        *slog.Logger

	mu         sync.Mutex
	pub        zmq4.Socket
	router     zmq4.Socket
	replayDone chan struct{}
	nextSeq    uint64
	ring       ring
	// published counts batches since start for the drop knob.
	published uint64
	dropEvery int
	paused    bool
	pending   [][]byte
	// truncate limits replays to that many replies without an end marker;
	// negative means off.
	truncate int
	// replayDelay is how long a replay request waits before it is read
	// from the ring and answered (the replay_delay fault).
	replayDelay time.Duration

	dropped, replays uint64
}

func (p *rankPublisher) socketOptions() []zmq4.Option {
	return []zmq4.Option{zmq4.WithLogger(slog.NewLogLogger(p.log.Handler(), slog.LevelDebug))}
}

// open creates the sockets of a fresh publisher incarnation: sequence 0 and
// an empty ring, as a new engine process has.
func (p *rankPublisher) open() error {
	pub := zmq4.NewPub(context.Background(), p.socketOptions()...)
	var err error
	dials := !engines.PublisherBinds(p.liveBind)
	if dials {
		err = pub.Dial(p.liveBind)
	} else {
		err = pub.Listen(p.liveBind)
	}
	if err != nil {
		pub.Close()
		if dials {
			return fmt.Errorf("rank %d live endpoint %s: %s: %w", p.rank, p.liveBind, connectHint, err)
		}
		return fmt.Errorf("rank %d live endpoint %s: %w", p.rank, p.liveBind, err)
	}
	var router zmq4.Socket
	var done chan struct{}
	if p.replayBind != "" {
		router = zmq4.NewRouter(context.Background(), p.socketOptions()...)
		if err := router.Listen(p.replayBind); err != nil {
			router.Close()
			pub.Close()
			return fmt.Errorf("rank %d replay endpoint %s: %w", p.rank, p.replayBind, err)
		}
		done = make(chan struct{})
		go p.serveReplay(router, done)
	}
	p.mu.Lock()
	p.pub, p.router, p.replayDone = pub, router, done
	p.nextSeq, p.ring, p.published = 0, newRing(p.bufferSteps), 0
	p.paused, p.pending = false, nil
	p.mu.Unlock()
	return nil
}

// close shuts the sockets and waits for the replay server to stop.
func (p *rankPublisher) close() {
	p.mu.Lock()
	pub, router, done := p.pub, p.router, p.replayDone
	p.pub, p.router, p.replayDone = nil, nil, nil
	p.mu.Unlock()
	if pub != nil {
		pub.Close()
	}
	if router != nil {
		router.Close()
	}
	if done != nil {
		<-done
	}
}

// publish hands one encoded batch to the publisher. While paused the batch
// waits, as it would in a stalled publisher thread's queue; its sequence is
// assigned when it is actually sent, as the engines do.
func (p *rankPublisher) publish(payload []byte) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.paused {
		p.pending = append(p.pending, payload)
		return nil
	}
	return p.sendLocked(payload)
}

func (p *rankPublisher) sendLocked(payload []byte) error {
	if p.pub == nil {
		return errors.New("publisher closed")
	}
	seq := p.nextSeq
	p.nextSeq++
	p.published++
	var seq8 [8]byte
	binary.BigEndian.PutUint64(seq8[:], seq)
	if p.dropEvery > 0 && p.published%uint64(p.dropEvery) == 0 {
		// Lost on the live stream only; replay still has it.
		p.dropped++
	} else if err := p.pub.Send(zmq4.NewMsgFrom(p.topic, seq8[:], payload)); err != nil {
		// The engines take the seq before sending and buffer only after a
		// successful send, so a failed send burns the seq for good.
		return fmt.Errorf("rank %d: send seq %d: %w", p.rank, seq, err)
	}
	p.ring.push(ringEntry{seq: seq, payload: payload})
	return nil
}

func (p *rankPublisher) setPaused(paused bool) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.paused = paused
	if paused {
		return nil
	}
	pending := p.pending
	p.pending = nil
	for _, b := range pending {
		if err := p.sendLocked(b); err != nil {
			return err
		}
	}
	return nil
}

// parseReplayRequest reads a replay request as the engines do: exactly three
// frames [identity, delimiter, start], start an unsigned big-endian integer
// of any width. ok is false for requests the engines ignore. A start wider
// than 64 bits is beyond every sequence, so it replays nothing.
func parseReplayRequest(frames [][]byte) (id []byte, start uint64, ok bool) {
	if len(frames) != 3 {
		return nil, 0, false
	}
	b := frames[2]
	for len(b) > 0 && b[0] == 0 {
		b = b[1:]
	}
	if len(b) > 8 {
		return frames[0], ^uint64(0), true
	}
	for _, c := range b {
		start = start<<8 | uint64(c)
	}
	return frames[0], start, true
}

func (p *rankPublisher) serveReplay(router zmq4.Socket, done chan struct{}) {
	defer close(done)
	for {
		msg, err := router.Recv()
		if err != nil {
			return
		}
		if msg.Type == zmq4.CmdMsg {
			continue
		}
		id, start, ok := parseReplayRequest(msg.Frames)
		if !ok {
			p.log.Warn("invalid replay request", "rank", p.rank, "frames", len(msg.Frames))
			continue
		}
		if err := p.replay(router, id, start); err != nil {
			p.log.Debug("replay reply failed", "rank", p.rank, "err", err)
		}
	}
}

// replay sends every buffered batch with seq >= start, then the end marker.
// Unlike the engines, whose replay runs on the publisher thread, the sim
// sends replies outside the publisher lock so a slow replay reader cannot
// stall Step.
func (p *rankPublisher) replay(router zmq4.Socket, id []byte, start uint64) error {
	// The delay is read again while waiting, so that lowering it (to 0)
	// releases a request already waiting.
	for begin := time.Now(); ; {
		p.mu.Lock()
		delay := p.replayDelay
		p.mu.Unlock()
		left := delay - time.Since(begin)
		if left <= 0 {
			break
		}
		time.Sleep(min(left, 10*time.Millisecond))
	}
	p.mu.Lock()
	entries := p.ring.from(start)
	truncate := p.truncate
	p.replays++
	p.mu.Unlock()
	marker := true
	if truncate >= 0 && len(entries) >= truncate {
		entries, marker = entries[:truncate], false
	}
	var seq8 [8]byte
	for _, e := range entries {
		binary.BigEndian.PutUint64(seq8[:], e.seq)
		frames := [][]byte{id, {}}
		if p.topicFrame {
			frames = append(frames, p.topic)
		}
		frames = append(frames, seq8[:], e.payload)
		if err := router.Send(zmq4.NewMsgFrom(frames...)); err != nil {
			return err
		}
	}
	if !marker {
		return nil
	}
	frames := [][]byte{id, {}}
	if p.topicFrame {
		frames = append(frames, []byte{})
	}
	frames = append(frames, endSeq, []byte{})
	return router.Send(zmq4.NewMsgFrom(frames...))
}
