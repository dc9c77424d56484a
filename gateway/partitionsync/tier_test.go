package partitionsync_test

import (
	"context"
	"fmt"
	"log/slog"
	"maps"
	"math/rand/v2"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/goleak"
	"google.golang.org/protobuf/proto"

	"github.com/kvrelay/kvrelay/engines/load"
	"github.com/kvrelay/kvrelay/gateway"
	"github.com/kvrelay/kvrelay/gateway/index"
	"github.com/kvrelay/kvrelay/gateway/partitionsync"
	"github.com/kvrelay/kvrelay/gateway/picker"
	"github.com/kvrelay/kvrelay/proto/kvpb"
	"github.com/kvrelay/kvrelay/sim"
	"github.com/kvrelay/kvrelay/testkit/kvstream"
	"github.com/kvrelay/kvrelay/testkit/logbuf"
	"github.com/kvrelay/kvrelay/testkit/testnats"
	"github.com/kvrelay/kvrelay/testkit/testrelay"
)

func TestMain(m *testing.M) {
	// zmq4's PUB socket leaves its writer goroutine behind on Close (the
	// simulated engines use one); it is not ours.
	goleak.VerifyTestMain(m, goleak.IgnoreAnyFunction("github.com/go-zeromq/zmq4.(*pubMWriter).run"))
}

// patience bounds every wait; waits poll and end as soon as their
// condition holds.
const patience = 60 * time.Second

