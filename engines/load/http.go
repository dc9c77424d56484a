package load

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strings"
	"sync/atomic"

	"google.golang.org/protobuf/proto"

	"github.com/kvrelay/kvrelay/proto/kvpb"
)

// httpGet reads url's body, at most maxBytes of it. Its errors show url
// without its credentials (redacted): the poller logs them.
func httpGet(ctx context.Context, client *http.Client, rawURL string, maxBytes int64) ([]byte, error) {
	url := redacted(rawURL)
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, rawURL, nil)
	if err != nil {
		return nil, fmt.Errorf("load: GET %s: not a valid URL", url) // err quotes it whole
	}
	resp, err := client.Do(req)
	if err != nil {
		return nil, fmt.Errorf("load: GET %s: %w", url, err)
	}
	defer resp.Body.Close()
	switch {
	case resp.StatusCode == http.StatusNotFound || resp.StatusCode == http.StatusMethodNotAllowed:
		return nil, fmt.Errorf("%w: GET %s: %s", ErrRefused, url, resp.Status)
	case resp.StatusCode != http.StatusOK:
		return nil, fmt.Errorf("load: GET %s: %s", url, resp.Status)
	}
	body, err := io.ReadAll(io.LimitReader(resp.Body, maxBytes+1))
	if err != nil {
		return nil, fmt.Errorf("load: GET %s: reading the body: %w", url, err)
	}
	if int64(len(body)) > maxBytes {
		return nil, fmt.Errorf("%w: GET %s: more than %d bytes", ErrTooLarge, url, maxBytes)
	}
	return body, nil
}

// v1Loads reads SGLang's GET /v1/loads (JSON, the shape of GetLoadsResponse).
type v1Loads struct {
	client *http.Client
	url    string
}

// NewV1Loads reads SGLang's /v1/loads at url (the full URL, for example
// http://127.0.0.1:30000/v1/loads). client nil is http.DefaultClient.
func NewV1Loads(client *http.Client, url string) Fetcher {
	if client == nil {
		client = http.DefaultClient
	}
	return &v1Loads{client: client, url: url}
}

func (v *v1Loads) Name() string { return "v1loads" }

func (v *v1Loads) Fetch(ctx context.Context, maxBytes int64) (map[int32]*kvpb.EngineLoad, error) {
	body, err := httpGet(ctx, v.client, v.url, maxBytes)
	if err != nil {
		return nil, err
	}
	return ParseV1Loads(body)
}

// v1LoadsJSON is /v1/loads as SGLang writes it: the per-rank dataclasses
// with their None fields left out, so a missing key is unknown.
type v1LoadsJSON struct {
	Loads []struct {
		DpRank                   *int32   `json:"dp_rank"`
		NumRunningReqs           *int32   `json:"num_running_reqs"`
		NumWaitingReqs           *int32   `json:"num_waiting_reqs"`
		NumUsedTokens            *int32   `json:"num_used_tokens"`
		MaxTotalNumTokens        *int32   `json:"max_total_num_tokens"`
		TokenUsage               *float64 `json:"token_usage"`
		GenThroughput            *float64 `json:"gen_throughput"`
		CacheHitRate             *float64 `json:"cache_hit_rate"`
		MaxRunningRequests       *int32   `json:"max_running_requests"`
		NumWaitingUncachedTokens *int32   `json:"num_waiting_uncached_tokens"`
		Memory                   *struct {
			WeightGB      float64 `json:"weight_gb"`
			KvCacheGB     float64 `json:"kv_cache_gb"`
			GraphGB       float64 `json:"graph_gb"`
			TokenCapacity int32   `json:"token_capacity"`
		} `json:"memory"`
		Speculative *struct {
			AcceptLength float64 `json:"accept_length"`
			AcceptRate   float64 `json:"accept_rate"`
		} `json:"speculative"`
		Lora *struct {
			SlotsUsed   int32   `json:"slots_used"`
			SlotsTotal  int32   `json:"slots_total"`
			Utilization float64 `json:"utilization"`
		} `json:"lora"`
		Disaggregation *struct {
			Mode                     string  `json:"mode"`
			PrefillPreallocQueueReqs int32   `json:"prefill_prealloc_queue_reqs"`
			PrefillInflightQueueReqs int32   `json:"prefill_inflight_queue_reqs"`
			DecodePreallocQueueReqs  int32   `json:"decode_prealloc_queue_reqs"`
			DecodeTransferQueueReqs  int32   `json:"decode_transfer_queue_reqs"`
			DecodeRetractedQueueReqs int32   `json:"decode_retracted_queue_reqs"`
			KvTransferSpeedGBs       float64 `json:"kv_transfer_speed_gb_s"`
			KvTransferLatencyMs      float64 `json:"kv_transfer_latency_ms"`
		} `json:"disaggregation"`
		Queues *struct {
			Waiting   int32 `json:"waiting"`
			Grammar   int32 `json:"grammar"`
			Paused    int32 `json:"paused"`
			Retracted int32 `json:"retracted"`
		} `json:"queues"`
	} `json:"loads"`
}

