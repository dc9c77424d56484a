// Package load reads an engine's load per DP rank, once per relay, for every
// subscriber stream to stamp on its batches (KvEventBatch.load, EngineLoad):
// what SMG's servicers put on their own KV-event streams (relay-semantics.md
// §1.6, §3.9).
//
// A Poller runs one Fetcher on a ticker beside the event path, never in it:
// a slow, down, malformed or oversized source costs its own goroutine a
// failed poll, logged once per change of state and counted, and nothing
// else. Readers (Latest) take the newest record per rank without locks on
// the event path. A record older than Options.MaxAge is no longer handed
// out: a batch then goes without a record (the gateway polls the worker
// itself) rather than with stale figures presented as fresh.
//
// Fetchers: the engine servicer's GetLoads over gRPC (NewGetLoads), the
// engine's Prometheus exposition (NewMetrics, vLLM and SGLang names), and
// SGLang's HTTP /v1/loads (NewV1Loads); NewHTTP tries /v1/loads first and
// falls back to /metrics, as SMG's gateway reads an HTTP worker.
//
// A field a source does not know stays unset in the record: the optional
// fields' presence says what is known (unknown is not zero).
package load

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/protobuf/proto"

	"github.com/kvrelay/kvrelay/proto/kvpb"
)

// Defaults for Options' zero fields.
const (
	// DefaultInterval is how often a source is read. The servicers stamp
	// their scheduler's figures every step and check for a change every
	// 100 ms; a quarter second keeps the record close to that at a cost an
	// engine's HTTP server does not notice.
	DefaultInterval = 250 * time.Millisecond
	// DefaultTimeout bounds one read.
	DefaultTimeout = 2 * time.Second
	// DefaultMaxAge is how long a record is handed out after its read: past
	// it, batches go without a record. SMG's gateway treats a worker whose
	// pushes stop as unknown and polls it; a record this old would be a
	// lie about an engine whose source went away.
	DefaultMaxAge = 5 * time.Second
	// DefaultMaxBytes caps one response (HTTP body or gRPC message). vLLM's
	// /metrics with histograms for a few ranks is a few hundred KiB.
	DefaultMaxBytes = 8 << 20
)

// Errors a Fetcher wraps so the Poller can count the outcome.
var (
	// ErrMalformed: the source answered with something that is not a load
	// report (bad JSON, bad exposition text, no known series).
	ErrMalformed = errors.New("malformed load report")
	// ErrTooLarge: the answer exceeded Options.MaxBytes.
	ErrTooLarge = errors.New("load report exceeds the byte cap")
	// ErrRefused: the source does not serve this report (HTTP 404, gRPC
	// UNIMPLEMENTED).
	ErrRefused = errors.New("load report not served")
)

// Fetcher reads every rank's load once. The records it returns carry no
// sample, load_only or age_ms: those are the stream's to set. It may keep
// state between calls (counters, for rates) and is called from one
// goroutine at a time.
type Fetcher interface {
	// Name labels the source in logs and metrics: getloads, metrics,
	// v1loads.
	Name() string
	Fetch(ctx context.Context, maxBytes int64) (map[int32]*kvpb.EngineLoad, error)
}

// Reading is one rank's record as last read. Load is shared by every
// reader: treat it as read-only.
type Reading struct {
	Load *kvpb.EngineLoad
	// At is when the read that produced it finished.
	At time.Time
	// Core and Full are Load's protobuf encoding without and with the
	// telemetry fields (10-17, SMG's core_only), written once per read so
	// a stream appends them to its batches without marshalling.
	Core, Full []byte
}

// Options configure a Poller.
type Options struct {
	Fetcher  Fetcher
	Interval time.Duration
	Timeout  time.Duration
	MaxAge   time.Duration
	MaxBytes int64
	Logger   *slog.Logger
	// Registerer takes kvrelay_load_polls_total and
	// kvrelay_load_record_age_seconds; nil registers nothing.
	Registerer prometheus.Registerer
	// Now is the clock (tests pass their own); nil is time.Now.
	Now func() time.Time
}

