package zmqsource

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"sync/atomic"
	"time"

	"github.com/go-zeromq/zmq4"
)

// endSeq is the replay end marker, (-1).to_bytes(8, "big", signed=True).
var endSeq = []byte{0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff}

// Defaults of the bounds on one replay. An engine answers with at most its
// ring (buffer_steps batches, 10,000 by default in every engine), so twice
// that is never a real answer; 256 MiB is the relay's default history, which
// is where a replay's batches go; 30 s is six times the per-reply wait.
const (
	DefaultReplayMaxReplies       = 20_000
	DefaultReplayMaxBytes   int64 = 256 << 20
	DefaultReplayMaxTime          = 30 * time.Second
)

// ErrReplayOutOfBounds is wrapped by the error of a replay whose server
// answered outside what was asked (a reply below the start or not after the
// previous one) or with more replies than MaxReplies: no engine does either,
// so nothing of that answer is trusted.
var ErrReplayOutOfBounds = errors.New("replay answer out of bounds")

// Replayer asks an engine rank's replay ROUTER for buffered batches.
type Replayer struct {
	Endpoint string // connect endpoint of the rank's ROUTER
	// PerReply bounds the wait for each reply, and for the connection
	// (default 5 s, as smg's relays).
	PerReply time.Duration
	// MaxReplies, MaxBytes (payload bytes) and MaxTime bound one replay
	// (defaults DefaultReplayMaxReplies, DefaultReplayMaxBytes,
	// DefaultReplayMaxTime).
	MaxReplies int
	MaxBytes   int64
	MaxTime    time.Duration
	// MaxMessageBytes is the largest reply accepted (default
	// DefaultMaxMessageBytes); a bigger one breaks the connection.
	MaxMessageBytes int64
	Logger          *slog.Logger // default slog.Default()

	stats replayerCounters
}

type replayerCounters struct {
	oversized, outOfRange, tooMany, tooBig, tooLong atomic.Uint64
}

// ReplayerStats are cumulative counters of replays cut short by a bound.
type ReplayerStats struct {
	Oversized  uint64 // a reply over MaxMessageBytes broke the connection
	OutOfRange uint64 // a reply below the start or not after the previous one
	TooMany    uint64 // more than MaxReplies
	TooBig     uint64 // more than MaxBytes
	TooLong    uint64 // longer than MaxTime
}

// Stats returns the counters so far.
func (r *Replayer) Stats() ReplayerStats {
	return ReplayerStats{
		Oversized:  r.stats.oversized.Load(),
		OutOfRange: r.stats.outOfRange.Load(),
		TooMany:    r.stats.tooMany.Load(),
		TooBig:     r.stats.tooBig.Load(),
		TooLong:    r.stats.tooLong.Load(),
	}
}

// Replay requests every buffered batch with seq >= from and returns them in
// arrival order. complete reports that the end marker arrived. When a reply
// does not arrive within PerReply, Replay returns what it has with
// complete=false and a nil error: engines truncate long replays silently
// (SGLang drops at its ROUTER's HWM, end marker included), so the caller
// resumes from its next missing seq. Replay does not check that the replies
// are contiguous or start at from; the engines start at their oldest
// buffered batch when from is older.
//
// A replay is bounded: past MaxBytes of payload or MaxTime it returns what
// it has with complete=false (the caller may resume); a reply below from or
// not after the previous one, or more than MaxReplies, ends it with an
// error wrapping ErrReplayOutOfBounds.
//
// A non-nil error means the ROUTER could not be reached, the connection
// broke, or a reply was malformed or out of bounds; msgs still holds the
// replies received before that. ctx ending returns ctx.Err() the same way.
func (r *Replayer) Replay(ctx context.Context, from uint64) (msgs []Message, complete bool, err error) {
	return r.replay(ctx, from, 0)
}

// ReplayUpTo is Replay stopped after n replies (n > 0), with complete true
// once they arrived: a caller that needs only the head of the ring (is the
// batch at from still there?) does not have the whole ring streamed to it,
// nor wait out the timeout of an answer the engine cuts short. The
// engines' ROUTERs drop what they still send to a DEALER that has gone.
func (r *Replayer) ReplayUpTo(ctx context.Context, from uint64, n int) (msgs []Message, complete bool, err error) {
	if n <= 0 {
		return nil, false, fmt.Errorf("replay from %s: asked for %d replies", r.Endpoint, n)
	}
	return r.replay(ctx, from, n)
}