// maxV1Ranks bounds the ranks one report may name: more is not an engine.
const maxV1Ranks = 4096

// ParseV1Loads reads a /v1/loads body into records per rank. A rank's record
// leaves unset what its report leaves out.
func ParseV1Loads(body []byte) (map[int32]*kvpb.EngineLoad, error) {
	var doc v1LoadsJSON
	if err := json.Unmarshal(body, &doc); err != nil {
		return nil, fmt.Errorf("%w: /v1/loads: %w", ErrMalformed, err)
	}
	if len(doc.Loads) == 0 {
		return nil, fmt.Errorf("%w: /v1/loads: no loads", ErrMalformed)
	}
	if len(doc.Loads) > maxV1Ranks {
		return nil, fmt.Errorf("%w: /v1/loads: %d ranks", ErrMalformed, len(doc.Loads))
	}
	out := make(map[int32]*kvpb.EngineLoad, len(doc.Loads))
	for i, l := range doc.Loads {
		if l.DpRank == nil || *l.DpRank < 0 {
			return nil, fmt.Errorf("%w: /v1/loads: load %d has no valid dp_rank", ErrMalformed, i)
		}
		r := &kvpb.EngineLoad{
			RunningRequests:       unsigned(deref(l.NumRunningReqs)),
			WaitingRequests:       unsigned(deref(l.NumWaitingReqs)),
			TokenUsage:            deref(l.TokenUsage),
			GenThroughput:         deref(l.GenThroughput),
			MaxRunningRequests:    unsigned(deref(l.MaxRunningRequests)),
			CacheHitRate:          l.CacheHitRate,
			NumUsedTokens:         l.NumUsedTokens,
			MaxTotalNumTokens:     l.MaxTotalNumTokens,
			WaitingUncachedTokens: optionalUnsigned(l.NumWaitingUncachedTokens),
		}
		if m := l.Memory; m != nil {
			r.Memory = &kvpb.EngineMemory{WeightGb: m.WeightGB, KvCacheGb: m.KvCacheGB, GraphGb: m.GraphGB, TokenCapacity: m.TokenCapacity}
		}
		if s := l.Speculative; s != nil {
			r.Speculative = &kvpb.EngineSpeculative{AcceptLength: s.AcceptLength, AcceptRate: s.AcceptRate}
		}
		if s := l.Lora; s != nil {
			r.Lora = &kvpb.EngineLora{SlotsUsed: s.SlotsUsed, SlotsTotal: s.SlotsTotal, Utilization: s.Utilization}
		}
		if d := l.Disaggregation; d != nil {
			r.Disaggregation = &kvpb.EngineDisaggregation{
				Mode: d.Mode, PrefillPreallocQueueReqs: d.PrefillPreallocQueueReqs, PrefillInflightQueueReqs: d.PrefillInflightQueueReqs,
				DecodePreallocQueueReqs: d.DecodePreallocQueueReqs, DecodeTransferQueueReqs: d.DecodeTransferQueueReqs,
				DecodeRetractedQueueReqs: d.DecodeRetractedQueueReqs, KvTransferSpeedGbS: d.KvTransferSpeedGBs, KvTransferLatencyMs: d.KvTransferLatencyMs,
			}
		}
		if q := l.Queues; q != nil {
			r.Queues = &kvpb.EngineQueues{Waiting: q.Waiting, Grammar: q.Grammar, Paused: q.Paused, Retracted: q.Retracted}
		}
		out[*l.DpRank] = r
	}
	return out, nil
}