func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(patience)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("not within %v: %s", patience, what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// The fleet: simulated vLLM engines, each behind a real relay and gRPC
// server on loopback, its relay stamping the stream with the engine's
// load records (a fixed record per worker, different across workers, so
// the picker's load knobs have something to tell apart).
type fleetWorker struct {
	id  string
	eng *sim.Engine
}

// constantLoad is a worker's engine load source: one record for rank 0.
type constantLoad struct{ rec *kvpb.EngineLoad }

func (c constantLoad) Name() string { return "constant" }

func (c constantLoad) Fetch(context.Context, int64) (map[int32]*kvpb.EngineLoad, error) {
	return map[int32]*kvpb.EngineLoad{0: proto.Clone(c.rec).(*kvpb.EngineLoad)}, nil
}

func startWorker(t *testing.T, i int) *fleetWorker {
	t.Helper()
	eng := testrelay.StartEngine(t, 1, 160)
	rec := &kvpb.EngineLoad{
		RunningRequests:       uint32(i % 5),
		TokenUsage:            0.1 + 0.05*float64(i%13),
		WaitingUncachedTokens: proto.Uint32(uint32(37 * (i % 7))),
	}
	p, err := load.NewPoller(load.Options{Fetcher: constantLoad{rec}, Interval: 200 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = p.Run(ctx) }()
	rel, stopRelay := testrelay.StartRelay(t, eng, 1)
	addr, stopServer := testrelay.ServeWithLoad(t, rel, "127.0.0.1:0", p)
	t.Cleanup(func() { stopServer(); stopRelay(); cancel(); <-done })
	return &fleetWorker{id: "grpc://" + addr, eng: eng}
}

// docs are the fleet's shared prompts: a system prompt or document many
// requests start with, 12 blocks of 16 tokens each.
func makeDocs(rng *rand.Rand, n int) [][]uint32 {
	docs := make([][]uint32, n)
	for d := range docs {
		docs[d] = randomTokens(rng, 12*16)
	}
	return docs
}

func randomTokens(rng *rand.Rand, n int) []uint32 {
	out := make([]uint32, n)
	for i := range out {
		out[i] = rng.Uint32N(151_936)
	}
	return out
}

// prompt is a shared document cut at a random block plus a new tail.
func prompt(rng *rand.Rand, docs [][]uint32) []uint32 {
	d := docs[rng.IntN(len(docs))]
	cut := rng.IntN(len(d)/16+1) * 16
	return append(append([]uint32(nil), d[:cut]...), randomTokens(rng, 16*(1+rng.IntN(3))+rng.IntN(16))...)
}

// serve runs n prompts through w's engine, as its traffic would.
func (w *fleetWorker) serve(t *testing.T, rng *rand.Rand, docs [][]uint32, n int) {
	t.Helper()
	for range n {
		if _, err := w.eng.Step(sim.Request{Rank: 0, Tokens: prompt(rng, docs)}); err != nil {
			t.Fatal(err)
		}
	}
}

// pickerConfig reads the engines' loads (overlap decay strong enough to
// send a request past its deepest holder when that one's backlog is
// long; KV-pressure thresholds the fleet stays under), so a replica that
// lost another partition's workers' loads would decide differently.
var pickerConfig = picker.Config{OverlapDecay: 1, OverloadTokenUsage: 0.9, BalanceTokenUsage: 0.9}

// replica is one gateway in process, with its tier connection when
// partitioned.
type replica struct {
	name   string
	gw     *gateway.Gateway
	tier   *partitionsync.Tier
	reg    *prometheus.Registry
	cancel context.CancelFunc
	done   chan struct{}
	once   sync.Once
}

func startReplica(t *testing.T, natsURL, prefix string, ids []string, parts, own int, deadline time.Duration) *replica {
	t.Helper()
	return startReplicaWith(t, natsURL, prefix, ids, parts, own, deadline, gateway.Config{Picker: pickerConfig, NoPlacements: true})
}

// startReplicaWith starts a replica of ids over base (its picker and
// placements); the workers, the partition and the registry are filled in.
func startReplicaWith(t *testing.T, natsURL, prefix string, ids []string, parts, own int, deadline time.Duration, base gateway.Config) *replica {
	t.Helper()
	return startReplicaOpts(t, ids, parts, own, base, partitionsync.Options{URL: natsURL, SubjectPrefix: prefix, Deadline: deadline})
}

// startReplicaOpts is startReplicaWith with the tier's options (URL,
// prefix, deadline, join wait, logger; its name and registry are filled
// in). base.Workers, when set, replaces the workers made from ids.
func startReplicaOpts(t *testing.T, ids []string, parts, own int, base gateway.Config, topts partitionsync.Options) *replica {
	t.Helper()
	ws := base.Workers
	if ws == nil {
		ws = make([]gateway.Worker, len(ids))
		for i, id := range ids {
			ws[i] = gateway.Worker{ID: id, Addr: id[len("grpc://"):]}
		}
	}
	reg := prometheus.NewRegistry()
	base.Workers, base.LoadPollInterval = ws, -1
	base.Partitions, base.Partition, base.Registerer = parts, own, reg
	gw, err := gateway.New(base)
	if err != nil {
		t.Fatal(err)
	}
	r := &replica{name: "full", gw: gw, reg: reg, done: make(chan struct{})}
	if parts > 1 {
		r.name = fmt.Sprintf("partition %d/%d", own, parts)
		topts.Name, topts.Registerer = r.name, reg
		if r.tier, err = partitionsync.Start(gw, topts); err != nil {
			t.Fatal(err)
		}
		gw.SetScatterer(r.tier)
		eventually(t, r.name+" connected", r.tier.Ready)
	}
	ctx, cancel := context.WithCancel(context.Background())
	r.cancel = cancel
	go func() { defer close(r.done); _ = gw.Run(ctx) }()
	t.Cleanup(r.stop)
	return r
}

func (r *replica) stop() {
	r.once.Do(func() {
		if r.tier != nil {
			r.tier.Close()
		}
		r.cancel()
		<-r.done
	})
}

// settled reports whether every worker's blocks and engine load are on
// the full replica and on the tier replica owning it, as many as its
// engine holds, and every tier replica answers its partition.
func settled(full *replica, tier []*replica, fleet []*fleetWorker) func() bool {
	return func() bool {
		for _, r := range tier {
			if !r.tier.Answering() {
				return false
			}
		}
		byID := func(r *replica) map[string]gateway.WorkerStatus {
			m := map[string]gateway.WorkerStatus{}
			for _, st := range r.gw.Workers() {
				m[st.ID] = st
			}
			return m
		}
		f := byID(full)
		owners := make([]map[string]gateway.WorkerStatus, len(tier))
		for i, r := range tier {
			owners[i] = byID(r)
		}
		for _, w := range fleet {
			want := len(testrelay.EngineLive(w.eng))
			_, parts := tier[0].gw.Partition()
			o := owners[ownerIndex(tier, gateway.PartitionOf(w.id, parts))][w.id]
			if f[w.id].IndexBlocks != want || o.IndexBlocks != want || f[w.id].EngineLoad == nil || o.EngineLoad == nil {
				return false
			}
		}
		return true
	}
}

// ownerIndex is the first replica of tier serving partition p.
func ownerIndex(tier []*replica, p int) int {
	for i, r := range tier {
		if own, _ := r.gw.Partition(); own == p {
			return i
		}
	}
	return -1
}

// sameLoads reports the same in-flight counts to every replica, as a
// client reporting totals does.
func sameLoads(t *testing.T, rng *rand.Rand, ids []string, rs ...*replica) {
	t.Helper()
	loads := map[string]int{}
	for _, id := range ids {
		if rng.IntN(3) == 0 {
			loads[id] = rng.IntN(6)
		} else {
			loads[id] = 0
		}
	}
	for _, r := range rs {
		if err := r.gw.ReportLoads(loads); err != nil {
			t.Fatal(err)
		}
	}
}

// compareRoutes routes n requests on the full replica and, round robin,
// on the tier's replicas, and fails at the first decision that differs.
// It returns how many decisions took overlaps from another partition than
// the routing replica's.
func compareRoutes(t *testing.T, rng *rand.Rand, docs [][]uint32, ids []string, full *replica, tier []*replica, n int) (remoteHits, steered int) {
	t.Helper()
	all := append([]*replica{full}, tier...)
	_, parts := tier[0].gw.Partition()
	reasons := map[picker.Reason]int{}
	equal := 0
	defer func() {
		t.Logf("%d partitions: %d decisions equal, %d on another partition's overlaps, %d past the deepest holder (loads); reasons %v",
			parts, equal, remoteHits, steered, reasons)
	}()
	for i := range n {
		sameLoads(t, rng, ids, all...)
		req := gateway.RouteRequest{TokenIDs: prompt(rng, docs)}
		r := tier[i%len(tier)]
		got := routeBoth(t, full, r, req, fmt.Sprintf("request %d", i)) // the tier's decision equals it
		equal++
		reasons[got.Reason]++
		best := 0
		for _, b := range got.MatchedBlocks {
			best = max(best, b)
		}
		if got.MatchedBlocks[got.Worker] < best {
			steered++
		}
		own, _ := r.gw.Partition()
		for w := range got.MatchedBlocks {
			if gateway.PartitionOf(w, parts) != own {
				remoteHits++
				break
			}
		}
	}
	return remoteHits, steered
}

func startFleet(t *testing.T, n int) ([]*fleetWorker, []string) {
	t.Helper()
	fleet := make([]*fleetWorker, n)
	ids := make([]string, n)
	for i := range fleet {
		fleet[i] = startWorker(t, i)
		ids[i] = fleet[i].id
	}
	return fleet, ids
}

func startTier(t *testing.T, url, prefix string, ids []string, parts int, deadline time.Duration) []*replica {
	t.Helper()
	tier := make([]*replica, parts)
	for p := range parts {
		tier[p] = startReplica(t, url, prefix, ids, parts, p, deadline)
	}
	return tier
}

// TestTierAnswersAsAFullReplica: a 4-partition tier and a full replica
// follow the same 12 engines (real relays over gRPC, engine loads on the
// streams); request by request, on shared-document traffic with evictions
// and client-reported loads, the tier's replicas route exactly as the full
// one does: same worker, reason and overlaps. A 16-partition tier (more
// partitions than some have workers) does too, on the same subject prefix
// as the 4-partition one (replacing a tier's P): neither takes the other's
// lookups.
func TestTierAnswersAsAFullReplica(t *testing.T) {
	ns := testnats.Start(t, testnats.Config{NoJetStream: true})
	fleet, ids := startFleet(t, 12)
	rng := rand.New(rand.NewPCG(31, 3))
	docs := makeDocs(rng, 5)
	full := startReplica(t, "", "", ids, 1, 0, 0)
	tier4 := startTier(t, ns.URL(), "shared", ids, 4, 10*time.Second)
	tier16 := startTier(t, ns.URL(), "shared", ids, 16, 10*time.Second)
	for _, w := range fleet {
		w.serve(t, rng, docs, 14)
	}
	eventually(t, "every worker's blocks and load on the full replica and its 4-tier owner", settled(full, tier4, fleet))
	eventually(t, "… and its 16-tier owner", settled(full, tier16, fleet))
	// The check is only as strong as the traffic: most decisions must rest
	// on another partition's overlaps, and some on the engines' loads.
	if hits, steered := compareRoutes(t, rng, docs, ids, full, tier4, 200); hits < 100 || steered < 5 {
		t.Fatalf("4 partitions: %d of 200 decisions used another partition's overlaps, %d were steered by load: the check is too weak", hits, steered)
	}
	if hits, steered := compareRoutes(t, rng, docs, ids, full, tier16, 100); hits < 50 || steered < 3 {
		t.Fatalf("16 partitions: %d of 100 decisions used another partition's overlaps, %d were steered by load", hits, steered)
	}
	for _, r := range append(tier4, tier16...) {
		if n := missing(t, r); n != 0 {
			t.Errorf("%s: %v partitions missing from its routes", r.name, n)
		}
	}
}

// missing sums r's kvrelay_gateway_scatter_missing_total over partitions.
func missing(t *testing.T, r *replica) float64 {
	t.Helper()
	mfs, err := r.reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var sum float64
	for _, mf := range mfs {
		if mf.GetName() == "kvrelay_gateway_scatter_missing_total" {
			for _, m := range mf.GetMetric() {
				sum += m.GetCounter().GetValue()
			}
		}
	}
	return sum
}

// counter is r's counter name{label=value} (0 when absent).
func counter(t *testing.T, r *replica, name, label, value string) float64 {
	t.Helper()
	mfs, err := r.reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == label && l.GetValue() == value {
					return m.GetCounter().GetValue()
				}
			}
		}
	}
	return 0
}