// replay is Replay, stopped after limit replies when limit > 0.
func (r *Replayer) replay(ctx context.Context, from uint64, limit int) (msgs []Message, complete bool, err error) {
	per := r.PerReply
	if per <= 0 {
		per = 5 * time.Second
	}
	log := r.Logger
	if log == nil {
		log = slog.Default()
	}
	log = log.With("endpoint", r.Endpoint)
	maxReplies, maxBytes, maxTime := r.MaxReplies, r.MaxBytes, r.MaxTime
	if maxReplies <= 0 {
		maxReplies = DefaultReplayMaxReplies
	}
	if maxBytes <= 0 {
		maxBytes = DefaultReplayMaxBytes
	}
	if maxTime <= 0 {
		maxTime = DefaultReplayMaxTime
	}
	maxMessage := r.MaxMessageBytes
	if maxMessage <= 0 {
		maxMessage = DefaultMaxMessageBytes
	}
	ep, err := dialEndpoint(r.Endpoint, true)
	if err != nil {
		return nil, false, fmt.Errorf("replay: %w", err)
	}

	sctx, cancel := context.WithCancel(withConnLimits(ctx,
		connLimits{maxMessageBytes: maxMessage, refused: &r.stats.oversized}))
	defer cancel()
	// A fresh DEALER per request with zmq4's random identity: a reused fixed
	// identity collides in the engines' ROUTER (no ROUTER_HANDOVER).
	dealer := zmq4.NewDealer(sctx,
		zmq4.WithLogger(slog.NewLogLogger(log.Handler(), slog.LevelDebug)),
		zmq4.WithDialerMaxRetries(0),
		zmq4.WithDialerTimeout(per),
		zmq4.WithTimeout(per))

	if err := dialBounded(ctx, cancel, dealer, ep, r.Endpoint, per); err != nil {
		closeAndDrain(dealer)
		return nil, false, fmt.Errorf("replay from %s: %w", r.Endpoint, err)
	}

	start := make([]byte, 8)
	binary.BigEndian.PutUint64(start, from)
	if err := dealer.Send(zmq4.NewMsgFrom([]byte{}, start)); err != nil {
		closeAndDrain(dealer)
		return nil, false, fmt.Errorf("replay from %s: send request: %w", r.Endpoint, err)
	}

	replies := make(chan zmq4.Msg)
	recvErr := make(chan error, 1)
	go func() {
		for {
			m, err := dealer.Recv()
			if err != nil {
				recvErr <- err
				return
			}
			select {
			case replies <- m:
			case <-sctx.Done():
				recvErr <- sctx.Err()
				return
			}
		}
	}()
	defer func() {
		cancel()
		<-recvErr // the receiver has stopped calling Recv
		closeAndDrain(dealer)
	}()

	timer := time.NewTimer(per)
	defer timer.Stop()
	overall := time.NewTimer(maxTime)
	defer overall.Stop()
	var payloadBytes int64
	for {
		select {
		case m := <-replies:
			if m.Type == zmq4.CmdMsg {
				continue
			}
			msg, end, err := parseReply(m.Frames)
			if err != nil {
				return msgs, false, fmt.Errorf("replay from %s: reply %d: %w", r.Endpoint, len(msgs), err)
			}
			if end {
				return msgs, true, nil
			}
			switch {
			case msg.Seq < from || (len(msgs) > 0 && msg.Seq <= msgs[len(msgs)-1].Seq):
				r.stats.outOfRange.Add(1)
				prev := "none"
				if len(msgs) > 0 {
					prev = fmt.Sprint(msgs[len(msgs)-1].Seq)
				}
				return msgs, false, fmt.Errorf("replay from %s: %w: reply %d has sequence %d, asked from %d, previous %s",
					r.Endpoint, ErrReplayOutOfBounds, len(msgs), msg.Seq, from, prev)
			case len(msgs) == maxReplies:
				r.stats.tooMany.Add(1)
				return msgs, false, fmt.Errorf("replay from %s: %w: more than %d replies (the engine's ring is smaller)",
					r.Endpoint, ErrReplayOutOfBounds, maxReplies)
			}
			payloadBytes += int64(len(msg.Payload))
			msgs = append(msgs, msg)
			if len(msgs) == limit {
				return msgs, true, nil
			}
			if payloadBytes >= maxBytes {
				r.stats.tooBig.Add(1)
				log.Warn("replay cut at its byte limit; the rest may be asked for again", "from", from,
					"received", len(msgs), "bytes", payloadBytes, "limit", maxBytes)
				return msgs, false, nil
			}
			timer.Reset(per)
		case <-overall.C:
			r.stats.tooLong.Add(1)
			log.Warn("replay cut at its time limit; the rest may be asked for again", "from", from,
				"received", len(msgs), "limit", maxTime)
			return msgs, false, nil
		case <-timer.C:
			log.Warn("replay incomplete: no reply in time", "from", from, "received", len(msgs), "timeout", per)
			return msgs, false, nil
		case err := <-recvErr:
			recvErr <- err // for the deferred wait
			return msgs, false, fmt.Errorf("replay from %s: connection: %w", r.Endpoint, err)
		case <-ctx.Done():
			return msgs, false, ctx.Err()
		}
	}
}

// parseReply reads one reply as a DEALER sees it: ["", seq, payload] from
// SGLang, TokenSpeed and older vLLM, or ["", topic, seq, payload] from vLLM
// after #45177. The end marker has FF×8 in the seq position; an empty last
// frame also ends the stream (old vLLM subscribers' test), since no engine
// sends an empty payload.
func parseReply(frames [][]byte) (Message, bool, error) {
	var topic, seqFrame, payload []byte
	switch len(frames) {
	case 3:
		seqFrame, payload = frames[1], frames[2]
	case 4:
		topic, seqFrame, payload = frames[1], frames[2], frames[3]
	default:
		return Message{}, false, fmt.Errorf("%d frames, want 3 or 4", len(frames))
	}
	if len(frames[0]) != 0 {
		return Message{}, false, fmt.Errorf("first frame is %d bytes, want the empty delimiter", len(frames[0]))
	}
	if bytes.Equal(seqFrame, endSeq) || len(payload) == 0 {
		return Message{}, true, nil
	}
	if len(seqFrame) != 8 {
		return Message{}, false, fmt.Errorf("sequence frame is %d bytes, want 8", len(seqFrame))
	}
	return Message{Seq: binary.BigEndian.Uint64(seqFrame), Topic: topic, Payload: payload}, false, nil
}
