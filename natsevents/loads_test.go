package natsevents

import (
	"context"
	"math"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"google.golang.org/protobuf/proto"

	"github.com/kvrelay/kvrelay/engines/load"
	"github.com/kvrelay/kvrelay/gateway/monitor"
	"github.com/kvrelay/kvrelay/proto/kvpb"
	"github.com/kvrelay/kvrelay/sim"
	"github.com/kvrelay/kvrelay/testkit/testrelay"
)

// scriptedLoads is a LoadSource whose records the test sets.
type scriptedLoads struct {
	mu   sync.Mutex
	recs map[int32]*kvpb.EngineLoad
}

func (s *scriptedLoads) Load(rank int32) *kvpb.EngineLoad {
	s.mu.Lock()
	defer s.mu.Unlock()
	if l := s.recs[rank]; l != nil {
		return proto.Clone(l).(*kvpb.EngineLoad)
	}
	return nil
}

func (s *scriptedLoads) set(rank int32, l *kvpb.EngineLoad) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.recs[rank] = l
}

// seenLoads records what a replica's monitor hands its OnLoad.
type seenLoads struct {
	mu     sync.Mutex
	byRank map[int32][]*kvpb.EngineLoad
}

func (s *seenLoads) add(_ string, rank int32, l *kvpb.EngineLoad) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.byRank[rank] = append(s.byRank[rank], proto.Clone(l).(*kvpb.EngineLoad))
}

func (s *seenLoads) of(rank int32) []*kvpb.EngineLoad {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]*kvpb.EngineLoad(nil), s.byRank[rank]...)
}

func (s *seenLoads) last(rank int32) *kvpb.EngineLoad {
	all := s.of(rank)
	if len(all) == 0 {
		return nil
	}
	return all[len(all)-1]
}

// TestLoadsReachAJetStreamReplica: a replica that reads a worker from
// JetStream alone (dead gRPC address) gets each rank's load records as
// load_only batches, telemetry and age included, on a change and on
// silence; they never enter the stream, and the index stays exact with
// them interleaved.
func TestLoadsReachAJetStreamReplica(t *testing.T) {
	js := startJetStream(t)
	a := startWorker(t, "a", 2)
	loads := &scriptedLoads{recs: map[int32]*kvpb.EngineLoad{
		0: {RunningRequests: 3, TokenUsage: 0.4, CacheHitRate: proto.Float64(0.5), WaitingUncachedTokens: proto.Uint32(128)},
		1: {WaitingRequests: 7, TokenUsage: 0.1, AgeMs: 2500},
	}}
	a.startSink(js.URL(), func(o *SinkOptions) { o.Loads = loads })
	a.run(20)
	eventually(t, "the first snapshot object", func() bool {
		return a.sinkCount("kvrelay_nats_events_snapshots_total", "result", "written") >= 1
	})
	seen := &seenLoads{byRank: map[int32][]*kvpb.EngineLoad{}}
	rep := startReplicaWith(t, js.URL(), func(o *monitor.Options, _ *SourceOptions) { o.OnLoad = seen.add }, monitor.Worker{ID: a.name, Addr: deadAddr})
	rep.exact(a.name, a.eng, "with loads")
	eventually(t, "both ranks' records", func() bool { return seen.last(0) != nil && seen.last(1) != nil })

	r0, r1 := seen.last(0), seen.last(1)
	if !r0.GetLoadOnly() || r0.GetRunningRequests() != 3 || r0.GetTokenUsage() != 0.4 || r0.GetCacheHitRate() != 0.5 || r0.GetWaitingUncachedTokens() != 128 {
		t.Errorf("rank 0's record: %v", r0)
	}
	if r0.GetAgeMs() >= 2500 {
		t.Errorf("rank 0's fresh record arrived %d ms old", r0.GetAgeMs())
	}
	// The sample was 2.5 s old at the sink: never younger downstream.
	if r1.GetWaitingRequests() != 7 || r1.GetAgeMs() < 2500 || time.Duration(r1.GetAgeMs())*time.Millisecond > loadMaxAge {
		t.Errorf("rank 1's record: %v", r1)
	}

	// Idle engine: heartbeats keep coming, and the stream stores none.
	stored := a.sinkCount("kvrelay_nats_events_published_total", "result", "stored")
	n := len(seen.of(1))
	eventually(t, "two heartbeats of an unchanged record", func() bool { return len(seen.of(1)) >= n+2 })
	if got := a.sinkCount("kvrelay_nats_events_published_total", "result", "stored"); got != stored {
		t.Errorf("the stream stored %v messages while only loads were sent, want none", got-stored)
	}
	if a.sinkCount("kvrelay_nats_events_loads_published_total", "reason", "heartbeat") < 2 {
		t.Error("no heartbeats counted")
	}

	// A change goes out without waiting for the heartbeat.
	loads.set(0, &kvpb.EngineLoad{RunningRequests: 9, TokenUsage: 0.4})
	eventually(t, "rank 0's change", func() bool { return seen.last(0).GetRunningRequests() == 9 })

	// One subscription: its samples only rise.
	var all []*kvpb.EngineLoad
	all = append(all, seen.of(0)...)
	all = append(all, seen.of(1)...)
	samples := map[uint64]bool{}
	for _, l := range all {
		if samples[l.GetSample()] || l.GetSample() == 0 {
			t.Fatalf("sample %d twice or zero in one subscription", l.GetSample())
		}
		samples[l.GetSample()] = true
	}

	a.run(15)
	rep.exact(a.name, a.eng, "events after loads")
	if v := rep.counter("kvrelay_gateway_batches_total", map[string]string{"worker": a.name, "disposition": "load_only"}); v < float64(len(all)) {
		t.Errorf("load_only batches counted %v, records seen %d", v, len(all))
	}
	for _, d := range []string{"stale", "gap"} {
		if v := rep.counter("kvrelay_gateway_batches_total", map[string]string{"worker": a.name, "disposition": d}); v != 0 {
			t.Errorf("%v %s batches: the load records disturbed admission", v, d)
		}
	}

	// Garbage on a load subject is counted and dropped; the feed goes on.
	nc, err := nats.Connect(js.URL())
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	for _, m := range []struct{ subject, data string }{
		{loadSubject(DefaultSubjectPrefix, WorkerToken(a.name), 0), "\xff\xff\xff"},
		{DefaultSubjectPrefix + "-load." + WorkerToken(a.name) + ".x", ""},
	} {
		if err := nc.Publish(m.subject, []byte(m.data)); err != nil {
			t.Fatal(err)
		}
	}
	eventually(t, "malformed records counted", func() bool {
		return rep.counter("kvrelay_gateway_events_loads_total", map[string]string{"result": "malformed"}) == 2
	})
	loads.set(0, &kvpb.EngineLoad{RunningRequests: 11})
	eventually(t, "records after the garbage", func() bool { return seen.last(0).GetRunningRequests() == 11 })
}

