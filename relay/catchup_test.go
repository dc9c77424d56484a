package relay

import (
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrelay/kvrelay/engines"
	"github.com/kvrelay/kvrelay/engines/vllm"
	"github.com/kvrelay/kvrelay/testkit/enginepeer"
)

// startCatchUpLab runs a relay against a pyzmq vLLM peer with a short idle
// probe, so that the catch-up replay runs within the test.
func startCatchUpLab(t *testing.T) (*enginepeer.Peer, *Relay, *lab) {
	t.Helper()
	peer := enginepeer.Start(t, enginepeer.Options{Engine: enginepeer.VLLM})
	r, err := New(Config{
		Engine:        vllm.Engine,
		KV:            engines.Config{Enabled: true, Endpoint: peer.PubEndpoint(0), ReplayEndpoint: peer.ReplayEndpoint(0)},
		DPSize:        1,
		ReplayTimeout: time.Second,
		PrimeRetry:    50 * time.Millisecond,
		CatchUpDelay:  100 * time.Millisecond,
		IdleProbe:     300 * time.Millisecond,
		Logger:        quietLogger(),
		Registerer:    prometheus.NewRegistry(),
	})
	if err != nil {
		t.Fatal(err)
	}
	l := runRelay(t, r)
	l.waitFor("the rank to connect", r.Ready)
	return peer, r, l
}

// A batch the live stream lost, with no later batch to reveal the gap, is
// found by the idle catch-up replay: the engine's ring still holds it.
func TestAQuietRankCatchesUpABatchTheLiveStreamLost(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a Python peer")
	}
	peer, _, l := startCatchUpLab(t)
	for i := 0; i < 3; i++ {
		if _, err := peer.Publish(0, enginepeer.Stored(nil, []int64{1, 2}, enginepeer.U64(uint64(10+i)))); err != nil {
			t.Fatal(err)
		}
	}
	l.cursor(0, 2)
	if err := peer.DropNext(0, 1); err != nil {
		t.Fatal(err)
	}
	pub, err := peer.Publish(0, enginepeer.Stored(nil, []int64{3, 4}, enginepeer.U64(99)))
	if err != nil {
		t.Fatal(err)
	}
	if pub.Live || !pub.Buffered {
		t.Fatalf("the peer was to drop seq %d live and keep it for replay: %+v", pub.Seq, pub)
	}
	l.cursor(0, pub.Seq)
}

// A publisher that restarted and went quiet while the relay's feed was away
// is found by the catch-up replay (its ring no longer holds the relay's
// cursor), and the new incarnation is relayed from its start.
func TestARestartHiddenByQuietIsFoundByTheCatchUpReplay(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a Python peer")
	}
	peer, r, l := startCatchUpLab(t)
	for i := 0; i < 4; i++ {
		if _, err := peer.Publish(0, enginepeer.Stored(nil, []int64{1, 2}, enginepeer.U64(uint64(10+i)))); err != nil {
			t.Fatal(err)
		}
	}
	l.cursor(0, 3)
	if err := peer.Restart(0); err != nil {
		t.Fatal(err)
	}
	// The new incarnation's first batch never reaches the live stream.
	if err := peer.DropNext(0, 1); err != nil {
		t.Fatal(err)
	}
	if _, err := peer.Publish(0, enginepeer.Stored(nil, []int64{7, 8}, enginepeer.U64(77))); err != nil {
		t.Fatal(err)
	}
	l.waitFor("the restart to be detected and seq 0 of the new incarnation relayed", func() bool {
		st := r.Status()
		rs := st.Ranks[0]
		return rs.Restarts == 1 && rs.Cursor != nil && *rs.Cursor == 0 && st.RecordBlocks == 1
	})
}
