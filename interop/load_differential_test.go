package interop

import (
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"sync"
	"testing"

	"github.com/google/go-cmp/cmp"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/testing/protocmp"

	"github.com/kvrelay/kvrelay/proto/kvpb"
	"github.com/kvrelay/kvrelay/testkit/enginepeer"
)

// loadTimeline is one engine's load per rank, given to both relays: to SMG's
// Python relay as its scripted load source (a JSON file of EngineLoad
// fields, read at every stamp), and to kvrelay as the engine's HTTP
// /v1/loads (SGLang's shape), which it polls.
type loadTimeline struct {
	t    *testing.T
	file string

	mu    sync.Mutex
	ranks map[int]*kvpb.EngineLoad
}

func (l *loadTimeline) set(rank int, rec *kvpb.EngineLoad) {
	l.t.Helper()
	l.mu.Lock()
	defer l.mu.Unlock()
	l.ranks[rank] = rec
	fields := map[string]map[string]any{}
	for r, rec := range l.ranks {
		f := map[string]any{
			"running_requests": rec.GetRunningRequests(), "waiting_requests": rec.GetWaitingRequests(),
			"token_usage": rec.GetTokenUsage(), "gen_throughput": rec.GetGenThroughput(),
			"max_running_requests":    rec.GetMaxRunningRequests(),
			"waiting_uncached_tokens": rec.GetWaitingUncachedTokens(), "cache_hit_rate": rec.GetCacheHitRate(),
			"num_used_tokens": rec.GetNumUsedTokens(), "max_total_num_tokens": rec.GetMaxTotalNumTokens(),
		}
		if q := rec.GetQueues(); q != nil {
			f["queues"] = map[string]any{"waiting": q.GetWaiting(), "grammar": q.GetGrammar()}
		}
		fields[fmt.Sprint(r)] = f
	}
	b, err := json.Marshal(fields)
	if err != nil {
		l.t.Fatal(err)
	}
	tmp := l.file + ".tmp"
	if err := os.WriteFile(tmp, b, 0o600); err != nil {
		l.t.Fatal(err)
	}
	if err := os.Rename(tmp, l.file); err != nil { // atomic for the reader
		l.t.Fatal(err)
	}
}

// ServeHTTP is /v1/loads for the same figures.
func (l *loadTimeline) ServeHTTP(w http.ResponseWriter, _ *http.Request) {
	l.mu.Lock()
	defer l.mu.Unlock()
	type load struct {
		DpRank     int              `json:"dp_rank"`
		Running    uint32           `json:"num_running_reqs"`
		Waiting    uint32           `json:"num_waiting_reqs"`
		Usage      float64          `json:"token_usage"`
		Rate       float64          `json:"gen_throughput"`
		MaxRunning uint32           `json:"max_running_requests"`
		Uncached   uint32           `json:"num_waiting_uncached_tokens"`
		HitRate    float64          `json:"cache_hit_rate"`
		Used       int32            `json:"num_used_tokens"`
		MaxTotal   int32            `json:"max_total_num_tokens"`
		Queues     map[string]int32 `json:"queues,omitempty"`
	}
	var out struct {
		Loads []load `json:"loads"`
	}
	for r, rec := range l.ranks {
		ld := load{DpRank: r, Running: rec.GetRunningRequests(), Waiting: rec.GetWaitingRequests(), Usage: rec.GetTokenUsage(),
			Rate: rec.GetGenThroughput(), MaxRunning: rec.GetMaxRunningRequests(), Uncached: rec.GetWaitingUncachedTokens(),
			HitRate: rec.GetCacheHitRate(), Used: rec.GetNumUsedTokens(), MaxTotal: rec.GetMaxTotalNumTokens()}
		if q := rec.GetQueues(); q != nil {
			ld.Queues = map[string]int32{"waiting": q.GetWaiting(), "grammar": q.GetGrammar()}
		}
		out.Loads = append(out.Loads, ld)
	}
	_ = json.NewEncoder(w).Encode(out)
}

func loadRecord(running uint32, usage float64) *kvpb.EngineLoad {
	return &kvpb.EngineLoad{
		RunningRequests: running, WaitingRequests: 1, TokenUsage: usage, GenThroughput: 120, MaxRunningRequests: 64,
		WaitingUncachedTokens: proto.Uint32(32), CacheHitRate: proto.Float64(0.5),
		NumUsedTokens: proto.Int32(1000), MaxTotalNumTokens: proto.Int32(4000),
		Queues: &kvpb.EngineQueues{Waiting: 1, Grammar: 2},
	}
}