func TestDecodeLoad(t *testing.T) {
	enc := func(l *kvpb.EngineLoad) []byte {
		b, err := proto.Marshal(l)
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	for _, tc := range []struct {
		name string
		data []byte
		err  string
	}{
		{"empty record", nil, ""},
		{"full record", enc(&kvpb.EngineLoad{RunningRequests: 2, TokenUsage: 0.3, CacheHitRate: proto.Float64(0.9), AgeMs: 1000}), ""},
		{"not protobuf", []byte{0xff, 0xff}, "load record"},
		{"too large", make([]byte, loadMaxBytes+1), "at most"},
		{"NaN usage", enc(&kvpb.EngineLoad{TokenUsage: math.NaN()}), "token_usage"},
		{"negative throughput", enc(&kvpb.EngineLoad{GenThroughput: -1}), "gen_throughput"},
		{"infinite hit rate", enc(&kvpb.EngineLoad{CacheHitRate: proto.Float64(math.Inf(1))}), "cache_hit_rate"},
		{"too old", enc(&kvpb.EngineLoad{AgeMs: 16000}), "old"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := decodeLoad(tc.data)
			if tc.err == "" && err != nil {
				t.Fatalf("refused: %v", err)
			}
			if tc.err != "" && (err == nil || !strings.Contains(err.Error(), tc.err)) {
				t.Fatalf("err %v, want one saying %q", err, tc.err)
			}
		})
	}
}

