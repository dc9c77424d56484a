package partitionsync_test

import (
	"fmt"
	"log/slog"
	"maps"
	"math/rand/v2"
	"net"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvrelay/kvrelay/gateway"
	"github.com/kvrelay/kvrelay/gateway/monitor"
	"github.com/kvrelay/kvrelay/gateway/partitionsync"
	"github.com/kvrelay/kvrelay/testkit/kvstream"
	"github.com/kvrelay/kvrelay/testkit/logbuf"
	"github.com/kvrelay/kvrelay/testkit/testnats"
	"github.com/kvrelay/kvrelay/testkit/testrelay"
)

// engineIn starts kvstream engines until one is in partition p of parts
// (the others serve unused until the test ends).
func engineIn(t *testing.T, p, parts int) *kvstream.Engine {
	t.Helper()
	for {
		if e := kvstream.Start(t); gateway.PartitionOf("grpc://"+e.Addr, parts) == p {
			return e
		}
	}
}

// deadIn is a worker of partition p of parts that nothing listens for (a
// low loopback port): its replica finds it unreachable.
func deadIn(p, parts int) string {
	for port := 1; ; port++ {
		if id := fmt.Sprintf("grpc://127.0.0.1:%d", port); gateway.PartitionOf(id, parts) == p {
			return id
		}
	}
}

// muteIn is a worker of partition p of parts whose address accepts TCP
// connections and never sends a byte (a hung relay); the listener closes
// when the test ends.
func muteIn(t *testing.T, p, parts int) string {
	t.Helper()
	for {
		lis, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		id := "grpc://" + lis.Addr().String()
		if gateway.PartitionOf(id, parts) != p {
			lis.Close()
			continue
		}
		var mu sync.Mutex
		var conns []net.Conn
		done := make(chan struct{})
		go func() {
			defer close(done)
			for {
				c, err := lis.Accept()
				if err != nil {
					return
				}
				mu.Lock()
				conns = append(conns, c)
				mu.Unlock()
			}
		}()
		t.Cleanup(func() {
			lis.Close()
			<-done
			mu.Lock()
			defer mu.Unlock()
			for _, c := range conns {
				c.Close()
			}
		})
		return id
	}
}

// holds reports whether r holds every worker of fleet as its engine does
// (blocks and engine load), whether or not it answers.
func holds(r *replica, fleet []*fleetWorker) func() bool {
	return func() bool {
		for _, w := range fleet {
			st := workerStatus(r, w.id)
			if st.IndexBlocks != len(testrelay.EngineLive(w.eng)) || st.EngineLoad == nil {
				return false
			}
		}
		return true
	}
}

// gauge is r's gauge name (0 when absent).
func gauge(t *testing.T, r *replica, name string) float64 {
	t.Helper()
	mfs, err := r.reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() == name && len(mf.GetMetric()) == 1 {
			return mf.GetMetric()[0].GetGauge().GetValue()
		}
	}
	return 0
}

// routeBoth routes req on full and on r and fails unless both decide
// alike; it returns the full replica's decision.
func routeBoth(t *testing.T, full, r *replica, req gateway.RouteRequest, what string) gateway.Decision {
	t.Helper()
	want, err := full.gw.Route(req)
	if err != nil {
		t.Fatal(err)
	}
	got, err := r.gw.Route(req)
	if err != nil {
		t.Fatal(err)
	}
	if got.Worker != want.Worker || got.Reason != want.Reason || got.RequestBlocks != want.RequestBlocks || got.BlockSize != want.BlockSize || !maps.Equal(got.MatchedBlocks, want.MatchedBlocks) {
		t.Fatalf("%s on %s: %s (%s, matched %v); the full replica: %s (%s, matched %v)",
			what, r.name, got.Worker, got.Reason, got.MatchedBlocks, want.Worker, want.Reason, want.MatchedBlocks)
	}
	return want
}

