package monitor

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"sort"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/kvrelay/kvrelay/proto/kvpb"
)

// BatchStream is one subscription's batches: a gRPC SubscribeKvEvents
// stream, or what an Options.OpenStream serves in its place. Header answers
// once the subscription is accepted (nil metadata with a nil error: the call
// ended, and Recv tells how); Recv returns io.EOF or a status error at the
// end, whose codes are read as a relay's (OUT_OF_RANGE and DATA_LOSS
// resync from zero, UNIMPLEMENTED disables the worker).
type BatchStream interface {
	Header() (metadata.MD, error)
	Recv() (*kvpb.KvEventBatch, error)
}

// SubscribeFunc opens one subscription with req.
type SubscribeFunc func(ctx context.Context, req *kvpb.SubscribeKvEventsRequest) (BatchStream, error)

// StreamOpener opens a worker's subscription from another source than the
// worker's gRPC stream (a JetStream stream, package natsevents); viaGRPC is
// the monitor's own gRPC call, for a source that falls back on it. The
// batches must be what the worker's relay would serve (snapshot chunks,
// then batches in order): they go through the same admission.
type StreamOpener func(ctx context.Context, w Worker, req *kvpb.SubscribeKvEventsRequest, viaGRPC SubscribeFunc) (BatchStream, error)

// DivergenceNotifier is a BatchStream that is told when the index it fed
// diverged from the relay's live digest and the worker is resynced for
// it, so that its opener can serve the resync from a source that can be
// exact rather than the one that just diverged (natsevents: the relay's
// gRPC stream instead of the same snapshot object).
type DivergenceNotifier interface {
	Diverged()
}

// snapshotProgress tracks a relay snapshot that is arriving in chunks.
type snapshotProgress struct {
	count, applied uint32
}

// subscription is one worker's subscription loop and recovery state.
type subscription struct {
	m      *Monitor
	w      Worker
	sink   Sink
	log    *slog.Logger
	cancel context.CancelFunc
	done   chan struct{}

	learnedBlockSize int    // the largest block size seen; owned by the goroutine
	liveApplied      uint64 // live batches applied; owned by the goroutine
	// lastDigest and lastDigestResync: when the sink's digest was last
	// compared, and last resynced for a divergence; owned by the goroutine.
	lastDigest, lastDigestResync time.Time
	// digestResync: the outcomeResync handle returned last is checkDigest's;
	// owned by the goroutine.
	digestResync bool
	// marked: caughtUp is set already (so a batch does not take mu for
	// it); owned by the goroutine.
	marked bool
	hot    hotMetrics

	mu            sync.Mutex // guards the fields below, read by status()
	cur           cursors
	snap          *snapshotProgress
	state         State
	lastErr       string
	subscriptions uint64
	applied       uint64
	blockSize     int
	degradedRanks int
	caughtUp      bool // WorkerStatus.CaughtUp
}

// hotMetrics are the series every batch touches, resolved once: a label
// lookup per batch costs more than the admission itself.
type hotMetrics struct {
	applied, stale, loadOnly, snapshot prometheus.Counter
	apply, lag                         prometheus.Observer
	degraded                           prometheus.Gauge
}

func newSubscription(m *Monitor, w Worker, sink Sink) *subscription {
	mt := m.metrics
	s := &subscription{
		m:     m,
		w:     w,
		sink:  sink,
		log:   m.log.With("worker", w.ID, "addr", w.Addr),
		done:  make(chan struct{}),
		cur:   newCursors(),
		state: StateConnecting,
		hot: hotMetrics{
			applied:  mt.batches.WithLabelValues(w.ID, "applied"),
			stale:    mt.batches.WithLabelValues(w.ID, "stale"),
			loadOnly: mt.batches.WithLabelValues(w.ID, "load_only"),
			snapshot: mt.batches.WithLabelValues(w.ID, "snapshot"),
			apply:    mt.apply.WithLabelValues(w.ID),
			lag:      mt.lag.WithLabelValues(w.ID),
			degraded: mt.degraded.WithLabelValues(w.ID),
		},
	}
	s.hot.degraded.Set(0)
	return s
}

