package load

import (
	"bytes"
	"context"
	"fmt"
	"math"
	"net/http"
	"strconv"
	"strings"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	"google.golang.org/protobuf/proto"

	"github.com/kvrelay/kvrelay/proto/kvpb"
)

// rateWindow is the shortest span a counter's rate is taken over: shorter
// deltas between quarter-second scrapes would swing with every scheduler
// step. The engines' own loggers average over longer still (vLLM logs
// every 10 s).
const rateWindow = time.Second

// metricsFetcher reads an engine's Prometheus exposition (vLLM's or
// SGLang's names) and turns each DP rank's series into a record. Counters
// become rates from deltas between scrapes, so it keeps the last counters.
type metricsFetcher struct {
	client *http.Client
	url    string
	now    func() time.Time
	rates  map[int32]*rankRates
}

// rankRates are one rank's counters at the start of the current rate
// window, and the rates last computed.
type rankRates struct {
	at                  time.Time
	hits, queries, gen  float64
	hitRate, throughput *float64
}

// NewMetrics reads the Prometheus exposition at url (…/metrics). client nil
// is http.DefaultClient.
func NewMetrics(client *http.Client, url string) Fetcher {
	if client == nil {
		client = http.DefaultClient
	}
	return &metricsFetcher{client: client, url: url, now: time.Now, rates: map[int32]*rankRates{}}
}

func (m *metricsFetcher) Name() string { return "metrics" }

func (m *metricsFetcher) Fetch(ctx context.Context, maxBytes int64) (map[int32]*kvpb.EngineLoad, error) {
	body, err := httpGet(ctx, m.client, m.url, maxBytes)
	if err != nil {
		return nil, err
	}
	return m.parse(body, m.now())
}

// series is what the exposition says about one rank, by the record's
// field; nil is not exposed.
type series struct {
	running, waiting, usage, genRate, hitRate, used, maxTotal, maxRunning, uncached *float64
	// Counters, for rates (vLLM).
	hits, queries, genTokens *float64
}

// maxRanks bounds the ranks one exposition may name.
const maxRanks = 4096

// parse reads one exposition taken at now.
func (m *metricsFetcher) parse(body []byte, now time.Time) (map[int32]*kvpb.EngineLoad, error) {
	parser := expfmt.NewTextParser(model.UTF8Validation)
	families, err := parser.TextToMetricFamilies(bytes.NewReader(body))
	if err != nil {
		return nil, fmt.Errorf("%w: %s: %w", ErrMalformed, m.url, err)
	}
	ranks := map[int32]*series{}
	var blockTokens *float64 // vLLM's cache_config_info: num_gpu_blocks × block_size
	for name, fam := range families {
		if name == "vllm:cache_config_info" {
			blockTokens = cacheTokens(fam)
			continue
		}
		field, rankLabel, ok := fieldOf(name)
		if !ok {
			continue
		}
		if current, old := replacedBy[name]; old && families[current] != nil {
			continue // both names exposed: the current one counts
		}
		for _, metric := range fam.GetMetric() {
			v, ok := valueOf(metric)
			if !ok {
				continue
			}
			rank, ok := rankOf(metric, rankLabel)
			if !ok {
				continue
			}
			s := ranks[rank]
			if s == nil {
				if len(ranks) >= maxRanks {
					return nil, fmt.Errorf("%w: %s: more than %d ranks", ErrMalformed, m.url, maxRanks)
				}
				s = &series{}
				ranks[rank] = s
			}
			*field(s) = &v
		}
	}
	if len(ranks) == 0 {
		return nil, fmt.Errorf("%w: %s: no vLLM or SGLang load series", ErrMalformed, m.url)
	}
	out := make(map[int32]*kvpb.EngineLoad, len(ranks))
	for rank, s := range ranks {
		out[rank] = m.record(rank, s, blockTokens, now)
	}
	for rank := range m.rates {
		if _, ok := ranks[rank]; !ok {
			delete(m.rates, rank)
		}
	}
	return out, nil
}