// Poller reads one source on a ticker and holds the newest record per rank.
type Poller struct {
	opts Options
	log  *slog.Logger

	readings atomic.Pointer[map[int32]*Reading]
	// updated is closed (and replaced) whenever a read changed some rank's
	// record beyond its age; streams waiting for a change select on it.
	mu      sync.Mutex
	updated chan struct{}

	polls *prometheus.CounterVec
	state string // the last outcome logged, for logging once per change
}

// NewPoller checks opts and builds a poller; Run starts it.
func NewPoller(opts Options) (*Poller, error) {
	if opts.Fetcher == nil {
		return nil, errors.New("load: no fetcher")
	}
	if opts.Interval < 0 || opts.Timeout < 0 || opts.MaxAge < 0 || opts.MaxBytes < 0 {
		return nil, fmt.Errorf("load: negative interval, timeout, age or byte cap in %+v", opts)
	}
	if opts.Interval == 0 {
		opts.Interval = DefaultInterval
	}
	if opts.Timeout == 0 {
		opts.Timeout = DefaultTimeout
	}
	if opts.MaxAge == 0 {
		opts.MaxAge = DefaultMaxAge
	}
	if opts.MaxBytes == 0 {
		opts.MaxBytes = DefaultMaxBytes
	}
	if opts.Now == nil {
		opts.Now = time.Now
	}
	log := opts.Logger
	if log == nil {
		log = slog.Default()
	}
	p := &Poller{
		opts: opts, log: log, updated: make(chan struct{}),
		polls: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvrelay_load_polls_total",
			Help: "Reads of the engine's load source, by source and outcome (ok, error, timeout, malformed, too_large, refused).",
		}, []string{"source", "outcome"}),
	}
	empty := map[int32]*Reading{}
	p.readings.Store(&empty)
	if opts.Registerer != nil {
		for _, c := range []prometheus.Collector{p.polls, ageCollector{p}} {
			if err := opts.Registerer.Register(c); err != nil {
				return nil, fmt.Errorf("load: register metrics: %w", err)
			}
		}
	}
	return p, nil
}

// Run reads the source every Interval until ctx ends. Reads never overlap:
// a slow source delays its own next read, nothing else.
func (p *Poller) Run(ctx context.Context) error {
	t := time.NewTicker(p.opts.Interval)
	defer t.Stop()
	for {
		p.PollOnce(ctx)
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
	}
}

// PollOnce reads the source once and publishes what it read.
func (p *Poller) PollOnce(ctx context.Context) {
	rctx, cancel := context.WithTimeout(ctx, p.opts.Timeout)
	loads, err := p.opts.Fetcher.Fetch(rctx, p.opts.MaxBytes)
	cancel()
	if ctx.Err() != nil {
		return // shutting down: not the source's fault
	}
	outcome := outcomeOf(err)
	p.polls.WithLabelValues(p.opts.Fetcher.Name(), outcome).Inc()
	p.logState(outcome, err, len(loads))
	if err != nil {
		return
	}
	p.publish(loads, p.opts.Now())
}

func outcomeOf(err error) string {
	switch {
	case err == nil:
		return "ok"
	case errors.Is(err, context.DeadlineExceeded):
		return "timeout"
	case errors.Is(err, ErrTooLarge):
		return "too_large"
	case errors.Is(err, ErrMalformed):
		return "malformed"
	case errors.Is(err, ErrRefused):
		return "refused"
	}
	return "error"
}

// logState logs a read's outcome only when it differs from the last one:
// a source that stays down is one line, and its recovery one more.
func (p *Poller) logState(outcome string, err error, ranks int) {
	if outcome == p.state {
		return
	}
	prev := p.state
	p.state = outcome
	switch {
	case err == nil:
		p.log.Info("engine load source readable", "load_source", p.opts.Fetcher.Name(), "ranks", ranks, "was", prev)
	default:
		p.log.Warn("engine load source unreadable; batches carry the last record until it ages out, then none",
			"load_source", p.opts.Fetcher.Name(), "outcome", outcome, "max_age", p.opts.MaxAge, "err", err)
	}
}

