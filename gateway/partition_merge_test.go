package gateway

import (
	"fmt"
	"strings"
	"sync"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/kvrelay/kvrelay/gateway/index"
	"github.com/kvrelay/kvrelay/gateway/picker"
	"github.com/kvrelay/kvrelay/proto/kvpb"
)

// fakeScatter answers a partitioned route's queries from answer, so the
// merge can be tested without NATS (package partitionsync tests the real
// scatter).
type fakeScatter struct {
	mu     sync.Mutex
	answer func(q PartitionQuery) []PartitionAnswer
	calls  int
	last   PartitionQuery
}

func (f *fakeScatter) Scatter(q PartitionQuery, local func()) []PartitionAnswer {
	f.mu.Lock()
	f.calls++
	f.last = q
	f.mu.Unlock()
	local()
	return f.answer(q)
}

func (f *fakeScatter) count() (int, PartitionQuery) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.calls, f.last
}

// idsIn returns n worker ids that PartitionOf puts in partition p of
// parts, named prefix000, prefix001, … so they sort in order.
func idsIn(t *testing.T, prefix string, p, parts, n int) []string {
	t.Helper()
	var ids []string
	for i := 0; len(ids) < n; i++ {
		if id := fmt.Sprintf("grpc://%s%03d:1", prefix, i); PartitionOf(id, parts) == p {
			ids = append(ids, id)
		}
	}
	return ids
}

func workersOf(model string, ids ...string) []Worker {
	var ws []Worker
	for _, id := range ids {
		ws = append(ws, Worker{ID: id, Addr: id[len("grpc://"):], Model: model})
	}
	return ws
}

// TestLearnBlockSizeConcurrent: learners racing with different sizes
// leave the index at the largest, the one recorded as learned. Before the
// fix (compare-and-swap, then set the index), a smaller learner's
// SetBlockSize could land after a larger one's.
func TestLearnBlockSizeConcurrent(t *testing.T) {
	g, err := New(Config{Workers: workersOf("", "grpc://x:1")})
	if err != nil {
		t.Fatal(err)
	}
	sizes := []int{16, 32, 64, 128}
	bad := 0
	rounds := 20000 // the old code failed about 1 round in 10,000
	if raceEnabled {
		rounds = 5000 // the detector slows each round several times
	}
	for range rounds {
		m := &model{ix: index.New(index.Options{})}
		start := make(chan struct{})
		var wg sync.WaitGroup
		for _, n := range sizes {
			wg.Go(func() { <-start; g.learnBlockSize(m, n) })
		}
		close(start)
		wg.Wait()
		if m.ix.BlockSize() != 128 || m.learnedBlock.Load() != 128 {
			bad++
		}
	}
	if bad > 0 {
		t.Errorf("%d of %d rounds: index block size not the largest learned", bad, rounds)
	}
}

// TestPartitionMergeKeepsDeepestDuplicate: an answer naming a worker twice
// with another worker's overlap sorting between ({b:4},{c:2},{b:1}) merges
// to one overlap per worker, the deepest, as a full index answers. Before
// the fix only adjacent duplicates were removed, and the picker kept b's
// shallower overlap.
func TestPartitionMergeKeepsDeepestDuplicate(t *testing.T) {
	a := idsIn(t, "a", 0, 2, 1)[0]
	p1 := idsIn(t, "b", 1, 2, 2)
	b, c := p1[0], p1[1]
	g, err := New(Config{Workers: workersOf("", a, b, c), Partitions: 2, Partition: 0, NoPlacements: true})
	if err != nil {
		t.Fatal(err)
	}
	for _, answers := range [][]PartitionAnswer{
		{{Partition: 1, Matches: []index.Match{{Worker: b, Blocks: 4}, {Worker: c, Blocks: 2}, {Worker: b, Blocks: 1}}}},
		{{Partition: 1, Matches: []index.Match{{Worker: b, Blocks: 1}, {Worker: c, Blocks: 2}, {Worker: b, Blocks: 4}}}},
		{{Partition: 1, Matches: []index.Match{{Worker: b, Blocks: 1}, {Worker: c, Blocks: 2}}}, {Partition: 1, Matches: []index.Match{{Worker: b, Blocks: 4}}}},
	} {
		g.SetScatterer(&fakeScatter{answer: func(PartitionQuery) []PartitionAnswer { return answers }})
		m := g.models[DefaultModel]
		got := new(index.Matches)
		g.partitionLookup(m, PartitionQuery{Model: DefaultModel, Prefix: make([]uint64, 4)}, got)
		want := []index.Match{{Worker: b, Blocks: 4}, {Worker: c, Blocks: 2}}
		if fmt.Sprint(got.Workers) != fmt.Sprint(want) {
			t.Errorf("answers %v merged to %v, want %v", answers, got.Workers, want)
		}
		d, err := g.Route(RouteRequest{TokenIDs: make([]uint32, 64)})
		if err != nil {
			t.Fatal(err)
		}
		if d.Worker != b || d.MatchedBlocks[b] != 4 {
			t.Errorf("answers %v: chose %s with matched %v, want %s at 4", answers, d.Worker, d.MatchedBlocks, b)
		}
	}
}