// TestTierRestartedReplicaAnswersOnlyWhenWhole: partition 1 of 2 runs two
// replicas, a and b; one of its workers (held) is a stream the test
// feeds by hand and holds the prompt most routes below hit. b is
// restarted: the new b subscribes again, gets its relay workers' state
// (snapshots), but nothing from held yet. While held has not delivered
// its state, the new b does not answer partition 1's lookups (it is not
// in the queue group: kvrelay_gateway_partition_answering 0, no lookup
// answered), so every route of partition 0's replica still equals the
// full replica's, held's overlaps included; before the fix b joined at
// once and answered about half of them without held's blocks. Once held
// delivers, b answers (counted caught_up), and the routes stay exact.
func TestTierRestartedReplicaAnswersOnlyWhenWhole(t *testing.T) {
	ns := testnats.Start(t, testnats.Config{NoJetStream: true})
	fleet, ids := startFleet(t, 6)
	held := engineIn(t, 1, 2)
	heldID := "grpc://" + held.Addr
	ids = append(ids, heldID)
	rng := rand.New(rand.NewPCG(31, 7))
	docs := makeDocs(rng, 4)
	// held's own document, 12 blocks no other worker holds.
	heldDoc := randomTokens(rng, 12*16)
	const deadline = 10 * time.Second
	full := startReplica(t, "", "", ids, 1, 0, 0)
	r0 := startReplica(t, ns.URL(), "restart", ids, 2, 0, deadline)
	a := startReplica(t, ns.URL(), "restart", ids, 2, 1, deadline)
	b := startReplica(t, ns.URL(), "restart", ids, 2, 1, deadline)
	for _, w := range fleet {
		w.serve(t, rng, docs, 10)
	}
	// Each batch goes to one of held's subscribers; the same batch again is
	// a duplicate to those that have it.
	feedHeld := func(rs ...*replica) func() bool {
		return func() bool {
			select {
			case held.Batches <- kvstream.StoreTokens(1, 16, heldDoc):
			default:
			}
			for _, r := range rs {
				if workerStatus(r, heldID).IndexBlocks != 12 {
					return false
				}
			}
			return true
		}
	}
	eventually(t, "held's document on the full replica and both of partition 1's", feedHeld(full, a, b))
	eventually(t, "the fleet settled", settled(full, []*replica{r0, a}, fleet))
	eventually(t, "… and on b", settled(full, []*replica{b}, onlyPartition(fleet, 1, 2)))

	// b restarts.
	b.stop()
	eventually(t, "the old b gone from the server", func() bool { return ns.ClientsNamed("partition 1/2") == 1 })
	b = startReplica(t, ns.URL(), "restart", ids, 2, 1, deadline)
	b.name = "partition 1/2 (restarted)"
	eventually(t, "the new b holds its relay workers", holds(b, onlyPartition(fleet, 1, 2)))
	eventually(t, "the new b streams from held", func() bool { return workerStatus(b, heldID).State == monitor.StateStreaming })
	eventually(t, "the new b catching up on held alone", func() bool { return slices.Equal(b.gw.CatchingUp(), []string{heldID}) })
	if b.tier.Answering() || gauge(t, b, "kvrelay_gateway_partition_answering") != 0 {
		t.Fatal("the new b answers partition 1 while held's state has not arrived")
	}

	// Routes on partition 0 while held is held back: partition 1's answers
	// must all be a's, so each decision is the full replica's.
	route := func(n int, what string) (onHeld int) {
		for i := range n {
			sameLoads(t, rng, ids, full, r0)
			toks := prompt(rng, docs)
			if i%2 == 0 {
				toks = append(slices.Clone(heldDoc[:16*(4+rng.IntN(9))]), randomTokens(rng, 20)...)
			}
			if d := routeBoth(t, full, r0, gateway.RouteRequest{TokenIDs: toks}, fmt.Sprintf("%s, request %d", what, i)); d.Worker == heldID && d.MatchedBlocks[heldID] > 0 {
				onHeld++
			}
		}
		return onHeld
	}
	const routes = 60
	if n := route(routes, "held back"); n < routes/4 {
		t.Fatalf("only %d of %d routes went to held on its overlap: the check is too weak", n, routes)
	}
	if n := missing(t, r0); n != 0 {
		t.Fatalf("partition 0's replica missed %v partitions while a answered", n)
	}
	if n := counter(t, b, "kvrelay_gateway_partition_lookups_total", "result", "answered"); n != 0 || b.tier.Answering() {
		t.Fatalf("the new b answered %v lookups while catching up", n)
	}

	// held delivers: b is whole, and answers.
	eventually(t, "held's document on the new b", feedHeld(b))
	eventually(t, "the new b answering", b.tier.Answering)
	if gauge(t, b, "kvrelay_gateway_partition_answering") != 1 || counter(t, b, "kvrelay_gateway_partition_joins_total", "how", "caught_up") != 1 ||
		counter(t, b, "kvrelay_gateway_partition_joins_total", "how", "timed_out") != 0 {
		t.Fatal("the new b's join metrics: want answering 1, one caught_up join")
	}
	if n := route(routes, "caught up"); n < routes/4 {
		t.Fatalf("only %d of %d routes went to held on its overlap", n, routes)
	}
	if n := counter(t, b, "kvrelay_gateway_partition_lookups_total", "result", "answered"); n == 0 {
		t.Fatal("the new b answered none of partition 1's lookups once whole")
	}
	if n := missing(t, r0); n != 0 {
		t.Fatalf("partition 0's replica missed %v partitions", n)
	}
}

