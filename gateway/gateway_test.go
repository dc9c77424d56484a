package gateway

import (
	"context"
	"errors"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"go.uber.org/goleak"
	"google.golang.org/grpc"

	"github.com/kvrelay/kvrelay/gateway/monitor"
	"github.com/kvrelay/kvrelay/gateway/picker"
	"github.com/kvrelay/kvrelay/proto/kvpb"
)

func TestMain(m *testing.M) {
	// zmq4's PUB socket leaves its writer goroutine behind on Close (the
	// simulated engines of the end-to-end test use one); it is not ours.
	goleak.VerifyTestMain(m, goleak.IgnoreAnyFunction("github.com/go-zeromq/zmq4.(*pubMWriter).run"))
}

const waitFor = 10 * time.Second

// engineServer is a real gRPC server on loopback that streams the batches
// the test pushes to whoever subscribes.
type engineServer struct {
	kvpb.UnimplementedVllmEngineServer
	addr    string
	batches chan *kvpb.KvEventBatch
	mu      sync.Mutex
	reqs    []*kvpb.SubscribeKvEventsRequest
	active  int // handlers running
}

// subscribers reports how many calls arrived and how many are still open.
func (e *engineServer) subscribers() (calls, active int) {
	e.mu.Lock()
	defer e.mu.Unlock()
	return len(e.reqs), e.active
}

func startEngine(t *testing.T) *engineServer {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	e := &engineServer{addr: lis.Addr().String(), batches: make(chan *kvpb.KvEventBatch, 64)}
	srv := grpc.NewServer()
	kvpb.RegisterVllmEngineServer(srv, e)
	go func() { _ = srv.Serve(lis) }()
	t.Cleanup(srv.Stop)
	return e
}

func (e *engineServer) SubscribeKvEvents(req *kvpb.SubscribeKvEventsRequest, stream grpc.ServerStreamingServer[kvpb.KvEventBatch]) error {
	e.mu.Lock()
	e.reqs = append(e.reqs, req)
	e.active++
	e.mu.Unlock()
	defer func() {
		e.mu.Lock()
		e.active--
		e.mu.Unlock()
	}()
	if err := stream.SendHeader(nil); err != nil {
		return err
	}
	for {
		select {
		case b := <-e.batches:
			if err := stream.Send(b); err != nil {
				return err
			}
		case <-stream.Context().Done():
			return nil
		}
	}
}

// tokens returns n tokens starting at base.
func tokens(base, n int) []uint32 {
	out := make([]uint32, n)
	for i := range out {
		out[i] = uint32(base + i)
	}
	return out
}

// storeBatch is a batch storing toks as one chain of full blocks.
func storeBatch(seq uint64, blockSize int, hashBase int64, toks []uint32) *kvpb.KvEventBatch {
	s := &kvpb.KvBlocksStored{}
	for i := 0; i+blockSize <= len(toks); i += blockSize {
		s.Blocks = append(s.Blocks, &kvpb.KvBlock{
			BlockHash: hashBase + int64(i/blockSize),
			TokenIds:  toks[i : i+blockSize],
			BlockSize: int32(blockSize),
		})
	}
	rank := int32(0)
	return &kvpb.KvEventBatch{
		SequenceNumber: seq,
		DpRank:         &rank,
		Timestamp:      float64(time.Now().UnixNano()) / 1e9,
		Events:         []*kvpb.KvCacheEvent{{EventId: seq, Data: &kvpb.KvCacheEvent_Stored{Stored: s}}},
	}
}

func runGateway(t *testing.T, cfg Config) *Gateway {
	t.Helper()
	g, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = g.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
	return g
}