func (s *subscription) status() WorkerStatus {
	s.mu.Lock()
	defer s.mu.Unlock()
	st := WorkerStatus{
		ID: s.w.ID, Addr: s.w.Addr, Service: s.w.Service, Model: s.w.Model,
		State: s.state, LastError: s.lastErr, Subscriptions: s.subscriptions,
		BatchesApplied: s.applied, Snapshot: s.snap != nil, BlockSize: s.blockSize, CaughtUp: s.caughtUp,
		Ranks: make([]RankStatus, 0, len(s.cur.ranks)),
	}
	for r, rc := range s.cur.ranks {
		st.Ranks = append(st.Ranks, RankStatus{Rank: r, Cursor: rc.last, HasCursor: rc.live, Degraded: rc.degraded, ReplayPending: rc.replayPending})
		st.Degraded = st.Degraded || rc.degraded
	}
	sort.Slice(st.Ranks, func(i, j int) bool { return st.Ranks[i].Rank < st.Ranks[j].Rank })
	return st
}

func (s *subscription) setState(st State, err error) {
	s.mu.Lock()
	s.state = st
	if err != nil {
		s.lastErr = err.Error()
	}
	s.mu.Unlock()
	v := 0.0
	if st == StateStreaming {
		v = 1
	}
	s.m.metrics.streaming.WithLabelValues(s.w.ID).Set(v)
	if s.m.opts.OnState != nil {
		s.m.opts.OnState(s.w.ID, st)
	}
}

// outcome is how one subscription attempt ended, and so what comes next.
type outcome int

const (
	outcomeRetry     outcome = iota // back off, then resubscribe with the cursors
	outcomeReconnect                // resubscribe at once (a gap asks for a replay)
	outcomeResync                   // resubscribe at once from zero (cursors already reset)
	outcomeDisabled                 // UNIMPLEMENTED: ask again at the slowest pace
	outcomeStopped                  // ctx ended
)

func (s *subscription) run(ctx context.Context) {
	defer func() {
		// A disabled worker stays disabled in the status; anything else
		// ended because the monitor stopped or the worker was removed.
		s.mu.Lock()
		disabled := s.state == StateDisabled
		s.mu.Unlock()
		if !disabled {
			s.setState(StateStopped, nil)
		}
	}()
	opts := s.m.opts
	dial := append([]grpc.DialOption{
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithKeepaliveParams(opts.Keepalive),
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(opts.MaxRecvMsgBytes)),
		// grpc's own reconnect backoff (1 s doubling to 120 s by default)
		// would keep a restarted worker unreachable long after it is back;
		// bound it like the subscription loop's.
		grpc.WithConnectParams(grpc.ConnectParams{
			Backoff:           backoff.Config{BaseDelay: opts.InitialBackoff, Multiplier: 2, Jitter: 0.2, MaxDelay: opts.MaxBackoff},
			MinConnectTimeout: opts.SubscribeDeadline,
		}),
	}, opts.DialOptions...)
	if s.w.Credentials != nil {
		// The last transport credentials given win over the plaintext default.
		dial = append(dial, grpc.WithTransportCredentials(s.w.Credentials))
	}
	cc, err := grpc.NewClient(s.w.Addr, dial...)
	if err != nil {
		// Only a malformed target gets here; retrying cannot fix it.
		s.log.Error("cannot create gRPC client; worker disabled", "err", err)
		s.m.metrics.failures.WithLabelValues(s.w.ID, "error").Inc()
		s.setState(StateDisabled, fmt.Errorf("create client: %w", err))
		return
	}
	defer cc.Close()
	if poll := opts.PollLoads; poll != nil {
		pctx, cancel := context.WithCancel(ctx)
		done := make(chan struct{})
		go func() { defer close(done); poll(pctx, s.w, cc) }()
		defer func() { cancel(); <-done }() // before the connection closes
	}
	subscribe := clientFor(s.w.Service, cc)
	if open := opts.OpenStream; open != nil {
		viaGRPC := subscribe
		subscribe = func(ctx context.Context, req *kvpb.SubscribeKvEventsRequest) (BatchStream, error) {
			return open(ctx, s.w, req, viaGRPC)
		}
	}

	delay := opts.InitialBackoff
	resyncs := 0           // resyncs in a row with no live batch applied in between
	unimplemented := false // the last answer was UNIMPLEMENTED (said and cleared once)
	for {
		if ctx.Err() != nil {
			return
		}
		s.setState(StateConnecting, nil)
		live := s.liveApplied
		out, answered, err := s.attempt(ctx, subscribe)
		switch {
		case out != outcomeResync:
			resyncs = 0
		case s.liveApplied > live:
			resyncs = 1 // the stream made progress before it asked for this one
		default:
			resyncs++
		}
		if answered && resyncs < 2 {
			// The worker served us: whatever ended the stream, the next wait
			// starts from the initial delay again. Not so for a worker that
			// asks for one resync after another (a snapshot, then DATA_LOSS,
			// over and over): asking faster does not help it.
			delay = opts.InitialBackoff
		}
		if out != outcomeDisabled {
			unimplemented = false
		}
		switch out {
		case outcomeStopped:
			return
		case outcomeDisabled:
			// UNIMPLEMENTED: the engine's events are off, or the worker does
			// not serve this service (the relay's message names the ones it
			// does). Both change when the worker restarts with other
			// settings, so it is asked again, at the slowest pace.
			if !unimplemented {
				unimplemented = true
				s.log.Warn("worker does not serve KV events under this service; asking again every max backoff",
					"service", s.w.Service, "every", opts.MaxBackoff, "err", err)
				s.sink.ClearWorker(s.w.ID)
			}
			s.setState(StateDisabled, err)
			delay = opts.MaxBackoff
			if !sleep(ctx, delay) {
				return
			}
			continue
		case outcomeResync:
			if resyncs == 1 {
				s.setState(StateConnecting, err)
				continue
			}
		case outcomeReconnect:
			continue
		}
		s.setState(StateBackoff, err)
		if err != nil {
			s.log.Info("subscription ended; backing off", "err", err, "delay", delay)
		}
		if !sleep(ctx, delay) {
			return
		}
		delay = min(delay*2, opts.MaxBackoff)
	}
}

