package load

import (
	"bytes"
	"context"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/testing/protocmp"

	"github.com/kvrelay/kvrelay/proto/kvpb"
	"github.com/kvrelay/kvrelay/testkit/logbuf"
)

func golden(t testing.TB, name string) []byte {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("..", "..", "testdata", "load", name))
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func TestVllmMetricsRatesFromCounterDeltas(t *testing.T) {
	m := NewMetrics(nil, "http://engine/metrics").(*metricsFetcher)
	t0 := time.Unix(5000, 0)
	first, err := m.parse(golden(t, "vllm_metrics_t0.txt"), t0)
	if err != nil {
		t.Fatal(err)
	}
	// First scrape: gauges only; no rate is known yet, so the hit rate is
	// unset and the throughput (no presence) 0. The KV capacity comes from
	// cache_config_info: 2048 blocks of 16 tokens.
	want0 := &kvpb.EngineLoad{RunningRequests: 3, WaitingRequests: 2, TokenUsage: 0.25,
		MaxTotalNumTokens: proto.Int32(32768), NumUsedTokens: proto.Int32(8192)}
	if d := cmp.Diff(want0, first[0], protocmp.Transform()); d != "" {
		t.Errorf("rank 0, first scrape (-want +got):\n%s", d)
	}
	if _, ok := first[1]; !ok || len(first) != 2 {
		t.Errorf("ranks %v, want 0 and 1 (the engine label)", first)
	}
	// Two seconds later: 750 hits of 1000 queried tokens, 600 tokens
	// generated.
	second, err := m.parse(golden(t, "vllm_metrics_t2.txt"), t0.Add(2*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	want2 := proto.Clone(want0).(*kvpb.EngineLoad)
	want2.CacheHitRate = proto.Float64(0.75)
	want2.GenThroughput = 300
	if d := cmp.Diff(want2, second[0], protocmp.Transform()); d != "" {
		t.Errorf("rank 0, second scrape (-want +got):\n%s", d)
	}
	// Rank 1 had no queries: its hit rate stays unknown, not 0.
	if second[1].CacheHitRate != nil {
		t.Errorf("rank 1 with no prefix-cache queries has hit rate %v, want unset", second[1].GetCacheHitRate())
	}
	// A counter that went down (the engine restarted) is a new window.
	third, err := m.parse(golden(t, "vllm_metrics_t0.txt"), t0.Add(4*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	if third[0].CacheHitRate != nil || third[0].GetGenThroughput() != 0 {
		t.Errorf("after a counter reset: %v, want no rates", third[0])
	}
}

func TestSglangSourcesAgree(t *testing.T) {
	m := NewMetrics(nil, "http://engine/metrics").(*metricsFetcher)
	fromMetrics, err := m.parse(golden(t, "sglang_metrics.txt"), time.Unix(1, 0))
	if err != nil {
		t.Fatal(err)
	}
	fromLoads, err := ParseV1Loads(golden(t, "sglang_v1_loads.json"))
	if err != nil {
		t.Fatal(err)
	}
	wantLoads0 := &kvpb.EngineLoad{
		RunningRequests: 4, WaitingRequests: 6, TokenUsage: 0.5, GenThroughput: 812.5, MaxRunningRequests: 128,
		WaitingUncachedTokens: proto.Uint32(900), CacheHitRate: proto.Float64(0.75),
		NumUsedTokens: proto.Int32(4096), MaxTotalNumTokens: proto.Int32(8192),
		Memory:         &kvpb.EngineMemory{WeightGb: 1.25, KvCacheGb: 6, GraphGb: 0.5, TokenCapacity: 8192},
		Speculative:    &kvpb.EngineSpeculative{AcceptLength: 2.5, AcceptRate: 0.6},
		Lora:           &kvpb.EngineLora{SlotsUsed: 1, SlotsTotal: 4, Utilization: 0.25},
		Disaggregation: &kvpb.EngineDisaggregation{Mode: "prefill", PrefillPreallocQueueReqs: 1, PrefillInflightQueueReqs: 2, KvTransferSpeedGbS: 12.5, KvTransferLatencyMs: 3.5},
		Queues:         &kvpb.EngineQueues{Waiting: 6, Grammar: 1, Retracted: 2},
	}
	if d := cmp.Diff(wantLoads0, fromLoads[0], protocmp.Transform()); d != "" {
		t.Errorf("/v1/loads rank 0 (-want +got):\n%s", d)
	}
	// Rank 1's report leaves the queued work out: unknown, not 0.
	if fromLoads[1].WaitingUncachedTokens != nil || fromLoads[1].Memory != nil {
		t.Errorf("/v1/loads rank 1: %v, want queued work and sections unset", fromLoads[1])
	}
	// /metrics says less (no admission window, capacity or sections), and
	// the same where both speak.
	wantMetrics0 := &kvpb.EngineLoad{RunningRequests: 4, WaitingRequests: 6, TokenUsage: 0.5, GenThroughput: 812.5,
		CacheHitRate: proto.Float64(0.75), NumUsedTokens: proto.Int32(4096)}
	if d := cmp.Diff(wantMetrics0, fromMetrics[0], protocmp.Transform()); d != "" {
		t.Errorf("/metrics rank 0 (-want +got):\n%s", d)
	}
}

func TestMalformedReports(t *testing.T) {
	tests := []struct {
		name, body string
		parse      func([]byte) error
	}{
		{"metrics: not exposition", "{\"loads\": []}", parseMetrics},
		{"metrics: no engine series", "# TYPE x gauge\nx 1\n", parseMetrics},
		{"metrics: bad rank label only", "vllm:num_requests_running{engine=\"-1\"} 3\n", parseMetrics},
		{"v1loads: not JSON", "vllm:num_requests_running 3\n", parseV1},
		{"v1loads: no loads", `{"loads": []}`, parseV1},
		{"v1loads: no rank", `{"loads": [{"num_running_reqs": 1}]}`, parseV1},
		{"v1loads: wrong type", `{"loads": [{"dp_rank": "zero"}]}`, parseV1},
		{"v1loads: out of range", `{"loads": [{"dp_rank": 0, "num_running_reqs": 1e12}]}`, parseV1},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.parse([]byte(tc.body))
			if outcomeOf(err) != "malformed" {
				t.Fatalf("err = %v, want a malformed report", err)
			}
		})
	}
}

func parseMetrics(b []byte) error {
	_, err := NewMetrics(nil, "u").(*metricsFetcher).parse(b, time.Now())
	return err
}

func parseV1(b []byte) error { _, err := ParseV1Loads(b); return err }

func FuzzParseMetrics(f *testing.F) {
	f.Add(golden(f, "vllm_metrics_t0.txt"))
	f.Add(golden(f, "sglang_metrics.txt"))
	f.Fuzz(func(t *testing.T, b []byte) {
		m := NewMetrics(nil, "u").(*metricsFetcher)
		for i := 0; i < 2; i++ { // twice: the rates path too
			loads, err := m.parse(b, time.Unix(int64(i)*2, 0))
			if err == nil && len(loads) == 0 {
				t.Fatal("no error and no ranks")
			}
			for _, l := range loads {
				if _, err := proto.Marshal(l); err != nil {
					t.Fatal(err)
				}
			}
		}
	})
}

func FuzzParseV1Loads(f *testing.F) {
	f.Add(golden(f, "sglang_v1_loads.json"))
	f.Fuzz(func(t *testing.T, b []byte) {
		loads, err := ParseV1Loads(b)
		if err == nil && len(loads) == 0 {
			t.Fatal("no error and no ranks")
		}
		if err != nil && outcomeOf(err) != "malformed" {
			t.Fatalf("a body that does not parse is %q: %v", outcomeOf(err), err)
		}
	})
}

// engineServer is an engine's HTTP server whose behaviour the test switches.
type engineServer struct {
	mu   sync.Mutex
	mode string // ok, down (500), slow, huge, garbage, gone (404)
	body []byte
}

func (e *engineServer) set(mode string) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.mode = mode
}

func (e *engineServer) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	e.mu.Lock()
	mode, body := e.mode, e.body
	e.mu.Unlock()
	switch mode {
	case "down":
		http.Error(w, "engine restarting", http.StatusInternalServerError)
	case "gone":
		http.NotFound(w, r)
	case "slow":
		select {
		case <-r.Context().Done():
		case <-time.After(10 * time.Second):
		}
	case "huge":
		_, _ = w.Write(bytes.Repeat([]byte("x"), 64<<10))
	case "garbage":
		_, _ = w.Write([]byte("<html>"))
	default:
		_, _ = w.Write(body)
	}
}

