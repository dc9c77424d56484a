package relay

import (
	"bytes"
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/zeebo/xxh3"
	"google.golang.org/protobuf/proto"

	"github.com/kvrelay/kvrelay/engines"
	"github.com/kvrelay/kvrelay/internal/latencyprobe"
	"github.com/kvrelay/kvrelay/proto/kvenc"
	"github.com/kvrelay/kvrelay/proto/kvpb"
	"github.com/kvrelay/kvrelay/relay/record"
)

// Message is one publisher batch as a transport delivers it: the
// publisher's own sequence number and the msgpack payload.
type Message struct {
	Seq     uint64
	Payload []byte
}

// Feed is one rank's live stream.
type Feed interface {
	Recv(ctx context.Context) (Message, error)
	// Connected reports whether the socket is connected to the publisher.
	Connected() bool
	Close() error
}

// Replayer asks a rank's replay ROUTER for everything from a sequence on.
// complete is false when the replay stopped before the engine's end marker
// (a reply timed out): what came is still valid, the rest may follow from a
// new request. err means no answer at all.
type Replayer interface {
	Replay(ctx context.Context, from uint64) (msgs []Message, complete bool, err error)
}

// headReplayer is a Replayer that can stop after n replies (complete once
// they came). The stale-batch check needs only the batch at the cursor:
// streaming it the whole ring per queued batch would cost the engine's
// replay thread a ring per batch.
type headReplayer interface {
	ReplayUpTo(ctx context.Context, from uint64, n int) (msgs []Message, complete bool, err error)
}

// Transport opens rank's live feed at endpoint and, when replayEndpoint is
// not empty, its replayer (nil otherwise). It must not block on the network:
// feeds connect in the background.
type Transport func(rank int32, endpoint, replayEndpoint string, replayTimeout time.Duration) (Feed, Replayer, error)

// normalizer turns a payload into a batch, written straight in its protobuf
// wire form: appendNormalized appends the encoded KvEventBatch (sequence seq,
// dp_rank rank) to dst. An error means the envelope does not decode, or the
// batch cannot be sent as proto3 (a string that is not valid UTF-8); dst is
// returned unchanged then.
type normalizer interface {
	appendNormalized(dst, payload []byte, seq uint64, rank int32) ([]byte, []dropCount, error)
	reset()
}

type dropCount struct {
	reason string
	n      uint64
}

// applied is what the record saw in one batch.
type applied struct {
	// reannounced are the indexes of the stored events the record took for
	// report-mode re-announcements (nil almost always).
	reannounced []int
	// events and storedBlocks count the batch's events and the blocks its
	// stored events list, for the relay's metrics.
	events, storedBlocks int
}

// liveRecord is the live-block record (relay/record).
type liveRecord interface {
	// applyEncoded folds one batch, in the wire form the relay sends, into
	// the record. An error (bytes that are not a KvEventBatch) leaves the
	// record unchanged.
	applyEncoded(enc []byte) (applied, error)
	ClearRank(rank int32)
	// LiveDigest is rank's anti-entropy digest and the copies it covers.
	LiveDigest(rank int32) (digest, blocks uint64)
	// cut captures the record for ranks, cheaply, under the relay's lock.
	cut(ranks []int32) recordCut
	// blocks and entries per rank, and in total.
	stats() (perRank map[int32]uint64, blocks, entries uint64)
	// evictedFrom counts the rank's entries dropped at the cap since the
	// rank last started empty.
	evictedFrom(rank int32) uint64
}

// recordCut orders and encodes a captured record off the lock.
type recordCut interface {
	Chunks(cursors, unknownBefore map[int32]uint64, ts float64) []*kvpb.KvEventBatch
	// Stream is Chunks one chunk at a time, each encoded when asked for.
	Stream(cursors, unknownBefore map[int32]uint64, ts float64) *record.ChunkStream
	Release()
}

// Relay follows every DP rank of one engine and serves subscribers. Build it
// with New, start it with Run, and Subscribe any number of times.
type Relay struct {
	cfg     Config
	log     *slog.Logger
	metrics *metrics
	ranks   []*rankState
	running atomic.Bool

	// mu is the admission lock: every change to the history, the record,
	// the ranks' cursors and the subscriber set happens under it, so a
	// snapshot cut under it is exact. Lock order: mu, then a
	// Subscription's mu.
	mu         sync.Mutex
	hist       *history
	rec        liveRecord
	generation uint64
	subs       map[*Subscription]struct{}
	relayed    uint64
	tip        atomic.Uint64 // the newest log position fanned out
}