// TestTierRefusesAnotherPartitionCount: a peer of another partition count
// (a misconfigured or forged one, on this tier's subjects) is refused both
// ways and counted: its answer is refused
// (kvrelay_gateway_partition_answers_refused_total{reason="partition_count"})
// and its partition missing from the route; its query is answered
// "refused" and counted
// (kvrelay_gateway_partition_lookups_total{result="partition_count"}).
func TestTierRefusesAnotherPartitionCount(t *testing.T) {
	ns := testnats.Start(t, testnats.Config{NoJetStream: true})
	_, ids := startFleet(t, 4)
	r := startReplica(t, ns.URL(), "forge", ids, 2, 0, 5*time.Second)
	peer, err := nats.Connect(ns.URL(), nats.Name("forged partition 1"))
	if err != nil {
		t.Fatal(err)
	}
	defer peer.Close()
	// Partition 1 of a 2-partition tier answering as one of 3.
	if _, err := peer.QueueSubscribe(partitionsync.LookupSubject("forge", 2, 1), partitionsync.QueueGroup(2, 1), func(m *nats.Msg) {
		_ = m.Respond(partitionsync.AppendAnswer(nil, 3, partitionsync.StatusAnswered, &gateway.PartitionAnswer{Partition: 1}))
	}); err != nil {
		t.Fatal(err)
	}
	if err := peer.Flush(); err != nil {
		t.Fatal(err)
	}
	var tokens []uint32
	for i := range 64 {
		tokens = append(tokens, uint32(i))
	}
	if _, err := r.gw.Route(gateway.RouteRequest{TokenIDs: tokens}); err != nil {
		t.Fatal(err)
	}
	if n := counter(t, r, "kvrelay_gateway_partition_answers_refused_total", "reason", "partition_count"); n != 1 {
		t.Errorf("an answer of 3 partitions to a 2-partition tier: %v refused as partition_count, want 1", n)
	}
	if n := missing(t, r); n != 1 {
		t.Errorf("an answer of 3 partitions to a 2-partition tier: %v missing, want 1", n)
	}

	// A query of 3 partitions on partition 0's subject, once partition 0
	// answers (its workers' state delivered).
	eventually(t, "partition 0 answering", r.tier.Answering)
	msg, err := peer.Request(partitionsync.LookupSubject("forge", 2, 0), partitionsync.AppendQuery(nil, 3, gateway.PartitionQuery{Model: "any"}), patience)
	if err != nil {
		t.Fatal(err)
	}
	var a gateway.PartitionAnswer
	st, parts, err := partitionsync.DecodeAnswer(msg.Data, &a)
	if err != nil || st != partitionsync.StatusRefused || parts != 2 || a.Partition != 0 {
		t.Errorf("a query of 3 partitions: answered status %d, partition %d of %d (%v); want refused, partition 0 of 2", st, a.Partition, parts, err)
	}
	if n := counter(t, r, "kvrelay_gateway_partition_lookups_total", "result", "partition_count"); n != 1 {
		t.Errorf("a query of 3 partitions: %v lookups counted partition_count, want 1", n)
	}
}

