package natsevents

import (
	"context"
	"sync"
	"time"
)

// claimQueue holds announcements waiting for the stream's check
// (streamCheck.verify): the newest per sink token, at most
// maxPendingClaims tokens, checked in rounds by run. The Source's liveness
// tracker and the MemberWatcher each keep one.
type claimQueue[C any] struct {
	mu      sync.Mutex
	pending map[string]C
	kick    chan struct{}
}

func newClaimQueue[C any]() *claimQueue[C] {
	return &claimQueue[C]{pending: map[string]C{}, kick: make(chan struct{}, 1)}
}

// verifyTimeout bounds one look-up of the stream.
const verifyTimeout = 5 * time.Second

// offer queues c as token's newest claim and wakes run; false, and c not
// queued, when maxPendingClaims other tokens are waiting.
func (q *claimQueue[C]) offer(token string, c C) bool {
	q.mu.Lock()
	_, waiting := q.pending[token]
	full := !waiting && len(q.pending) >= maxPendingClaims
	if !full {
		q.pending[token] = c
	}
	q.mu.Unlock()
	if full {
		return false
	}
	select {
	case q.kick <- struct{}{}:
	default:
	}
	return true
}

// run checks the waiting claims until ctx ends, in rounds at most every
// verifyEvery: verify each (within verifyTimeout), then settle it with
// the result. A settle that returns false ends the round early (the
// stream cannot be asked); the claims not reached are dropped, their
// sinks announce again.
func (q *claimQueue[C]) run(ctx context.Context, verify func(ctx context.Context, token string, c C) (reason string, err error),
	settle func(token string, c C, reason string, err error) (more bool)) {
	for {
		select {
		case <-ctx.Done():
			return
		case <-q.kick:
		}
		q.mu.Lock()
		claims := q.pending
		q.pending = make(map[string]C, len(claims))
		q.mu.Unlock()
		for token, c := range claims {
			vctx, cancel := context.WithTimeout(ctx, verifyTimeout)
			reason, err := verify(vctx, token, c)
			cancel()
			if ctx.Err() != nil {
				return
			}
			if !settle(token, c, reason, err) {
				break
			}
		}
		if !sleep(ctx, verifyEvery) {
			return
		}
	}
}