// TestTierJoinsAfterTheWait: a replica whose own workers are a relay (it
// delivers a snapshot), a dead address (unreachable: nothing to wait
// for) and a stream that is open but never delivers anything (silent),
// while another replica answers its partition, holds its answers back for
// the join wait and no less, then answers anyway, counted timed_out and
// logged with the silent worker's name (not the others'); it answers
// lookups from then on. A replica whose own workers are a relay, a dead
// address and a mute one (it accepts connections and never answers: each
// subscribe attempt waits out its deadline, so the worker is connecting
// most of the time, and unreachable from its first failure on) answers as
// soon as the relay delivered and the mute worker's first attempt failed,
// with a join wait far off (caught_up). A replica with the silent worker and no other
// replica of its partition answers at once (alone): a partial answer
// leaves out fewer workers than none.
func TestTierJoinsAfterTheWait(t *testing.T) {
	ns := testnats.Start(t, testnats.Config{NoJetStream: true})
	var relays [2]*fleetWorker
	for i := 0; relays[0] == nil || relays[1] == nil; i++ {
		w := startWorker(t, i)
		if p := gateway.PartitionOf(w.id, 2); relays[p] == nil {
			relays[p] = w
		}
	}
	silent := "grpc://" + engineIn(t, 0, 2).Addr
	ids := []string{relays[0].id, relays[1].id, silent, deadIn(0, 2), deadIn(1, 2), muteIn(t, 1, 2)}
	rng := rand.New(rand.NewPCG(31, 8))
	docs := makeDocs(rng, 2)
	for _, w := range relays {
		w.serve(t, rng, docs, 6)
	}
	base := gateway.Config{Picker: pickerConfig, NoPlacements: true}
	opts := func(prefix string, wait time.Duration, log *logbuf.Buffer) partitionsync.Options {
		o := partitionsync.Options{URL: ns.URL(), SubjectPrefix: prefix, Deadline: 10 * time.Second, JoinWait: wait}
		if log != nil {
			o.Logger = slog.New(slog.NewTextHandler(log, nil))
		}
		return o
	}
	// A replica of each partition that answers at once: the others hold
	// back while it does.
	twins := []*replica{startReplicaOpts(t, ids, 2, 0, base, opts("wait", -1, nil)), startReplicaOpts(t, ids, 2, 1, base, opts("wait", -1, nil))}
	for _, r := range twins {
		eventually(t, r.name+" (twin) answering", r.tier.Answering)
	}
	// Long enough for the relay's snapshot and the dead worker's refusal
	// on a loaded host, so that the silent worker alone is behind then.
	const wait = 5 * time.Second
	var logs logbuf.Buffer
	start := time.Now()
	p0 := startReplicaOpts(t, ids, 2, 0, base, opts("wait", wait, &logs))
	p1 := startReplicaOpts(t, ids, 2, 1, base, opts("wait", time.Hour, nil))

	// Partition 1: its relay delivers, its dead and mute workers are
	// unreachable.
	eventually(t, "partition 1 answering, its dead and mute workers unreachable and its relay whole", p1.tier.Answering)
	if counter(t, p1, "kvrelay_gateway_partition_joins_total", "how", "caught_up") != 1 {
		t.Error("partition 1 did not join as caught_up")
	}

	// Partition 0: only the silent worker holds it back.
	eventually(t, "partition 0 waiting for its silent worker alone", func() bool {
		return p0.tier.Answering() || slices.Equal(p0.gw.CatchingUp(), []string{silent})
	})
	var joined time.Duration
	eventually(t, "partition 0 answering after the wait", func() bool {
		joined = time.Since(start)
		return p0.tier.Answering()
	})
	if joined < wait {
		t.Fatalf("partition 0 answered %v after its start, before its join wait %v passed", joined, wait)
	}
	if got := p0.gw.CatchingUp(); !slices.Equal(got, []string{silent}) {
		t.Errorf("partition 0 catching up %v after the wait, want the silent worker alone", got)
	}
	if counter(t, p0, "kvrelay_gateway_partition_joins_total", "how", "timed_out") != 1 || counter(t, p0, "kvrelay_gateway_partition_joins_total", "how", "caught_up") != 0 ||
		counter(t, p0, "kvrelay_gateway_partition_joins_total", "how", "alone") != 0 || gauge(t, p0, "kvrelay_gateway_partition_answering") != 1 {
		t.Error("partition 0's join metrics: want one timed_out join, answering 1")
	}
	line := ""
	for _, l := range strings.Split(logs.String(), "\n") {
		if strings.Contains(l, "answering the partition's lookups although") {
			line = l
		}
	}
	if !strings.Contains(line, silent) || !strings.Contains(line, "catching_up=1") || strings.Contains(line, relays[0].id) || strings.Contains(line, ids[3]) {
		t.Errorf("the timed-out join's log line does not name the silent worker alone: %q", line)
	}
	// Partition 0's replicas answer partition 1's routes: this one too.
	const routes = 40
	for range routes {
		if _, err := p1.gw.Route(gateway.RouteRequest{TokenIDs: prompt(rng, docs)}); err != nil {
			t.Fatal(err)
		}
	}
	if n := missing(t, p1); n != 0 {
		t.Errorf("partition 1's routes missed partition 0 %v times", n)
	}
	if n := counter(t, p0, "kvrelay_gateway_partition_lookups_total", "result", "answered"); n == 0 {
		t.Errorf("partition 0's replica answered none of %d lookups after it joined", routes)
	}

	// Alone in its partition (a tier of its own), with the silent worker:
	// it answers at once.
	lone := startReplicaOpts(t, ids, 2, 0, base, opts("alone", time.Hour, nil))
	eventually(t, "the lone replica answering", lone.tier.Answering)
	if counter(t, lone, "kvrelay_gateway_partition_joins_total", "how", "alone") != 1 {
		t.Error("the lone replica did not join as alone")
	}
	if got := lone.gw.CatchingUp(); !slices.Contains(got, silent) {
		t.Errorf("the lone replica: catching up %v, want the silent worker among them", got)
	}
}