// TestTierRefusesAnAnswerForAnotherPartition: each partition is asked on
// its own reply subject, so a replica of partition 1 (forged, or confused)
// answering as partition 2 is refused and counted
// (kvrelay_gateway_partition_answers_refused_total{reason="reply_subject"}),
// and both are missing from the route: 1 refused, 2 with no replica
// subscribed. Both are known at once, so the route does not wait for the
// deadline.
func TestTierRefusesAnAnswerForAnotherPartition(t *testing.T) {
	ns := testnats.Start(t, testnats.Config{NoJetStream: true})
	_, ids := startFleet(t, 6)
	// A worker of partition 2, whatever ports the fleet got (remote to
	// this replica: it never dials it).
	var w2 string
	for i := 1; w2 == ""; i++ {
		if id := fmt.Sprintf("grpc://127.0.0.1:%d", i); gateway.PartitionOf(id, 3) == 2 {
			w2 = id
		}
	}
	const deadline = 20 * time.Second
	r := startReplica(t, ns.URL(), "claim", append(ids, w2), 3, 0, deadline)
	peer, err := nats.Connect(ns.URL(), nats.Name("partition 1 claiming 2"))
	if err != nil {
		t.Fatal(err)
	}
	defer peer.Close()
	if _, err := peer.QueueSubscribe(partitionsync.LookupSubject("claim", 3, 1), partitionsync.QueueGroup(3, 1), func(m *nats.Msg) {
		a := gateway.PartitionAnswer{Partition: 2, Matches: []index.Match{{Worker: w2, Blocks: 1}}}
		_ = m.Respond(partitionsync.AppendAnswer(nil, 3, partitionsync.StatusAnswered, &a))
	}); err != nil {
		t.Fatal(err)
	}
	if err := peer.Flush(); err != nil {
		t.Fatal(err)
	}
	var tokens []uint32
	for i := range 64 {
		tokens = append(tokens, uint32(i))
	}
	start := time.Now()
	got, err := r.gw.Route(gateway.RouteRequest{TokenIDs: tokens})
	if err != nil {
		t.Fatal(err)
	}
	if took := time.Since(start); took > deadline/2 {
		t.Errorf("the route took %v: it waited for partitions already refused or without a responder (deadline %v)", took, deadline)
	}
	if got.MatchedBlocks[w2] != 0 {
		t.Errorf("partition 1's answer as partition 2 was merged: %s at %d blocks", w2, got.MatchedBlocks[w2])
	}
	if n := counter(t, r, "kvrelay_gateway_partition_answers_refused_total", "reason", "reply_subject"); n != 1 {
		t.Errorf("%v answers refused as reply_subject, want 1", n)
	}
	for p := 1; p <= 2; p++ {
		if n := counter(t, r, "kvrelay_gateway_scatter_missing_total", "partition", strconv.Itoa(p)); n != 1 {
			t.Errorf("partition %d: missing %v times, want once", p, n)
		}
	}
}

