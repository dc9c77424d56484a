// Package monitor keeps one SubscribeKvEvents stream open per worker and
// feeds what it admits into an index.
//
// It implements SMG's gateway-side recovery protocol (the G3
// kv_event_monitor): a cursor per (worker, DP rank); in-order batches are
// applied, duplicates dropped, a gap is answered by one reconnect with the
// unchanged cursor and, if the server skips it again, settled by its size (up
// to 1,024 missed batches the blocks are kept and the rank marked degraded,
// beyond that the worker is cleared); a sequence that goes backwards in a way
// no duplicate can is read as a publisher restart; relay snapshot chunks
// clear the worker and resync every cursor; OUT_OF_RANGE and DATA_LOSS clear
// the worker and resubscribe from zero; UNIMPLEMENTED disables the worker.
//
// A subscribe call that is not answered (no headers) within the subscribe
// deadline (2 s) is abandoned; reconnects back off from 100 ms to 5 s, and
// the delay starts over once a worker answers. Two departures from SMG's
// loop, both against hot loops: OUT_OF_RANGE or DATA_LOSS when the monitor
// held no cursor to forget is backed off (asking again at once would get the
// same answer), and so is a resync requested again before any live batch
// arrived since the previous one.
//
// Each subscription sends rank 0's cursor in start_sequence_number, which
// every server reads, and every rank's cursor in rank_cursors (field 16, a
// kvrelay extension). Servers that predate the field skip it as an unknown
// field (proto3 parsing keeps or drops unknown fields, it never rejects them;
// TestOldServerIgnoresRankCursors checks this against a server compiled
// without the field, and the gateway package's TestSMGPythonRelay against
// SMG's own Python relay), so the map is always sent.
//
// Batches are read off the gRPC stream with a client-side codec that decodes
// each frame with package kvdec into storage the stream reuses (decode.go),
// not with the generated client's proto.Unmarshal: the same messages, without
// an allocation per block. Hence the Sink contract: Apply must not keep a
// batch.
package monitor

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sort"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/keepalive"

	"github.com/kvrelay/kvrelay/proto/kvpb"
)

// Service names the gRPC service a worker serves SubscribeKvEvents on.
type Service string

// The services that carry SubscribeKvEvents.
const (
	ServiceVLLM       Service = "vllm"
	ServiceSGLang     Service = "sglang"
	ServiceTokenSpeed Service = "tokenspeed"
)

// FullName is the service's gRPC name (package and service), as the
// engines' servicers register it; empty for an unknown service.
func (s Service) FullName() string {
	switch s {
	case ServiceVLLM, "":
		return kvpb.VllmEngine_ServiceDesc.ServiceName
	case ServiceSGLang:
		return kvpb.SglangScheduler_ServiceDesc.ServiceName
	case ServiceTokenSpeed:
		return kvpb.TokenSpeedScheduler_ServiceDesc.ServiceName
	}
	return ""
}

// ParseService accepts the service names the command line uses.
func ParseService(s string) (Service, error) {
	switch Service(s) {
	case ServiceVLLM, ServiceSGLang, ServiceTokenSpeed:
		return Service(s), nil
	}
	return "", fmt.Errorf("unknown service %q (want vllm, sglang or tokenspeed)", s)
}

// Worker is one subscription target.
type Worker struct {
	// ID names the worker in the index, in metrics and in routing answers.
	// Empty means Addr.
	ID string
	// Addr is the worker's gRPC address, host:port.
	Addr string
	// Service selects the gRPC service; empty means vllm.
	Service Service
	// Model is the model the worker serves; it selects the index.
	Model string
	// Credentials secure the worker's stream (TLS, a client certificate);
	// nil dials in plaintext.
	Credentials credentials.TransportCredentials
}

// Sink receives what the monitor admits for a worker. Calls for one worker
// come from one goroutine in stream order; calls for different workers may be
// concurrent. A batch read from a gRPC stream lives in storage the stream
// reuses for the next one (package kvdec): Apply must not keep b, or
// anything it points to, after it returns; a sink that needs to keep a part
// copies it (proto.Clone). Only b.Load is the sink's to keep.
type Sink interface {
	// Apply applies an admitted batch (live, replayed or a snapshot chunk).
	Apply(worker string, b *kvpb.KvEventBatch)
	// ClearWorker drops every block the worker holds.
	ClearWorker(worker string)
}