// TestPartitionMergeDropsOwnAndOutOfRange: answers claiming this replica's
// own partition, or one outside the tier, are dropped whole (and counted):
// their overlaps are not merged, and their unreachable workers do not
// leave the fleet. Before the fix an answer claiming partition 0 could
// give partition 0's own worker a forged overlap, or take it out of the
// fleet by calling it unreachable.
func TestPartitionMergeDropsOwnAndOutOfRange(t *testing.T) {
	own := idsIn(t, "a", 0, 2, 2)
	a, a2 := own[0], own[1]
	b := idsIn(t, "b", 1, 2, 1)[0]
	bad := []PartitionAnswer{
		{Partition: 0, Matches: []index.Match{{Worker: a2, Blocks: 3}}, Unreachable: []string{a}},
		{Partition: 2, Matches: []index.Match{{Worker: a2, Blocks: 3}}, Unreachable: []string{a}},
		{Partition: -1, Matches: []index.Match{{Worker: a2, Blocks: 3}}, Unreachable: []string{a}},
	}
	for _, x := range bad {
		g, err := New(Config{Workers: workersOf("", a, a2, b), Partitions: 2, Partition: 0, NoPlacements: true, Registerer: prometheus.NewRegistry()})
		if err != nil {
			t.Fatal(err)
		}
		answers := []PartitionAnswer{{Partition: 1, Matches: []index.Match{{Worker: b, Blocks: 1}}}, x}
		g.SetScatterer(&fakeScatter{answer: func(PartitionQuery) []PartitionAnswer { return answers }})
		d, err := g.Route(RouteRequest{TokenIDs: make([]uint32, 64)})
		if err != nil {
			t.Fatal(err)
		}
		if d.MatchedBlocks[a2] != 0 || d.Worker != b || d.MatchedBlocks[b] != 1 {
			t.Errorf("answer claiming partition %d: chose %s, matched %v; want %s at 1, %s unmatched", x.Partition, d.Worker, d.MatchedBlocks, b, a2)
		}
		g.mu.Lock()
		inFleet := g.models[DefaultModel].fleet.Has(a)
		g.mu.Unlock()
		if !inFleet {
			t.Errorf("answer claiming partition %d took own worker %s out of the fleet", x.Partition, a)
		}
		if n := testutil.ToFloat64(g.metrics.answersDropped); n != 1 {
			t.Errorf("answer claiming partition %d: kvrelay_gateway_partition_answers_dropped_total = %v, want 1", x.Partition, n)
		}
	}
}