// TestDifferentialLoadRecords: SMG's Python relay (smg-grpc-servicer
// 0.14.1's kv_relay with its LoadRecorder) and kvrelay follow one engine
// peer and one load timeline. Every event batch both relay carries the same
// record, field by field (sample and age_ms aside: each stream numbers its
// own records, and kvrelay's record is as old as its last poll); both send
// load_only heartbeats repeating their last batch's sequence and rank with
// the telemetry, and the same change of load as one.
func TestDifferentialLoadRecords(t *testing.T) {
	kvrelayBin(t)
	tl := &loadTimeline{t: t, file: filepath.Join(t.TempDir(), "load.json"), ranks: map[int]*kvpb.EngineLoad{}}
	tl.set(0, loadRecord(2, 0.25))
	tl.set(1, loadRecord(5, 0.5))
	hs := httptest.NewServer(tl)
	defer hs.Close()

	peer := enginepeer.Start(t, enginepeer.Options{Engine: enginepeer.VLLM, DPSize: 2})
	pub, replay := peer.PubEndpoint(0), peer.ReplayEndpoint(0)
	kv := startKvrelay(t, "kvrelay serve", "vllm", kvEventsConfig("vllm", endpointPort(t, pub), endpointPort(t, replay)), 2, freePort(t),
		"--engine-metrics-url", hs.URL+"/v1/loads", "--load-interval", "50ms")
	py, pyAddr := startPyRelay(t, "vllm", pub, replay, 2, "--load-file", tl.file)
	logs := []*proc{kv.proc, py}
	kvLive := subscribeKv(t, "kvrelay", kv.addr, "vllm", &kvpb.SubscribeKvEventsRequest{})
	pyLive := subscribeKv(t, "python relay", pyAddr, "vllm", &kvpb.SubscribeKvEventsRequest{})
	d := newDiffRun(t, peer, "vllm", 2)
	// The Python relay's SUB sockets join late: warm up until each rank's
	// batch reaches it.
	for rank := 0; rank < 2; rank++ {
		pyLive.waitBatches(t, fmt.Sprintf("a warm-up batch of rank %d", rank), func(bs []*kvpb.KvEventBatch) bool {
			for _, b := range bs {
				if int(b.GetDpRank()) == rank && len(b.GetEvents()) > 0 {
					return true
				}
			}
			d.publish(rank, "warm-up", enginepeer.Stored(nil, tokens(4, 100*rank), h(uint64(900+rank))))
			return false
		}, logs...)
	}

	var main []rankSeq
	var parent uint64
	for i := 0; i < 6; i++ {
		rank := i % 2
		hash := uint64(10 + i)
		var p *enginepeer.Hash
		if parent != 0 {
			p = hp(parent)
		}
		seq := d.publish(rank, "main", enginepeer.Stored(p, tokens(4, 4*i), h(hash)))
		parent = hash
		main = append(main, rankSeq{int32(rank), seq})
		// Each rank is its own ZMQ socket, so the relays may take two
		// ranks' batches in either order; the heartbeats name the last
		// batch's rank. Wait for each batch on both streams before the
		// next, so that the last one is rank 1's on both.
		for _, s := range []*kvStream{kvLive, pyLive} {
			s.waitBatches(t, fmt.Sprintf("main batch %d (rank %d, sequence %d)", i, rank, seq), func(bs []*kvpb.KvEventBatch) bool {
				return hasAll(bs, map[int32]uint64{int32(rank): seq})
			}, logs...)
		}
	}
	last := main[len(main)-1]
	want := map[int32]uint64{last.rank: last.seq}
	for _, s := range []*kvStream{kvLive, pyLive} {
		s.waitBatches(t, "the main batches and a heartbeat after them", func(bs []*kvpb.KvEventBatch) bool {
			return hasAll(bs, want) && bs[len(bs)-1].GetLoad().GetLoadOnly()
		}, logs...)
	}
	// Rank 1's load moves (the rank of the last batch, which the
	// heartbeats name): both relays send it as a load_only batch.
	tl.set(1, loadRecord(9, 0.75))
	for _, s := range []*kvStream{kvLive, pyLive} {
		s.waitBatches(t, "the changed load as a heartbeat", func(bs []*kvpb.KvEventBatch) bool {
			b := bs[len(bs)-1]
			return b.GetLoad().GetLoadOnly() && b.GetLoad().GetRunningRequests() == 9
		}, logs...)
	}
	after := d.publish(1, "after the change", enginepeer.Stored(hp(parent), tokens(4, 40), h(99)))
	main = append(main, rankSeq{1, after})
	for _, s := range []*kvStream{kvLive, pyLive} {
		s.waitBatches(t, "the batch after the change", func(bs []*kvpb.KvEventBatch) bool {
			return hasAll(bs, map[int32]uint64{1: after})
		}, logs...)
	}

	kvBatches, _ := kvLive.snapshot()
	pyBatches, _ := pyLive.snapshot()
	noNumbering := protocmp.IgnoreFields(&kvpb.EngineLoad{}, "sample", "age_ms")
	byKey := func(bs []*kvpb.KvEventBatch) map[rankSeq]*kvpb.EngineLoad {
		out := map[rankSeq]*kvpb.EngineLoad{}
		for _, b := range bs {
			if !b.GetLoad().GetLoadOnly() {
				out[rankSeq{b.GetDpRank(), b.GetSequenceNumber()}] = b.GetLoad()
			}
		}
		return out
	}
	kvRecords, pyRecords := byKey(kvBatches), byKey(pyBatches)
	for _, k := range main {
		if kvRecords[k] == nil || pyRecords[k] == nil {
			t.Errorf("batch %+v: kvrelay record %v, python record %v; want both", k, kvRecords[k], pyRecords[k])
			continue
		}
		if diff := cmp.Diff(pyRecords[k], kvRecords[k], protocmp.Transform(), noNumbering); diff != "" {
			t.Errorf("batch %+v: records differ (-python +kvrelay):\n%s", k, diff)
		}
	}
	heartbeats := func(name string, bs []*kvpb.KvEventBatch) []*kvpb.EngineLoad {
		var distinct []*kvpb.EngineLoad
		var prev *kvpb.KvEventBatch
		var sample uint64
		for i, b := range bs {
			l := b.GetLoad()
			if l == nil {
				continue
			}
			if l.GetSample() != sample+1 {
				t.Errorf("%s: batch %d has sample %d after %d; want it to rise by one", name, i, l.GetSample(), sample)
			}
			sample = l.GetSample()
			if hasTelemetry := l.CacheHitRate != nil; !l.GetLoadOnly() && hasTelemetry != (sample == 1) {
				t.Errorf("%s: event batch %d (sample %d) telemetry %v; want it on the stream's first record only", name, i, sample, hasTelemetry)
			}
			if l.GetLoadOnly() {
				if prev == nil || b.GetSequenceNumber() != prev.GetSequenceNumber() || b.GetDpRank() != prev.GetDpRank() || len(b.GetEvents()) != 0 || l.CacheHitRate == nil {
					t.Errorf("%s: heartbeat %d (rank %d seq %d) must repeat the last batch's rank and sequence, with no events and the telemetry", name, i, b.GetDpRank(), b.GetSequenceNumber())
				}
				if n := len(distinct); n == 0 || !proto.Equal(stripNumbering(distinct[n-1]), stripNumbering(l)) {
					distinct = append(distinct, stripNumbering(l))
				}
				continue
			}
			prev = b
		}
		return distinct
	}
	kvBeats, pyBeats := heartbeats("kvrelay", kvBatches), heartbeats("python relay", pyBatches)
	if diff := cmp.Diff(pyBeats, kvBeats, protocmp.Transform()); diff != "" {
		t.Errorf("the loads the heartbeats carried differ (-python +kvrelay):\n%s", diff)
	}
	if len(kvBeats) != 2 {
		t.Errorf("kvrelay's heartbeats carried %d distinct loads, want 2 (before and after the change)", len(kvBeats))
	}
}

func stripNumbering(l *kvpb.EngineLoad) *kvpb.EngineLoad {
	c := proto.Clone(l).(*kvpb.EngineLoad)
	c.Sample, c.AgeMs = 0, 0
	return c
}