func TestBadSourcesAreCountedLoggedOnceAndAgeOut(t *testing.T) {
	eng := &engineServer{mode: "ok", body: golden(t, "sglang_v1_loads.json")}
	hs := httptest.NewServer(eng)
	defer hs.Close()
	reg := prometheus.NewRegistry()
	logs := &logbuf.Buffer{}
	now := time.Unix(10000, 0)
	var clockMu sync.Mutex
	p, err := NewPoller(Options{
		Fetcher: NewV1Loads(hs.Client(), hs.URL+"/v1/loads"), Timeout: 200 * time.Millisecond,
		MaxBytes: 32 << 10, MaxAge: 3 * time.Second, Registerer: reg,
		Logger: slog.New(slog.NewTextHandler(logs, nil)),
		Now: func() time.Time {
			clockMu.Lock()
			defer clockMu.Unlock()
			return now
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	advance := func(d time.Duration) {
		clockMu.Lock()
		defer clockMu.Unlock()
		now = now.Add(d)
	}
	ctx := context.Background()
	p.PollOnce(ctx)
	if r, ok := p.Latest(0); !ok || r.Load.GetRunningRequests() != 4 {
		t.Fatalf("Latest(0) = %v, %v after a good read", r, ok)
	}
	for _, mode := range []string{"down", "slow", "huge", "garbage", "gone"} {
		eng.set(mode)
		for i := 0; i < 3; i++ {
			p.PollOnce(ctx)
			advance(500 * time.Millisecond)
		}
	}
	// Every bad read was counted under its outcome; the warning was logged
	// once per change of state, not once per read.
	want := map[string]float64{"ok": 1, "error": 3, "timeout": 3, "too_large": 3, "malformed": 3, "refused": 3}
	for outcome, n := range want {
		if got := testutil.ToFloat64(p.polls.WithLabelValues("v1loads", outcome)); got != n {
			t.Errorf("polls{outcome=%s} = %v, want %v", outcome, got, n)
		}
	}
	if n := strings.Count(logs.String(), "level=WARN"); n != 5 {
		t.Errorf("%d warnings for 5 bad states over 15 reads, want 5:\n%s", n, logs.String())
	}
	// 7.5 s of failed reads: the record is past its 3 s age and no longer
	// handed out, but still reported with its age.
	if r, ok := p.Latest(0); ok {
		t.Fatalf("a record %v old is still handed out", p.Now().Sub(r.At))
	}
	if err := testutil.CollectAndCompare(ageCollector{p}, strings.NewReader(`
# HELP kvrelay_load_record_age_seconds Age of each DP rank's newest engine load record; past the max age, batches carry none.
# TYPE kvrelay_load_record_age_seconds gauge
kvrelay_load_record_age_seconds{rank="0",source="v1loads"} 7.5
kvrelay_load_record_age_seconds{rank="1",source="v1loads"} 7.5
`)); err != nil {
		t.Error(err)
	}
	eng.set("ok")
	p.PollOnce(ctx)
	if _, ok := p.Latest(0); !ok {
		t.Fatal("no record after the source recovered")
	}
	if n := strings.Count(logs.String(), "engine load source readable"); n != 2 {
		t.Errorf("recovery logged %d times, want once (plus the first read)", n)
	}
}

func TestUpdatedClosesOnlyOnChange(t *testing.T) {
	f := &scripted{}
	p, err := NewPoller(Options{Fetcher: f, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	f.next = map[int32]*kvpb.EngineLoad{0: {RunningRequests: 1}}
	ch := p.Updated()
	p.PollOnce(context.Background())
	select {
	case <-ch:
	default:
		t.Fatal("the first record did not close Updated")
	}
	ch = p.Updated()
	f.next = map[int32]*kvpb.EngineLoad{0: {RunningRequests: 1}}
	p.PollOnce(context.Background())
	select {
	case <-ch:
		t.Fatal("an unchanged read closed Updated: every idle stream would wake")
	default:
	}
	f.next = map[int32]*kvpb.EngineLoad{0: {RunningRequests: 2}}
	p.PollOnce(context.Background())
	select {
	case <-ch:
	default:
		t.Fatal("a changed record did not close Updated")
	}
}

type scripted struct{ next map[int32]*kvpb.EngineLoad }

func (s *scripted) Name() string { return "scripted" }
func (s *scripted) Fetch(context.Context, int64) (map[int32]*kvpb.EngineLoad, error) {
	return s.next, nil
}

// TestHTTPFallbackNameIsSafeToScrape: NewHTTP's source changes its name when
// /v1/loads goes away; a /metrics scrape reads that name while the poller
// changes it (run with -race), and the log names the source now read.
func TestHTTPFallbackNameIsSafeToScrape(t *testing.T) {
	loads := &engineServer{mode: "ok", body: golden(t, "sglang_v1_loads.json")}
	metrics := &engineServer{mode: "ok", body: golden(t, "sglang_metrics.txt")}
	mux := http.NewServeMux()
	mux.Handle("/v1/loads", loads)
	mux.Handle("/metrics", metrics)
	hs := httptest.NewServer(mux)
	defer hs.Close()
	f, err := NewHTTP(hs.Client(), hs.URL)
	if err != nil {
		t.Fatal(err)
	}
	logs := &logbuf.Buffer{}
	p, err := NewPoller(Options{Fetcher: f, Logger: slog.New(slog.NewTextHandler(logs, nil))})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	p.PollOnce(ctx)
	if _, ok := p.Latest(0); !ok {
		t.Fatal("no record after a good /v1/loads read")
	}

	// The scraper calls Collect as the registry does, and shares nothing
	// with the poller but the record map, which the failed read below does
	// not replace: only the race detector orders the two.
	done := make(chan struct{})
	var scrapes atomic.Int64
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			select {
			case <-done:
				return
			default:
			}
			ch := make(chan prometheus.Metric, 8)
			ageCollector{p}.Collect(ch)
			scrapes.Add(1)
		}
	}()
	loads.set("gone")
	metrics.set("down")
	p.PollOnce(ctx)
	for seen := scrapes.Load(); scrapes.Load() < seen+2; {
		runtime.Gosched()
	}
	close(done)
	wg.Wait()

	if got := f.Name(); got != "metrics" {
		t.Fatalf("Name() = %q after /v1/loads was refused, want metrics", got)
	}
	if n := strings.Count(logs.String(), "level=WARN"); n != 1 {
		t.Fatalf("%d warnings, want 1:\n%s", n, logs.String())
	}
	if n := strings.Count(logs.String(), "load_source=metrics"); n != 1 {
		t.Errorf("the failed /metrics read is not logged under load_source=metrics:\n%s", logs.String())
	}
}

// TestRanksOfChangingSourceStayBounded: a source that names a different
// rank on every read (a restarting engine, a peer declaring ranks) holds
// only the ranks read within MaxAge, not every rank it ever named.
func TestRanksOfChangingSourceStayBounded(t *testing.T) {
	f := &scripted{}
	now := time.Unix(10000, 0)
	reg := prometheus.NewRegistry()
	p, err := NewPoller(Options{
		Fetcher: f, MaxAge: time.Second, Registerer: reg,
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil)),
		Now:    func() time.Time { return now },
	})
	if err != nil {
		t.Fatal(err)
	}
	const interval = 250 * time.Millisecond
	for i := range int32(1000) {
		f.next = map[int32]*kvpb.EngineLoad{i: {RunningRequests: 1}}
		p.PollOnce(context.Background())
		now = now.Add(interval)
	}
	// Reads at 0, 250, 500, 750 and 1000 ms before the last are within
	// the 1 s age.
	if got := len(p.Ranks()); got > 5 {
		t.Errorf("%d ranks held after 1000 reads naming one rank each, want at most 5", got)
	}
	if got := testutil.CollectAndCount(ageCollector{p}); got > 5 {
		t.Errorf("%d age series, want at most 5", got)
	}
	if _, ok := p.Latest(999); !ok {
		t.Error("the newest rank's record is not handed out")
	}
}

// TestUnencodableRecordIsNotHandedOut: a record that does not encode (a
// string that is not UTF-8) would be stamped as an empty record, which
// reads as an idle engine; the rank goes without one instead, and its
// earlier record is withdrawn.
func TestUnencodableRecordIsNotHandedOut(t *testing.T) {
	f := &scripted{}
	p, err := NewPoller(Options{Fetcher: f, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	bad := &kvpb.EngineLoad{RunningRequests: 3, Disaggregation: &kvpb.EngineDisaggregation{Mode: "\xff"}}
	for _, read := range []struct {
		loads  map[int32]*kvpb.EngineLoad
		want0  bool
		detail string
	}{
		{map[int32]*kvpb.EngineLoad{0: {RunningRequests: 1}, 1: {RunningRequests: 2}}, true, "a good read"},
		{map[int32]*kvpb.EngineLoad{0: bad, 1: {RunningRequests: 2}}, false, "rank 0 not encodable"},
	} {
		f.next = read.loads
		p.PollOnce(context.Background())
		r, ok := p.Latest(0)
		if ok != read.want0 {
			t.Fatalf("%s: Latest(0) = %v, %v; want handed out %v", read.detail, r, ok, read.want0)
		}
		if ok && (len(r.Core) == 0 || len(r.Full) == 0) {
			t.Fatalf("%s: rank 0's record has empty encodings", read.detail)
		}
		if r, ok := p.Latest(1); !ok || r.Load.GetRunningRequests() != 2 {
			t.Fatalf("%s: rank 1 = %v, %v; the good rank lost its record", read.detail, r, ok)
		}
	}
}
