package relay

import (
	"context"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"time"
)

// dupInjector wraps the relay's real ZeroMQ transport and re-delivers some
// messages: a live batch handed to the relay a second time right behind
// itself (what a duplicate send looks like on the wire), and a replay reply
// repeated inside the answer. It changes nothing else; it is a fault
// injector, not a stand-in for the sockets.
type dupInjector struct {
	seed     uint64
	liveOdds int // one live batch in liveOdds is delivered twice (0: never)
	replOdds int // one replay reply in replOdds is repeated (0: never)

	live, replies atomic.Uint64 // duplicates injected

	mu    sync.Mutex
	feeds map[int32]*dupFeed
}

func (d *dupInjector) wrap(inner Transport) Transport {
	return func(rank int32, endpoint, replayEndpoint string, timeout time.Duration) (Feed, Replayer, error) {
		feed, rep, err := inner(rank, endpoint, replayEndpoint, timeout)
		if err != nil {
			return nil, nil, err
		}
		f := &dupFeed{Feed: feed, d: d, rng: rand.New(rand.NewPCG(d.seed, uint64(rank)))}
		d.mu.Lock()
		if d.feeds == nil {
			d.feeds = map[int32]*dupFeed{}
		}
		d.feeds[rank] = f
		d.mu.Unlock()
		if rep == nil {
			return f, nil, nil
		}
		return f, &dupReplayer{inner: rep, d: d, rng: rand.New(rand.NewPCG(d.seed, 1000+uint64(rank)))}, nil
	}
}

// reconnects reports how often rank's real subscriber reconnected.
func (d *dupInjector) reconnects(rank int32) uint64 {
	d.mu.Lock()
	f := d.feeds[rank]
	d.mu.Unlock()
	if f == nil {
		return 0
	}
	if z, ok := f.Feed.(zmqFeed); ok {
		return z.s.Stats().Reconnects
	}
	return 0
}

// dupFeed is only ever read by its rank's reader goroutine.
type dupFeed struct {
	Feed
	d       *dupInjector
	rng     *rand.Rand
	pending *Message
}

func (f *dupFeed) Recv(ctx context.Context) (Message, error) {
	if m := f.pending; m != nil {
		f.pending = nil
		f.d.live.Add(1)
		return *m, nil
	}
	m, err := f.Feed.Recv(ctx)
	if err == nil && f.d.liveOdds > 0 && f.rng.IntN(f.d.liveOdds) == 0 {
		again := Message{Seq: m.Seq, Payload: append([]byte(nil), m.Payload...)}
		f.pending = &again
	}
	return m, err
}

// dupReplayer is called by one rank goroutine at a time.
type dupReplayer struct {
	inner Replayer
	d     *dupInjector
	rng   *rand.Rand
}

func (r *dupReplayer) Replay(ctx context.Context, from uint64) ([]Message, bool, error) {
	msgs, complete, err := r.inner.Replay(ctx, from)
	if r.d.replOdds == 0 || len(msgs) == 0 {
		return msgs, complete, err
	}
	out := make([]Message, 0, len(msgs)+2)
	for _, m := range msgs {
		out = append(out, m)
		if r.rng.IntN(r.d.replOdds) == 0 {
			out = append(out, m)
			r.d.replies.Add(1)
		}
	}
	return out, complete, err
}

// ReplayUpTo forwards to the real replayer, so the drill's stale checks
// take the path production takes; a head of n replies has nothing to
// duplicate within it that matters.
func (r *dupReplayer) ReplayUpTo(ctx context.Context, from uint64, n int) ([]Message, bool, error) {
	if h, ok := r.inner.(headReplayer); ok {
		return h.ReplayUpTo(ctx, from, n)
	}
	msgs, complete, err := r.inner.Replay(ctx, from)
	if len(msgs) >= n {
		return msgs[:n], true, err
	}
	return msgs, complete, err
}