// withoutPartition is m less the workers of partition p.
func withoutPartition(m map[string]int, p, parts int) map[string]int {
	out := map[string]int{}
	for w, b := range m {
		if gateway.PartitionOf(w, parts) != p {
			out[w] = b
		}
	}
	return out
}

// TestTierPartitionKilledMidRun: partition 1 runs two replicas (one
// queue group), partition 2 one. Killing one of partition 1's changes
// nothing: the other answers, nothing is missing. Killing partition 2's
// only replica: every route still answers at once (NATS says no
// responder), without partition 2's workers and with the others' overlaps
// exact, and kvrelay_gateway_scatter_missing_total counts each; a
// partition 2 that is subscribed but never answers holds each route for
// the deadline and no longer, logged by partition. A new partition 2
// replica rebuilds its workers from their relays, and the answers are
// exact again.
func TestTierPartitionKilledMidRun(t *testing.T) {
	ns := testnats.Start(t, testnats.Config{NoJetStream: true})
	fleet, ids := startFleet(t, 12)
	rng := rand.New(rand.NewPCG(31, 4))
	docs := makeDocs(rng, 5)
	// Long enough that a loaded host never makes a live partition miss
	// it (the missing counts below are exact), short enough to wait out.
	const deadline = 2 * time.Second
	full := startReplica(t, "", "", ids, 1, 0, 0)
	tier := startTier(t, ns.URL(), "kill", ids, 4, deadline)
	twin := startReplica(t, ns.URL(), "kill", ids, 4, 1, deadline)
	twin.name = "partition 1/4 (second replica)"
	var logs logbuf.Buffer
	front := tier[0]
	// The replica the routes go to logs what it misses.
	front.tier.Close()
	var err error
	if front.tier, err = partitionsync.Start(front.gw, partitionsync.Options{
		URL: ns.URL(), Name: "front", SubjectPrefix: "kill", Deadline: deadline,
		Registerer: front.reg, Logger: slog.New(slog.NewTextHandler(&logs, nil)),
	}); err != nil {
		t.Fatal(err)
	}
	front.gw.SetScatterer(front.tier)
	for _, w := range fleet {
		w.serve(t, rng, docs, 14)
	}
	eventually(t, "every worker on the full replica and its owner", settled(full, tier, fleet))
	eventually(t, "… and on partition 1's second replica", settled(full, []*replica{twin}, onlyPartition(fleet, 1, 4)))
	compareOn := func(n int) (missed float64) {
		before := missing(t, front)
		if hits, _ := compareRoutes(t, rng, docs, ids, full, []*replica{front}, n); hits == 0 {
			t.Fatal("no decision used another partition's overlaps")
		}
		return missing(t, front) - before
	}
	if m := compareOn(40); m != 0 {
		t.Fatalf("all partitions up: %v missing", m)
	}

	// One of partition 1's two replicas goes; once the server has dropped
	// it, the other answers every query.
	tier[1].stop()
	eventually(t, "partition 1's first replica gone from the server", func() bool { return ns.ClientsNamed("partition 1/4") == 1 })
	if m := compareOn(40); m != 0 {
		t.Fatalf("partition 1 on its second replica: %v missing", m)
	}

	// Partition 2's only replica goes.
	tier[2].stop()
	eventually(t, "partition 2's replica gone from the server", func() bool { return ns.ClientsNamed("partition 2/4") == 0 })
	before := missing(t, front)
	const routes = 40
	var slowest time.Duration
	for range routes {
		sameLoads(t, rng, ids, full, front)
		req := gateway.RouteRequest{TokenIDs: prompt(rng, docs)}
		want, err := full.gw.Route(req)
		if err != nil {
			t.Fatal(err)
		}
		start := time.Now()
		got, err := front.gw.Route(req)
		slowest = max(slowest, time.Since(start))
		if err != nil {
			t.Fatalf("partition 2 down: %v", err)
		}
		if w := withoutPartition(want.MatchedBlocks, 2, 4); !maps.Equal(got.MatchedBlocks, w) {
			t.Fatalf("partition 2 down: matched %v, want the full replica's less partition 2's: %v", got.MatchedBlocks, w)
		}
	}
	if m := missing(t, front) - before; m != routes {
		t.Fatalf("partition 2 down: %v missing over %d routes, want one each", m, routes)
	}
	// NATS says "no responders" at once, so no route waits for the
	// deadline: a quarter of it leaves a loaded host's scheduling room and
	// still tells "at once" from "waited".
	if slowest > deadline/4 {
		t.Errorf("partition 2 down (no responder): the slowest route took %v, want under a quarter of the deadline %v", slowest, deadline)
	}
	t.Logf("partition 2 down: slowest of %d routes %v (no responder)", routes, slowest)

	// A partition 2 that is subscribed and never answers (a hung replica):
	// each route waits the deadline, and no longer.
	hung, err := nats.Connect(ns.URL(), nats.Name("hung partition 2"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := hung.QueueSubscribe(partitionsync.LookupSubject("kill", 4, 2), partitionsync.QueueGroup(4, 2), func(*nats.Msg) {}); err != nil {
		t.Fatal(err)
	}
	if err := hung.Flush(); err != nil {
		t.Fatal(err)
	}
	before = missing(t, front)
	const hungRoutes = 3
	for i := range hungRoutes {
		start := time.Now()
		if _, err := front.gw.Route(gateway.RouteRequest{TokenIDs: prompt(rng, docs)}); err != nil {
			t.Fatal(err)
		}
		// The deadline runs from the scatter's start, inside the route.
		if took := time.Since(start); took < deadline || took > deadline+time.Second {
			t.Errorf("hung partition 2, route %d: took %v, want the deadline %v (and at most a second more on a loaded host)", i, took, deadline)
		}
	}
	if m := missing(t, front) - before; m != hungRoutes {
		t.Errorf("hung partition 2: %v missing over %d routes", m, hungRoutes)
	}
	hung.Close()
	if !strings.Contains(logs.String(), "partition=2") || !strings.Contains(logs.String(), "partition missing from the route") {
		t.Errorf("no log line names the missing partition:\n%s", logs.String())
	}

	// Partition 2 comes back: a new replica rebuilds its workers from their
	// relays; once it holds them, the answers are exact again.
	back := startReplica(t, ns.URL(), "kill", ids, 4, 2, deadline)
	eventually(t, "partition 2's new replica holds its workers", settled(full, []*replica{back}, onlyPartition(fleet, 2, 4)))
	eventually(t, "the hung subscriber gone from the server", func() bool { return ns.ClientsNamed("hung") == 0 })
	if m := compareOn(40); m != 0 {
		t.Fatalf("partition 2 back: %v missing", m)
	}
}

// onlyPartition is the workers of fleet in partition p of parts.
func onlyPartition(fleet []*fleetWorker, p, parts int) []*fleetWorker {
	var out []*fleetWorker
	for _, w := range fleet {
		if gateway.PartitionOf(w.id, parts) == p {
			out = append(out, w)
		}
	}
	return out
}

// TestTierReassignment: workers added to and removed from every replica
// (as the membership sources do) go to the partition PartitionOf names,
// which subscribes to them; once it holds them the answers are exact. A
// tier of another partition count, started beside it on its own subjects
// (how P changes: a new tier, then the traffic moves), answers exactly
// too.
func TestTierReassignment(t *testing.T) {
	ns := testnats.Start(t, testnats.Config{NoJetStream: true})
	fleet, ids := startFleet(t, 8)
	rng := rand.New(rand.NewPCG(31, 5))
	docs := makeDocs(rng, 4)
	full := startReplica(t, "", "", ids, 1, 0, 0)
	tier := startTier(t, ns.URL(), "re3", ids, 3, 10*time.Second)
	for _, w := range fleet {
		w.serve(t, rng, docs, 10)
	}
	eventually(t, "8 workers settled", settled(full, tier, fleet))
	compareRoutes(t, rng, docs, ids, full, tier, 40)

	// Four workers join.
	for i := range 4 {
		w := startWorker(t, 8+i)
		for _, r := range append([]*replica{full}, tier...) {
			if err := r.gw.AddWorker(gateway.Worker{ID: w.id, Addr: w.id[len("grpc://"):]}); err != nil {
				t.Fatal(err)
			}
		}
		w.serve(t, rng, docs, 10)
		fleet, ids = append(fleet, w), append(ids, w.id)
	}
	eventually(t, "12 workers settled", settled(full, tier, fleet))
	if hits, _ := compareRoutes(t, rng, docs, ids, full, tier, 60); hits == 0 {
		t.Fatal("no decision used another partition's overlaps")
	}
	joined := 0
	for _, w := range fleet[8:] {
		for _, r := range tier {
			own, parts := r.gw.Partition()
			st := workerStatus(r, w.id)
			if mine := gateway.PartitionOf(w.id, parts) == own; mine != (st.State != gateway.StateRemote) {
				t.Errorf("%s: worker %s in state %s (its partition %d)", r.name, w.id, st.State, gateway.PartitionOf(w.id, parts))
			}
			if st.State != gateway.StateRemote {
				joined++
			}
		}
	}
	if joined != 4 {
		t.Errorf("%d subscriptions to the 4 new workers across the tier, want one each", joined)
	}

	// Two leave.
	for _, id := range ids[:2] {
		for _, r := range append([]*replica{full}, tier...) {
			if err := r.gw.RemoveWorker(id); err != nil {
				t.Fatal(err)
			}
		}
	}
	fleet, ids = fleet[2:], ids[2:]
	compareRoutes(t, rng, docs, ids, full, tier, 40)

	// Another partition count beside it.
	tier5 := startTier(t, ns.URL(), "re5", ids, 5, 10*time.Second)
	eventually(t, "the 5-partition tier settled", settled(full, tier5, fleet))
	if hits, _ := compareRoutes(t, rng, docs, ids, full, tier5, 60); hits == 0 {
		t.Fatal("5 partitions: no decision used another partition's overlaps")
	}
}

func workerStatus(r *replica, id string) gateway.WorkerStatus {
	for _, st := range r.gw.Workers() {
		if st.ID == id {
			return st
		}
	}
	return gateway.WorkerStatus{}
}

// TestTierCarriesBlockSizeAndReachability: what a full replica learns
// from a worker's stream besides its blocks reaches the other partitions
// in the answers. A replica whose own worker never stored a block learns
// another partition's block size (32, not the default 16) and hashes its
// routes with it; a worker whose relay cannot be reached is left out of
// the routes of every partition, as of a full replica's.
func TestTierCarriesBlockSizeAndReachability(t *testing.T) {
	ns := testnats.Start(t, testnats.Config{NoJetStream: true})
	var engines [2]*kvstream.Engine
	for engines[0] == nil || engines[1] == nil {
		e := kvstream.Start(t)
		if p := gateway.PartitionOf("grpc://"+e.Addr, 2); engines[p] == nil {
			engines[p] = e
		}
	}
	// A dead worker in partition 1: nothing listens on a low loopback port.
	dead := ""
	for port := 1; dead == ""; port++ {
		if id := fmt.Sprintf("grpc://127.0.0.1:%d", port); gateway.PartitionOf(id, 2) == 1 {
			dead = id
		}
	}
	ids := []string{"grpc://" + engines[0].Addr, "grpc://" + engines[1].Addr, dead}
	full := startReplica(t, "", "", ids, 1, 0, 0)
	tier := startTier(t, ns.URL(), "bs", ids, 2, 10*time.Second)
	unreachable := func(r *replica) bool { return workerStatus(r, dead).State == "backoff" }
	eventually(t, "the dead worker in backoff on the full replica and partition 1", func() bool { return unreachable(full) && unreachable(tier[1]) })

	prompt := kvstream.SeqTokens(11, 4*32)
	// Each batch goes to one of the worker's two subscribers (partition
	// 1's replica and the full one); the same batch again is a duplicate
	// to the one that has it.
	eventually(t, "partition 1's worker indexed", func() bool {
		select {
		case engines[1].Batches <- kvstream.StoreTokens(1, 32, prompt):
		default:
		}
		return workerStatus(tier[1], ids[1]).IndexBlocks == 4 && workerStatus(full, ids[1]).IndexBlocks == 4
	})
	// Its workers: one indexed, one unreachable; so it answers.
	eventually(t, "partition 1 answering", tier[1].tier.Answering)
	d, err := tier[0].gw.Route(gateway.RouteRequest{TokenIDs: prompt})
	if err != nil {
		t.Fatal(err)
	}
	if d.BlockSize != 32 || d.Worker != ids[1] || d.MatchedBlocks[ids[1]] != 4 || d.Reason != picker.ReasonHit {
		t.Fatalf("partition 0's route: %+v; want block size 32, %s with 4 blocks, event_hit", d, ids[1])
	}

	// The dead worker is the least loaded: a replica that did not know it
	// is unreachable would send every no-overlap request there.
	for i := range 20 {
		loads := map[string]int{ids[0]: 3 + i%2, ids[1]: 4 - i%2, dead: 0}
		for _, r := range append([]*replica{full}, tier...) {
			if err := r.gw.ReportLoads(loads); err != nil {
				t.Fatal(err)
			}
		}
		req := gateway.RouteRequest{TokenIDs: kvstream.SeqTokens(100_000+1000*i, 64)}
		want, err := full.gw.Route(req)
		if err != nil {
			t.Fatal(err)
		}
		got, err := tier[0].gw.Route(req)
		if err != nil {
			t.Fatal(err)
		}
		if got.Worker == dead || got.Worker != want.Worker {
			t.Fatalf("no-overlap request %d: partition 0 chose %s, the full replica %s (dead: %s)", i, got.Worker, want.Worker, dead)
		}
	}
}
