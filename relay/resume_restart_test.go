package relay

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrelay/kvrelay/engines"
	"github.com/kvrelay/kvrelay/engines/vllm"
	"github.com/kvrelay/kvrelay/proto/kvpb"
	"github.com/kvrelay/kvrelay/testkit/enginepeer"
)

// rankCursorClient is a subscriber that keeps state as SMG's gateway does
// (gateway-side.md §1.4): a cursor per rank; a batch at or below its rank's
// cursor is stale, except that the first batch of a rank on a new
// connection below the cursor, or a sequence 0 or 1 below it, reads as a
// restarted publisher and clears every rank's state; on OUT_OF_RANGE
// everything is reset and it subscribes from zero. blocks counts the stored
// copies of each rank's hashes.
type rankCursorClient struct {
	cursor   map[int32]uint64
	seen     map[int32]bool
	fresh    map[int32]bool
	blocks   map[int32]map[int64]int
	stale    int
	restarts int
}

func newRankCursorClient() *rankCursorClient {
	c := &rankCursorClient{}
	c.reset()
	return c
}

func (c *rankCursorClient) reset() {
	c.cursor, c.seen, c.fresh, c.blocks = map[int32]uint64{}, map[int32]bool{}, map[int32]bool{}, map[int32]map[int64]int{}
}

// connected marks every rank fresh, as a new subscription does.
func (c *rankCursorClient) connected() {
	for rank := range c.seen {
		c.fresh[rank] = true
	}
}

func (c *rankCursorClient) apply(b *kvpb.KvEventBatch) {
	rank, seq := b.GetDpRank(), b.GetSequenceNumber()
	fresh := c.fresh[rank]
	c.fresh[rank] = false
	if c.seen[rank] && seq <= c.cursor[rank] {
		if seq == c.cursor[rank] || !(fresh || seq <= 1) {
			c.stale++
			return
		}
		c.restarts++
		c.cursor, c.seen, c.blocks = map[int32]uint64{}, map[int32]bool{}, map[int32]map[int64]int{}
	}
	c.seen[rank], c.cursor[rank] = true, seq
	if c.blocks[rank] == nil {
		c.blocks[rank] = map[int64]int{}
	}
	for _, ev := range b.GetEvents() {
		switch {
		case ev.GetCleared() != nil:
			c.blocks[rank] = map[int64]int{}
		case ev.GetStored() != nil:
			for _, blk := range ev.GetStored().GetBlocks() {
				c.blocks[rank][blk.GetBlockHash()]++
			}
		case ev.GetRemoved() != nil:
			for _, h := range ev.GetRemoved().GetBlockHashes() {
				if c.blocks[rank][h]--; c.blocks[rank][h] <= 0 {
					delete(c.blocks[rank], h)
				}
			}
		}
	}
}

// resume subscribes with rank 0's cursor alone, as SMG's gateway does, and
// on ErrOutOfRange resets and subscribes from zero. It reports whether the
// cursor was refused.
func (c *rankCursorClient) resume(t *testing.T, r *Relay) (*Subscription, bool) {
	t.Helper()
	s, err := r.Subscribe(context.Background(), &kvpb.SubscribeKvEventsRequest{StartSequenceNumber: c.cursor[0]})
	refused := errors.Is(err, ErrOutOfRange)
	switch {
	case refused:
		c.reset()
		s, err = r.Subscribe(context.Background(), &kvpb.SubscribeKvEventsRequest{})
	case err == nil:
		c.connected()
	}
	if err != nil {
		t.Fatalf("resume at rank 0's cursor %d: %v", c.cursor[0], err)
	}
	t.Cleanup(s.Close)
	return s, refused
}

// readUntil applies s's batches until every rank's cursor reached last.
func (c *rankCursorClient) readUntil(t *testing.T, s *Subscription, last map[int32]uint64) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for {
		done := true
		for rank, seq := range last {
			done = done && c.seen[rank] && c.cursor[rank] >= seq
		}
		if done {
			return
		}
		b, err := s.Next(ctx)
		if err != nil {
			t.Fatalf("reading until %v (at %v): %v", last, c.cursor, err)
		}
		c.apply(b)
	}
}

// exactAgainst fails unless every rank holds exactly the blocks PublishMany
// stored for sequences 0..last (hash = seq+1).
func (c *rankCursorClient) exactAgainst(t *testing.T, last map[int32]uint64) {
	t.Helper()
	for rank, l := range last {
		var missing []int64
		for seq := uint64(0); seq <= l; seq++ {
			if c.blocks[rank][int64(seq+1)] != 1 {
				missing = append(missing, int64(seq+1))
			}
		}
		if len(missing) > 0 || len(c.blocks[rank]) != int(l+1) {
			t.Fatalf("rank %d holds %d blocks, want %d; not exactly once: %d hashes (first %v)",
				rank, len(c.blocks[rank]), l+1, len(missing), missing[:min(len(missing), 8)])
		}
	}
}

// gatedReplayer holds a rank's replays until gate closes, so that a test
// decides which rank primes first.
type gatedReplayer struct {
	Replayer
	gate <-chan struct{}
}

func (g gatedReplayer) Replay(ctx context.Context, from uint64) ([]Message, bool, error) {
	select {
	case <-g.gate:
	case <-ctx.Done():
		return nil, false, ctx.Err()
	}
	return g.Replayer.Replay(ctx, from)
}