// TestTierDisagreeingReplicasFlipOnlyTheWorker: partition 1's two
// replicas disagree on one worker (a reaches its relay; b is given a dead
// address for it, so finds it unreachable), and partition 0's routes get
// either's answer, so the worker's mark flips from one route to the next.
// Each flip moves that worker alone in the asker's fleets
// (kvrelay_gateway_fleet_syncs_total{scope="workers"}); none walks every
// model's every worker ({scope="all"} stays put), which before the fix
// each flip did under the gateway's lock.
func TestTierDisagreeingReplicasFlipOnlyTheWorker(t *testing.T) {
	ns := testnats.Start(t, testnats.Config{NoJetStream: true})
	var fleet []*fleetWorker
	var ids []string
	victim := ""
	for i := 0; victim == "" || len(fleet) < 4; i++ {
		w := startWorker(t, i)
		fleet, ids = append(fleet, w), append(ids, w.id)
		if victim == "" && gateway.PartitionOf(w.id, 2) == 1 {
			victim = w.id
		}
	}
	rng := rand.New(rand.NewPCG(31, 9))
	docs := makeDocs(rng, 3)
	for _, w := range fleet {
		w.serve(t, rng, docs, 6)
	}
	const deadline = 10 * time.Second
	r0 := startReplica(t, ns.URL(), "flap", ids, 2, 0, deadline)
	a := startReplica(t, ns.URL(), "flap", ids, 2, 1, deadline)
	var misled []gateway.Worker
	for _, id := range ids {
		w := gateway.Worker{ID: id, Addr: id[len("grpc://"):]}
		if id == victim {
			w.Addr = deadIn(1, 2)[len("grpc://"):]
		}
		misled = append(misled, w)
	}
	b := startReplicaOpts(t, ids, 2, 1, gateway.Config{Picker: pickerConfig, NoPlacements: true, Workers: misled},
		partitionsync.Options{URL: ns.URL(), SubjectPrefix: "flap", Deadline: deadline})
	b.name = "partition 1/2 (misled)"
	eventually(t, "a streams from the worker, b finds it unreachable", func() bool {
		return workerStatus(a, victim).State == monitor.StateStreaming && workerStatus(b, victim).State == monitor.StateBackoff
	})
	eventually(t, "every replica answering", func() bool { return r0.tier.Answering() && a.tier.Answering() && b.tier.Answering() })
	// Alone in its partition, r0 answered at once; its own workers settle
	// before the count starts (a stream opening is a full sync).
	eventually(t, "r0's own workers streaming and caught up", func() bool {
		for _, st := range r0.gw.Workers() {
			if st.State != gateway.StateRemote && (st.State != monitor.StateStreaming || !st.CaughtUp) {
				return false
			}
		}
		return true
	})
	// A first route settles what is pending (the fleets' first sync).
	if _, err := r0.gw.Route(gateway.RouteRequest{TokenIDs: prompt(rng, docs)}); err != nil {
		t.Fatal(err)
	}
	all := counter(t, r0, "kvrelay_gateway_fleet_syncs_total", "scope", "all")
	flips := counter(t, r0, "kvrelay_gateway_fleet_syncs_total", "scope", "workers")
	const routes = 60
	for range routes {
		if _, err := r0.gw.Route(gateway.RouteRequest{TokenIDs: prompt(rng, docs)}); err != nil {
			t.Fatal(err)
		}
	}
	flips = counter(t, r0, "kvrelay_gateway_fleet_syncs_total", "scope", "workers") - flips
	if n := counter(t, r0, "kvrelay_gateway_fleet_syncs_total", "scope", "all") - all; n != 0 {
		t.Errorf("%v syncs of every worker over %d routes (%v flips of the one worker): a flip walks the whole fleet", n, routes, flips)
	}
	if flips == 0 {
		t.Fatalf("no flip over %d routes: partition 1's answers never disagreed (a answered %v lookups, b %v)", routes,
			counter(t, a, "kvrelay_gateway_partition_lookups_total", "result", "answered"), counter(t, b, "kvrelay_gateway_partition_lookups_total", "result", "answered"))
	}
	if n := missing(t, r0); n != 0 {
		t.Errorf("%v partitions missing", n)
	}
	t.Logf("%d routes: %v flips of the worker, each applied alone", routes, flips)
}