func TestParseLoadSubject(t *testing.T) {
	for _, tc := range []struct {
		subject string
		token   string
		rank    int32
		ok      bool
	}{
		{"kvrelay.events-load.a%2Eb.3", "a%2Eb", 3, true},
		{"kvrelay.events-load.w.0", "w", 0, true},
		{"kvrelay.events-load.w.1024", "", 0, false},
		{"kvrelay.events-load.w.-1", "", 0, false},
		{"kvrelay.events-load.w.", "", 0, false},
		{"w.1", "", 0, false}, // no prefix
		{"1", "", 0, false},
		{"..1", "", 0, false},
	} {
		token, rank, err := parseLoadSubject(tc.subject)
		if (err == nil) != tc.ok || token != tc.token || rank != tc.rank {
			t.Errorf("%q: %q %d %v", tc.subject, token, rank, err)
		}
	}
}

// TestLoadFeedAges: a record waiting in a feed is handed on with the time
// it waited added to its age, and dropped once older than loadMaxAge; the
// batch repeats the rank's last delivered sequence.
func TestLoadFeedAges(t *testing.T) {
	now := time.Unix(1000, 0)
	tr := newLoadTracker(testLogger())
	tr.now = func() time.Time { return now }
	f := tr.attach("w")
	defer tr.detach("w", f)
	f.delivered(&kvpb.KvEventBatch{SequenceNumber: 41, DpRank: proto.Int32(1)})
	tr.handle(&nats.Msg{Subject: "p-load.w.1", Data: mustMarshal(t, &kvpb.EngineLoad{RunningRequests: 4, AgeMs: 200})})
	tr.handle(&nats.Msg{Subject: "p-load.w.2", Data: mustMarshal(t, &kvpb.EngineLoad{RunningRequests: 5})})
	if f.waitCtx().Err() == nil {
		t.Fatal("a pending record does not wake the reader")
	}
	now = now.Add(1300 * time.Millisecond)
	b := f.next()
	if b.GetDpRank() != 1 || b.GetSequenceNumber() != 41 || !b.GetLoad().GetLoadOnly() || b.GetLoad().GetAgeMs() != 1500 || b.GetLoad().GetSample() != 1 {
		t.Fatalf("first batch: %v", b)
	}
	now = now.Add(loadMaxAge)
	if b := f.next(); b != nil {
		t.Fatalf("a record %s old handed on: %v", loadMaxAge+1300*time.Millisecond, b)
	}
	if f.waitCtx().Err() != nil {
		t.Fatal("an empty feed's wait is cancelled")
	}
	// A new subscription gets the tracker's records, here too old.
	g := tr.attach("w")
	defer tr.detach("w", g)
	if b := g.next(); b != nil {
		t.Fatalf("a stale record handed to a new subscription: %v", b)
	}
	// A worker nobody follows is not kept.
	tr.handle(&nats.Msg{Subject: "p-load.other.0", Data: mustMarshal(t, &kvpb.EngineLoad{})})
	if _, ok := tr.latest["other"]; ok {
		t.Fatal("records of an unfollowed worker kept")
	}
}

