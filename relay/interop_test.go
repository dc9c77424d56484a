package relay

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrelay/kvrelay/engines"
	"github.com/kvrelay/kvrelay/engines/sglang"
	"github.com/kvrelay/kvrelay/proto/kvpb"
	"github.com/kvrelay/kvrelay/testkit/enginepeer"
)

// The relay over real libzmq sockets: a pyzmq SGLang publisher with two DP
// ranks (startup clear, replay ROUTER), live drops filled from the replay, a
// replay truncated at the "HWM" and resumed, and a restart ending the stream.
func TestRelayFollowsARealSGLangPublisherOverZeroMQ(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a Python peer")
	}
	peer := enginepeer.Start(t, enginepeer.Options{Engine: enginepeer.SGLang, DPSize: 2})
	r, err := New(Config{
		Engine:        sglang.Engine,
		KV:            engines.Config{Enabled: true, Endpoint: peer.PubEndpoint(0), ReplayEndpoint: peer.ReplayEndpoint(0)},
		DPSize:        2,
		ReplayTimeout: 300 * time.Millisecond,
		PrimeRetry:    50 * time.Millisecond,
		Logger:        quietLogger(),
		Registerer:    prometheus.NewRegistry(),
	})
	if err != nil {
		t.Fatal(err)
	}
	l := runRelay(t, r)
	l.waitFor("both ranks connected", r.Ready)

	hash := func(rank, i int) enginepeer.Hash { return enginepeer.I64(int64(rank*1_000_000 + i)) }
	publish := func(rank, i int) uint64 {
		t.Helper()
		pub, err := peer.Publish(rank, enginepeer.Stored(nil, []int64{int64(i), int64(i + 1)}, hash(rank, i)))
		if err != nil {
			t.Fatal(err)
		}
		return pub.Seq
	}
	// A few batches per rank; the first ones may miss the SUB (slow
	// joiner) and are then recovered from the replay.
	var last [2]uint64
	for i := 1; i <= 5; i++ {
		for rank := 0; rank < 2; rank++ {
			last[rank] = publish(rank, i)
		}
	}
	l.cursor(0, last[0])
	l.cursor(1, last[1])

	// Rank 1 loses three batches live; rank 0 loses five and its replay is
	// cut after two replies.
	if err := peer.DropNext(1, 3); err != nil {
		t.Fatal(err)
	}
	if err := peer.DropNext(0, 5); err != nil {
		t.Fatal(err)
	}
	if err := peer.TruncateReplay(0, 2); err != nil {
		t.Fatal(err)
	}
	for i := 6; i <= 11; i++ {
		for rank := 0; rank < 2; rank++ {
			last[rank] = publish(rank, i)
		}
	}
	l.cursor(0, last[0])
	l.cursor(1, last[1])

	st := r.Status()
	for _, rs := range st.Ranks {
		if rs.Holes != 0 || rs.UnknownBefore != 0 || *rs.WindowFirst != 0 {
			t.Fatalf("rank %d: %+v", rs.Rank, rs)
		}
	}
	if st.RecordBlocks != 22 {
		t.Fatalf("record blocks %d, want 22", st.RecordBlocks)
	}

	// Every rank's window is complete from its startup clear: cursor 0 gets
	// the whole log, each rank contiguous from 0.
	s := l.subscribe(0)
	want := [2]uint64{}
	for n := 0; n < int(last[0]+last[1]+2); n++ {
		b := next(t, s)
		rank := b.GetDpRank()
		if b.GetSequenceNumber() != want[rank] {
			t.Fatalf("rank %d: sequence %d, want %d", rank, b.GetSequenceNumber(), want[rank])
		}
		want[rank]++
	}
	if got := counter(r.metrics.replays.WithLabelValues("0", "truncated")); got < 1 {
		t.Errorf("rank 0's truncated replays %v, want at least one", got)
	}

	// A restart of rank 1 ends the stream with data loss. The SUB has to
	// reconnect to the new PUB first, so publish until the relay notices.
	if err := peer.Restart(1); err != nil {
		t.Fatal(err)
	}
	// Publish only while the new sequences stay below the old cursor (one
	// the relay reads as the next of the old incarnation is no restart to
	// anyone); if the relay saw none of them, its catch-up replay finds the
	// restart.
	old, newSeq := last[1], uint64(0) // SGLang's startup clear is 0
	deadline := time.Now().Add(30 * time.Second)
	for i := 100; ; i++ {
		if time.Now().After(deadline) {
			t.Fatalf("no data loss after rank 1's restart (new sequence %d, old %d): %+v", newSeq, old, r.Status().Ranks[1])
		}
		if newSeq+3 < old {
			newSeq = publish(1, i)
		}
		nctx, ncancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
		_, err := s.Next(nctx)
		ncancel()
		if errors.Is(err, ErrDataLoss) {
			break
		}
		if err != nil && !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("after rank 1's restart: %v", err)
		}
	}
	// The log was cleared: rank 0's newest batch is no longer in it, so its
	// cursor alone cannot say what the client holds of rank 1's new
	// incarnation; it is refused (issue 14.1), and the client comes back
	// from zero, as it does after the DATA_LOSS anyway.
	resumed, err := r.Subscribe(context.Background(), &kvpb.SubscribeKvEventsRequest{StartSequenceNumber: last[0]})
	if !errors.Is(err, ErrOutOfRange) {
		if err == nil {
			resumed.Close()
		}
		t.Fatalf("rank 0's newest cursor after the log was cleared: %v, want ErrOutOfRange", err)
	}
}