// sleep waits d, or less if ctx ends first; it reports whether d passed.
func sleep(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}

// noAnswerError is what a subscribe call gets when the worker accepted the
// connection but sent no headers within the deadline (a port that accepts but
// does not serve yet, a half-open connection). It reads as UNAVAILABLE.
type noAnswerError struct{ deadline time.Duration }

func (e noAnswerError) Error() string {
	return fmt.Sprintf("subscribe did not answer within %s", e.deadline)
}

func (e noAnswerError) GRPCStatus() *status.Status {
	return status.New(codes.Unavailable, e.Error())
}

// attempt runs one subscribe call and reads its stream to the end; answered
// says the call got its headers.
func (s *subscription) attempt(ctx context.Context, subscribe SubscribeFunc) (out outcome, answered bool, err error) {
	s.mu.Lock()
	start, perRank := s.cur.resume()
	s.mu.Unlock()
	_, digests := s.sink.(Digester)
	req := &kvpb.SubscribeKvEventsRequest{StartSequenceNumber: start, RankCursors: perRank, LiveDigests: digests}

	callCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	stream, err := subscribe(callCtx, req)
	if err == nil {
		err = s.awaitHeaders(stream, cancel)
	}
	if err != nil {
		if ctx.Err() != nil {
			return outcomeStopped, false, nil
		}
		out, err = s.onStreamError(err, start)
		return out, false, err
	}

	s.m.metrics.subscriptions.WithLabelValues(s.w.ID).Inc()
	s.mu.Lock()
	s.subscriptions++
	s.cur.markFresh()
	s.mu.Unlock()
	s.setState(StateStreaming, nil)
	s.log.Debug("subscribed", "start_sequence_number", start, "rank_cursors", perRank)

	out, err = s.read(stream)
	if ctx.Err() != nil {
		return outcomeStopped, true, nil
	}
	s.abandonSnapshot()
	if out == outcomeReconnect || out == outcomeResync {
		return out, true, nil
	}
	if err == nil {
		return outcomeRetry, true, errors.New("stream ended")
	}
	out, err = s.onStreamError(err, start)
	return out, true, err
}

