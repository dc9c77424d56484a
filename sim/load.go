package sim

import (
	"math"
	"net/http"
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// The simulated scheduler behind the load an engine exports. Every request
// a step serves joins its rank's waiting queue with its prompt's uncached
// tokens to prefill and LoadModel.OutputTokens to decode. Up to MaxRunning
// run at once; the rank prefills PrefillTokensPerSecond shared first come
// first served, and each prefilled request decodes DecodeTokensPerSecond.
// Time is the engine's clock, so the load moves with the simulated work:
// a burst of requests on one rank queues there, its KV usage and backlog
// rise and drain, and a rank whose prompts hit the cache has less to
// prefill and holds less. The figures are exported as the engine does (ServeLoad):
// vLLM's /metrics (engine label = DP rank; counters for prefix-cache
// queries and hits and generated tokens), SGLang's /metrics (dp_rank
// label) and its /v1/loads JSON. TokenSpeed exports no load.

// LoadModel shapes the simulated scheduler. Zero fields take the defaults.
type LoadModel struct {
	// MaxRunning is the batch size (default 16).
	MaxRunning int
	// PrefillTokensPerSecond is each rank's prefill speed (default 16,384).
	PrefillTokensPerSecond float64
	// DecodeTokensPerSecond is each running request's decode speed once
	// prefilled (default 40).
	DecodeTokensPerSecond float64
	// OutputTokens is each request's generated length (default 64).
	OutputTokens int
}

func (m LoadModel) withDefaults() LoadModel {
	if m.MaxRunning <= 0 {
		m.MaxRunning = 16
	}
	if m.PrefillTokensPerSecond <= 0 {
		m.PrefillTokensPerSecond = 16_384
	}
	if m.DecodeTokensPerSecond <= 0 {
		m.DecodeTokensPerSecond = 40
	}
	if m.OutputTokens <= 0 {
		m.OutputTokens = 64
	}
	return m
}

// loadTick is the simulated time one scheduling pass covers: finer than
// the sources' quarter-second scrapes.
const loadTick = 10 * time.Millisecond

// simRequest is one request in a rank's scheduler.
type simRequest struct {
	prompt      int     // prompt tokens
	uncached    int     // of which the cache did not hold
	prefillLeft float64 // uncached tokens still to prefill
	decodeLeft  float64 // tokens still to generate
	generated   float64
}

// rankLoad is one rank's scheduler state and counters.
type rankLoad struct {
	waiting, running []*simRequest
	at               time.Time // simulated time the state is at
	// Counters, in tokens, as vLLM counts them.
	queries, hits, generation float64
	// hitRate is a decayed average of the requests' hit fractions (SGLang
	// reports a recent rate, not a lifetime one).
	hitRate float64
	served  int
}

// admitLocked takes one served request into rank's queue at now; e.mu is
// held.
func (e *Engine) admitLocked(rank int, prompt, hitTokens int, now time.Time) {
	e.loadMu.Lock()
	defer e.loadMu.Unlock()
	l := e.loads[rank]
	e.advanceLocked(l, now)
	hitTokens = min(hitTokens, prompt)
	l.queries += float64(prompt)
	l.hits += float64(hitTokens)
	frac := 0.0
	if prompt > 0 {
		frac = float64(hitTokens) / float64(prompt)
	}
	if l.served == 0 {
		l.hitRate = frac
	} else {
		l.hitRate = 0.9*l.hitRate + 0.1*frac
	}
	l.served++
	u := prompt - hitTokens
	l.waiting = append(l.waiting, &simRequest{prompt: prompt, uncached: u, prefillLeft: float64(u), decodeLeft: float64(e.loadModel.OutputTokens)})
	e.scheduleLocked(l)
}

// scheduleLocked moves waiting requests into free batch slots.
func (e *Engine) scheduleLocked(l *rankLoad) {
	for len(l.running) < e.loadModel.MaxRunning && len(l.waiting) > 0 {
		l.running = append(l.running, l.waiting[0])
		l.waiting[0] = nil
		l.waiting = l.waiting[1:]
	}
}

// advanceLocked runs rank's scheduler up to now, one loadTick at a time.
func (e *Engine) advanceLocked(l *rankLoad, now time.Time) {
	if l.at.IsZero() || !now.After(l.at) {
		if l.at.IsZero() {
			l.at = now
		}
		return
	}
	m := e.loadModel
	for l.at.Before(now) {
		if len(l.running) == 0 && len(l.waiting) == 0 {
			l.at = now // idle: nothing to run through
			return
		}
		dt := min(loadTick, now.Sub(l.at))
		l.at = l.at.Add(dt)
		sec := dt.Seconds()
		budget := m.PrefillTokensPerSecond * sec
		kept := l.running[:0]
		for _, r := range l.running {
			if r.prefillLeft > 0 {
				use := math.Min(budget, r.prefillLeft)
				r.prefillLeft -= use
				budget -= use
			} else {
				d := math.Min(m.DecodeTokensPerSecond*sec, r.decodeLeft)
				r.decodeLeft -= d
				r.generated += d
				l.generation += d
			}
			if r.prefillLeft > 0 || r.decodeLeft > 0 {
				kept = append(kept, r)
			}
		}
		clear(l.running[len(kept):])
		l.running = kept
		e.scheduleLocked(l)
	}
}

// RankLoad is one rank's load as the simulated engine exports it.
type RankLoad struct {
	Rank                     int     `json:"dp_rank"`
	NumRunningReqs           int     `json:"num_running_reqs"`
	NumWaitingReqs           int     `json:"num_waiting_reqs"`
	NumTotalReqs             int     `json:"num_total_reqs"`
	NumUsedTokens            int     `json:"num_used_tokens"`
	MaxTotalNumTokens        int     `json:"max_total_num_tokens"`
	TokenUsage               float64 `json:"token_usage"`
	GenThroughput            float64 `json:"gen_throughput"`
	CacheHitRate             float64 `json:"cache_hit_rate"`
	Utilization              float64 `json:"utilization"`
	MaxRunningRequests       int     `json:"max_running_requests"`
	NumWaitingUncachedTokens int     `json:"num_waiting_uncached_tokens"`
	// Counters (tokens), for vLLM's exposition.
	PrefixCacheQueries float64 `json:"-"`
	PrefixCacheHits    float64 `json:"-"`
	GenerationTokens   float64 `json:"-"`
}

// Loads is every rank's load now (the engine's clock).
func (e *Engine) Loads() []RankLoad {
	e.loadMu.Lock()
	defer e.loadMu.Unlock()
	now := e.clock()
	capTokens := e.opts.CapacityBlocks * e.opts.BlockSize
	out := make([]RankLoad, len(e.loads))
	for i, l := range e.loads {
		e.advanceLocked(l, now)
		used, decoding := 0.0, 0
		for _, r := range l.running {
			// A running request holds the blocks it allocated: its
			// uncached prompt and what it generated. The cached blocks it
			// found are shared with the cache and other requests (a chat's
			// system prompt), so they are not counted per request.
			used += float64(r.uncached) + r.generated
			if r.prefillLeft == 0 {
				decoding++
			}
		}
		uncached := 0
		for _, r := range l.waiting {
			uncached += r.uncached
		}
		usage := math.Min(1, used/float64(capTokens))
		out[i] = RankLoad{
			Rank: i, NumRunningReqs: len(l.running), NumWaitingReqs: len(l.waiting), NumTotalReqs: len(l.running) + len(l.waiting),
			NumUsedTokens: int(math.Min(used, float64(capTokens))), MaxTotalNumTokens: capTokens,
			TokenUsage: usage, Utilization: usage,
			GenThroughput: float64(decoding) * e.loadModel.DecodeTokensPerSecond,
			CacheHitRate:  l.hitRate, MaxRunningRequests: e.loadModel.MaxRunning, NumWaitingUncachedTokens: uncached,
			PrefixCacheQueries: l.queries, PrefixCacheHits: l.hits, GenerationTokens: l.generation,
		}
	}
	return out
}

// loadCollector writes the engine's exposition with its own metric names.
type loadCollector struct {
	e     *Engine
	model string
}

var (
	vllmDescs = struct{ running, waiting, usage, queries, hits, generation, cacheInfo *prometheus.Desc }{
		running:    prometheus.NewDesc("vllm:num_requests_running", "Number of requests in model execution batches.", []string{"model_name", "engine"}, nil),
		waiting:    prometheus.NewDesc("vllm:num_requests_waiting", "Number of requests waiting to be processed.", []string{"model_name", "engine"}, nil),
		usage:      prometheus.NewDesc("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", []string{"model_name", "engine"}, nil),
		queries:    prometheus.NewDesc("vllm:prefix_cache_queries_total", "Prefix cache queries, in terms of number of queried tokens.", []string{"model_name", "engine"}, nil),
		hits:       prometheus.NewDesc("vllm:prefix_cache_hits_total", "Prefix cache hits, in terms of number of cached tokens.", []string{"model_name", "engine"}, nil),
		generation: prometheus.NewDesc("vllm:generation_tokens_total", "Number of generation tokens processed.", []string{"model_name", "engine"}, nil),
		cacheInfo:  prometheus.NewDesc("vllm:cache_config_info", "Information of the LLMEngine CacheConfig", []string{"block_size", "engine", "num_gpu_blocks", "enable_prefix_caching"}, nil),
	}
	sglangDescs = struct{ running, queue, usage, throughput, hitRate, used, utilization *prometheus.Desc }{
		running:     prometheus.NewDesc("sglang:num_running_reqs", "The number of running requests.", []string{"model_name", "dp_rank"}, nil),
		queue:       prometheus.NewDesc("sglang:num_queue_reqs", "The number of requests in the waiting queue.", []string{"model_name", "dp_rank"}, nil),
		usage:       prometheus.NewDesc("sglang:token_usage", "The token usage.", []string{"model_name", "dp_rank"}, nil),
		throughput:  prometheus.NewDesc("sglang:gen_throughput", "The generation throughput (token/s).", []string{"model_name", "dp_rank"}, nil),
		hitRate:     prometheus.NewDesc("sglang:cache_hit_rate", "The prefix cache hit rate.", []string{"model_name", "dp_rank"}, nil),
		used:        prometheus.NewDesc("sglang:num_used_tokens", "The number of used tokens.", []string{"model_name", "dp_rank"}, nil),
		utilization: prometheus.NewDesc("sglang:utilization", "The utilization.", []string{"model_name", "dp_rank"}, nil),
	}
)

func (c loadCollector) Describe(ch chan<- *prometheus.Desc) { prometheus.DescribeByCollect(c, ch) }

func (c loadCollector) Collect(ch chan<- prometheus.Metric) {
	gauge, counter := prometheus.GaugeValue, prometheus.CounterValue
	for _, l := range c.e.Loads() {
		rank := strconv.Itoa(l.Rank)
		switch c.e.opts.Engine {
		case "vllm":
			d := vllmDescs
			ch <- prometheus.MustNewConstMetric(d.running, gauge, float64(l.NumRunningReqs), c.model, rank)
			ch <- prometheus.MustNewConstMetric(d.waiting, gauge, float64(l.NumWaitingReqs), c.model, rank)
			ch <- prometheus.MustNewConstMetric(d.usage, gauge, l.TokenUsage, c.model, rank)
			ch <- prometheus.MustNewConstMetric(d.queries, counter, l.PrefixCacheQueries, c.model, rank)
			ch <- prometheus.MustNewConstMetric(d.hits, counter, l.PrefixCacheHits, c.model, rank)
			ch <- prometheus.MustNewConstMetric(d.generation, counter, l.GenerationTokens, c.model, rank)
			ch <- prometheus.MustNewConstMetric(d.cacheInfo, gauge, 1, strconv.Itoa(c.e.opts.BlockSize), rank, strconv.Itoa(c.e.opts.CapacityBlocks), "True")
		case "sglang":
			d := sglangDescs
			ch <- prometheus.MustNewConstMetric(d.running, gauge, float64(l.NumRunningReqs), c.model, rank)
			ch <- prometheus.MustNewConstMetric(d.queue, gauge, float64(l.NumWaitingReqs), c.model, rank)
			ch <- prometheus.MustNewConstMetric(d.usage, gauge, l.TokenUsage, c.model, rank)
			ch <- prometheus.MustNewConstMetric(d.throughput, gauge, l.GenThroughput, c.model, rank)
			ch <- prometheus.MustNewConstMetric(d.hitRate, gauge, l.CacheHitRate, c.model, rank)
			ch <- prometheus.MustNewConstMetric(d.used, gauge, float64(l.NumUsedTokens), c.model, rank)
			ch <- prometheus.MustNewConstMetric(d.utilization, gauge, l.Utilization, c.model, rank)
		}
	}
}

// serveLoad adds the engine's load endpoints to mux: GET /metrics (vLLM's
// or SGLang's names) and, for SGLang, GET /v1/loads. vLLM serves no
// /v1/loads (404, as the real one), so a reader that tries it first falls
// back to /metrics; TokenSpeed serves neither.
func (e *Engine) serveLoad(mux *http.ServeMux) {
	if e.opts.Engine != "vllm" && e.opts.Engine != "sglang" {
		return
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(loadCollector{e: e, model: e.opts.ModelName})
	mux.Handle("GET /metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	if e.opts.Engine != "sglang" {
		return
	}
	mux.HandleFunc("GET /v1/loads", func(w http.ResponseWriter, r *http.Request) {
		loads := e.Loads()
		agg := struct {
			TotalRunning int     `json:"total_running_reqs"`
			TotalWaiting int     `json:"total_waiting_reqs"`
			Total        int     `json:"total_reqs"`
			AvgUsage     float64 `json:"avg_token_usage"`
			AvgThrough   float64 `json:"avg_throughput"`
			AvgUtil      float64 `json:"avg_utilization"`
		}{}
		for _, l := range loads {
			agg.TotalRunning += l.NumRunningReqs
			agg.TotalWaiting += l.NumWaitingReqs
			agg.Total += l.NumTotalReqs
			agg.AvgUsage += l.TokenUsage / float64(len(loads))
			agg.AvgThrough += l.GenThroughput / float64(len(loads))
			agg.AvgUtil += l.Utilization / float64(len(loads))
		}
		writeJSON(w, http.StatusOK, map[string]any{
			"timestamp": e.clock().UTC().Format(time.RFC3339Nano), "version": "sim", "dp_rank_count": len(loads),
			"loads": loads, "aggregate": agg,
		})
	})
}