// State is where a worker's subscription stands.
type State string

// Subscription states.
const (
	StateConnecting State = "connecting" // a subscribe call is in flight
	StateStreaming  State = "streaming"  // the stream is open
	StateBackoff    State = "backoff"    // waiting before the next attempt
	StateDisabled   State = "disabled"   // the worker answered UNIMPLEMENTED (events off, or another service); asked again every MaxBackoff
	StateStopped    State = "stopped"    // the monitor stopped or the worker was removed
)

// Defaults, from SMG G3's subscription loop and its keepalive settings.
const (
	DefaultSubscribeDeadline = 2 * time.Second
	DefaultInitialBackoff    = 100 * time.Millisecond
	DefaultMaxBackoff        = 5 * time.Second
	// DefaultMaxRecvMsgBytes is what a relay may send by default (kvrelay
	// serve --max-send-msg-bytes). gRPC's own 4 MiB default is below one
	// real batch of 131,072 blocks (6.5 MB), which a relay never splits:
	// such a batch would fail the stream again at every resubscribe.
	DefaultMaxRecvMsgBytes = 1 << 30
)

// DefaultKeepalive pings an open stream every 30 s and gives the answer 10 s.
// SMG moved from 1 s pings to these values because grpc-core servers answered
// faster pings with a too_many_pings GOAWAY; grpc-go raises any Time below
// 10 s to 10 s anyway. Pings are sent only while a stream is open, so a
// server enforcing PermitWithoutStream=false is never offended; a server's
// EnforcementPolicy.MinTime must be at most 30 s (grpc-go's default is 5 min,
// but it forgives pings on a connection that carries data, which heartbeats
// provide). A silent, half-open connection is noticed within about 40 s.
var DefaultKeepalive = keepalive.ClientParameters{Time: 30 * time.Second, Timeout: 10 * time.Second}

// Options configure a Monitor. Zero values take the defaults.
type Options struct {
	SubscribeDeadline time.Duration
	InitialBackoff    time.Duration
	MaxBackoff        time.Duration
	// Keepalive overrides DefaultKeepalive when Time is non-zero.
	Keepalive keepalive.ClientParameters
	// MaxRecvMsgBytes is the largest message accepted from a worker
	// (default DefaultMaxRecvMsgBytes). Only what arrives is allocated.
	MaxRecvMsgBytes int
	// DialOptions are added to the monitor's own (insecure transport,
	// keepalive, connect backoff).
	DialOptions []grpc.DialOption
	// Registerer receives the kvrelay_gateway_* metrics; nil leaves them
	// unregistered.
	Registerer prometheus.Registerer
	Logger     *slog.Logger
	// OnLoad, if set, receives every load record a worker pushes on its
	// stream (rank is the batch's dp_rank, 0 when absent).
	OnLoad func(worker string, rank int32, load *kvpb.EngineLoad)
	// PollLoads, if set, runs beside each worker's subscription for as
	// long as it lasts, with the worker's gRPC connection: SMG's gateway
	// polls GetLoads on the channel the stream uses.
	PollLoads func(ctx context.Context, w Worker, conn grpc.ClientConnInterface)
	// OnState, if set, is called after every change of a worker's state
	// (not under the monitor's locks).
	OnState func(worker string, state State)
	// OnBlockSize, if set, is called when a worker's stream reveals the
	// model's block size: the largest block_size of its stored blocks, so
	// called again only when a larger one appears (a partial-page store,
	// at vLLM's hash block size, can come first).
	OnBlockSize func(model string, blockSize int)
	// DigestEvery is how often at most a worker's index is compared with
	// the relay's live digest, for a sink that is a Digester (default 1 s:
	// the sink may compute its digest from the whole worker's state).
	// DigestResyncEvery is how often at most a divergence resyncs the worker
	// from a snapshot (default 1 min); one that comes back sooner is counted
	// and logged only, so that a lasting cause (an event kind the index does
	// not apply as the relay does) cannot turn into a snapshot every second.
	DigestEvery, DigestResyncEvery time.Duration
	// OpenStream, if set, opens every subscription in place of the gRPC
	// call (it may make that call itself): a worker's batches then come
	// from another transport through the same admission.
	OpenStream StreamOpener
}