// awaitHeaders waits for the call's response headers under the subscribe
// deadline, leaving the stream's own context open for the stream's life.
// Servers send headers before any batch (an idle engine may publish nothing
// for minutes), so headers are the answer the deadline waits for.
func (s *subscription) awaitHeaders(stream BatchStream, cancel context.CancelFunc) error {
	d := s.m.opts.SubscribeDeadline
	var expired atomic.Bool
	t := time.AfterFunc(d, func() {
		expired.Store(true)
		cancel()
	})
	md, _ := stream.Header() // grpc-go reports a failed call on Recv, not here
	if !t.Stop() && expired.Load() {
		return noAnswerError{deadline: d}
	}
	if md == nil {
		// The call ended without headers: a status-only answer such as
		// UNIMPLEMENTED or OUT_OF_RANGE. Recv returns it.
		if _, err := stream.Recv(); err != nil {
			return err
		}
		return errors.New("stream ended without headers")
	}
	return nil
}

// onStreamError classifies a call's or a stream's terminal error. The codes
// are honoured wherever they arrive: SMG reads OUT_OF_RANGE only on the call
// and DATA_LOSS only on the stream, but a grpc-go server's handler error
// always arrives on the stream.
func (s *subscription) onStreamError(err error, sentStart uint64) (outcome, error) {
	code := status.Code(err)
	switch code {
	case codes.Unimplemented:
		s.m.metrics.failures.WithLabelValues(s.w.ID, "unimplemented").Inc()
		return outcomeDisabled, err
	case codes.OutOfRange, codes.DataLoss:
		reason := "out_of_range"
		if code == codes.DataLoss {
			reason = "data_loss"
		}
		s.m.metrics.failures.WithLabelValues(s.w.ID, reason).Inc()
		s.mu.Lock()
		hadState := s.cur.anyLive() || sentStart != 0
		s.cur.resetAll()
		s.snap = nil
		s.mu.Unlock()
		s.sink.ClearWorker(s.w.ID)
		s.updateDegraded()
		s.m.metrics.resyncs.WithLabelValues(s.w.ID, reason).Inc()
		s.log.Warn("worker asked for a resync; cleared and resubscribing from zero", "reason", reason, "err", err)
		if !hadState {
			// Nothing was reset: the same request would get the same answer,
			// so back off rather than spin.
			return outcomeRetry, err
		}
		return outcomeResync, err
	case codes.Unavailable:
		if errors.As(err, new(noAnswerError)) {
			s.m.metrics.failures.WithLabelValues(s.w.ID, "deadline").Inc()
		} else {
			s.m.metrics.failures.WithLabelValues(s.w.ID, "unavailable").Inc()
		}
		return outcomeRetry, err
	default:
		s.m.metrics.failures.WithLabelValues(s.w.ID, "error").Inc()
		return outcomeRetry, err
	}
}

// abandonSnapshot forgets every cursor when a stream ended while a snapshot
// was arriving: the index holds part of the state, and only a subscription
// from zero brings the whole snapshot again.
func (s *subscription) abandonSnapshot() {
	s.mu.Lock()
	abandoned := s.snap != nil
	if abandoned {
		s.snap = nil
		s.cur.resetAll()
	}
	s.mu.Unlock()
	if abandoned {
		s.m.metrics.resyncs.WithLabelValues(s.w.ID, "snapshot_abandoned").Inc()
		s.updateDegraded()
		s.log.Warn("stream ended during a snapshot; resubscribing from zero")
	}
}

// read consumes the stream until it ends or a gap asks for a reconnect.
func (s *subscription) read(stream BatchStream) (outcome, error) {
	for {
		b, err := stream.Recv()
		if err == io.EOF {
			return outcomeRetry, nil
		}
		if err != nil {
			return outcomeRetry, err
		}
		if out := s.handle(b); out == outcomeReconnect || out == outcomeResync {
			if s.digestResync {
				s.digestResync = false
				if n, ok := stream.(DivergenceNotifier); ok {
					n.Diverged()
				}
			}
			return out, nil
		}
	}
}

