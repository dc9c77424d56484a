package zmqsource

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"log/slog"
	"time"

	"github.com/go-zeromq/zmq4"
)

// endSeq is the replay end marker, (-1).to_bytes(8, "big", signed=True).
var endSeq = []byte{0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff}

// Replayer asks an engine rank's replay ROUTER for buffered batches.
type Replayer struct {
	Endpoint string // connect endpoint of the rank's ROUTER
	// PerReply bounds the wait for each reply, and for the connection
	// (default 5 s, as smg's relays).
	PerReply time.Duration
	Logger   *slog.Logger // default slog.Default()
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
// A non-nil error means the ROUTER could not be reached, the connection
// broke, or a reply was malformed; msgs still holds the replies received
// before that. ctx ending returns ctx.Err() the same way.
func (r *Replayer) Replay(ctx context.Context, from uint64) (msgs []Message, complete bool, err error) {
	per := r.PerReply
	if per <= 0 {
		per = 5 * time.Second
	}
	log := r.Logger
	if log == nil {
		log = slog.Default()
	}
	log = log.With("endpoint", r.Endpoint)
	ep, err := dialEndpoint(r.Endpoint, true)
	if err != nil {
		return nil, false, fmt.Errorf("replay: %w", err)
	}

	sctx, cancel := context.WithCancel(ctx)
	defer cancel()
	// A fresh DEALER per request with zmq4's random identity: a reused fixed
	// identity collides in the engines' ROUTER (no ROUTER_HANDOVER).
	dealer := zmq4.NewDealer(sctx,
		zmq4.WithLogger(slog.NewLogLogger(log.Handler(), slog.LevelDebug)),
		zmq4.WithDialerMaxRetries(0),
		zmq4.WithDialerTimeout(per),
		zmq4.WithTimeout(per))

	if err := dialBounded(ctx, cancel, dealer, ep, per); err != nil {
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
			msgs = append(msgs, msg)
			timer.Reset(per)
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