func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(waitFor)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// TestRoutesToTheWorkerHoldingThePrefix runs scripted engines → monitor →
// real index → picker.
func TestRoutesToTheWorkerHoldingThePrefix(t *testing.T) {
	a, b, c := startEngine(t), startEngine(t), startEngine(t)
	reg := prometheus.NewRegistry()
	g := runGateway(t, Config{
		Workers: []Worker{
			{ID: "A", Addr: a.addr, Model: "llama"},
			{ID: "B", Addr: b.addr, Model: "llama"},
			{ID: "C", Addr: c.addr, Model: "other"},
		},
		Registerer: reg,
	})
	promptA := tokens(1000, 32*4)
	promptB := tokens(5000, 32*6)
	a.batches <- storeBatch(1, 32, 100, promptA)
	b.batches <- storeBatch(1, 32, 100, promptB[:32*2]) // B holds 2 of promptB's 6 blocks
	eventually(t, "both applied", func() bool {
		n := 0
		for _, w := range g.Workers() {
			if w.ID != "C" && w.IndexBlocks > 0 {
				n++
			}
		}
		return n == 2
	})

	d, err := g.Route(RouteRequest{Model: "llama", TokenIDs: append(append([]uint32{}, promptA...), 7, 8, 9)})
	if err != nil {
		t.Fatal(err)
	}
	if d.Worker != "A" || d.Reason != picker.ReasonHit || d.MatchedBlocks["A"] != 4 || d.BlockSize != 32 || d.RequestBlocks != 4 {
		t.Errorf("prompt A: %+v", d)
	}
	d, err = g.Route(RouteRequest{Model: "llama", TokenIDs: promptB})
	if err != nil {
		t.Fatal(err)
	}
	if d.Worker != "B" || d.MatchedBlocks["B"] != 2 || d.RequestBlocks != 6 {
		t.Errorf("prompt B: %+v", d)
	}
	// Another namespace is another block: no overlap.
	d, err = g.Route(RouteRequest{Model: "llama", TokenIDs: promptA, LoraName: "adapter"})
	if err != nil {
		t.Fatal(err)
	}
	if d.Reason != picker.ReasonNoOverlap || len(d.MatchedBlocks) != 0 {
		t.Errorf("other namespace: %+v", d)
	}
	// Model "other" has its own index: llama's blocks are not in it.
	d, err = g.Route(RouteRequest{Model: "other", TokenIDs: promptA})
	if err != nil || d.Worker != "C" || d.Reason != picker.ReasonNoOverlap {
		t.Errorf("other model: %+v %v", d, err)
	}

	// A hot holder spills: A's in-flight count trips both margins.
	d, err = g.Route(RouteRequest{Model: "llama", TokenIDs: promptA, Loads: map[string]int{"A": 500, "B": 0}})
	if err != nil {
		t.Fatal(err)
	}
	if d.Worker != "B" || d.Reason != picker.ReasonSpill {
		t.Errorf("spill: %+v", d)
	}
	if got := testutil.ToFloat64(g.metrics.routes.WithLabelValues("llama", "event_hit")); got != 2 {
		t.Errorf("event_hit decisions = %v", got)
	}
	if n, err := testutil.GatherAndCount(reg, "kvrelay_gateway_index_blocks"); err != nil || n < 2 {
		t.Errorf("index_blocks series: %d, %v", n, err)
	}

	// A removal of blocks A's index never held is counted for A; nothing
	// was left out at a run cap.
	rank := int32(0)
	a.batches <- &kvpb.KvEventBatch{SequenceNumber: 2, DpRank: &rank, Events: []*kvpb.KvCacheEvent{{EventId: 2,
		Data: &kvpb.KvCacheEvent_Removed{Removed: &kvpb.KvBlocksRemoved{BlockHashes: []int64{9001, 9002}}}}}}
	eventually(t, "the removal applied", func() bool {
		g.mu.Lock()
		ix := g.models["llama"].ix
		g.mu.Unlock()
		return ix.Stats().Workers["A"].Counters.UnknownRemovals == 2
	})
	const want = `
# HELP kvrelay_gateway_index_unknown_removals_total Removals of a block (or tier copy) the model's index did not hold for the worker: blocks left out at the run cap, or stores the index never saw.
# TYPE kvrelay_gateway_index_unknown_removals_total counter
kvrelay_gateway_index_unknown_removals_total{model="llama",worker="A"} 2
kvrelay_gateway_index_unknown_removals_total{model="llama",worker="B"} 0
# HELP kvrelay_gateway_index_unindexed_blocks_total Stored blocks the model's index left out for the worker because the index had no run id left for the run they would start (2^24 - 2 live runs a model); lookups under-report the worker for them until runs are freed.
# TYPE kvrelay_gateway_index_unindexed_blocks_total counter
kvrelay_gateway_index_unindexed_blocks_total{model="llama",worker="A"} 0
kvrelay_gateway_index_unindexed_blocks_total{model="llama",worker="B"} 0
`
	// C, whose engine sent nothing, has no series yet (as index_blocks).
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want),
		"kvrelay_gateway_index_unknown_removals_total", "kvrelay_gateway_index_unindexed_blocks_total"); err != nil {
		t.Error(err)
	}
}

func TestRouteErrors(t *testing.T) {
	e := startEngine(t)
	g := runGateway(t, Config{Workers: []Worker{{ID: "A", Addr: e.addr}}})
	if _, err := g.Route(RouteRequest{Model: "nope"}); !errors.Is(err, ErrUnknownModel) {
		t.Errorf("unknown model: %v", err)
	}
	// An unnamed model is the default one.
	d, err := g.Route(RouteRequest{TokenIDs: tokens(0, 40)})
	if err != nil || d.Worker != "A" || d.Reason != picker.ReasonNoOverlap || d.Model != DefaultModel {
		t.Errorf("default model: %+v %v", d, err)
	}
	if err := g.ReportLoad("nope", 3); !errors.Is(err, ErrUnknownWorker) {
		t.Errorf("ReportLoad unknown: %v", err)
	}
	if err := g.ReportLoad("A", 3); err != nil {
		t.Fatal(err)
	}
	// All or nothing: an unknown name leaves A's count alone.
	if err := g.ReportLoads(map[string]int{"A": 9, "nope": 1}); !errors.Is(err, ErrUnknownWorker) {
		t.Errorf("ReportLoads with an unknown worker: %v", err)
	}
	if _, err := g.Route(RouteRequest{Loads: map[string]int{"A": 9, "nope": 1}}); !errors.Is(err, ErrUnknownWorker) {
		t.Errorf("Route with an unknown worker's load: %v", err)
	}
	if w := g.Workers(); len(w) != 1 || w[0].Inflight != 3 {
		t.Errorf("workers %+v", w)
	}
	if err := g.RemoveWorker("A"); err != nil {
		t.Fatal(err)
	}
	if _, err := g.Route(RouteRequest{}); !errors.Is(err, ErrNoWorkers) {
		t.Errorf("no workers: %v", err)
	}
	if err := g.RemoveWorker("A"); !errors.Is(err, ErrUnknownWorker) {
		t.Errorf("second remove: %v", err)
	}
}