// handle runs one batch through admission and applies it.
func (s *subscription) handle(b *kvpb.KvEventBatch) outcome {
	rank := b.GetDpRank()
	if l := b.GetLoad(); l != nil {
		if s.m.opts.OnLoad != nil {
			s.m.opts.OnLoad(s.w.ID, rank, l)
		}
		if l.GetLoadOnly() {
			s.hot.loadOnly.Inc()
			// A relay sends a load-only record only when nothing else is
			// queued for this stream: what it had, snapshot or history,
			// was applied before this.
			s.markCaughtUp()
			return outcomeRetry
		}
	}
	if snap := b.GetSnapshot(); snap != nil {
		s.handleSnapshot(b, rank, snap)
		return outcomeRetry
	}

	seq := b.GetSequenceNumber()
	s.mu.Lock()
	adm := s.cur.admit(rank, seq, clearsAll(b))
	s.mu.Unlock()
	id := s.w.ID
	switch adm.verdict {
	case verdictStale:
		s.hot.stale.Inc()
		return outcomeRetry
	case verdictReplay:
		s.m.metrics.batches.WithLabelValues(id, "gap").Inc()
		s.m.metrics.gaps.WithLabelValues(id, "replay_requested").Inc()
		s.log.Info("gap; reconnecting for a replay", "rank", rank, "sequence", seq, "missed", adm.missed)
		return outcomeReconnect
	case verdictRestart:
		s.log.Warn("publisher restarted; worker cleared", "rank", rank, "sequence", seq)
		s.m.metrics.resyncs.WithLabelValues(id, "publisher_restart").Inc()
		s.sink.ClearWorker(id)
	case verdictUnrecoveredCleared:
		s.log.Warn("gap not replayed and too wide to keep; worker cleared", "rank", rank, "sequence", seq, "missed", adm.missed)
		s.m.metrics.gaps.WithLabelValues(id, "unrecovered_cleared").Inc()
		s.m.metrics.missed.WithLabelValues(id).Add(float64(adm.missed))
		s.m.metrics.resyncs.WithLabelValues(id, "gap_cleared").Inc()
		s.sink.ClearWorker(id)
	case verdictUnrecoveredKept:
		s.log.Warn("gap not replayed; blocks kept, rank degraded", "rank", rank, "sequence", seq, "missed", adm.missed)
		s.m.metrics.gaps.WithLabelValues(id, "unrecovered_kept").Inc()
		s.m.metrics.missed.WithLabelValues(id).Add(float64(adm.missed))
	}
	s.liveApplied++
	s.observeLag(b, s.apply(b, s.hot.applied))
	s.markCaughtUp()
	return s.checkDigest(b, rank)
}

// checkDigest compares the sink's digest of rank, right after it applied b,
// with the relay's digest after the same batch. A divergence is counted and
// logged with its rank; at most once per DigestResyncEvery it also clears
// the worker and resubscribes from zero, so that a snapshot heals it.
func (s *subscription) checkDigest(b *kvpb.KvEventBatch, rank int32) outcome {
	d, ok := s.sink.(Digester)
	if !ok || b.LiveDigest == nil {
		return outcomeRetry
	}
	now := time.Now()
	if now.Sub(s.lastDigest) < s.m.opts.DigestEvery {
		return outcomeRetry
	}
	s.lastDigest = now
	got, blocks := d.LiveDigest(s.w.ID, rank)
	if got == b.GetLiveDigest() && blocks == b.GetLiveBlocks() {
		return outcomeRetry
	}
	s.m.metrics.diverged.WithLabelValues(s.w.ID, strconv.Itoa(int(rank))).Inc()
	resync := s.lastDigestResync.IsZero() || now.Sub(s.lastDigestResync) >= s.m.opts.DigestResyncEvery
	s.log.Warn("index diverged from the relay's live digest", "rank", rank, "sequence", b.GetSequenceNumber(),
		"relay_blocks", b.GetLiveBlocks(), "index_blocks", blocks, "resync", resync)
	if !resync {
		return outcomeRetry
	}
	s.lastDigestResync = now
	s.digestResync = true
	s.mu.Lock()
	s.cur.resetAll()
	s.snap = nil
	s.mu.Unlock()
	s.sink.ClearWorker(s.w.ID)
	s.updateDegraded()
	s.m.metrics.resyncs.WithLabelValues(s.w.ID, "digest").Inc()
	return outcomeResync
}

