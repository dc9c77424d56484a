package relay

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrelay/kvrelay/engines"
	"github.com/kvrelay/kvrelay/internal/latencyprobe"
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

// directFeed is a Feed the rank loop waits on itself: Ready is signalled
// when TryRecv may have a batch, ConnChanged when Connected may have
// changed. The zmq feed is one. Other feeds get a goroutine blocked in Recv
// and a 100 ms poll of Connected; a direct feed saves that goroutine's
// hand-off on every batch and the poll's 10 wake-ups a second per rank.
type directFeed interface {
	Feed
	Ready() <-chan struct{}
	TryRecv() (Message, bool)
	ConnChanged() <-chan struct{}
}

// runRank is one rank's state machine: prime, then admit live batches,
// filling gaps from the replay before anything later is relayed.
func (r *Relay) runRank(ctx context.Context, rk *rankState, feed Feed) {
	var (
		msgs   chan Message
		ready  <-chan struct{}
		connC  <-chan struct{}
		direct directFeed
	)
	if d, ok := feed.(directFeed); ok {
		direct, ready = d, d.Ready()
	} else {
		msgs = make(chan Message)
		var reader sync.WaitGroup
		reader.Go(func() { r.read(ctx, rk, feed, msgs) })
		defer reader.Wait()
	}

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
	// the rank has been quiet for IdleProbe (see catchUp). A direct feed
	// says when its connection changes, and a timer is set to the next of
	// those two deadlines; any other feed's connection is polled.
	var (
		tick       <-chan time.Time
		wake       *time.Timer
		connected  bool
		catchUpAt  time.Time
		lastActive = time.Now()
	)
	if rk.replay != nil && (r.cfg.CatchUpDelay > 0 || r.cfg.IdleProbe > 0) {
		if direct != nil {
			wake = time.NewTimer(time.Hour)
			wake.Stop()
			defer wake.Stop()
			tick, connC = wake.C, direct.ConnChanged()
		} else {
			t := time.NewTicker(catchUpTick)
			defer t.Stop()
			tick = t.C
		}
	}
	// check runs the catch-up replay when it is due.
	check := func(now time.Time) {
		up := feed.Connected()
		if up && !connected && r.cfg.CatchUpDelay > 0 {
			catchUpAt = now.Add(r.cfg.CatchUpDelay)
		}
		connected = up
		due := !catchUpAt.IsZero() && !now.Before(catchUpAt)
		idle := r.cfg.IdleProbe > 0 && now.Sub(lastActive) >= r.cfg.IdleProbe
		if !up || primeC != nil || !(due || idle) {
			return
		}
		catchUpAt = time.Time{}
		lastActive = now
		if !rk.hasCursor {
			// Nothing relayed yet: the start replay may have answered
			// before the engine's first batch, which the live stream
			// then missed. Ask from 0 again.
			primeC = closedChan
			return
		}
		if r.catchUp(ctx, rk) && ctx.Err() == nil {
			primeC = closedChan
		}
		// A replay that did not answer took up to ReplayTimeout; the
		// quiet time counts from its end, not its start.
		lastActive = time.Now()
	}
	// arm sets the direct feed's timer to the next deadline of check. A
	// batch moves the idle deadline later without re-arming: the timer
	// then fires early, finds nothing due and is set again, once per
	// IdleProbe while batches flow.
	arm := func() {
		if wake == nil {
			return
		}
		var at time.Time
		if connected && primeC == nil {
			at = catchUpAt
			if r.cfg.IdleProbe > 0 {
				if t := lastActive.Add(r.cfg.IdleProbe); at.IsZero() || t.Before(at) {
					at = t
				}
			}
		}
		if at.IsZero() {
			wake.Stop()
			return
		}
		wake.Reset(time.Until(at))
	}
	live := func(m Message) {
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
	for {
		select {
		case <-ctx.Done():
			return
		case now := <-tick:
			check(now)
			arm()
		case <-connC:
			check(time.Now())
			arm()
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
			arm()
		case <-retryC:
			if !rk.hasCursor && rk.replay != nil {
				primeC = closedChan
			}
		case <-rk.reprime:
			if !rk.hasCursor && rk.replay != nil {
				primeC = closedChan
			}
		case <-ready:
			// One batch per signal: the queue keeps the signal up while
			// more are queued, so the other cases still get their turn.
			if m, ok := direct.TryRecv(); ok {
				latencyprobe.Mark(latencyprobe.Received, rk.rank, m.Seq)
				live(m)
			}
		case m := <-msgs:
			live(m)
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

func (r *Relay) logSummary(msg string) {
	st := r.Status()
	r.log.Info(msg, "relayed", st.Relayed, "history_entries", st.History.Entries, "history_bytes", st.History.Bytes,
		"holes", st.History.Holes, "record_blocks", st.RecordBlocks, "subscribers", st.Subscribers, "generation", st.Generation)
}
