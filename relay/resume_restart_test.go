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
	"github.com/kvrelay/kvrelay/internal/enginepeer"
	"github.com/kvrelay/kvrelay/proto/kvpb"
)

// rankCursorClient is a subscriber that keeps state as SMG's gateway does:
// a cursor per rank, a batch at or below its rank's cursor dropped as stale,
// a clear resetting the batch's rank, and on OUT_OF_RANGE everything reset
// and a new subscription from zero. blocks counts the stored copies of each
// rank's hashes.
type rankCursorClient struct {
	cursor map[int32]uint64
	seen   map[int32]bool
	blocks map[int32]map[int64]int
	stale  int
}

func newRankCursorClient() *rankCursorClient {
	c := &rankCursorClient{}
	c.reset()
	return c
}

func (c *rankCursorClient) reset() {
	c.cursor, c.seen, c.blocks = map[int32]uint64{}, map[int32]bool{}, map[int32]map[int64]int{}
}

func (c *rankCursorClient) apply(b *kvpb.KvEventBatch) {
	rank := b.GetDpRank()
	if c.seen[rank] && b.GetSequenceNumber() <= c.cursor[rank] {
		c.stale++
		return
	}
	c.seen[rank], c.cursor[rank] = true, b.GetSequenceNumber()
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
	zmq := zmqTransport(kv.Topic, kv.HWM, quietLogger())
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
// does. With rank 1 primed first, its batches 375..449 sit before rank 0's
// batch 374 in the new log, and serving what follows 374 skipped them: the
// cursor must be refused instead (the reader then comes back from zero).
// With rank 0 primed first, every rank-1 batch follows 374 and the cursor
// is served. Either way the reader ends with the exact live set. On the
// relay that served it, the same cursor is honoured and repeats only rank-1
// batches the reader drops as stale.
func TestARank0CursorAfterARelayRestartNeverSkipsAnotherRanksBatches(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a Python peer")
	}
	for _, tc := range []struct {
		first, later int32
		wantRefused  bool
	}{
		{first: 1, later: 0, wantRefused: true},
		{first: 0, later: 1, wantRefused: false},
	} {
		t.Run(fmt.Sprintf("rank %d primes first", tc.first), func(t *testing.T) {
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

			// On the same relay, rank 0's cursor is honoured: the rank-1
			// batches after rank 0's 374 in the log come again, and a
			// reader with per-rank cursors drops them as stale.
			same := newRankCursorClient()
			sameSub := l1.subscribe(0)
			same.readUntil(t, sameSub, at374)
			sameSub.Close()
			resumed := l1.subscribe(at374[0])
			more := publish(10)
			same.readUntil(t, resumed, more)
			resumed.Close()
			same.exactAgainst(t, more)
			if same.stale == 0 {
				t.Fatalf("the same-relay resume repeated no rank-1 batch; this test's log order was to make it repeat some")
			}
			stop1()

			// kill: the engine moves on while no relay runs.
			last := publish(75)
			gate := make(chan struct{})
			r2, _ := startRelayOn(t, peer, tc.later, gate)
			l2 := &lab{t: t, r: r2}
			l2.cursor(tc.first, last[tc.first])
			close(gate)
			l2.cursor(tc.later, last[tc.later])

			s2, err := r2.Subscribe(context.Background(), &kvpb.SubscribeKvEventsRequest{StartSequenceNumber: reader.cursor[0]})
			switch {
			case tc.wantRefused && !errors.Is(err, ErrOutOfRange):
				t.Fatalf("rank 0's cursor %d after rank 1 primed first: got %v, want ErrOutOfRange", reader.cursor[0], err)
			case !tc.wantRefused && err != nil:
				t.Fatalf("rank 0's cursor %d after rank 0 primed first: %v", reader.cursor[0], err)
			case err != nil:
				reader.reset()
				s2 = l2.subscribe(0)
			}
			t.Cleanup(s2.Close)
			reader.readUntil(t, s2, last)
			reader.exactAgainst(t, last)
		})
	}
}