func mustMarshal(t *testing.T, m proto.Message) []byte {
	t.Helper()
	b, err := proto.Marshal(m)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func FuzzDecodeLoad(f *testing.F) {
	f.Add("kvrelay.events-load.w.0", []byte{})
	f.Add("p-load.a%2Eb.3", []byte{0x08, 0x02, 0x21, 0, 0, 0, 0, 0, 0, 0xe0, 0x3f})
	f.Add("x", []byte{0xff})
	f.Fuzz(func(t *testing.T, subject string, data []byte) {
		tr := newLoadTracker(testLogger())
		f := tr.attach("w")
		defer tr.detach("w", f)
		tr.handle(&nats.Msg{Subject: subject, Data: data})
		if l, err := decodeLoad(data); err == nil {
			if math.IsNaN(l.GetTokenUsage()) || l.GetGenThroughput() < 0 {
				t.Fatalf("accepted %v", l)
			}
		}
		if b := f.next(); b != nil && !b.GetLoad().GetLoadOnly() {
			t.Fatalf("a feed batch without load_only: %v", b)
		}
	})
}

// scriptedFetcher is a load.Fetcher answering the records the test sets.
type scriptedFetcher struct{ loads *scriptedLoads }

func (f scriptedFetcher) Name() string { return "scripted" }

func (f scriptedFetcher) Fetch(context.Context, int64) (map[int32]*kvpb.EngineLoad, error) {
	out := map[int32]*kvpb.EngineLoad{}
	for _, r := range []int32{0, 1} {
		if l := f.loads.Load(r); l != nil {
			out[r] = l
		}
	}
	return out, nil
}

// TestJetStreamAndGRPCReplicasSeeTheSameLoads: one relay's load poller
// stamps its gRPC stream and feeds its sink; a replica on gRPC and one on
// JetStream end with the same record per rank, field by field (the
// stream's own fields aside: sample, age, load_only), before and after
// the engine's load changes.
func TestJetStreamAndGRPCReplicasSeeTheSameLoads(t *testing.T) {
	js := startJetStream(t)
	w := &worker{t: t, name: "w", eng: testrelay.StartEngine(t, 2, 128), dpSize: 2}
	t.Cleanup(w.down)
	scripted := &scriptedLoads{recs: map[int32]*kvpb.EngineLoad{
		0: {RunningRequests: 4, TokenUsage: 0.25, WaitingUncachedTokens: proto.Uint32(64), CacheHitRate: proto.Float64(0.5)},
		1: {WaitingRequests: 3, TokenUsage: 0.75, GenThroughput: 900},
	}}
	p, err := load.NewPoller(load.Options{Fetcher: scriptedFetcher{scripted}, Interval: 50 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = p.Run(ctx) }()
	w.stops = append(w.stops, func() { cancel(); <-done })
	rel, stopRelay := testrelay.StartRelay(t, w.eng, w.dpSize)
	w.rel = rel
	w.stops = append(w.stops, stopRelay)
	addr, stopServer := testrelay.ServeWithLoad(t, rel, "127.0.0.1:0", p)
	w.addr = addr
	w.stops = append(w.stops, stopServer)
	w.startSink(js.URL(), func(o *SinkOptions) { o.Loads = PollerLoads(p) })
	w.run(20)
	eventually(t, "the first snapshot object", func() bool {
		return w.sinkCount("kvrelay_nats_events_snapshots_total", "result", "written") >= 1
	})

	overGRPC := &seenLoads{byRank: map[int32][]*kvpb.EngineLoad{}}
	overNATS := &seenLoads{byRank: map[int32][]*kvpb.EngineLoad{}}
	startReplicaWith(t, "", func(o *monitor.Options, _ *SourceOptions) { o.OnLoad = overGRPC.add }, monitor.Worker{ID: w.name, Addr: w.addr})
	startReplicaWith(t, js.URL(), func(o *monitor.Options, _ *SourceOptions) { o.OnLoad = overNATS.add }, monitor.Worker{ID: w.name, Addr: deadAddr})

	// core is what both paths must agree on: the engine's figures.
	core := func(l *kvpb.EngineLoad) *kvpb.EngineLoad {
		if l == nil {
			return nil
		}
		c := proto.Clone(l).(*kvpb.EngineLoad)
		c.Sample, c.AgeMs, c.LoadOnly = 0, 0, false
		load.CoreOnly(c)
		return c
	}
	agree := func(when string, rank int32, want *kvpb.EngineLoad) {
		t.Helper()
		eventually(t, when, func() bool {
			g, n := core(overGRPC.last(rank)), core(overNATS.last(rank))
			return proto.Equal(g, core(want)) && proto.Equal(n, core(want))
		})
	}
	// A batch on each rank: a stream's load_only heartbeats carry only
	// its last batch's rank (SMG's rule), so a rank's record reaches a
	// gRPC subscriber on that rank's batches.
	stepRank := func(rank, n int) {
		t.Helper()
		if _, err := w.eng.Step(sim.Request{Rank: rank, Tokens: loadTestPrompt(n)}); err != nil {
			t.Fatal(err)
		}
	}
	stepRank(0, 1)
	stepRank(1, 2)
	agree("both replicas hold rank 0's record", 0, scripted.Load(0))
	agree("both replicas hold rank 1's record", 1, scripted.Load(1))

	changed := &kvpb.EngineLoad{RunningRequests: 9, TokenUsage: 0.5, WaitingUncachedTokens: proto.Uint32(0)}
	scripted.set(0, changed)
	eventually(t, "the poller's new record", func() bool {
		r, ok := p.Latest(0)
		return ok && r.Load.GetRunningRequests() == 9
	})
	stepRank(0, 3)
	agree("both replicas follow rank 0's change", 0, changed)
}

// loadTestPrompt is two blocks of tokens no workload request shares.
func loadTestPrompt(n int) []uint32 {
	toks := make([]uint32, 32)
	for i := range toks {
		toks[i] = 1<<24 + uint32(n)<<8 + uint32(i)
	}
	return toks
}