// TestPartitionBlockSizeAdoption: another partition's block size is
// adopted only from a partition owning a worker of the model here, and
// only up to MaxAdoptedBlockSize; each offer is counted by outcome. Before
// the fix one answer of 1 Mi tokens set the model's block size for good,
// from any partition.
func TestPartitionBlockSizeAdoption(t *testing.T) {
	a := idsIn(t, "a", 0, 2, 1)[0]
	b := idsIn(t, "b", 1, 2, 1)[0]
	tokens := make([]uint32, 4096)
	route := func(g *Gateway, answers ...PartitionAnswer) Decision {
		t.Helper()
		g.SetScatterer(&fakeScatter{answer: func(PartitionQuery) []PartitionAnswer { return answers }})
		d, err := g.Route(RouteRequest{TokenIDs: tokens})
		if err != nil {
			t.Fatal(err)
		}
		return d
	}
	count := func(g *Gateway, outcome string) float64 {
		return testutil.ToFloat64(g.metrics.blockSizes.WithLabelValues(DefaultModel, outcome))
	}

	// Partition 1 owns b: a poisoned size is refused, a sane one adopted.
	reg := prometheus.NewRegistry()
	g, err := New(Config{Workers: workersOf("", a, b), Partitions: 2, Partition: 0, NoPlacements: true, Registerer: reg})
	if err != nil {
		t.Fatal(err)
	}
	def := g.models[DefaultModel].ix.BlockSize()
	for _, n := range []int{1 << 20, MaxAdoptedBlockSize + 1} {
		if d := route(g, PartitionAnswer{Partition: 1, BlockSize: n}); d.BlockSize != def {
			t.Errorf("an answer of block size %d: routes hash at %d, want the default %d", n, d.BlockSize, def)
		}
	}
	if n := count(g, "too_large"); n != 2 {
		t.Errorf("too_large = %v, want 2", n)
	}
	if d := route(g, PartitionAnswer{Partition: 1, BlockSize: 32}); d.BlockSize != 32 || d.RequestBlocks != len(tokens)/32 {
		t.Errorf("partition 1 (owns %s) says 32: route hashed at %d into %d blocks", b, d.BlockSize, d.RequestBlocks)
	}
	if d := route(g, PartitionAnswer{Partition: 1, BlockSize: MaxAdoptedBlockSize}); d.BlockSize != MaxAdoptedBlockSize {
		t.Errorf("partition 1 says %d, the bound: route hashed at %d", MaxAdoptedBlockSize, d.BlockSize)
	}
	if n := count(g, "adopted"); n != 2 {
		t.Errorf("adopted = %v, want 2", n)
	}
	want := fmt.Sprintf(`
# HELP kvrelay_gateway_block_size Block size (tokens) learned from the model's KV events, or (partitioned) adopted from another partition's answer; absent until one is seen.
# TYPE kvrelay_gateway_block_size gauge
kvrelay_gateway_block_size{model=%q} %d
`, DefaultModel, MaxAdoptedBlockSize)
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want), "kvrelay_gateway_block_size"); err != nil {
		t.Errorf("an adopted block size is not on kvrelay_gateway_block_size: %v", err)
	}

	// Partition 1 owns no worker of the model here (b is another model's):
	// its size is refused.
	g, err = New(Config{Workers: append(workersOf("", a), workersOf("other", b)...), Partitions: 2, Partition: 0, NoPlacements: true, Registerer: prometheus.NewRegistry()})
	if err != nil {
		t.Fatal(err)
	}
	if d := route(g, PartitionAnswer{Partition: 1, BlockSize: 32}); d.BlockSize != def {
		t.Errorf("partition 1 owns no worker of the model, says 32: route hashed at %d, want %d", d.BlockSize, def)
	}
	if n := count(g, "not_assigned"); n != 1 {
		t.Errorf("not_assigned = %v, want 1", n)
	}
	// Once it owns one, the same answer is adopted; and when that worker
	// leaves, a larger size from it is refused again.
	if err := g.AddWorker(workersOf("", idsIn(t, "c", 1, 2, 1)...)[0]); err != nil {
		t.Fatal(err)
	}
	if d := route(g, PartitionAnswer{Partition: 1, BlockSize: 32}); d.BlockSize != 32 {
		t.Errorf("partition 1 now owns a worker of the model, says 32: route hashed at %d", d.BlockSize)
	}
	if err := g.RemoveWorker(idsIn(t, "c", 1, 2, 1)[0]); err != nil {
		t.Fatal(err)
	}
	if d := route(g, PartitionAnswer{Partition: 1, BlockSize: 64}); d.BlockSize != 32 {
		t.Errorf("partition 1's worker of the model removed, it says 64: route hashed at %d, want 32", d.BlockSize)
	}
	if n := count(g, "not_assigned"); n != 2 {
		t.Errorf("not_assigned = %v, want 2", n)
	}
}