// startRelayOn runs a two-rank vLLM relay on peer's sockets. With
// later >= 0, rank later's replays wait for gate.
func startRelayOn(t *testing.T, peer *enginepeer.Peer, later int32, gate <-chan struct{}) (*Relay, func()) {
	t.Helper()
	kv := engines.Config{Enabled: true, Endpoint: peer.PubEndpoint(0), ReplayEndpoint: peer.ReplayEndpoint(0)}
	zmq := zmqTransport(kv.Topic, kv.HWM, zmqLimits{}, quietLogger())
	r, err := New(Config{
		Engine:        vllm.Engine,
		KV:            kv,
		DPSize:        2,
		ReplayTimeout: 2 * time.Second,
		PrimeRetry:    50 * time.Millisecond,
		Logger:        quietLogger(),
		Registerer:    prometheus.NewRegistry(),
		Transport: func(rank int32, ep, rep string, timeout time.Duration) (Feed, Replayer, error) {
			f, rp, err := zmq(rank, ep, rep, timeout)
			if err == nil && rank == later && rp != nil {
				rp = gatedReplayer{Replayer: rp, gate: gate}
			}
			return f, rp, err
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	stopped := false
	stop := func() {
		if stopped {
			return
		}
		stopped = true
		cancel()
		if err := <-done; err != nil {
			t.Error(err)
		}
	}
	t.Cleanup(stop)
	return r, stop
}

// Issue 14.1. A reader at sequence 374 of both ranks; the relay is stopped
// and started again on the same sockets while the engine moves on to 449;
// the new relay primes both ranks from their replays, one before the
// other; the reader resumes with rank 0's cursor alone, as SMG's gateway
// does. With rank 1 primed first, its batches 375..449 sat before rank 0's
// batch 374 in the new log, and serving what follows 374 skipped them; with
// rank 0 primed first, rank 1 came again from 0, which SMG's gateway reads
// as a restart. The new relay cannot know what the reader holds of rank 1:
// it refuses the cursor in both orders, and the reader ends exact from zero.
func TestARank0CursorAfterARelayRestartIsRefusedWhicheverRankPrimesFirst(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a Python peer")
	}
	for _, first := range []int32{1, 0} {
		later := 1 - first
		t.Run(fmt.Sprintf("rank %d primes first", first), func(t *testing.T) {
			peer := enginepeer.Start(t, enginepeer.Options{Engine: enginepeer.VLLM, DPSize: 2})
			publish := func(count int) map[int32]uint64 {
				t.Helper()
				last := map[int32]uint64{}
				for rank := 0; rank < 2; rank++ {
					_, l, err := peer.PublishMany(rank, count, 0)
					if err != nil {
						t.Fatal(err)
					}
					last[int32(rank)] = l
				}
				return last
			}

			r1, stop1 := startRelayOn(t, peer, -1, nil)
			l1 := &lab{t: t, r: r1}
			l1.waitFor("both ranks connected", r1.Ready)
			at374 := publish(375)
			reader := newRankCursorClient()
			s := l1.subscribe(0)
			reader.readUntil(t, s, at374)
			s.Close()
			stop1()

			// kill: the engine moves on while no relay runs.
			last := publish(75)
			gate := make(chan struct{})
			r2, _ := startRelayOn(t, peer, later, gate)
			l2 := &lab{t: t, r: r2}
			l2.cursor(first, last[first])
			close(gate)
			l2.cursor(later, last[later])

			s2, refused := reader.resume(t, r2)
			if !refused {
				t.Errorf("rank 0's cursor %d after the restart was served; want ErrOutOfRange", at374[0])
			}
			reader.readUntil(t, s2, last)
			reader.exactAgainst(t, last)
		})
	}
}

// On the relay that served it, a rank-0 cursor is honoured when at most one
// batch of every other rank follows it in the log (the reader then holds it
// as its cursor, a stale repeat, or lacks it), and refused when more do
// (the reader may have applied several, and would read their repeat as a
// restart).
func TestARank0CursorOnTheSameRelayIsHonouredOnlyWhereNoOtherRankRepeats(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a Python peer")
	}
	peer := enginepeer.Start(t, enginepeer.Options{Engine: enginepeer.VLLM, DPSize: 2})
	r, _ := startRelayOn(t, peer, -1, nil)
	l := &lab{t: t, r: r}
	l.waitFor("both ranks connected", r.Ready)
	last := map[int32]uint64{}
	step := func(rank int32) { // one batch, in the relay's log before the next
		t.Helper()
		_, seq, err := peer.PublishMany(int(rank), 1, 0)
		if err != nil {
			t.Fatal(err)
		}
		last[rank] = seq
		l.cursor(rank, seq)
	}
	for i := 0; i < 20; i++ { // the ranks step together
		step(0)
		step(1)
	}
	lockstep := newRankCursorClient()
	s := l.subscribe(0)
	lockstep.readUntil(t, s, last)
	s.Close()
	// lockstep stopped at rank 0's 19 and rank 1's 19, one entry after
	// rank 0's.
	s, refused := lockstep.resume(t, r)
	if refused {
		t.Fatalf("the cursor of a reader at one rank-1 batch past rank 0's was refused")
	}
	step(0)
	lockstep.readUntil(t, s, last)
	lockstep.exactAgainst(t, last)
	if lockstep.restarts != 0 || lockstep.stale != 1 {
		t.Fatalf("lockstep resume: %d restarts, %d stale repeats; want 0 and 1 (rank 1's cursor)", lockstep.restarts, lockstep.stale)
	}

	// ahead stops at rank 0's 20 and rank 1's 21, two entries after rank 0's.
	ahead := newRankCursorClient()
	step(1)
	step(1)
	s = l.subscribe(0)
	ahead.readUntil(t, s, last)
	s.Close()
	s, refused = ahead.resume(t, r)
	if !refused {
		t.Fatalf("the cursor of a reader two rank-1 batches past rank 0's was served")
	}
	ahead.readUntil(t, s, last)
	ahead.exactAgainst(t, last)
}