// handleSnapshot applies one relay snapshot chunk. Chunks bypass admission:
// they carry consecutive sequences ending at the relay's cut, and each sets
// its rank's cursor.
func (s *subscription) handleSnapshot(b *kvpb.KvEventBatch, rank int32, snap *kvpb.KvSnapshotChunk) {
	s.mu.Lock()
	begin := snap.GetIndex() == 0 || s.snap == nil
	if begin {
		if snap.GetIndex() != 0 {
			s.log.Warn("snapshot chunk without its first chunk; treating it as a resync", "index", snap.GetIndex())
		}
		s.cur.resetAll()
		s.snap = &snapshotProgress{count: max(snap.GetCount(), 1)}
	}
	s.cur.resyncTo(rank, b.GetSequenceNumber(), snap.GetUnknownBefore() > 0)
	s.snap.applied++
	last := s.snap.applied >= s.snap.count
	if last {
		s.snap = nil
	}
	s.mu.Unlock()
	if begin {
		s.m.metrics.resyncs.WithLabelValues(s.w.ID, "snapshot").Inc()
		s.sink.ClearWorker(s.w.ID)
	}
	_ = s.apply(b, s.hot.snapshot)
	if last {
		s.markCaughtUp() // after the last chunk is in the sink, not before
	}
}

// markCaughtUp records that the worker's state has been delivered once
// (WorkerStatus.CaughtUp).
func (s *subscription) markCaughtUp() {
	if s.marked {
		return
	}
	s.marked = true
	s.mu.Lock()
	s.caughtUp = true
	s.mu.Unlock()
}

// apply hands an admitted batch to the sink and keeps the counters.
// It returns when the apply finished, for the lag.
func (s *subscription) apply(b *kvpb.KvEventBatch, disposition prometheus.Counter) time.Time {
	start := time.Now()
	s.sink.Apply(s.w.ID, b)
	end := time.Now()
	s.hot.apply.Observe(end.Sub(start).Seconds())
	disposition.Inc()
	s.mu.Lock()
	s.applied++
	s.mu.Unlock()
	s.learnBlockSize(b)
	s.updateDegraded()
	return end
}

// observeLag records publisher stamp → apply; a stamp in the future (clock
// skew) is not a lag and is skipped.
func (s *subscription) observeLag(b *kvpb.KvEventBatch, applied time.Time) {
	ts := b.GetTimestamp()
	if ts <= 0 {
		return
	}
	lag := float64(applied.UnixNano())/1e9 - ts
	if lag >= 0 {
		s.hot.lag.Observe(lag)
	}
}

// learnBlockSize takes the model's block size from the stored blocks: the
// largest block_size seen on this subscription. vLLM at KV-group granularity
// (hash_block_size smaller than the page, #51614) also stores partial-page
// entries whose block_size is the hash block size; only full pages carry the
// page size, which is what requests must be hashed at. The first store can be
// a partial one (a prompt shorter than a page), so a smaller size never
// replaces a larger one. Only the first block of each stored event is read:
// one event's blocks share a size.
func (s *subscription) learnBlockSize(b *kvpb.KvEventBatch) {
	for _, ev := range b.GetEvents() {
		blocks := ev.GetStored().GetBlocks()
		if len(blocks) == 0 {
			continue
		}
		n := int(blocks[0].GetBlockSize())
		if n <= s.learnedBlockSize {
			continue
		}
		s.learnedBlockSize = n
		s.mu.Lock()
		s.blockSize = n
		s.mu.Unlock()
		s.m.learnBlockSize(s.w, n)
	}
}

func (s *subscription) updateDegraded() {
	s.mu.Lock()
	n := s.cur.degradedCount()
	changed := n != s.degradedRanks
	s.degradedRanks = n
	s.mu.Unlock()
	if changed {
		s.hot.degraded.Set(float64(n))
	}
}

// clearsAll reports whether the batch carries an engine-wide cache clear: a
// Cleared event with no ownership (an owned clear is another agent's and
// says nothing about the engine's own blocks).
func clearsAll(b *kvpb.KvEventBatch) bool {
	for _, ev := range b.GetEvents() {
		if c := ev.GetCleared(); c != nil && c.GetOwnership() == "" {
			return true
		}
	}
	return false
}
