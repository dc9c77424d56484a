package gateway

import (
	"slices"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"

	"github.com/kvrelay/kvrelay/gateway/index"
	"github.com/kvrelay/kvrelay/proto/kvpb"
	"github.com/kvrelay/kvrelay/sim"
)

// Issue 14.4's drill: a simulated two-rank vLLM engine behind a real relay
// and gRPC server, our gateway following it with live digests on. While
// everything is exact no divergence is counted (genuine second copies and
// evictions included). Then one index entry is corrupted behind the
// monitor's back (a block stored in the index only, on rank 1): the
// next batch of that rank whose digest is compared reveals it, the rank is
// named, the worker is cleared and resynced from a snapshot, and the index
// is exact again.
func TestACorruptedIndexEntryIsCaughtByTheDigestAndHealed(t *testing.T) {
	e := startRelayedEngine(t, 2)
	g, reg, _ := startGatewayAt(t, e.addr)
	engines := map[string]*sim.Engine{"P": e.eng}
	workload(t, e.eng, 60)
	assertExact(t, g, engines, "before the drill")
	// Let a few digest comparisons happen on healthy state.
	for i := 0; i < 3; i++ {
		workload(t, e.eng, 10)
		assertExact(t, g, engines, "healthy")
	}
	if n := counterWith(t, reg, "kvrelay_gateway_digest_divergences_total", nil); n != 0 {
		t.Fatalf("%g divergences while the index was exact", n)
	}

	// A phantom: a block the engine never held, stored in the index only
	// (an eviction of a real block would be healed by the engine's own
	// later removal of it under this churn).
	ix := g.models["llama"].ix
	const phantom = 0x7e57_0000_0000_0001
	toks := make([]uint32, 16)
	for i := range toks {
		toks[i] = uint32(700_000 + i)
	}
	ix.Apply("P", &kvpb.KvEventBatch{DpRank: proto.Int32(1), Events: []*kvpb.KvCacheEvent{{
		Data: &kvpb.KvCacheEvent_Stored{Stored: &kvpb.KvBlocksStored{Blocks: []*kvpb.KvBlock{{BlockHash: phantom, TokenIds: toks, BlockSize: 16}}}},
	}}})
	if !slices.ContainsFunc(ix.LiveSet("P"), func(b index.LiveBlock) bool { return b.EngineHash == phantom }) {
		t.Fatalf("the drill's phantom block did not reach the index")
	}

	deadline := time.Now().Add(waitFor)
	for counterWith(t, reg, "kvrelay_gateway_digest_divergences_total", map[string]string{"rank": "1"}) == 0 {
		if time.Now().After(deadline) {
			t.Fatalf("the phantom block on rank 1 was never caught")
		}
		workload(t, e.eng, 2)
	}
	if n := counterWith(t, reg, "kvrelay_gateway_digest_divergences_total", map[string]string{"rank": "0"}); n != 0 {
		t.Errorf("rank 0 counted %g divergences; only rank 1 was corrupted", n)
	}
	// The resync is counted just after the divergence, on the monitor's
	// goroutine.
	for counterWith(t, reg, "kvrelay_gateway_resyncs_total", map[string]string{"reason": "digest"}) == 0 {
		if time.Now().After(deadline) {
			t.Fatalf("the divergence was counted but no resync followed")
		}
		time.Sleep(time.Millisecond)
	}
	workload(t, e.eng, 5)
	assertExact(t, g, engines, "after the resync")
	if n := counterWith(t, reg, "kvrelay_gateway_resyncs_total", map[string]string{"reason": "digest"}); n != 1 {
		t.Errorf("kvrelay_gateway_resyncs_total{reason=digest} = %g, want 1", n)
	}
}