// publish installs a read's records and wakes streams when any rank's
// record changed. A rank the read did not report keeps its last record,
// which ages out; once it is past MaxAge it is dropped, so a source that
// names different ranks over time holds only the recent ones (and as many
// age series).
func (p *Poller) publish(loads map[int32]*kvpb.EngineLoad, at time.Time) {
	old := *p.readings.Load()
	next := maps.Clone(old)
	maps.DeleteFunc(next, func(_ int32, r *Reading) bool { return at.Sub(r.At) > p.opts.MaxAge })
	changed := false
	for rank, l := range loads {
		r := &Reading{Load: l, At: at, Core: marshalCore(l), Full: marshal(l)}
		if r.Core == nil || r.Full == nil {
			// Not encodable: a stream would append an empty record, which
			// reads as an idle engine. Hand out nothing for the rank.
			p.log.Debug("engine load record does not encode; the rank goes without one", "load_source", p.opts.Fetcher.Name(), "rank", rank)
			if _, ok := next[rank]; ok {
				delete(next, rank)
				changed = true
			}
			continue
		}
		if prev, ok := old[rank]; !ok || !proto.Equal(prev.Load, l) {
			changed = true
		}
		next[rank] = r
	}
	p.readings.Store(&next)
	if changed {
		p.mu.Lock()
		close(p.updated)
		p.updated = make(chan struct{})
		p.mu.Unlock()
	}
}

// Latest is rank's newest record, or false when there is none or it is
// older than MaxAge.
func (p *Poller) Latest(rank int32) (*Reading, bool) {
	return p.LatestAt(rank, p.opts.Now())
}

// LatestAt is Latest at now (a stream that read the clock already: one
// clock read per batch is enough).
func (p *Poller) LatestAt(rank int32, now time.Time) (*Reading, bool) {
	r, ok := (*p.readings.Load())[rank]
	if !ok || now.Sub(r.At) > p.opts.MaxAge {
		return nil, false
	}
	return r, true
}

// Ranks lists the ranks with a record, fresh or not, in order.
func (p *Poller) Ranks() []int32 {
	m := *p.readings.Load()
	ranks := make([]int32, 0, len(m))
	for r := range m {
		ranks = append(ranks, r)
	}
	sort.Slice(ranks, func(i, j int) bool { return ranks[i] < ranks[j] })
	return ranks
}

// Updated is closed when a read changes some rank's record. Take it before
// checking Latest, then wait on it.
func (p *Poller) Updated() <-chan struct{} {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.updated
}

// Now is the poller's clock, for ages.
func (p *Poller) Now() time.Time { return p.opts.Now() }

// MaxAge is the age past which Latest hands out nothing.
func (p *Poller) MaxAge() time.Duration { return p.opts.MaxAge }

func marshal(l *kvpb.EngineLoad) []byte {
	b, err := proto.MarshalOptions{Deterministic: true}.Marshal(l)
	if err != nil {
		// An EngineLoad has no required fields and no maps: marshalling
		// one cannot fail (but a string field that is not UTF-8 can).
		// nil leaves the record off rather than panic.
		return nil
	}
	if b == nil {
		b = []byte{} // an empty record encodes fine: nil means it failed
	}
	return b
}

func marshalCore(l *kvpb.EngineLoad) []byte {
	c := proto.Clone(l).(*kvpb.EngineLoad)
	CoreOnly(c)
	return marshal(c)
}

// CoreOnly clears the record's telemetry (fields 10-17), as SMG's
// engine_load::core_only does: what an event batch carries after a stream's
// first record.
func CoreOnly(l *kvpb.EngineLoad) {
	l.CacheHitRate = nil
	l.NumUsedTokens = nil
	l.MaxTotalNumTokens = nil
	l.Memory = nil
	l.Queues = nil
	l.Speculative = nil
	l.Lora = nil
	l.Disaggregation = nil
}

// ageCollector reports each rank's record age at scrape time.
type ageCollector struct{ p *Poller }

var ageDesc = prometheus.NewDesc("kvrelay_load_record_age_seconds",
	"Age of each DP rank's newest engine load record; past the max age, batches carry none.", []string{"source", "rank"}, nil)

func (c ageCollector) Describe(ch chan<- *prometheus.Desc) { ch <- ageDesc }

func (c ageCollector) Collect(ch chan<- prometheus.Metric) {
	now := c.p.opts.Now()
	for rank, r := range *c.p.readings.Load() {
		ch <- prometheus.MustNewConstMetric(ageDesc, prometheus.GaugeValue, now.Sub(r.At).Seconds(),
			c.p.opts.Fetcher.Name(), fmt.Sprint(rank))
	}
}
