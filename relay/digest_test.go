package relay

import (
	"context"
	"testing"

	"github.com/kvrelay/kvrelay/internal/livedigest"
	"github.com/kvrelay/kvrelay/proto/kvpb"
)

// A subscriber that asks for live digests gets, on every relayed batch
// (history and live), its rank's digest right after that batch, equal to
// the sum over what the batches so far left live; one that does not ask
// gets the engine's batches unchanged.
func TestLiveDigestsRideOnEveryBatchForASubscriberThatAsks(t *testing.T) {
	l := newLab(t, labOpts{ranks: 2})
	l.interleave("0 1") // stores 0 (rank 0) and 1000 (rank 1)
	asks, err := l.r.Subscribe(context.Background(), &kvpb.SubscribeKvEventsRequest{LiveDigests: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(asks.Close)
	plain := l.subscribe(0)
	l.pubs[0].publish(payload(0, stored(-1, 7), removed(0)))
	want := map[int32][]uint64{ // per rank, the digest after each of its batches
		0: {livedigest.Block(0, livedigest.TierDevice), livedigest.Block(7, livedigest.TierDevice)},
		1: {livedigest.Block(1000, livedigest.TierDevice)},
	}
	seen := map[int32]int{}
	for range 3 {
		b := next(t, asks)
		rank := b.GetDpRank()
		if b.LiveDigest == nil || b.GetLiveDigest() != want[rank][seen[rank]] || b.GetLiveBlocks() != 1 {
			t.Fatalf("%s: digest %v over %v, want %x over 1", describe(b), b.LiveDigest, b.LiveBlocks, want[rank][seen[rank]])
		}
		seen[rank]++
		if p := next(t, plain); p.LiveDigest != nil || p.LiveBlocks != nil {
			t.Fatalf("%s: a subscriber that did not ask got a digest", describe(p))
		}
	}
}
