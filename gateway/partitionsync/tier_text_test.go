package partitionsync_test

import (
	"fmt"
	"maps"
	"math/rand/v2"
	"strings"
	"testing"
	"time"

	"github.com/kvrelay/kvrelay/gateway"
	"github.com/kvrelay/kvrelay/gateway/picker"
	"github.com/kvrelay/kvrelay/testkit/testnats"
)

// textPickerConfig is pickerConfig with an overlap decay strong enough
// for a backlog of a few dozen tokens to send a text request (64-byte
// blocks, a few per request) past its deepest placement.
var textPickerConfig = picker.Config{OverlapDecay: 4, OverloadTokenUsage: 0.9, BalanceTokenUsage: 0.9}

// capture is a placement publisher keeping the hashes it is given.
type capture struct{ hashes []uint64 }

func (c *capture) PublishPlacement(_, _ string, hashes []uint64) { c.hashes = hashes }

// textHashes returns text's placement hashes, as a route publishes them
// (from a gateway of its own, so no replica's placements change).
func textHashes(t *testing.T, ids []string, text string) []uint64 {
	t.Helper()
	g, err := gateway.New(gateway.Config{Workers: []gateway.Worker{{ID: ids[0], Addr: ids[0][len("grpc://"):]}}})
	if err != nil {
		t.Fatal(err)
	}
	c := &capture{}
	g.SetPlacementPublisher(c)
	if _, err := g.Route(gateway.RouteRequest{Text: text}); err != nil {
		t.Fatal(err)
	}
	if len(c.hashes) != len(text)/gateway.TextBlockBytes {
		t.Fatalf("%d hashes published for %d bytes of text", len(c.hashes), len(text))
	}
	return c.hashes
}

// startPlacementReplica is startReplica with placements on (text routes
// rest on them).
func startPlacementReplica(t *testing.T, natsURL, prefix string, ids []string, parts, own int) *replica {
	t.Helper()
	return startReplicaWith(t, natsURL, prefix, ids, parts, own, 10*time.Second, gateway.Config{Picker: textPickerConfig})
}

// TestTierTextRoutesAsAFullReplica: with placements on, text requests
// (no token ids) on a 4-partition tier's replicas are routed as the full
// replica routes them: same worker, reason and placement overlaps. The
// picker reads the engines' loads (overlap decay), which only the other
// partitions' answers bring, so a text route that asked no other
// partition (review finding 1) chose differently. Each request goes to
// the full replica and to every tier replica, so their placements (each
// records the blocks it routes) stay the same.
func TestTierTextRoutesAsAFullReplica(t *testing.T) {
	ns := testnats.Start(t, testnats.Config{NoJetStream: true})
	fleet, ids := startFleet(t, 12)
	rng := rand.New(rand.NewPCG(31, 4))
	full := startPlacementReplica(t, "", "", ids, 1, 0)
	tier := make([]*replica, 4)
	for p := range tier {
		tier[p] = startPlacementReplica(t, ns.URL(), "text", ids, 4, p)
	}
	tokenDocs := makeDocs(rng, 3)
	for _, w := range fleet {
		w.serve(t, rng, tokenDocs, 4) // so that the streams carry loads
	}
	eventually(t, "every worker's blocks and load on the full replica and its owner", settled(full, tier, fleet))
	// Each shared document is placed, as other replicas would have shared
	// it, on three workers at different depths, the same on every replica:
	// which holder a request goes to then rests on the engines' backlogs.
	all := append([]*replica{full}, tier...)
	docs := make([]string, 6)
	for d := range docs {
		docs[d] = strings.Repeat(fmt.Sprintf("document %d, a shared system prompt. ", d), 8)[:4*gateway.TextBlockBytes]
		hs := textHashes(t, ids, docs[d])
		for k, i := range rng.Perm(len(ids))[:3] {
			for _, r := range all {
				if err := r.gw.ApplyPlacement(gateway.DefaultModel, "peer", ids[i], hs[:len(hs)-k]); err != nil {
					t.Fatal(err)
				}
			}
		}
	}
	reasons := map[picker.Reason]int{}
	steered := 0
	const n = 60
	for i := range n {
		sameLoads(t, rng, ids, all...)
		req := gateway.RouteRequest{Text: docs[rng.IntN(len(docs))] + strings.Repeat(fmt.Sprintf("question %d: %x. ", i, rng.Uint64()), 1+rng.IntN(4))}
		want, err := full.gw.Route(req)
		if err != nil {
			t.Fatal(err)
		}
		for _, r := range tier {
			got, err := r.gw.Route(req)
			if err != nil {
				t.Fatal(err)
			}
			if got.Worker != want.Worker || got.Reason != want.Reason || got.RequestBlocks != want.RequestBlocks || !maps.Equal(got.MatchedBlocks, want.MatchedBlocks) {
				t.Fatalf("text request %d on %s: %s (%s, matched %v); the full replica: %s (%s, matched %v)",
					i, r.name, got.Worker, got.Reason, got.MatchedBlocks, want.Worker, want.Reason, want.MatchedBlocks)
			}
		}
		reasons[want.Reason]++
		best := 0
		for _, b := range want.MatchedBlocks {
			best = max(best, b)
		}
		if want.MatchedBlocks[want.Worker] < best {
			steered++
		}
	}
	t.Logf("%d text requests routed alike on the full replica and 4 partitions; reasons %v; %d past the deepest placement (loads)", n, reasons, steered)
	// The check is only as strong as the traffic: placements must be hit,
	// and loads must steer some.
	if reasons[picker.ReasonPlacementHit] < n/2 || steered == 0 {
		t.Fatalf("reasons %v, %d steered by load: the check is too weak", reasons, steered)
	}
	for _, r := range tier {
		if m := missing(t, r); m != 0 {
			t.Errorf("%s: %v partitions missing from its routes", r.name, m)
		}
	}
}