func TestRemoveWorkerTakesItsBlocks(t *testing.T) {
	a, b := startEngine(t), startEngine(t)
	g := runGateway(t, Config{Workers: []Worker{{ID: "A", Addr: a.addr}, {ID: "B", Addr: b.addr}}})
	prompt := tokens(0, 64)
	a.batches <- storeBatch(1, 16, 1, prompt)
	eventually(t, "A indexed", func() bool {
		d, err := g.Route(RouteRequest{TokenIDs: prompt})
		return err == nil && d.Reason == picker.ReasonHit
	})
	if err := g.RemoveWorker("A"); err != nil {
		t.Fatal(err)
	}
	d, err := g.Route(RouteRequest{TokenIDs: prompt})
	if err != nil || d.Worker != "B" || d.Reason != picker.ReasonNoOverlap {
		t.Errorf("after removal: %+v %v", d, err)
	}
	// And it can come back, subscribing afresh.
	if err := g.AddWorker(Worker{ID: "A", Addr: a.addr}); err != nil {
		t.Fatal(err)
	}
	// Push only once the old stream is gone, or its handler could take it.
	eventually(t, "A resubscribed", func() bool { calls, active := a.subscribers(); return calls == 2 && active == 1 })
	a.batches <- storeBatch(1, 16, 1, prompt)
	eventually(t, "A indexed again", func() bool {
		d, err := g.Route(RouteRequest{TokenIDs: prompt})
		return err == nil && d.Worker == "A" && d.Reason == picker.ReasonHit
	})
}

func TestEngineLoadShownInWorkers(t *testing.T) {
	e := startEngine(t)
	g := runGateway(t, Config{Workers: []Worker{{ID: "A", Addr: e.addr, Service: monitor.ServiceVLLM}}})
	b := storeBatch(0, 16, 1, nil)
	b.Events = nil
	b.Load = &kvpb.EngineLoad{RunningRequests: 7, WaitingRequests: 2, LoadOnly: true}
	e.batches <- b
	eventually(t, "engine load", func() bool {
		w := g.Workers()
		return len(w) == 1 && w[0].EngineLoad != nil && w[0].EngineLoad.RunningRequests == 7
	})
}

func TestNewValidates(t *testing.T) {
	if _, err := New(Config{Workers: []Worker{{ID: "A"}}}); err == nil {
		t.Error("worker without address accepted")
	}
	if _, err := New(Config{Workers: []Worker{{Addr: "x:1"}, {Addr: "x:1"}}}); err == nil {
		t.Error("duplicate worker accepted")
	}
	if _, err := New(Config{Picker: picker.Config{Temperature: -1}}); err == nil {
		t.Error("bad picker config accepted")
	}
}

func TestNoRouteToAnUnreachableWorkerWhileAHealthyOneExists(t *testing.T) {
	healthy := startEngine(t)
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	down := lis.Addr().String()
	_ = lis.Close() // nothing listens there: every subscribe fails
	g := runGateway(t, Config{
		Workers: []Worker{{ID: "up", Addr: healthy.addr}, {ID: "down", Addr: down}},
		Monitor: monitor.Options{InitialBackoff: 20 * time.Millisecond, MaxBackoff: 50 * time.Millisecond},
	})
	eventually(t, "the down worker to back off and the other to stream", func() bool {
		states := map[string]monitor.State{}
		for _, w := range g.Workers() {
			states[w.ID] = w.State
		}
		return states["down"] == monitor.StateBackoff && states["up"] == monitor.StateStreaming
	})
	// The healthy worker is busy, so load alone would pick the other.
	for i := 0; i < 20; i++ {
		d, err := g.Route(RouteRequest{TokenIDs: tokens(i*100, 64), Loads: map[string]int{"up": 50, "down": 0}})
		if err != nil {
			t.Fatal(err)
		}
		if d.Worker != "up" {
			t.Fatalf("routed to %q, whose stream is in backoff, while %q streams", d.Worker, "up")
		}
	}
	// With no reachable worker left, routing still answers.
	if err := g.RemoveWorker("up"); err != nil {
		t.Fatal(err)
	}
	if d, err := g.Route(RouteRequest{TokenIDs: tokens(0, 64)}); err != nil || d.Worker != "down" {
		t.Fatalf("only an unreachable worker left: %+v %v", d, err)
	}
}
