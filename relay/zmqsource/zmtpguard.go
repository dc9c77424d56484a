package zmqsource

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
)

// DefaultMaxMessageBytes is the largest ZeroMQ message (all frames together)
// and frame accepted from an engine. The largest real batch is one vLLM step
// storing blocks for every token it scheduled: with 2 M tokens in one step
// (a long-context prefill far beyond today's usual max_num_batched_tokens),
// the token ids take up to 5 bytes each in msgpack (10 MB) and 125 k blocks
// of 16 tokens add a hash each (32-byte hashes: 4.3 MB), about 16 MB in all.
// 64 MiB leaves four times that.
const DefaultMaxMessageBytes int64 = 64 << 20

// maxFramesPerMessage bounds how many frames one message may have. Engines
// send 3 (live, old replay) or 4 (vLLM's replay with a topic); zmq4 keeps a
// slice entry per frame, so empty frames would otherwise cost memory for no
// bytes of the limit.
const maxFramesPerMessage = 64

// zmtpGreetingBytes is the fixed size of a ZMTP 3.x greeting.
const zmtpGreetingBytes = 64

// ErrMessageTooLarge is wrapped by the error a connection fails with when
// its peer declares a frame or a message over the limit.
var ErrMessageTooLarge = errors.New("zmq message over the size limit")

// connLimits travel to the guarded transport in the context a socket is
// made with: zmq4's transports are registered once per process, so a
// per-socket setting cannot reach them any other way.
type connLimits struct {
	maxMessageBytes int64
	refused         *atomic.Uint64 // connections closed for a message over the limit
}

type connLimitsKey struct{}

func withConnLimits(ctx context.Context, l connLimits) context.Context {
	return context.WithValue(ctx, connLimitsKey{}, l)
}

func connLimitsFrom(ctx context.Context) connLimits {
	if l, ok := ctx.Value(connLimitsKey{}).(connLimits); ok && l.maxMessageBytes > 0 {
		return l
	}
	return connLimits{maxMessageBytes: DefaultMaxMessageBytes}
}

// zmtpGuard follows the ZMTP 3.x byte stream a peer sends (the 64-byte
// greeting, then frames: a flags byte, a 1- or 8-byte size, the body) as
// zmq4 reads it, and fails the read that completes a frame header whose
// size, or whose message's running total, is over the limit. zmq4 needs the
// whole header before it allocates the body, so it never sees such a size.
type zmtpGuard struct {
	peer   string // the endpoint, for the error
	limits connLimits

	greeting  int    // greeting bytes still to pass
	sizeLeft  int    // size bytes of the current header still to read; 0: at a flags byte or in a body
	inHeader  bool   // a flags byte was read and its size is being read
	flags     byte   // of the current frame
	size      uint64 // being assembled
	bodyLeft  uint64 // body bytes of the current frame still to pass
	msgBytes  uint64 // frames of the current message so far
	msgFrames int
	err       error // sticky: the connection is done
}

const (
	flagMore    = 0x01
	flagLong    = 0x02
	flagCommand = 0x04
)

func newZMTPGuard(peer string, limits connLimits) *zmtpGuard {
	return &zmtpGuard{peer: peer, limits: limits, greeting: zmtpGreetingBytes}
}

// observe follows b, the next bytes of the stream, and reports an error if
// they complete a header over the limit.
func (g *zmtpGuard) observe(b []byte) error {
	if g.err != nil {
		return g.err
	}
	for len(b) > 0 {
		switch {
		case g.greeting > 0:
			n := min(g.greeting, len(b))
			g.greeting -= n
			b = b[n:]
		case g.bodyLeft > 0:
			n := min(g.bodyLeft, uint64(len(b)))
			g.bodyLeft -= n
			b = b[n:]
		case !g.inHeader:
			g.flags = b[0]
			b = b[1:]
			g.inHeader, g.size = true, 0
			g.sizeLeft = 1
			if g.flags&flagLong != 0 {
				g.sizeLeft = 8
			}
		default:
			g.size = g.size<<8 | uint64(b[0])
			b = b[1:]
			g.sizeLeft--
			if g.sizeLeft == 0 {
				g.inHeader = false
				if err := g.frame(); err != nil {
					g.err = err
					return err
				}
			}
		}
	}
	return nil
}

// frame checks a complete frame header.
func (g *zmtpGuard) frame() error {
	max := uint64(g.limits.maxMessageBytes)
	g.msgFrames++
	g.msgBytes += min(g.size, max+1) // no overflow: both terms are at most max+1
	switch {
	case g.size > max:
		return g.refuse(fmt.Errorf("%w: %s declared a frame of %d bytes, over the %d-byte limit",
			ErrMessageTooLarge, g.peer, g.size, max))
	case g.msgBytes > max:
		return g.refuse(fmt.Errorf("%w: %s sent a message of at least %d bytes in %d frames, over the %d-byte limit",
			ErrMessageTooLarge, g.peer, g.msgBytes, g.msgFrames, max))
	case g.msgFrames > maxFramesPerMessage:
		return g.refuse(fmt.Errorf("%w: %s sent a message of more than %d frames",
			ErrMessageTooLarge, g.peer, maxFramesPerMessage))
	}
	g.bodyLeft = g.size
	if g.flags&flagMore == 0 || g.flags&flagCommand != 0 {
		g.msgBytes, g.msgFrames = 0, 0 // the message ends with this frame
	}
	return nil
}

func (g *zmtpGuard) refuse(err error) error {
	if g.limits.refused != nil {
		g.limits.refused.Add(1)
	}
	return err
}