// TestPartitionedTextRouteScatters: a text route (placements on) on a
// partitioned replica asks the other partitions with a hash-less query,
// so the picker sees their workers' engine signals and reachability and
// decides as a full replica does. Before the fix the text branch never
// scattered: partition 1's worker b, at 95% KV usage, took the request by
// its placement where a full replica spills it.
func TestPartitionedTextRouteScatters(t *testing.T) {
	a := idsIn(t, "a", 0, 2, 1)[0]
	b := idsIn(t, "b", 1, 2, 1)[0]
	pc := picker.Config{OverloadTokenUsage: 0.9}
	full, err := New(Config{Workers: workersOf("", a, b), Picker: pc})
	if err != nil {
		t.Fatal(err)
	}
	part, err := New(Config{Workers: workersOf("", a, b), Picker: pc, Partitions: 2, Partition: 0})
	if err != nil {
		t.Fatal(err)
	}
	fs := &fakeScatter{answer: func(PartitionQuery) []PartitionAnswer {
		return []PartitionAnswer{{Partition: 1, Signals: []WorkerSignal{{Worker: b, EngineSignal: picker.EngineSignal{TokenUsage: 0.95, HasTokenUsage: true}}}}}
	}}
	part.SetScatterer(fs)
	full.recordLoad(a, 0, &kvpb.EngineLoad{TokenUsage: 0.1}, LoadPushed)
	full.recordLoad(b, 0, &kvpb.EngineLoad{TokenUsage: 0.95}, LoadPushed)
	part.recordLoad(a, 0, &kvpb.EngineLoad{TokenUsage: 0.1}, LoadPushed)
	text := strings.Repeat("a shared system prompt, long enough for a few text blocks. ", 4)
	hs := textPrefixHashes(text, index.Namespace{})
	for _, g := range []*Gateway{full, part} {
		if err := g.ApplyPlacement(DefaultModel, "peer", b, hs); err != nil {
			t.Fatal(err)
		}
	}
	want, err := full.Route(RouteRequest{Text: text})
	if err != nil {
		t.Fatal(err)
	}
	got, err := part.Route(RouteRequest{Text: text})
	if err != nil {
		t.Fatal(err)
	}
	if got.Worker != want.Worker || got.Reason != want.Reason {
		t.Errorf("text route: full replica %s (%s), partitioned %s (%s)", want.Worker, want.Reason, got.Worker, got.Reason)
	}
	if want.Worker != a {
		t.Errorf("full replica chose %s (%s): the test means b to be over the threshold", want.Worker, want.Reason)
	}
	calls, q := fs.count()
	if calls != 1 || len(q.Prefix) != 0 || !q.Loads {
		t.Errorf("text route scattered %d times, last query %d hashes, loads %v; want once, no hashes, loads", calls, len(q.Prefix), q.Loads)
	}

	// Reachability: partition 1 reports b unreachable, so b leaves the
	// fleet, as a full replica leaves a worker whose stream is down.
	fs.answer = func(PartitionQuery) []PartitionAnswer {
		return []PartitionAnswer{{Partition: 1, Unreachable: []string{b}}}
	}
	if _, err := part.Route(RouteRequest{Text: text}); err != nil {
		t.Fatal(err)
	}
	part.mu.Lock()
	inFleet := part.models[DefaultModel].fleet.Has(b)
	part.mu.Unlock()
	if inFleet {
		t.Errorf("partition 1 reported %s unreachable on a text route; it is still in the fleet", b)
	}
}

// TestRemoveWorkerForgetsRemoteDown: a worker another partition reported
// unreachable, removed and added again, starts reachable (back in the
// fleet) until its partition says otherwise. Before the fix the old report
// outlived the worker and kept it out of the fleet.
func TestRemoveWorkerForgetsRemoteDown(t *testing.T) {
	a := idsIn(t, "a", 0, 2, 1)[0]
	b := idsIn(t, "b", 1, 2, 1)[0]
	g, err := New(Config{Workers: workersOf("", a, b), Partitions: 2, Partition: 0, NoPlacements: true})
	if err != nil {
		t.Fatal(err)
	}
	inFleet := func() bool {
		g.mu.Lock()
		defer g.mu.Unlock()
		return g.models[DefaultModel].fleet.Has(b)
	}
	g.SetScatterer(&fakeScatter{answer: func(PartitionQuery) []PartitionAnswer {
		return []PartitionAnswer{{Partition: 1, Unreachable: []string{b}}}
	}})
	if _, err := g.Route(RouteRequest{TokenIDs: make([]uint32, 64)}); err != nil {
		t.Fatal(err)
	}
	if inFleet() {
		t.Fatalf("partition 1 reported %s unreachable; it is still in the fleet", b)
	}
	if err := g.RemoveWorker(b); err != nil {
		t.Fatal(err)
	}
	g.reachMu.Lock()
	left := len(g.remoteDown)
	g.reachMu.Unlock()
	if left != 0 {
		t.Errorf("after removing %s, %d partitions' unreachable sets remain", b, left)
	}
	if err := g.AddWorker(workersOf("", b)[0]); err != nil {
		t.Fatal(err)
	}
	g.SetScatterer(nil) // partition 1 silent: its last report stands
	if _, err := g.Route(RouteRequest{TokenIDs: make([]uint32, 64)}); err != nil {
		t.Fatal(err)
	}
	if !inFleet() {
		t.Errorf("%s removed and added again is kept out of the fleet by a report about its former self", b)
	}
}