// rankState is one DP rank. The fields under "guarded by Relay.mu" are
// written only by the rank's goroutine, with the lock held; that goroutine
// reads them without the lock, everyone else with it.
type rankState struct {
	rank           int32
	endpoint       string
	replayEndpoint string
	label          string // the rank as a metric label
	norm           normalizer
	replay         Replayer
	replayCounters atomic.Pointer[replayerStatser] // for scrapes: replay is set without the lock
	feed           atomic.Pointer[feedBox]
	reprime        chan struct{}

	// guarded by Relay.mu
	hasCursor     bool
	cursor        uint64
	hasStart      bool
	startedAt     uint64
	unknownBefore uint64
	// recordEvicted is the record's eviction count for the rank last seen.
	recordEvicted    uint64
	warnedEviction   bool
	lastEvictionWarn time.Time
	restarts         uint64
	// liveFrom is the sequence of the first batch of this incarnation the
	// rank's live socket delivered. Such a batch was published after this
	// relay subscribed, so no relay that ran before this one can have sent
	// it, nor any later batch of the rank: a cursor at or past it was read
	// from this relay's log (see resumeRank0).
	hasLiveFrom bool
	liveFrom    uint64
	// lastLive is the sequence of the last live batch of this incarnation
	// the rank loop took (hasLastLive: it took one). Owned by the rank
	// goroutine. One incarnation's live stream is in order, so a batch
	// below the cursor but past lastLive may be an old batch that waited on
	// the socket while a replay ran past it (see staleLive); one below
	// lastLive cannot be.
	lastLive    uint64
	hasLastLive bool

	// Owned by the rank goroutine. encBuf is the scratch buffer its
	// batches are encoded into.
	encBuf []byte
	// A replay usually runs past the live
	// stream: the live copies of what it gave are still queued on the
	// socket, and by the admission table alone they would read as a
	// sequence regression. replayed holds the payload hash of every batch
	// a replay gave from replayedFrom on, so such a copy is recognised
	// exactly (a restarted publisher does not resend identical bytes).
	replayedFrom uint64
	replayed     map[uint64]uint64
	replayedMax  uint64
	// lastSeq and lastHash name the batch relayed last. The admission
	// table reads a clear at the cursor's sequence as a restarted
	// publisher's startup clear; the same bytes delivered again are the
	// same batch (a new incarnation stamps a new time), not a restart.
	lastSeq  uint64
	lastHash uint64
	hasLast  bool
	// recoveringStart is set while a start recovery (priming, a late join)
	// runs, with startOrigin the sequence the publisher counts from. The
	// first batch it relays fixes the rank's start, and unknown_before
	// with it, under the same lock as the cursor: set afterwards, a status
	// or snapshot read in between (a resumed replay can take a whole
	// ReplayTimeout) shows the cursor caught up and unknown_before 0.
	recoveringStart bool
	startOrigin     uint64

	// Owned by the rank goroutine: log throttling. A replay endpoint that
	// does not answer is warned about once, until it answers again; the
	// undecodable-batch warning is logged at most once per
	// undecodableLogEvery, with the count of the ones not logged.
	replayFailures        uint64
	undecodableLoggedAt   time.Time
	undecodableSuppressed uint64
}

// undecodableLogEvery spaces the per-batch undecodable warnings of a rank:
// an engine sending only garbage would otherwise log every batch (the
// metric counts each one).
const undecodableLogEvery = 10 * time.Second

// maxPrimeRetry caps the doubling wait between start replays that fail.
const maxPrimeRetry = 30 * time.Second

type feedBox struct{ Feed }

func (rk *rankState) replayStatser() (replayerStatser, bool) {
	if p := rk.replayCounters.Load(); p != nil {
		return *p, true
	}
	return nil, false
}

// New validates cfg and builds a relay. It opens no socket; Run does.
func New(cfg Config) (*Relay, error) {
	if err := cfg.resolve(); err != nil {
		return nil, err
	}
	var ranks []*rankState
	for i := 0; cfg.KV.Enabled && i < cfg.DPSize; i++ {
		ep, err := engines.ConnectEndpoint(cfg.KV.Endpoint, i)
		if err != nil {
			return nil, fmt.Errorf("relay: rank %d: %w", i, err)
		}
		rep := ""
		if cfg.KV.ReplayEndpoint != "" {
			if rep, err = engines.ConnectEndpoint(cfg.KV.ReplayEndpoint, i); err != nil {
				return nil, fmt.Errorf("relay: rank %d replay: %w", i, err)
			}
		}
		rk := &rankState{
			rank:           int32(i),
			endpoint:       ep,
			replayEndpoint: rep,
			label:          fmt.Sprint(i),
			reprime:        make(chan struct{}, 1),
		}
		rk.norm = newWireNormalizer(cfg.Engine.Dialect)
		ranks = append(ranks, rk)
	}
	labels := prometheus.Labels{"engine": cfg.Engine.Name, "relay": cfg.Instance}
	m, err := newMetrics(cfg.Registerer, labels)
	if err != nil {
		return nil, err
	}
	rankLabels := make([]string, len(ranks))
	for i, rk := range ranks {
		rankLabels[i] = rk.label
	}
	m.zeroSeries(rankLabels, restartReasonsOf(cfg.Engine))
	r := &Relay{
		cfg:     cfg,
		log:     cfg.Logger.With("engine", cfg.Engine.Name, "relay", cfg.Instance),
		metrics: m,
		ranks:   ranks,
		hist:    newHistory(cfg.HistoryBatches, cfg.HistoryBytes),
		subs:    map[*Subscription]struct{}{},
		rec:     newRecordAdapter(cfg.ReportModeFull, cfg.RecordMaxEntries),
	}
	if err := m.registerState(r, labels); err != nil {
		m.unregister()
		return nil, err
	}
	return r, nil
}

// Enabled reports whether the engine publishes events at all.
func (r *Relay) Enabled() bool { return r.cfg.KV.Enabled }

