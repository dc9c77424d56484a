package sim

import (
	"context"
	"fmt"
	"math"
	"net/http"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvrelay/kvrelay/engines/load"
	"github.com/kvrelay/kvrelay/internal/freeport"
	"github.com/kvrelay/kvrelay/proto/kvpb"
)

// prompt is n tokens from base, distinct per base.
func prompt(base, n int) []uint32 {
	out := make([]uint32, n)
	for i := range out {
		out[i] = uint32(base + i)
	}
	return out
}

// TestLoadMovesWithWork: the simulated engine's exported load, read by the
// relay's own load sources (NewHTTP: /v1/loads first, /metrics when that
// is refused), follows the work: a burst queues on its rank, the queue's
// uncached tokens and the KV usage rise, a repeated prompt hits the cache,
// and everything drains as the engine's clock moves.
func TestLoadMovesWithWork(t *testing.T) {
	for _, tc := range []struct {
		engine string
		// uncached: the engine reports the queue's uncached tokens
		// (SGLang's /v1/loads; vLLM's /metrics has no such series).
		uncached bool
	}{
		{"vllm", false},
		{"sglang", true},
	} {
		t.Run(tc.engine, func(t *testing.T) {
			var clock atomic.Int64
			clock.Store(time.Unix(1_000_000, 0).UnixNano())
			now := func() time.Time { return time.Unix(0, clock.Load()) }
			advance := func(d time.Duration) { clock.Add(int64(d)) }
			base := freeport.ForTest(t, 4)
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			cfg := fmt.Sprintf(`{"enable_kv_cache_events": true, "endpoint": "tcp://*:%d", "replay_endpoint": "tcp://*:%d"}`, base, base+2)
			if tc.engine == "sglang" {
				cfg = fmt.Sprintf(`{"publisher": "zmq", "endpoint": "tcp://*:%d", "replay_endpoint": "tcp://*:%d"}`, base, base+2)
			}
			e, err := Start(ctx, Options{
				Engine: tc.engine, KVEventsConfig: cfg, DPSize: 2, BlockSize: 16, CapacityBlocks: 64,
				ControlAddr: "127.0.0.1:0", Clock: now,
				Load: LoadModel{MaxRunning: 4, PrefillTokensPerSecond: 640, DecodeTokensPerSecond: 10, OutputTokens: 20},
			})
			if err != nil {
				t.Fatal(err)
			}
			defer e.Close()
			client := &http.Client{Transport: &http.Transport{}}
			defer client.CloseIdleConnections()
			f, err := load.NewHTTP(client, "http://"+e.ControlAddr())
			if err != nil {
				t.Fatal(err)
			}
			read := func() map[int32]*kvpb.EngineLoad {
				t.Helper()
				recs, err := f.Fetch(ctx, 1<<20)
				if err != nil {
					t.Fatal(err)
				}
				return recs
			}
			idle := read()
			if len(idle) != 2 || idle[0].GetRunningRequests() != 0 || idle[0].GetTokenUsage() != 0 {
				t.Fatalf("idle engine: %v", idle)
			}

			// Six 64-token prompts on rank 0: four run, two wait with all
			// their tokens uncached.
			var reqs []Request
			for i := range 6 {
				reqs = append(reqs, Request{Rank: 0, Tokens: prompt(10_000*(i+1), 64)})
			}
			if _, err := e.Step(reqs...); err != nil {
				t.Fatal(err)
			}
			busy := read()
			r0, r1 := busy[0], busy[1]
			if r0.GetRunningRequests() != 4 || r0.GetWaitingRequests() != 2 || r1.GetRunningRequests() != 0 {
				t.Errorf("after the burst: rank 0 %v, rank 1 %v", r0, r1)
			}
			// Four running 64-token prompts of a 1,024-token cache.
			if r0.GetTokenUsage() != 0.25 {
				t.Errorf("rank 0's KV usage %v, want 0.25", r0.GetTokenUsage())
			}
			if got := r0.WaitingUncachedTokens; tc.uncached != (got != nil) || (got != nil && *got != 128) {
				t.Errorf("rank 0's waiting uncached tokens %v (reported: %v)", got, tc.uncached)
			}

			// Prefill (256 tokens at 640/s) then 20 tokens at 10/s: after
			// 2.5 s the first four are done and the last two run.
			advance(2500 * time.Millisecond)
			mid := read()[0]
			if mid.GetRunningRequests() != 2 || mid.GetWaitingRequests() != 0 {
				t.Errorf("after 2.5 s: %v", mid)
			}
			advance(10 * time.Second)
			if done := read()[0]; done.GetRunningRequests() != 0 || done.GetTokenUsage() != 0 {
				t.Errorf("drained: %v", done)
			}
			l := e.Loads()[0]
			if math.Abs(l.GenerationTokens-6*20) > 1e-6 || l.PrefixCacheQueries != 6*64 || l.PrefixCacheHits != 0 {
				t.Errorf("counters: %+v", l)
			}

			// The same prompt again hits the cache (its blocks stayed).
			if _, err := e.Step(Request{Rank: 0, Tokens: prompt(10_000, 64)}); err != nil {
				t.Fatal(err)
			}
			if l := e.Loads()[0]; l.PrefixCacheHits != 64 || l.CacheHitRate <= 0 {
				t.Errorf("after a repeated prompt: %+v", l)
			}
			// vLLM's hit rate comes from the counters' deltas between
			// scrapes a rate window apart; SGLang reports it.
			deadline := time.Now().Add(30 * time.Second)
			for {
				if r := read()[0]; r.CacheHitRate != nil && r.GetCacheHitRate() > 0 {
					break
				}
				if time.Now().After(deadline) {
					t.Fatal("no cache hit rate in the records")
				}
				if _, err := e.Step(Request{Rank: 0, Tokens: prompt(10_000, 64)}); err != nil {
					t.Fatal(err)
				}
				time.Sleep(50 * time.Millisecond)
			}
		})
	}
}

// TestTokenSpeedExportsNoLoad: TokenSpeed has no load exposition to mimic.
func TestTokenSpeedExportsNoLoad(t *testing.T) {
	base := freeport.ForTest(t, 1)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	e, err := Start(ctx, Options{Engine: "tokenspeed", KVEventsConfig: fmt.Sprintf(`{"enable_kv_cache_events": true, "endpoint": "tcp://*:%d"}`, base), ControlAddr: "127.0.0.1:0"})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	client := &http.Client{Transport: &http.Transport{}}
	defer client.CloseIdleConnections()
	for _, path := range []string{"/metrics", "/v1/loads"} {
		resp, err := client.Get("http://" + e.ControlAddr() + path)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusNotFound {
			t.Errorf("%s: %s, want 404", path, resp.Status)
		}
	}
}