// Digester is a Sink that can tell its live digest of a worker's rank
// (internal/livedigest), to compare with the relay's. A subscription to a
// Digester asks the relay for live digests.
type Digester interface {
	LiveDigest(worker string, rank int32) (digest, blocks uint64)
}

func (o Options) withDefaults() Options {
	if o.SubscribeDeadline <= 0 {
		o.SubscribeDeadline = DefaultSubscribeDeadline
	}
	if o.InitialBackoff <= 0 {
		o.InitialBackoff = DefaultInitialBackoff
	}
	if o.MaxBackoff <= 0 {
		o.MaxBackoff = DefaultMaxBackoff
	}
	if o.MaxBackoff < o.InitialBackoff {
		o.MaxBackoff = o.InitialBackoff
	}
	if o.Keepalive.Time == 0 {
		o.Keepalive = DefaultKeepalive
	}
	if o.MaxRecvMsgBytes <= 0 {
		o.MaxRecvMsgBytes = DefaultMaxRecvMsgBytes
	}
	if o.Logger == nil {
		o.Logger = slog.New(slog.DiscardHandler)
	}
	if o.DigestEvery <= 0 {
		o.DigestEvery = time.Second
	}
	if o.DigestResyncEvery <= 0 {
		o.DigestResyncEvery = time.Minute
	}
	return o
}

// RankStatus is one DP rank's cursor.
type RankStatus struct {
	Rank int32 `json:"rank"`
	// Cursor is the last applied sequence; HasCursor is false after a reset.
	Cursor        uint64 `json:"cursor"`
	HasCursor     bool   `json:"has_cursor"`
	Degraded      bool   `json:"degraded"`
	ReplayPending bool   `json:"replay_pending"`
}

// WorkerStatus is a worker's subscription state, for /v1/workers.
type WorkerStatus struct {
	ID             string       `json:"id"`
	Addr           string       `json:"addr"`
	Service        Service      `json:"service"`
	Model          string       `json:"model"`
	State          State        `json:"state"`
	Ranks          []RankStatus `json:"ranks"`
	LastError      string       `json:"last_error,omitempty"`
	Subscriptions  uint64       `json:"subscriptions"`
	BatchesApplied uint64       `json:"batches_applied"`
	Degraded       bool         `json:"degraded"`
	// Snapshot is true while a relay snapshot is arriving.
	Snapshot bool `json:"snapshot_in_progress"`
	// BlockSize is the block size this worker's events revealed, 0 if none yet.
	BlockSize int `json:"block_size"`
	// CaughtUp: a subscription has delivered the worker's state once since
	// it was added: a whole snapshot applied, a batch applied outside a
	// snapshot (a relay serving its history from sequence 0, or live
	// batches), or a load-only record (a relay sends those only when it has
	// nothing else queued for the stream). It stays set through later
	// reconnects.
	CaughtUp bool `json:"caught_up"`
}

// Monitor runs one subscription goroutine per worker.
type Monitor struct {
	opts    Options
	metrics *metrics
	log     *slog.Logger

	mu         sync.Mutex
	workers    map[string]*subscription
	blockSizes map[string]int // model → learned block size
	runCtx     context.Context
	wg         sync.WaitGroup
	stopped    bool
}

// New builds a Monitor; it registers its metrics on opts.Registerer.
func New(opts Options) (*Monitor, error) {
	opts = opts.withDefaults()
	m, err := newMetrics(opts.Registerer)
	if err != nil {
		return nil, err
	}
	return &Monitor{
		opts:       opts,
		metrics:    m,
		log:        opts.Logger,
		workers:    map[string]*subscription{},
		blockSizes: map[string]int{},
	}, nil
}

// CheckWorker refuses a worker Add would refuse for what it is (no
// address, an unknown service) and fills in the default service. A
// partitioned gateway checks the workers another partition subscribes to
// with it, so that every replica accepts and refuses the same workers.
func CheckWorker(w Worker) (Worker, error) {
	if w.Addr == "" {
		return w, errors.New("monitor: worker has no address")
	}
	if w.Service == "" {
		w.Service = ServiceVLLM
	}
	if _, err := ParseService(string(w.Service)); err != nil {
		return w, fmt.Errorf("monitor: worker %s: %w", w.Addr, err)
	}
	return w, nil
}