// Run follows every rank until ctx is done, then closes the sockets and
// returns once every goroutine it started has ended. A transport that cannot
// be opened is an error; everything after that (a publisher that is down, a
// replay that does not answer) is retried or recorded, never fatal.
func (r *Relay) Run(ctx context.Context) error {
	if !r.running.CompareAndSwap(false, true) {
		return errors.New("relay: Run called twice")
	}
	if !r.cfg.KV.Enabled {
		<-ctx.Done()
		return nil
	}
	transport := r.cfg.Transport
	if transport == nil {
		transport = zmqTransport(r.cfg.KV.Topic, r.cfg.KV.HWM, r.cfg.zmqLimits(), r.log)
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var (
		wg       sync.WaitGroup
		errMu    sync.Mutex
		firstErr error
	)
	for _, rk := range r.ranks {
		feed, rep, err := transport(rk.rank, rk.endpoint, rk.replayEndpoint, r.cfg.ReplayTimeout)
		if err != nil {
			errMu.Lock()
			firstErr = fmt.Errorf("relay: rank %d at %s: %w", rk.rank, rk.endpoint, err)
			errMu.Unlock()
			cancel()
			break
		}
		rk.replay = rep
		if s, ok := rep.(replayerStatser); ok {
			rk.replayCounters.Store(&s)
		}
		rk.feed.Store(&feedBox{feed})
		wg.Go(func() {
			defer func() {
				if err := feed.Close(); err != nil {
					r.log.Warn("closing a rank's feed", "rank", rk.rank, "err", err)
				}
			}()
			r.runRank(ctx, rk, feed)
		})
	}
	wg.Wait()
	r.logSummary("relay stopped")
	return firstErr
}

// Ready reports whether every rank's feed is connected.
func (r *Relay) Ready() bool {
	if !r.cfg.KV.Enabled {
		return true
	}
	for _, rk := range r.ranks {
		f := rk.feed.Load()
		if f == nil || !f.Connected() {
			return false
		}
	}
	return true
}

var closedChan = func() chan struct{} { c := make(chan struct{}); close(c); return c }()

// runRank is one rank's state machine: prime, then admit live batches,
// filling gaps from the replay before anything later is relayed.
func (r *Relay) runRank(ctx context.Context, rk *rankState, feed Feed) {
	msgs := make(chan Message)
	var reader sync.WaitGroup
	reader.Go(func() { r.read(ctx, rk, feed, msgs) })
	defer reader.Wait()

	var primeC <-chan struct{}
	var retry *time.Timer
	if rk.replay != nil {
		primeC = closedChan
	}
	defer func() {
		if retry != nil {
			retry.Stop()
		}
	}()
	retryC := make(chan struct{}, 1)
	// The start replay is retried with a doubling wait while the engine
	// does not answer.
	primeWait := r.cfg.PrimeRetry

	// The catch-up replay runs a while after the feed connects, and when
	// the rank has been quiet for IdleProbe (see catchUp).
	var (
		tick       <-chan time.Time
		connected  bool
		catchUpAt  time.Time
		lastActive = time.Now()
	)
	if rk.replay != nil && (r.cfg.CatchUpDelay > 0 || r.cfg.IdleProbe > 0) {
		t := time.NewTicker(catchUpTick)
		defer t.Stop()
		tick = t.C
	}
	for {
		select {
		case <-ctx.Done():
			return
		case now := <-tick:
			up := feed.Connected()
			if up && !connected && r.cfg.CatchUpDelay > 0 {
				catchUpAt = now.Add(r.cfg.CatchUpDelay)
			}
			connected = up
			due := !catchUpAt.IsZero() && !now.Before(catchUpAt)
			idle := r.cfg.IdleProbe > 0 && now.Sub(lastActive) >= r.cfg.IdleProbe
			if !up || primeC != nil || !(due || idle) {
				continue
			}
			catchUpAt = time.Time{}
			lastActive = now
			if !rk.hasCursor {
				// Nothing relayed yet: the start replay may have answered
				// before the engine's first batch, which the live stream
				// then missed. Ask from 0 again.
				primeC = closedChan
				continue
			}
			if r.catchUp(ctx, rk) && ctx.Err() == nil {
				primeC = closedChan
			}
			// A replay that did not answer took up to ReplayTimeout; the
			// quiet time counts from its end, not its start.
			lastActive = time.Now()
		case <-primeC:
			primeC = nil
			primed := r.prime(ctx, rk)
			lastActive = time.Now()
			if primed {
				primeWait = r.cfg.PrimeRetry
			}
			if !primed && ctx.Err() == nil {
				wait := primeWait
				primeWait = min(2*primeWait, max(maxPrimeRetry, r.cfg.PrimeRetry))
				retry = time.AfterFunc(wait, func() {
					select {
					case retryC <- struct{}{}:
					default:
					}
				})
			}
		case <-retryC:
			if !rk.hasCursor && rk.replay != nil {
				primeC = closedChan
			}
		case <-rk.reprime:
			if !rk.hasCursor && rk.replay != nil {
				primeC = closedChan
			}
		case m := <-msgs:
			// A live batch ends priming: admission replays what it
			// missed (a late join) by itself.
			lastActive = time.Now()
			primeC = nil
			if retry != nil {
				retry.Stop()
			}
			r.admitLive(ctx, rk, m)
			rk.lastLive, rk.hasLastLive = m.Seq, true
		}
	}
}

// read pumps the feed into msgs, so the rank loop can wait for a live batch
// and a prime retry at once.
func (r *Relay) read(ctx context.Context, rk *rankState, feed Feed, msgs chan<- Message) {
	for {
		m, err := feed.Recv(ctx)
		if err != nil {
			if ctx.Err() != nil {
				return
			}
			r.log.Warn("receive failed; retrying", "rank", rk.rank, "endpoint", rk.endpoint, "err", err)
			select {
			case <-ctx.Done():
				return
			case <-time.After(recvErrorBackoff):
			}
			continue
		}
		latencyprobe.Mark(latencyprobe.Received, rk.rank, m.Seq)
		select {
		case msgs <- m:
		case <-ctx.Done():
			return
		}
	}
}

// admitLive applies the admission table to one live batch.
func (r *Relay) admitLive(ctx context.Context, rk *rankState, m Message) {
	if len(rk.replayed) > 0 {
		if h, ok := rk.replayed[m.Seq]; ok && h == xxh3.Hash(m.Payload) {
			r.metrics.duplicates.WithLabelValues(rk.label).Inc()
			if m.Seq >= rk.replayedMax {
				rk.replayed = nil // the live stream has caught up
			}
			return
		}
		if m.Seq >= rk.replayedMax {
			rk.replayed = nil // the live stream has caught up
		}
	}
	clear := startsWithClear(m.Payload)
	if clear && rk.hasLast && rk.hasCursor && m.Seq == rk.cursor && m.Seq == rk.lastSeq && xxh3.Hash(m.Payload) == rk.lastHash {
		r.metrics.duplicates.WithLabelValues(rk.label).Inc()
		return
	}
	maxGap := r.cfg.window()
	if rk.replay != nil {
		maxGap *= 2
	}
	v, reason := admit(rk.hasCursor, rk.cursor, m.Seq, clear, maxGap)
	if v == restart && r.staleLive(ctx, rk, m.Seq, reason) {
		return
	}
	if v == restart {
		r.restartRank(rk, reason, m.Seq)
		v = accept
	}
	if !rk.hasLiveFrom {
		r.mu.Lock()
		rk.liveFrom, rk.hasLiveFrom = m.Seq, true
		r.mu.Unlock()
	}
	switch v {
	case duplicate:
		r.metrics.duplicates.WithLabelValues(rk.label).Inc()
		return
	case gap:
		from, to := rk.cursor+1, m.Seq-1
		r.metrics.gaps.WithLabelValues(rk.label).Inc()
		r.log.Warn("publisher gap; filling it from the replay", "rank", rk.rank, "from", from, "to", to)
		rk.replayedFrom = m.Seq
		r.fill(ctx, rk, from, to)
	case accept:
		switch {
		case rk.hasCursor:
		case joinedLate(m.Seq, clear):
			r.recoverStart(ctx, rk, m.Seq)
		case m.Seq == 1 && !clear && rk.replay != nil:
			r.recoverZero(ctx, rk)
		}
	}
	if ctx.Err() != nil {
		return
	}
	// Re-admit: the replay may have run past this batch, which then has
	// been relayed already.
	if rk.hasCursor && m.Seq <= rk.cursor {
		r.metrics.duplicates.WithLabelValues(rk.label).Inc()
		return
	}
	r.relay(rk, m.Seq, m.Payload)
}

// staleLive reports whether a live batch the admission table reads as a
// restart, because it went back below the cursor, is an old batch of the
// current incarnation; it is then counted and skipped.
//
// Live batches wait on the socket while the rank loop runs a replay (the
// start replay, a catch-up). A replay that runs past them relays later
// batches, and the live copies of those are recognised by their hashes
// (replayed); but what the engine's ring no longer held when it answered
// was written off as lost or unknown, and the live copies of those arrive
// below the cursor with nothing to recognise them by. A relay that took
// them for a restart would end every subscriber with DATA_LOSS for an
// engine that never restarted. Only a batch at or past the last live one
// (a second copy of a stale batch is at it) can be such a copy: one
// incarnation's live stream is in order. For it the engine's replay
// decides, as in catchUp: an engine whose ring still holds the batch the
// relay relayed last, byte for byte, has not restarted (a new incarnation
// stamps new times). Only that batch is asked for, so a run of stale
// batches costs the engine one reply each, not a ring each. Without that
// answer (no replay, an error, no batch at the cursor, a ring that rolled
// past it) the table's verdict stands. The check trusts that the replay
// endpoint is served by the process that publishes the live stream, as
// every engine binds both.
func (r *Relay) staleLive(ctx context.Context, rk *rankState, seq uint64, reason restartReason) bool {
	switch {
	case reason != counterRestarted && reason != sequenceRegression,
		rk.replay == nil, !rk.hasCursor, !rk.hasLast, rk.lastSeq != rk.cursor,
		rk.hasLastLive && seq < rk.lastLive:
		return false
	}
	msgs, _, err := r.askReplayHead(ctx, rk, rk.cursor)
	if err != nil || len(msgs) == 0 || msgs[0].Seq != rk.cursor || xxh3.Hash(msgs[0].Payload) != rk.lastHash {
		return false
	}
	r.metrics.stale.WithLabelValues(rk.label).Inc()
	if !rk.hasLastLive || seq != rk.lastLive+1 {
		// Once per run of such batches: the next ones follow in order.
		r.log.Info("live batch older than what a replay relayed; the engine still holds the cursor's batch, so it did not restart: skipping it",
			"rank", rk.rank, "seq", seq, "cursor", rk.cursor)
	}
	return true
}

// relay normalizes one batch and admits it: history, record, cursor, then
// every subscriber's queue. Admission never waits for a subscriber.
//
// The batch is written once, straight from the decoder into its protobuf
// wire form (no message is built), into the rank's reused buffer and then
// copied out at its exact size: the history keeps these bytes for a long
// time, every subscriber is sent them, and the record applies them.
func (r *Relay) relay(rk *rankState, seq uint64, payload []byte) {
	enc, drops, err := rk.norm.appendNormalized(rk.encBuf[:0], payload, seq, rk.rank)
	if err != nil {
		// Relay an empty batch under the sequence so that nobody sees a
		// gap for it: the payload does not decode, or (logged as an
		// error) holds a string proto3 cannot carry.
		enc = r.emptyBatch(rk, seq, err)
	}
	rk.encBuf = enc
	enc = bytes.Clone(enc)
	if cap(rk.encBuf) > maxKeptEncBuf {
		rk.encBuf = nil // one huge batch should not pin its buffer for ever
	}

	r.mu.Lock()
	got, err := r.rec.applyEncoded(enc)
	if err != nil {
		// The relay's own encoding did not decode: a defect, not an
		// engine's fault. The record is unchanged; relay the batch
		// empty, as an undecodable one, rather than send bytes the
		// record could not read.
		r.log.Error("the record could not apply a relayed batch; relaying it empty", "rank", rk.rank, "seq", seq, "err", err)
		// Cloned: emptyBatch writes in the rank's buffer, which the next
		// batch reuses, and these bytes go to the history.
		enc = bytes.Clone(r.emptyBatch(rk, seq, nil))
		got = applied{}
	}
	if len(got.reannounced) > 0 && r.cfg.SuppressReannounced {
		enc = withoutEvents(enc, got.reannounced)
		got.events -= len(got.reannounced) // they are not relayed
	}
	sum, n := r.rec.LiveDigest(rk.rank)
	digest := liveDigest{sum: sum, blocks: n, set: true}
	pos := r.hist.pushBatch(rk.rank, seq, enc, int64(len(enc)), digest)
	r.noteEvictions(rk, seq)
	rk.cursor, rk.hasCursor = seq, true
	startFixed := false
	if !rk.hasStart {
		rk.startedAt, rk.hasStart = seq, true
		if rk.recoveringStart {
			rk.unknownBefore, startFixed = seq-rk.startOrigin, true
		}
	}
	r.relayed++
	relayed := r.relayed
	r.fanOut(posBatch{pos: pos, enc: enc, digest: digest, live: true, rank: rk.rank, seq: seq})
	r.mu.Unlock()

	if startFixed {
		r.countUnknownBefore(rk, rk.unknownBefore)
	}

	rk.lastSeq, rk.lastHash, rk.hasLast = seq, xxh3.Hash(payload), true
	if len(got.reannounced) > 0 {
		r.metrics.reannounced.WithLabelValues(rk.label, fmt.Sprint(r.cfg.SuppressReannounced)).Add(float64(len(got.reannounced)))
	}
	r.metrics.batches.WithLabelValues(rk.label).Inc()
	r.metrics.events.WithLabelValues(rk.label).Add(float64(got.events))
	r.metrics.blocks.WithLabelValues(rk.label).Add(float64(got.storedBlocks))
	for _, d := range drops {
		r.metrics.drops.WithLabelValues(d.reason).Add(float64(d.n))
	}
	if relayed%summaryEvery == 0 {
		r.logSummary("relay summary")
	}
}

// emptyBatch is the wire form of an empty batch at rank's seq, what the
// relay sends in place of a batch it cannot relay, so that the sequence has
// no gap. cause is the normalizer's error (nil when the caller logged its
// own): an undecodable payload is counted and its warning throttled; a batch
// that decoded but cannot be encoded is a different fault and logged as an
// error.
func (r *Relay) emptyBatch(rk *rankState, seq uint64, cause error) []byte {
	switch {
	case cause == nil:
	case errors.Is(cause, kvenc.ErrInvalidUTF8):
		r.log.Error("encoding a relayed batch failed; relaying it empty", "rank", rk.rank, "seq", seq, "err", cause)
	default:
		r.metrics.undecodable.WithLabelValues(rk.label).Inc()
		if now := time.Now(); now.Sub(rk.undecodableLoggedAt) >= undecodableLogEvery {
			r.log.Warn("undecodable batch; relaying it empty", "rank", rk.rank, "seq", seq, "err", cause,
				"not_logged_since_last", rk.undecodableSuppressed)
			rk.undecodableLoggedAt, rk.undecodableSuppressed = now, 0
		} else {
			rk.undecodableSuppressed++
		}
	}
	// Cannot fail: an empty batch has no string to be invalid.
	enc, _ := kvenc.AppendBatch(rk.encBuf[:0], &kvpb.KvEventBatch{SequenceNumber: seq, DpRank: proto.Int32(rk.rank)})
	return enc
}

// maxKeptEncBuf is the largest encoding buffer a rank keeps between batches.
const maxKeptEncBuf = 4 << 20

// withoutEvents is the batch enc without the events at the indexes drop
// (ascending), re-encoded: the stage that keeps report-mode
// re-announcements out of the stream (Config.SuppressReannounced). The
// batch keeps its sequence, so a batch left empty still closes its place in
// the rank's sequence. It is rare (a request asked for report mode "full"
// and the relay was told to suppress it), so it decodes the batch.
func withoutEvents(enc []byte, drop []int) []byte {
	b := &kvpb.KvEventBatch{}
	if err := proto.Unmarshal(enc, b); err != nil {
		// Cannot happen for bytes the record just applied; keep the
		// engine's batch rather than lose its sequence.
		return enc
	}
	kept := b.Events[:0]
	for i, ev := range b.Events {
		if len(drop) > 0 && drop[0] == i {
			drop = drop[1:]
			continue
		}
		kept = append(kept, ev)
	}
	clear(b.Events[len(kept):])
	b.Events = kept
	out, err := kvenc.AppendBatch(nil, b)
	if err != nil {
		return enc // as above: these strings encoded a moment ago
	}
	return out
}

// lose records rank's sequences from..to as a hole: nothing will ever
// deliver them, and the cursor moves past them.
func (r *Relay) lose(rk *rankState, from, to uint64) {
	if to < from {
		return
	}
	r.mu.Lock()
	r.hist.pushHole(rk.rank, from, to)
	rk.cursor, rk.hasCursor = to, true
	r.mu.Unlock()
	r.metrics.lost.WithLabelValues(rk.label).Add(float64(to - from + 1))
	r.log.Warn("publisher batches lost: no replay can give them", "rank", rk.rank, "from", from, "to", to)
}

// restartRank starts a new incarnation of rk's publisher. The history is one
// log for every rank, so it is cleared whole: every live subscriber is ended
// (gateways then reset every rank and come back from zero, when they get a
// snapshot), and no entry of the old incarnation can be served to a client
// whose cursor happens to fall inside the new one.
func (r *Relay) restartRank(rk *rankState, reason restartReason, seq uint64) {
	r.mu.Lock()
	old := rk.cursor
	r.generation++
	gen := r.generation
	r.hist.clear()
	r.rec.ClearRank(rk.rank)
	rk.hasCursor, rk.cursor = false, 0
	rk.hasStart, rk.startedAt = false, 0
	rk.hasLiveFrom, rk.liveFrom = false, 0
	rk.hasLastLive, rk.lastLive = false, 0
	rk.unknownBefore = 0
	rk.restarts++
	err := fmt.Errorf("%w: publisher of rank %d at %s restarted (%s, incarnation %d); resubscribe from zero",
		ErrDataLoss, rk.rank, rk.endpoint, reason, gen)
	for s := range r.subs {
		s.end(err, "publisher_restart")
	}
	r.mu.Unlock()
	rk.norm.reset()
	rk.replayed = nil
	rk.hasLast = false
	r.metrics.unknownBefore.WithLabelValues(rk.label).Set(0)
	r.metrics.restarts.WithLabelValues(rk.label, string(reason)).Inc()
	r.log.Warn("publisher restarted", "rank", rk.rank, "reason", string(reason), "cursor", old, "seq", seq, "generation", gen)
}

// replayStats is what one fill obtained.
type replayStats struct {
	recovered uint64
	first     uint64 // the first recovered sequence, if recovered > 0
	answered  bool   // some replay answered (end marker or batches)
}

// fill recovers rk's sequences from..to from the replay before anything
// later is relayed. Replies below what is expected are dropped; replies past
// to are relayed too (the live copies then read as duplicates); a replay
// that stops early is asked again from the next missing sequence; whatever
// no replay gives becomes a hole.
func (r *Relay) fill(ctx context.Context, rk *rankState, from, to uint64) replayStats {
	if rk.replay == nil {
		r.lose(rk, from, to)
		return replayStats{}
	}
	msgs, complete, err := r.askReplay(ctx, rk, from)
	st, next := r.takeReplies(ctx, rk, from, to, true, msgs, complete, err)
	if next <= to && ctx.Err() == nil {
		r.lose(rk, next, to)
	}
	r.log.Info("gap filled", "rank", rk.rank, "from", from, "to", to, "recovered", st.recovered)
	return st
}

func (r *Relay) askReplay(ctx context.Context, rk *rankState, from uint64) ([]Message, bool, error) {
	msgs, complete, err := rk.replay.Replay(ctx, from)
	r.noteReplay(ctx, rk, from, complete, err)
	return msgs, complete, err
}

// askReplayHead asks for the first batch the engine holds from from on,
// and for the whole ring from a replayer that cannot stop early.
func (r *Relay) askReplayHead(ctx context.Context, rk *rankState, from uint64) ([]Message, bool, error) {
	h, ok := rk.replay.(headReplayer)
	if !ok {
		return r.askReplay(ctx, rk, from)
	}
	msgs, complete, err := h.ReplayUpTo(ctx, from, 1)
	r.noteReplay(ctx, rk, from, complete, err)
	return msgs, complete, err
}

// noteReplay logs a replay's failure once per outage and counts the request
// by result.
func (r *Relay) noteReplay(ctx context.Context, rk *rankState, from uint64, complete bool, err error) {
	result := "complete"
	switch {
	case err != nil:
		result = "error"
		if ctx.Err() == nil {
			// Once per outage: an absent engine is retried with backoff,
			// and every retry would say the same.
			rk.replayFailures++
			if rk.replayFailures == 1 {
				r.log.Warn("replay failed; retrying quietly until it answers", "rank", rk.rank, "endpoint", rk.replayEndpoint, "from", from, "err", err)
			} else {
				r.log.Debug("replay failed again", "rank", rk.rank, "endpoint", rk.replayEndpoint, "from", from, "failures", rk.replayFailures, "err", err)
			}
		}
	case !complete:
		result = "truncated"
	}
	if err == nil && rk.replayFailures > 0 {
		r.log.Info("replay answering again", "rank", rk.rank, "endpoint", rk.replayEndpoint, "failures", rk.replayFailures)
		rk.replayFailures = 0
	}
	r.metrics.replays.WithLabelValues(rk.label, result).Inc()
}

// takeReplies relays a replay's answer from expected on, and asks again
// while the answer was cut short but brought something new. With bounded,
// it stops once the range up to to is covered. It returns the next sequence
// still missing.
func (r *Relay) takeReplies(ctx context.Context, rk *rankState, expected, to uint64, bounded bool,
	msgs []Message, complete bool, err error) (replayStats, uint64) {
	var st replayStats
	// missingAt is where the previous answer lacked a sequence: a reply can
	// be missing because a send-HWM dropped it (SGLang), so a sequence is
	// declared lost only when two answers in a row lack it.
	var missingAt uint64
	haveMissing := false
	// unanswered counts attempts in a row that brought nothing: an error (no
	// connection within the timeout, a broken one) or no reply before the
	// timeout. Such an attempt says nothing about what the engine holds (a
	// busy host can miss one deadline), so it is made again before the rest
	// is written off: a replay that is down costs one more timeout per gap,
	// a hiccup no longer costs the batches.
	unanswered := 0
	// held keeps what an answer gave past the sequence it lacked. By the
	// time the engine is asked again its ring may have moved on; what only
	// the earlier answer still had was received, not lost.
	var held []Message
	// last is set when the replay is given up with held replies: they are
	// taken as the final answer, and whatever they lack is lost.
	last := false
	for round := 0; ; round++ {
		if err != nil || (len(msgs) == 0 && !complete) {
			unanswered++
			if unanswered >= maxUnansweredReplays || round+1 >= maxReplayRounds || ctx.Err() != nil {
				if held == nil || ctx.Err() != nil {
					return st, expected
				}
				// Giving up, but an earlier answer brought these: they were
				// received, so they are relayed, and only what precedes
				// them is lost.
				msgs, complete, err, held, last = held, true, nil, nil, true
			} else {
				r.log.Info("replay brought nothing; asking again", "rank", rk.rank, "from", expected, "err", err)
				msgs, complete, err = r.askReplay(ctx, rk, expected)
				continue
			}
		}
		unanswered = 0
		st.answered = true
		if held != nil {
			msgs, held = mergeReplies(msgs, held), nil
		}
		took, jumped := 0, false
		for i, m := range msgs {
			if m.Seq < expected {
				r.metrics.replayStale.WithLabelValues(rk.label).Inc()
				continue
			}
			if m.Seq > expected && m.Seq-expected > r.cfg.window() && (!bounded || m.Seq > to+1) {
				// Further ahead than the engine's ring reaches: no engine
				// answers so, and recording it as a hole would let one reply
				// put 2^63 lost batches in the counters. The answer ends
				// here; what it did not give stays missing. A gap being
				// filled may be up to twice the ring (admission lets the
				// ring fill its end), so there a reply within the gap is in
				// reach: only the head before it is lost, a bounded hole.
				r.log.Warn("replay reply beyond the engine's replay window; ignoring the rest of the answer",
					"rank", rk.rank, "expected", expected, "seq", m.Seq, "window", r.cfg.window())
				return st, expected
			}
			if m.Seq > expected {
				if !last && (!haveMissing || missingAt != expected) {
					missingAt, haveMissing, jumped = expected, true, true
					held = msgs[i:]
					break
				}
				// Asked again and still not there: the engine's ring no
				// longer holds it, or it was never buffered.
				r.lose(rk, expected, m.Seq-1)
				expected = m.Seq
			}
			r.relay(rk, m.Seq, m.Payload)
			r.metrics.recovered.WithLabelValues(rk.label).Inc()
			if st.recovered == 0 {
				st.first = m.Seq
			}
			st.recovered++
			took++
			expected = m.Seq + 1
			if m.Seq >= rk.replayedFrom {
				if rk.replayed == nil {
					rk.replayed, rk.replayedMax = map[uint64]uint64{}, 0
				}
				rk.replayed[m.Seq] = xxh3.Hash(m.Payload)
				rk.replayedMax = max(rk.replayedMax, m.Seq)
			}
		}
		switch {
		case jumped && round+1 < maxReplayRounds && ctx.Err() == nil:
		case last, took == 0, complete, bounded && expected > to,
			round+1 >= maxReplayRounds, ctx.Err() != nil:
			return st, expected
		}
		r.log.Info("replay cut short; resuming it", "rank", rk.rank, "from", expected)
		msgs, complete, err = r.askReplay(ctx, rk, expected)
	}
}

// mergeReplies joins two answers of one replay into one, in sequence
// order, each sequence once (newer's copy where both have it).
func mergeReplies(newer, older []Message) []Message {
	out := make([]Message, 0, len(newer)+len(older))
	out = append(append(out, newer...), older...)
	slices.SortStableFunc(out, func(a, b Message) int { return cmp.Compare(a.Seq, b.Seq) })
	return slices.CompactFunc(out, func(a, b Message) bool { return a.Seq == b.Seq })
}

// catchUp asks the replay for what the live stream missed with no later
// batch to reveal it: batches sent before this subscription reached the
// publisher (ZeroMQ's slow joiner), the tail of a burst the PUB dropped at
// its high-water mark, or the first batches of a publisher that restarted
// while the feed was reconnecting. It asks from the cursor itself, so the
// answer also tells whether the engine still holds the batch the relay
// relayed last: a different batch there, or nothing at or after the cursor
// in a complete answer, means a new incarnation. It reports whether it
// restarted the rank (the caller then primes it from 0).
func (r *Relay) catchUp(ctx context.Context, rk *rankState) bool {
	from := rk.cursor
	if from == math.MaxUint64 {
		return false // nothing follows; the next batch is a regression
	}
	msgs, complete, err := r.askReplay(ctx, rk, from)
	if err != nil || ctx.Err() != nil {
		return false
	}
	switch {
	case len(msgs) == 0:
		if !complete || !rk.hasLast || rk.lastSeq != from {
			return false
		}
		// The engine's ring always holds its newest batches; with none at
		// or after a batch it sent, its counter went back.
		r.restartRank(rk, replayMismatch, from)
		return true
	case msgs[0].Seq == from:
		if rk.hasLast && rk.lastSeq == from && xxh3.Hash(msgs[0].Payload) != rk.lastHash {
			r.restartRank(rk, replayMismatch, from)
			return true
		}
		msgs = msgs[1:]
	}
	if len(msgs) == 0 {
		return false
	}
	r.log.Info("catch-up replay found batches the live stream missed", "rank", rk.rank, "from", from+1, "first", msgs[0].Seq)
	cursorHash, haveCursorHash := rk.lastHash, rk.hasLast && rk.lastSeq == from
	rk.replayedFrom = from + 1
	r.takeReplies(ctx, rk, from+1, 0, false, msgs, complete, nil)
	// The catch-up ran between two live messages, so a redelivery of the
	// batch at the old cursor may still be on its way: it is now below the
	// cursor and must read as a duplicate, not as a sequence regression.
	if haveCursorHash && rk.replayed != nil {
		rk.replayed[from] = cursorHash
	}
	return false
}

// recoverStart fills 0..seq-1 for a publisher that was already counting when
// its first live batch arrived. What the replay cannot reach is unknown.
func (r *Relay) recoverStart(ctx context.Context, rk *rankState, seq uint64) {
	// No replay reaches further back than the engine's ring, so no hole
	// wider than it is recorded: a first batch at 2^63 (forged, or a
	// sequence jump) must not make 2^63 lost batches.
	var from uint64
	if w := r.cfg.window(); seq > w {
		from = seq - w
	}
	rk.replayedFrom = from
	rk.recoveringStart, rk.startOrigin = true, 0
	st := r.fill(ctx, rk, from, seq-1)
	rk.recoveringStart = false
	if st.recovered == 0 {
		// The live batch seq, relayed next, is the start: unknown_before is
		// set before the cursor reaches it.
		r.setUnknownBefore(rk, seq)
	}
	unknown := rk.unknownBefore
	if unknown == 0 {
		r.log.Info("late join recovered from the publisher's start", "rank", rk.rank, "first_live", seq, "recovered", st.recovered)
	} else {
		r.log.Warn("late join: sequences before the relay's start are unknown", "rank", rk.rank, "first_live", seq, "unknown_before", unknown)
	}
}

// recoverZero asks for sequence 0 when a publisher's first live batch is 1.
// The Rust relay takes 1 as a counter's start (smg's mock engine counts from
// 1), but the engines count from 0, and 0 is the batch a subscriber that
// joins late is likeliest to miss. A replay without 0 costs nothing: no hole
// is recorded, as for the mock.
func (r *Relay) recoverZero(ctx context.Context, rk *rankState) {
	rk.replayedFrom = 0
	for attempt := 0; attempt < 2; attempt++ {
		msgs, complete, err := r.askReplay(ctx, rk, 0)
		if err != nil || len(msgs) == 0 {
			return
		}
		if msgs[0].Seq == 0 {
			r.takeReplies(ctx, rk, 0, 0, true, msgs, complete, nil)
			return
		}
		if complete {
			return // the engine counts from 1
		}
		// An answer cut short may have lost 0 itself: ask once more.
	}
}

// noteEvictions marks the rank's snapshots incomplete once its record hit
// the cap: entries stored before seq may be missing, as after a late join.
// Called with r.mu held.
func (r *Relay) noteEvictions(rk *rankState, seq uint64) {
	n := r.rec.evictedFrom(rk.rank)
	if n == rk.recordEvicted {
		return
	}
	if n > rk.recordEvicted {
		r.metrics.recordEvicted.WithLabelValues(rk.label).Add(float64(n - rk.recordEvicted))
		if !rk.warnedEviction || time.Since(rk.lastEvictionWarn) > time.Minute {
			r.log.Warn("live-block record at its cap: evicted the oldest-stored blocks; snapshots of this rank are marked incomplete",
				"rank", rk.rank, "evicted_total", n, "cap_entries", r.cfg.RecordMaxEntries)
			rk.warnedEviction, rk.lastEvictionWarn = true, time.Now()
		}
		if seq > rk.unknownBefore {
			rk.unknownBefore = seq
			r.metrics.unknownBefore.WithLabelValues(rk.label).Set(float64(seq))
		}
	}
	rk.recordEvicted = n
}

func (r *Relay) setUnknownBefore(rk *rankState, unknown uint64) {
	r.mu.Lock()
	rk.unknownBefore = unknown
	r.mu.Unlock()
	r.countUnknownBefore(rk, unknown)
}

func (r *Relay) countUnknownBefore(rk *rankState, unknown uint64) {
	r.metrics.unknownBefore.WithLabelValues(rk.label).Set(float64(unknown))
	// The total adds at most one replay window per incarnation: one batch
	// with a forged sequence must not add 2^63 (the gauge has the exact
	// value).
	r.metrics.unknownBeforeStart.WithLabelValues(rk.label).Add(float64(min(unknown, r.cfg.window())))
}

// prime asks the replay for everything from 0 before any live batch. It
// reports whether the engine answered (an empty but complete answer counts:
// the engine is up and has published nothing).
func (r *Relay) prime(ctx context.Context, rk *rankState) bool {
	if rk.hasCursor {
		return true
	}
	pctx, cancel := context.WithTimeout(ctx, 2*r.cfg.ReplayTimeout)
	defer cancel()
	msgs, complete, err := r.askReplay(pctx, rk, 0)
	if err != nil {
		return false
	}
	if len(msgs) == 0 {
		return complete
	}
	// An engine counting from 1 (smg's mock) lacks 0 without losing it.
	var start uint64
	if msgs[0].Seq == 1 && complete {
		start = 1
	}
	base := start
	if msgs[0].Seq-start > r.cfg.window() {
		// The ring starts further on than it could ever reach back (an
		// engine that has run for a while): what precedes it is unknown,
		// not a hole, and no hole wider than the window is recorded.
		start = msgs[0].Seq
	}
	rk.replayedFrom = 0
	rk.recoveringStart, rk.startOrigin = true, base
	st, _ := r.takeReplies(ctx, rk, start, 0, false, msgs, complete, nil)
	rk.recoveringStart = false
	if st.recovered == 0 {
		r.setUnknownBefore(rk, 0)
	}
	r.metrics.primed.WithLabelValues(rk.label).Add(float64(st.recovered))
	r.log.Info("primed from the publisher's replay", "rank", rk.rank, "batches", st.recovered, "unknown_before", rk.unknownBefore)
	return true
}

// triggerReprime asks every rank with nothing relayed to replay from 0
// again: a publisher that spoke only before the first start replay answered
// is otherwise invisible until its next batch.
func (r *Relay) triggerReprime() {
	for _, rk := range r.ranks {
		select {
		case rk.reprime <- struct{}{}:
		default:
		}
	}
}

func (r *Relay) logSummary(msg string) {
	st := r.Status()
	r.log.Info(msg, "relayed", st.Relayed, "history_entries", st.History.Entries, "history_bytes", st.History.Bytes,
		"holes", st.History.Holes, "record_blocks", st.RecordBlocks, "subscribers", st.Subscribers, "generation", st.Generation)
}