func deref[T any](p *T) T {
	var zero T
	if p == nil {
		return zero
	}
	return *p
}

func optionalUnsigned(p *int32) *uint32 {
	if p == nil {
		return nil
	}
	return proto.Uint32(unsigned(*p))
}

// engineHTTP reads an engine's HTTP server as SMG's gateway reads an HTTP
// worker: /v1/loads first, and /metrics once /v1/loads is refused (an
// engine that does not serve it, vLLM).
type engineHTTP struct {
	loads   *v1Loads
	metrics *metricsFetcher
	// refused: /v1/loads answered 404; read /metrics from then on. Set by
	// the polling goroutine, read by Name from a /metrics scrape.
	refused atomic.Bool
}

// NewHTTP reads the engine whose HTTP server is at base (for example
// http://127.0.0.1:8000): /v1/loads first, /metrics when that is refused.
// A base that already names a path (…/metrics or …/v1/loads) reads that
// path only.
func NewHTTP(client *http.Client, base string) (Fetcher, error) {
	u, err := url.Parse(base)
	if err != nil || u.Scheme == "" || u.Host == "" {
		return nil, fmt.Errorf("load: engine URL %q: want http(s)://host:port[/metrics|/v1/loads]", redacted(base))
	}
	path := strings.TrimRight(u.Path, "/")
	switch {
	case strings.HasSuffix(path, "/v1/loads") || strings.HasSuffix(path, "/get_load"):
		if strings.HasSuffix(path, "/get_load") {
			return nil, fmt.Errorf("load: engine URL %q: /get_load is SGLang's deprecated endpoint; use /v1/loads", redacted(base))
		}
		return NewV1Loads(client, base), nil
	case strings.HasSuffix(path, "/metrics"):
		return NewMetrics(client, base), nil
	case path != "":
		return nil, fmt.Errorf("load: engine URL %q: give the server's base URL, or one ending in /metrics or /v1/loads", redacted(base))
	}
	root := strings.TrimRight(base, "/")
	return &engineHTTP{
		loads:   NewV1Loads(client, root+"/v1/loads").(*v1Loads),
		metrics: NewMetrics(client, root+"/metrics").(*metricsFetcher),
	}, nil
}

func (e *engineHTTP) Name() string {
	if e.refused.Load() {
		return "metrics"
	}
	return "v1loads"
}

func (e *engineHTTP) Fetch(ctx context.Context, maxBytes int64) (map[int32]*kvpb.EngineLoad, error) {
	if !e.refused.Load() {
		loads, err := e.loads.Fetch(ctx, maxBytes)
		if !errors.Is(err, ErrRefused) {
			return loads, err
		}
		e.refused.Store(true)
	}
	return e.metrics.Fetch(ctx, maxBytes)
}

// redacted is an engine URL as messages show it: its userinfo (basic
// auth, http://user:pw@host) replaced by REDACTED, also where the URL
// does not parse.
func redacted(s string) string {
	i := strings.Index(s, "://")
	if i < 0 {
		return s
	}
	rest := s[i+3:]
	authority := rest
	if j := strings.IndexAny(rest, "/?#"); j >= 0 {
		authority = rest[:j]
	}
	at := strings.LastIndexByte(authority, '@')
	if at < 0 {
		return s
	}
	return s[:i+3] + "REDACTED@" + rest[at+1:]
}