// record is one rank's record: what the exposition says, counters turned
// into rates. What it does not say stays unset (or 0 for the fields that
// have no presence).
func (m *metricsFetcher) record(rank int32, s *series, blockTokens *float64, now time.Time) *kvpb.EngineLoad {
	r := &kvpb.EngineLoad{
		RunningRequests:       count(s.running),
		WaitingRequests:       count(s.waiting),
		TokenUsage:            deref(s.usage),
		MaxRunningRequests:    count(s.maxRunning),
		WaitingUncachedTokens: optionalCount(s.uncached),
		CacheHitRate:          s.hitRate,
		NumUsedTokens:         tokens(s.used),
		MaxTotalNumTokens:     tokens(s.maxTotal),
	}
	if s.genRate != nil {
		r.GenThroughput = *s.genRate
	}
	if r.MaxTotalNumTokens == nil && blockTokens != nil {
		r.MaxTotalNumTokens = tokens(blockTokens)
	}
	if r.NumUsedTokens == nil && r.MaxTotalNumTokens != nil && s.usage != nil {
		// As vLLM's servicer reports it: usage of the KV capacity.
		r.NumUsedTokens = proto.Int32(int32(math.Round(*s.usage * float64(*r.MaxTotalNumTokens))))
	}
	if s.hits != nil || s.genTokens != nil {
		m.counterRates(rank, s, now)
		rr := m.rates[rank]
		if rr.hitRate != nil && r.CacheHitRate == nil {
			r.CacheHitRate = proto.Float64(*rr.hitRate)
		}
		if rr.throughput != nil && s.genRate == nil {
			r.GenThroughput = *rr.throughput
		}
	}
	return r
}

// counterRates advances rank's rate window: once it spans rateWindow, the
// rates are the counters' deltas over it. A counter that went down (the
// engine restarted) starts a new window with the rates unknown.
func (m *metricsFetcher) counterRates(rank int32, s *series, now time.Time) {
	hits, queries, gen := deref(s.hits), deref(s.queries), deref(s.genTokens)
	rr := m.rates[rank]
	if rr == nil || hits < rr.hits || queries < rr.queries || gen < rr.gen {
		m.rates[rank] = &rankRates{at: now, hits: hits, queries: queries, gen: gen}
		return
	}
	span := now.Sub(rr.at)
	if span < rateWindow {
		return
	}
	if s.genTokens != nil {
		rr.throughput = proto.Float64((gen - rr.gen) / span.Seconds())
	}
	if dq := queries - rr.queries; s.hits != nil && s.queries != nil && dq > 0 {
		// No queries in the window says nothing about the hit rate: the
		// last one stands.
		rr.hitRate = proto.Float64((hits - rr.hits) / dq)
	}
	rr.at, rr.hits, rr.queries, rr.gen = now, hits, queries, gen
}

// fieldOf maps a family name to the series field it fills and the label that
// names the rank: vLLM's "engine", SGLang's "dp_rank". SGLang's names carry
// "sglang:" (its /metrics) or "sglang_" (/v1/loads?format=prometheus and
// older releases).
func fieldOf(name string) (func(*series) **float64, string, bool) {
	if rest, ok := strings.CutPrefix(name, "vllm:"); ok {
		f, ok := vllmFields[strings.TrimSuffix(rest, "_total")]
		return f, "engine", ok
	}
	rest, ok := strings.CutPrefix(name, "sglang:")
	if !ok {
		rest, ok = strings.CutPrefix(name, "sglang_")
	}
	if !ok {
		return nil, "", false
	}
	f, ok := sglangFields[rest]
	return f, "dp_rank", ok
}