// ErrDuplicateWorker is returned by Add for an ID already present.
var ErrDuplicateWorker = errors.New("worker already added")

// Add registers a worker whose admitted batches go to sink. Before Run it
// only records the worker; during Run it starts subscribing at once.
func (m *Monitor) Add(w Worker, sink Sink) error {
	w, err := CheckWorker(w)
	if err != nil {
		return err
	}
	if sink == nil {
		return errors.New("monitor: worker has no sink")
	}
	if w.ID == "" {
		w.ID = w.Addr
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.stopped {
		return errors.New("monitor: stopped")
	}
	if _, dup := m.workers[w.ID]; dup {
		return fmt.Errorf("monitor: %s: %w", w.ID, ErrDuplicateWorker)
	}
	s := newSubscription(m, w, sink)
	m.workers[w.ID] = s
	if m.runCtx != nil {
		m.start(s)
	}
	return nil
}

// start launches s's goroutine; m.mu is held.
func (m *Monitor) start(s *subscription) {
	ctx, cancel := context.WithCancel(m.runCtx)
	s.cancel = cancel
	m.wg.Add(1)
	go func() {
		defer m.wg.Done()
		defer close(s.done)
		s.run(ctx)
	}()
}

// Remove stops the worker's subscription, waits for it to end, and clears the
// worker's blocks from its sink.
func (m *Monitor) Remove(id string) error {
	m.mu.Lock()
	s, ok := m.workers[id]
	if ok {
		delete(m.workers, id)
	}
	running := ok && s.cancel != nil
	m.mu.Unlock()
	if !ok {
		return fmt.Errorf("monitor: unknown worker %q", id)
	}
	if running {
		s.cancel()
		<-s.done
	}
	s.sink.ClearWorker(id)
	m.metrics.forget(id)
	return nil
}

// Run subscribes to every worker and blocks until ctx ends; then it stops
// every subscription and returns once all have finished. It may be called
// once.
func (m *Monitor) Run(ctx context.Context) error {
	m.mu.Lock()
	if m.runCtx != nil || m.stopped {
		m.mu.Unlock()
		return errors.New("monitor: Run called twice")
	}
	m.runCtx = ctx
	ids := make([]string, 0, len(m.workers))
	for id := range m.workers {
		ids = append(ids, id)
	}
	sort.Strings(ids)
	for _, id := range ids {
		m.start(m.workers[id])
	}
	m.mu.Unlock()

	<-ctx.Done()
	m.mu.Lock()
	m.stopped = true
	m.mu.Unlock()
	m.wg.Wait()
	return nil
}

// Workers reports every worker's subscription, sorted by ID.
func (m *Monitor) Workers() []WorkerStatus {
	m.mu.Lock()
	subs := make([]*subscription, 0, len(m.workers))
	for _, s := range m.workers {
		subs = append(subs, s)
	}
	m.mu.Unlock()
	out := make([]WorkerStatus, 0, len(subs))
	for _, s := range subs {
		out = append(out, s.status())
	}
	sort.Slice(out, func(i, j int) bool { return out[i].ID < out[j].ID })
	return out
}

// BlockSize is the block size learned for model from its workers' events, or
// 0 when none has been seen.
func (m *Monitor) BlockSize(model string) int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.blockSizes[model]
}

// learnBlockSize records a model's block size: the largest any of its
// workers revealed (see subscription.learnBlockSize: a smaller one is a
// partial page). SMG's gateway lets the last writer win; a worker whose
// partial-page store arrived first would then set every request's hashing
// to the hash block size. A disagreement between workers' page sizes is
// logged because it makes one of them unmatchable.
func (m *Monitor) learnBlockSize(w Worker, n int) {
	m.mu.Lock()
	prev := m.blockSizes[w.Model]
	if n > prev {
		m.blockSizes[w.Model] = n
	}
	m.mu.Unlock()
	switch {
	case prev == 0:
		m.log.Info("learned block size", "model", w.Model, "worker", w.ID, "block_size", n)
	case n != prev:
		m.log.Warn("block sizes differ: a partial page, or workers of one model with different page sizes",
			"model", w.Model, "worker", w.ID, "block_size", n, "previous", prev)
	}
	if n > prev && m.opts.OnBlockSize != nil {
		m.opts.OnBlockSize(w.Model, n)
	}
}