var vllmFields = map[string]func(*series) **float64{
	"num_requests_running":  func(s *series) **float64 { return &s.running },
	"num_requests_waiting":  func(s *series) **float64 { return &s.waiting },
	"kv_cache_usage_perc":   func(s *series) **float64 { return &s.usage },
	"prefix_cache_hits":     func(s *series) **float64 { return &s.hits },
	"prefix_cache_queries":  func(s *series) **float64 { return &s.queries },
	"generation_tokens":     func(s *series) **float64 { return &s.genTokens },
	"gpu_cache_usage_perc":  func(s *series) **float64 { return &s.usage }, // before kv_cache_usage_perc
	"gpu_prefix_cache_hits": func(s *series) **float64 { return &s.hits },  // before prefix_cache_hits
	"gpu_prefix_cache_queries": func(s *series) **float64 {
		return &s.queries
	},
}

// replacedBy maps vLLM's deprecated names to their current ones.
var replacedBy = map[string]string{
	"vllm:gpu_cache_usage_perc":           "vllm:kv_cache_usage_perc",
	"vllm:gpu_prefix_cache_hits_total":    "vllm:prefix_cache_hits_total",
	"vllm:gpu_prefix_cache_queries_total": "vllm:prefix_cache_queries_total",
}

var sglangFields = map[string]func(*series) **float64{
	"num_running_reqs":            func(s *series) **float64 { return &s.running },
	"num_queue_reqs":              func(s *series) **float64 { return &s.waiting },
	"num_waiting_reqs":            func(s *series) **float64 { return &s.waiting },
	"token_usage":                 func(s *series) **float64 { return &s.usage },
	"gen_throughput":              func(s *series) **float64 { return &s.genRate },
	"cache_hit_rate":              func(s *series) **float64 { return &s.hitRate },
	"num_used_tokens":             func(s *series) **float64 { return &s.used },
	"max_total_num_tokens":        func(s *series) **float64 { return &s.maxTotal },
	"max_running_requests":        func(s *series) **float64 { return &s.maxRunning },
	"num_waiting_uncached_tokens": func(s *series) **float64 { return &s.uncached },
}

func valueOf(m *dto.Metric) (float64, bool) {
	var v float64
	switch {
	case m.Gauge != nil:
		v = m.Gauge.GetValue()
	case m.Counter != nil:
		v = m.Counter.GetValue()
	case m.Untyped != nil:
		v = m.Untyped.GetValue()
	default:
		return 0, false
	}
	if math.IsNaN(v) || math.IsInf(v, 0) || v < 0 {
		return 0, false
	}
	return v, true
}

// rankOf is the rank the metric's label names; a metric without the label
// is rank 0's (an engine without data parallelism).
func rankOf(m *dto.Metric, label string) (int32, bool) {
	for _, l := range m.GetLabel() {
		if l.GetName() == label {
			r, err := strconv.ParseInt(l.GetValue(), 10, 32)
			if err != nil || r < 0 {
				return 0, false
			}
			return int32(r), true
		}
	}
	return 0, true
}

// cacheTokens is the KV capacity in tokens from vLLM's cache_config_info
// labels (num_gpu_blocks × block_size), nil when they are missing.
func cacheTokens(fam *dto.MetricFamily) *float64 {
	for _, m := range fam.GetMetric() {
		var blocks, size float64
		for _, l := range m.GetLabel() {
			v, err := strconv.ParseFloat(l.GetValue(), 64)
			if err != nil {
				continue
			}
			switch l.GetName() {
			case "num_gpu_blocks":
				blocks = v
			case "block_size":
				size = v
			}
		}
		if t := blocks * size; t > 0 && t <= math.MaxInt32 {
			return &t
		}
	}
	return nil
}

func count(p *float64) uint32 {
	if p == nil {
		return 0
	}
	return uint32(min(math.Round(*p), math.MaxUint32))
}

func optionalCount(p *float64) *uint32 {
	if p == nil {
		return nil
	}
	return proto.Uint32(count(p))
}

func tokens(p *float64) *int32 {
	if p == nil {
		return nil
	}
	return proto.Int32(int32(min(math.Round(*p), math.MaxInt32)))
}
