package natsevents

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvrelay/kvrelay/internal/natsconn"
	"github.com/kvrelay/kvrelay/internal/natslog"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/protobuf/proto"

	"github.com/kvrelay/kvrelay/proto/kvpb"
	"github.com/kvrelay/kvrelay/relay"
	"github.com/kvrelay/kvrelay/relay/record"
)

// Relay is what the sink needs of a relay: the subscription every gRPC
// subscriber gets, a snapshot cut with its log position, and the ranks a
// snapshot must account for.
type Relay interface {
	Subscribe(ctx context.Context, req *kvpb.SubscribeKvEventsRequest) (*relay.Subscription, error)
	SnapshotAt() ([]*kvpb.KvEventBatch, uint64)
	Ranks() []int32
}

// SinkOptions configures a Sink.
type SinkOptions struct {
	// URL is the NATS server list (nats://host:4222, comma-separated).
	URL string
	// Worker names this relay's engine on the stream; gateways use the
	// same name (see Source). Required.
	Worker string
	// Stream is the JetStream stream (DefaultStream); its snapshots go to
	// the object store bucket BucketFor(Stream).
	Stream string
	// SubjectPrefix is where the stream's subjects live
	// (DefaultSubjectPrefix): <prefix>.<WorkerToken(worker)>.<rank>.
	SubjectPrefix string
	// MaxAge is the retention of the stream when the sink creates it
	// (DefaultMaxAge); Duplicates its duplicate window (DefaultDuplicates).
	// An existing stream is used as it is.
	MaxAge, Duplicates time.Duration
	// SnapshotEvery is how often the worker's snapshot object is
	// rewritten (DefaultSnapshotEvery); it is also written after every
	// (re)subscription.
	SnapshotEvery time.Duration
	// MaxPending bounds the publishes awaiting their acks
	// (DefaultMaxPending); AckTimeout is how long one may wait (5 s).
	MaxPending int
	AckTimeout time.Duration
	// RetryWait is the pause before a resync after a failure (1 s).
	RetryWait time.Duration
	// AliveEvery is how often the sink announces itself on core NATS
	// while a pass is publishing (DefaultAliveEvery; negative: never, as
	// a relay from before announcements), so that gateways can tell a
	// silent sink from an idle engine (see alive.go).
	AliveEvery time.Duration
	// Member, if set, is this worker as gateways should route to it, in
	// the gateway's --worker syntax (grpc://HOST:PORT,model=M,service=S):
	// each announcement carries it in a header (members.go), and gateways
	// that take their workers from the announcements add it.
	Member string
	// Loads, if set, is the relay's load sources: each relayed rank's
	// record is published beside the stream (see loads.go), so that a
	// gateway on JetStream sees the loads a gRPC subscriber gets.
	Loads       LoadSource
	NATSOptions []nats.Option
	Registerer  prometheus.Registerer
	Logger      *slog.Logger
}

// Defaults of SinkOptions.
const (
	DefaultMaxAge        = time.Hour
	DefaultDuplicates    = 10 * time.Minute
	DefaultSnapshotEvery = 30 * time.Second
	DefaultMaxPending    = 1024
)

func (o SinkOptions) withDefaults() (SinkOptions, error) {
	if o.Worker == "" {
		return o, errors.New("natsevents: the sink needs a worker name")
	}
	var err error
	if o.Stream, o.SubjectPrefix, err = streamDefaults(o.Stream, o.SubjectPrefix); err != nil {
		return o, err
	}
	if o.MaxAge <= 0 {
		o.MaxAge = DefaultMaxAge
	}
	if o.Duplicates <= 0 {
		o.Duplicates = DefaultDuplicates
	}
	if o.SnapshotEvery <= 0 {
		o.SnapshotEvery = DefaultSnapshotEvery
	}
	if o.MaxPending <= 0 {
		o.MaxPending = DefaultMaxPending
	}
	if o.AckTimeout <= 0 {
		o.AckTimeout = 5 * time.Second
	}
	if o.RetryWait <= 0 {
		o.RetryWait = time.Second
	}
	if o.AliveEvery == 0 {
		o.AliveEvery = DefaultAliveEvery
	}
	if o.AliveEvery > maxAliveEvery {
		return o, fmt.Errorf("natsevents: announcement interval %s above %s", o.AliveEvery, maxAliveEvery)
	}
	if o.AliveEvery > 0 && o.AliveEvery < time.Millisecond {
		return o, fmt.Errorf("natsevents: announcement interval %s below 1ms", o.AliveEvery)
	}
	if len(o.Member) > maxMemberSpec || strings.ContainsAny(o.Member, "\r\n") {
		return o, fmt.Errorf("natsevents: member %q: one line of at most %d bytes", o.Member, maxMemberSpec)
	}
	if o.Member != "" && o.AliveEvery < 0 {
		return o, errors.New("natsevents: a member is announced, which needs announcements on")
	}
	if o.Logger == nil {
		o.Logger = slog.New(slog.DiscardHandler)
	}
	return o, nil
}

// Sink publishes one relay's batches to JetStream. It is one more
// subscriber of the relay: a slow or unreachable NATS makes it lag or
// resync, never the relay wait.
type Sink struct {
	opts  SinkOptions
	rel   Relay
	token string
	log   *slog.Logger
	nc    *nats.Conn
	js    jetstream.JetStream
	m     *sinkMetrics

	mu   sync.Mutex
	fail func(error) // cancels the current follow when an async publish fails
	wake func(error) // ends the current wait for a batch (request.go)
	// requested: a snapshot request came in since the pass last looked.
	requested atomic.Bool
	reqSub    *nats.Subscription

	// What the announcements say (alive.go): this process's random
	// incarnation, the current pass (0: none publishing) and the newest
	// stored message's stream sequence.
	incarnation uint64
	pass        atomic.Uint64
	lastSeq     atomic.Uint64
	// storedAt is when the sink last stored a message (unix nanoseconds);
	// markEvery how long it may store none before it stores a marker
	// again (markInterval of the stream's age limit).
	storedAt, markEvery atomic.Int64

	// ranks are the DP ranks relayed so far: their loads are published.
	ranksMu sync.Mutex
	ranks   map[int32]struct{}
}

type sinkMetrics struct {
	published                  *prometheus.CounterVec // result: stored, duplicate, failed
	bytes                      prometheus.Counter
	resyncs                    *prometheus.CounterVec // reason
	snapshots                  *prometheus.CounterVec // result
	connected                  prometheus.Gauge
	snapshotBytes, snapshotSeq prometheus.Gauge
	loads                      *prometheus.CounterVec // reason: change, heartbeat
}

func newSinkMetrics(reg prometheus.Registerer) (*sinkMetrics, error) {
	m := &sinkMetrics{
		published: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvrelay_nats_events_published_total",
			Help: "Batches and snapshot chunks published to JetStream, by the server's answer (stored, duplicate: dropped by the stream's duplicate window, failed)."}, []string{"result"}),
		bytes: prometheus.NewCounter(prometheus.CounterOpts{Name: "kvrelay_nats_events_published_bytes_total",
			Help: "Payload bytes handed to JetStream."}),
		resyncs: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvrelay_nats_events_resyncs_total",
			Help: "Times the sink subscribed to the relay again from zero (its stream then carries a snapshot), by reason."}, []string{"reason"}),
		snapshots: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvrelay_nats_events_snapshots_total",
			Help: "Snapshot objects written, by result."}, []string{"result"}),
		connected: prometheus.NewGauge(prometheus.GaugeOpts{Name: "kvrelay_nats_events_connected",
			Help: "1 while the sink is connected to NATS."}),
		snapshotBytes: prometheus.NewGauge(prometheus.GaugeOpts{Name: "kvrelay_nats_events_snapshot_bytes",
			Help: "Size of the last snapshot object written."}),
		snapshotSeq: prometheus.NewGauge(prometheus.GaugeOpts{Name: "kvrelay_nats_events_snapshot_stream_sequence",
			Help: "Stream sequence the last snapshot object is consistent with."}),
		loads: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvrelay_nats_events_loads_published_total",
			Help: "Engine load records published beside the stream, by reason (change: SMG's thresholds; heartbeat: 1 s, 5 s after two unchanged)."}, []string{"reason"}),
	}
	for _, r := range []string{"stored", "duplicate", "failed"} {
		m.published.WithLabelValues(r)
	}
	for _, r := range []string{"start", "data_loss", "publish_failed", "nats_down"} {
		m.resyncs.WithLabelValues(r)
	}
	for _, r := range []string{"written", "failed", "deferred"} {
		m.snapshots.WithLabelValues(r)
	}
	if reg != nil {
		for _, c := range []prometheus.Collector{m.published, m.bytes, m.resyncs, m.snapshots, m.connected, m.snapshotBytes, m.snapshotSeq, m.loads} {
			if err := reg.Register(c); err != nil {
				return nil, fmt.Errorf("natsevents: %w", err)
			}
		}
	}
	return m, nil
}

// NewSink connects to NATS without waiting for it: an unreachable server
// is retried in the background, and Run publishes once it answers.
func NewSink(rel Relay, opts SinkOptions) (*Sink, error) {
	opts, err := opts.withDefaults()
	if err != nil {
		return nil, err
	}
	m, err := newSinkMetrics(opts.Registerer)
	if err != nil {
		return nil, err
	}
	s := &Sink{opts: opts, rel: rel, token: WorkerToken(opts.Worker), log: opts.Logger, m: m, incarnation: rand.Uint64(), ranks: map[int32]struct{}{}}
	nopts := append([]nats.Option{
		nats.ConnectHandler(func(*nats.Conn) { m.connected.Set(1); s.log.Info("NATS connected") }),
		nats.ReconnectHandler(func(*nats.Conn) { m.connected.Set(1); s.log.Info("NATS reconnected") }),
		nats.DisconnectErrHandler(func(_ *nats.Conn, err error) {
			m.connected.Set(0)
			s.log.Warn("NATS disconnected; the stream will get a snapshot when it is back", "err", natslog.RedactError(err))
			s.failFollow(fmt.Errorf("NATS disconnected: %w", natslog.RedactError(err)))
		}),
	}, opts.NATSOptions...)
	if s.nc, err = natsconn.Connect(opts.URL, "kvrelay-serve "+opts.Worker, opts.RetryWait, s.log, nopts...); err != nil {
		return nil, fmt.Errorf("natsevents: %w", err)
	}
	s.js, err = jetstream.New(s.nc,
		jetstream.WithPublishAsyncMaxPending(opts.MaxPending),
		jetstream.WithPublishAsyncTimeout(opts.AckTimeout),
		jetstream.WithPublishAsyncErrHandler(func(_ jetstream.JetStream, _ *nats.Msg, err error) {
			m.published.WithLabelValues("failed").Inc()
			s.failFollow(fmt.Errorf("a publish failed: %w", err))
		}))
	if err != nil {
		s.nc.Close()
		return nil, fmt.Errorf("natsevents: %w", err)
	}
	// A subscription made before the server answers is sent when it does.
	if s.reqSub, err = s.nc.Subscribe(snapshotRequestSubject(opts.SubjectPrefix, s.token), s.takeRequest); err != nil {
		s.nc.Close()
		return nil, fmt.Errorf("natsevents: subscribe to snapshot requests: %w", err)
	}
	return s, nil
}

func (s *Sink) failFollow(err error) {
	s.mu.Lock()
	f := s.fail
	s.mu.Unlock()
	if f != nil {
		f(err)
	}
}

// Close closes the NATS connection (after Run returned).
func (s *Sink) Close() { s.nc.Close() }

// Run publishes until ctx ends. Each pass subscribes to the relay from
// zero, so the stream first gets the relay's snapshot (or its complete
// history, whose batches the duplicate window drops when they are there
// already), then every batch; any failure ends the pass, and the next one,
// RetryWait later, starts with a snapshot again, so the stream is never
// left with a hole that no snapshot follows.
func (s *Sink) Run(ctx context.Context) error {
	if s.opts.AliveEvery > 0 {
		actx, cancel := context.WithCancel(ctx)
		done := make(chan struct{})
		go func() { defer close(done); s.announce(actx) }()
		defer func() { cancel(); <-done }()
	}
	if s.opts.AliveEvery > 0 {
		mctx, cancel := context.WithCancel(ctx)
		done := make(chan struct{})
		go func() { defer close(done); s.remark(mctx) }()
		defer func() { cancel(); <-done }()
	}
	if s.opts.Loads != nil {
		lctx, cancel := context.WithCancel(ctx)
		done := make(chan struct{})
		go func() { defer close(done); s.publishLoads(lctx) }()
		defer func() { cancel(); <-done }()
	}
	reason := "start"
	passes := uint64(0)
	for ctx.Err() == nil {
		if !s.nc.IsConnected() {
			reason = "nats_down"
			if !sleep(ctx, s.opts.RetryWait) {
				break
			}
			continue
		}
		s.m.resyncs.WithLabelValues(reason).Inc()
		passes++
		s.pass.Store(passes)
		err := s.follow(ctx)
		s.pass.Store(0)
		if ctx.Err() != nil {
			break
		}
		switch {
		case errors.Is(err, relay.ErrDataLoss), errors.Is(err, relay.ErrOutOfRange):
			reason = "data_loss"
		case errors.Is(err, relay.ErrDisabled):
			s.log.Warn("the engine's KV events are off; nothing to publish", "err", err)
			<-ctx.Done()
			return nil
		default:
			reason = "publish_failed"
		}
		s.log.Warn("JetStream sink resyncs from a snapshot", "err", err, "reason", reason)
		if !sleep(ctx, s.opts.RetryWait) {
			break
		}
	}
	return nil
}

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

// ensure creates the stream and the bucket when they are missing.
func (s *Sink) ensure(ctx context.Context) (jetstream.ObjectStore, error) {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	maxAge := s.opts.MaxAge
	if st, err := s.js.Stream(ctx, s.opts.Stream); errors.Is(err, jetstream.ErrStreamNotFound) {
		_, err = s.js.CreateStream(ctx, jetstream.StreamConfig{
			Name:        s.opts.Stream,
			Description: "kvrelay KV-cache event batches, one subject per worker and DP rank",
			Subjects:    []string{s.opts.SubjectPrefix + ".>"},
			Retention:   jetstream.LimitsPolicy,
			Discard:     jetstream.DiscardOld,
			Storage:     jetstream.FileStorage,
			MaxAge:      s.opts.MaxAge,
			Duplicates:  s.opts.Duplicates,
		})
		if err != nil && !errors.Is(err, jetstream.ErrStreamNameAlreadyInUse) {
			return nil, fmt.Errorf("create stream %s: %w", s.opts.Stream, err)
		}
	} else if err != nil {
		return nil, fmt.Errorf("stream %s: %w", s.opts.Stream, err)
	} else {
		maxAge = st.CachedInfo().Config.MaxAge // an existing stream is used as it is
	}
	s.markEvery.Store(int64(markInterval(maxAge)))
	bucket := BucketFor(s.opts.Stream)
	obs, err := s.js.ObjectStore(ctx, bucket)
	if errors.Is(err, jetstream.ErrBucketNotFound) {
		obs, err = s.js.CreateObjectStore(ctx, jetstream.ObjectStoreConfig{Bucket: bucket, Storage: jetstream.FileStorage,
			Description: "kvrelay snapshots of each worker's live blocks, with the stream sequence they are consistent with"})
		if errors.Is(err, jetstream.ErrBucketExists) {
			obs, err = s.js.ObjectStore(ctx, bucket)
		}
	}
	if err != nil {
		return nil, fmt.Errorf("object store %s: %w", bucket, err)
	}
	return obs, nil
}

// streamSeqKey names the object metadata that repeats the snapshot's
// stream sequence, so that a gateway can tell a snapshot's age without
// downloading it.
const streamSeqKey = "kvrelay-stream-sequence"

// pendingSnapshot is a cut waiting for the stream sequence of the last
// message it covers.
type pendingSnapshot struct {
	chunks []*kvpb.KvEventBatch
	pos    uint64 // the relay log position of the cut
}

// follow is one pass: subscribe from zero and publish until a failure.
func (s *Sink) follow(ctx context.Context) error {
	obs, err := s.ensure(ctx)
	if err != nil {
		return err
	}
	fctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	s.mu.Lock()
	s.fail = cancel
	s.mu.Unlock()
	defer func() {
		s.mu.Lock()
		s.fail = nil
		s.mu.Unlock()
	}()

	if mp := s.nc.MaxPayload(); mp < record.MaxChunkBytes {
		s.log.Warn("the NATS server's max_payload is below the relay's largest snapshot chunk: a larger chunk or batch cannot be published, and the sink resyncs at each", "max_payload", mp, "largest_chunk", record.MaxChunkBytes)
	}
	// What the stream holds of each rank must be read before this pass
	// publishes anything (see passAcks).
	acks, err := s.startAcks(fctx)
	if err != nil {
		return err
	}
	if s.opts.AliveEvery > 0 {
		if err := s.mark(fctx); err != nil {
			return err
		}
	}
	sub, err := s.rel.Subscribe(fctx, &kvpb.SubscribeKvEventsRequest{LiveDigests: true})
	if err != nil {
		return err
	}
	defer sub.Close()

	var (
		last      *ack   // the newest publish
		lastPos   uint64 // its relay log position
		pending   *pendingSnapshot
		inChunks  bool   // a snapshot of the subscription is arriving
		due       = true // a snapshot is due (at once after subscribing)
		unsettled bool   // due, but a rank could still hide messages below it
		nextSnap  time.Time
		lastCut   time.Time
		published int
	)
	for {
		if !due && !time.Now().Before(nextSnap) {
			due = true
		}
		if !due && s.requested.Load() && time.Since(lastCut) >= snapshotRequestEvery {
			s.requested.Store(false)
			due = true
		}
		if due {
			// Cut only once no rank can have a message stored below the
			// cut's sequence that the cut does not cover; checked again
			// as answers arrive, so the cut comes as soon as it can.
			if !acks.read(fctx, lastPos, false) {
				return errors.New("a message of this pass was not stored")
			}
			rank, ok := acks.settled()
			if !ok && !unsettled {
				s.m.snapshots.WithLabelValues("deferred").Inc()
				s.log.Debug("snapshot deferred: a rank's earlier messages are in the stream and it has had no new one yet", "rank", rank)
			}
			unsettled = !ok
		}
		if due && !unsettled && !inChunks && pending == nil {
			// With nothing relayed yet there is nothing to cut: the next
			// batch tries again.
			if chunks, pos := s.rel.SnapshotAt(); len(chunks) > 0 {
				due, nextSnap, lastCut = false, time.Now().Add(s.opts.SnapshotEvery), time.Now()
				pending = &pendingSnapshot{chunks: chunks, pos: pos}
				if last != nil && lastPos == pos {
					if !s.writeSnapshot(fctx, obs, pending, last, &acks) {
						due, nextSnap = false, time.Now().Add(min(time.Second, s.opts.SnapshotEvery))
					}
					pending = nil
				}
			}
		}
		var deadline time.Time
		switch {
		case !due && s.requested.Load():
			// A request came in too soon after the last cut.
			deadline = lastCut.Add(snapshotRequestEvery)
		case !due:
			deadline = nextSnap
		case unsettled:
			// The answer that settles the last rank may come after its
			// message: look again shortly even if nothing else is relayed.
			deadline = time.Now().Add(settleCheckEvery)
		}
		wait, wcancel := fctx, context.CancelFunc(func() {})
		if !deadline.IsZero() {
			wait, wcancel = context.WithDeadline(fctx, deadline)
		}
		// A snapshot request ends the wait too.
		wait, wake := context.WithCancelCause(wait)
		s.mu.Lock()
		s.wake = wake
		s.mu.Unlock()
		if !due && s.requested.Load() && time.Since(lastCut) >= snapshotRequestEvery {
			wake(errSnapshotRequested) // came in since the check above
		}
		enc, err := sub.NextEncoded(wait)
		s.mu.Lock()
		s.wake = nil
		s.mu.Unlock()
		wake(nil)
		wcancel()
		if err != nil {
			if cause := context.Cause(fctx); cause != nil {
				if ctx.Err() != nil {
					return nil
				}
				return cause
			}
			if errors.Is(err, context.DeadlineExceeded) || errors.Is(context.Cause(wait), errSnapshotRequested) {
				continue // a snapshot is due or requested, or a rank may have settled
			}
			return err
		}
		pos := sub.LogPosition()
		if pending != nil && pos > pending.pos {
			if last != nil {
				if !s.writeSnapshot(fctx, obs, pending, last, &acks) {
					due, nextSnap = false, time.Now().Add(min(time.Second, s.opts.SnapshotEvery))
				}
			}
			pending = nil
		}
		b, err := batchHeader(enc)
		if err != nil {
			return fmt.Errorf("reading a relayed batch: %w", err)
		}
		s.noteRank(b.GetDpRank())
		msg := nats.NewMsg(rankSubject(s.opts.SubjectPrefix, s.token, b.GetDpRank()))
		msg.Data = enc
		// Ties the sink's announcements to its stream (alive.go).
		s.stamp(msg)
		if snap := b.GetSnapshot(); snap != nil {
			// Chunks carry no message id: a snapshot published again is
			// a new resync point, harmless to apply again.
			inChunks = snap.GetIndex()+1 < snap.GetCount()
		} else {
			msg.Header.Set(jetstream.MsgIDHeader, msgID(s.token, b, enc))
		}
		// No resend on "no responders" (nats.go's default resends twice,
		// 250 ms apart): the publishes after it go on meanwhile, so a
		// resend could be stored behind later batches of its rank. The
		// failure ends the pass instead, and the resync's snapshot follows.
		f, err := s.js.PublishMsgAsync(msg, jetstream.WithRetryAttempts(0))
		if err != nil {
			s.m.published.WithLabelValues("failed").Inc()
			return fmt.Errorf("publishing sequence %d of rank %d to %s: %w", b.GetSequenceNumber(), b.GetDpRank(), msg.Subject, err)
		}
		s.m.bytes.Add(float64(len(enc)))
		a := &ack{done: make(chan struct{}), pos: pos, rank: b.GetDpRank()}
		go s.awaitAck(fctx, f, a)
		last, lastPos = a, pos
		acks.queue = append(acks.queue, a)
		acks.read(fctx, pos, false)
		published++
		if pending != nil && pos == pending.pos && !inChunks {
			// The cut's last batch is out: nothing the cut covers is left.
			if !s.writeSnapshot(fctx, obs, pending, last, &acks) {
				due, nextSnap = false, time.Now().Add(min(time.Second, s.opts.SnapshotEvery))
			}
			pending = nil
		}
		if published == 1 {
			s.log.Info("publishing to JetStream", "stream", s.opts.Stream, "subject", msg.Subject)
		}
	}
}

// ack is the server's answer to one publish, read once from its future
// (whose channels deliver once) and kept for whoever waits on it.
type ack struct {
	done chan struct{} // closed when seq or err is set
	seq  uint64
	dup  bool // the stream held the message already (at seq)
	err  error
	pos  uint64 // the batch's relay log position
	rank int32
}

// settleCheckEvery is how often a due snapshot waiting for a rank to
// settle looks at the answers again when nothing else is relayed.
const settleCheckEvery = 100 * time.Millisecond

// passAcks is what one pass's answers say about its snapshots.
//
// A snapshot object at stream sequence S is read with the worker's
// messages above S, so it must cover every message of the worker stored
// at or below S. Each message of this pass is stored above every earlier
// one, except a duplicate: the stream keeps it at the sequence an earlier
// run stored it at, which may be below S even when the batch comes after
// the cut (a restarted relay primes its ranks at different times, in
// another order than the earlier run relayed them). So a cut is written
// only when every configured rank is settled, that is, none of its later
// batches can be a duplicate:
//
//   - the stream held nothing of the rank when the pass began, or
//   - the rank had a message stored new in this pass (a rank's batches
//     come in order, and once one is new, none after it was stored
//     before), or
//   - a duplicate of the rank was the rank's newest batch in the stream
//     when the pass began (its later batches were never stored).
//
// A rank that has not primed yet is not settled unless the stream holds
// nothing of it: its re-published history would be duplicates below the
// cut (issue 30). Its absence from a cut with nothing of it in the stream
// hides nothing: its batches are then all stored above the cut, as its
// batches follow a gRPC snapshot that did not cover it.
type passAcks struct {
	queue   []*ack // not yet read, in publish order
	ranks   []int32
	fresh   map[int32]bool
	settle  map[int32]bool   // settled otherwise than by a new message
	lastIDs map[int32]uint64 // the rank's newest batch in the stream at the start
}

// startAcks reads, before the pass publishes, the newest message of each
// configured rank in the stream.
func (s *Sink) startAcks(ctx context.Context) (passAcks, error) {
	ranks := s.rel.Ranks()
	p := passAcks{ranks: ranks, fresh: map[int32]bool{}, settle: map[int32]bool{}, lastIDs: map[int32]uint64{}}
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	st, err := s.js.Stream(ctx, s.opts.Stream)
	if err != nil {
		return p, fmt.Errorf("stream %s: %w", s.opts.Stream, err)
	}
	for _, r := range ranks {
		m, err := st.GetLastMsgForSubject(ctx, rankSubject(s.opts.SubjectPrefix, s.token, r))
		switch {
		case errors.Is(err, jetstream.ErrMsgNotFound):
			p.settle[r] = true
		case err != nil:
			return p, fmt.Errorf("the stream's newest message of rank %d: %w", r, err)
		case m.Header.Get(jetstream.MsgIDHeader) != "":
			p.lastIDs[r] = m.Sequence
		default:
			// A snapshot chunk: the rank's newest batch is further back;
			// the rank settles by a new message.
		}
	}
	return p, nil
}

// read takes in the answers up to position upTo, waiting for them when
// wait is set, else only those already there; false if one failed.
func (p *passAcks) read(ctx context.Context, upTo uint64, wait bool) bool {
	for len(p.queue) > 0 && p.queue[0].pos <= upTo {
		a := p.queue[0]
		if wait {
			select {
			case <-a.done:
			case <-ctx.Done():
				return false
			}
		} else {
			select {
			case <-a.done:
			default:
				return true
			}
		}
		if a.err != nil {
			return false
		}
		if !a.dup {
			p.fresh[a.rank] = true
		} else if last, ok := p.lastIDs[a.rank]; ok && a.seq == last {
			p.settle[a.rank] = true
		}
		p.queue[0] = nil
		p.queue = p.queue[1:]
	}
	return true
}

// settled says whether every configured rank is settled by the answers
// read so far, and if not, one that is not.
func (p *passAcks) settled() (int32, bool) {
	for _, r := range p.ranks {
		if !p.fresh[r] && !p.settle[r] {
			return r, false
		}
	}
	return 0, true
}

// awaitAck reads one publish's answer into a and counts it. A failure is
// also reported to the error handler, which ends the pass.
func (s *Sink) awaitAck(ctx context.Context, f jetstream.PubAckFuture, a *ack) {
	defer close(a.done)
	select {
	case pa := <-f.Ok():
		// For a duplicate, the sequence the stream already held it at.
		a.seq, a.dup = pa.Sequence, pa.Duplicate
		s.noteSeq(pa.Sequence)
		if pa.Duplicate {
			s.m.published.WithLabelValues("duplicate").Inc()
		} else {
			s.m.published.WithLabelValues("stored").Inc()
		}
	case a.err = <-f.Err():
	case <-ctx.Done():
		a.err = context.Cause(ctx)
	}
}

// writeSnapshot stores a cut once the ack of last, the newest message it
// covers, gives that message's stream sequence. A failure is counted and
// logged; the next period tries again.
func (s *Sink) writeSnapshot(ctx context.Context, obs jetstream.ObjectStore, p *pendingSnapshot, last *ack, acks *passAcks) (done bool) {
	select {
	case <-last.done:
	case <-ctx.Done():
		return true
	}
	if last.err != nil || !acks.read(ctx, p.pos, true) {
		s.m.snapshots.WithLabelValues("failed").Inc()
		s.log.Warn("snapshot not written: a message it covers was not stored", "err", last.err)
		return true // the pass ends on the failure anyway
	}
	if rank, ok := acks.settled(); !ok {
		// Cut again a little later. (The loop cuts only once settled, so
		// this holds; it guards the rule where it matters.)
		s.m.snapshots.WithLabelValues("deferred").Inc()
		s.log.Debug("snapshot deferred: a rank's earlier messages are in the stream and it has had no new one yet", "rank", rank)
		return false
	}
	// Every rank is settled (see passAcks): every message stored at or
	// below last's sequence is covered by the cut, and none after it is
	// stored below. last itself may be a duplicate (a settling one): its
	// sequence is then the earlier run's, and the cut still covers
	// everything at or below it.
	seq := last.seq
	if len(p.chunks) > maxSnapshotChunks {
		// Replicas would refuse the object: write none rather than one
		// they all fail on; they stay on the stream or their gRPC streams.
		s.m.snapshots.WithLabelValues("failed").Inc()
		s.log.Warn("snapshot not written: too many chunks for a snapshot object", "chunks", len(p.chunks), "max", maxSnapshotChunks)
		return true
	}
	o := snapshotObject{StreamSeq: seq, Chunks: make([][]byte, 0, len(p.chunks))}
	for _, c := range p.chunks {
		enc, err := proto.Marshal(c)
		if err != nil {
			s.m.snapshots.WithLabelValues("failed").Inc()
			s.log.Warn("snapshot not written", "err", err)
			return true
		}
		o.Chunks = append(o.Chunks, enc)
	}
	data := encodeSnapshot(o)
	wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	_, err := obs.Put(wctx, jetstream.ObjectMeta{Name: s.token, Metadata: map[string]string{streamSeqKey: strconv.FormatUint(seq, 10)}}, bytes.NewReader(data))
	if err != nil {
		s.m.snapshots.WithLabelValues("failed").Inc()
		s.log.Warn("snapshot not written", "err", err)
		return true
	}
	s.m.snapshots.WithLabelValues("written").Inc()
	s.m.snapshotBytes.Set(float64(len(data)))
	s.m.snapshotSeq.Set(float64(seq))
	s.log.Debug("snapshot written", "stream_sequence", seq, "chunks", len(o.Chunks), "bytes", len(data), "object", s.token+" in "+BucketFor(s.opts.Stream)+" at "+strconv.FormatUint(seq, 10))
	return true
}

// noteSeq raises lastSeq, what the announcements say, to seq, a message
// stored now.
func (s *Sink) noteSeq(seq uint64) {
	s.storedAt.Store(time.Now().UnixNano())
	for cur := s.lastSeq.Load(); seq > cur && !s.lastSeq.CompareAndSwap(cur, seq); cur = s.lastSeq.Load() {
	}
}

// stamp gives a message of the sink what ties its announcements to the
// stream (alive.go): its incarnation, and its member if it announces one.
func (s *Sink) stamp(msg *nats.Msg) {
	msg.Header.Set(IncarnationHeader, incarnationText(s.incarnation))
	if s.opts.Member != "" {
		msg.Header.Set(MemberHeader, s.opts.Member)
	}
}

// sinkMarkSubject is where a worker's sink stores its marker: under the
// worker's token, so in the stream (<prefix>.>) and among what an
// announcement is checked against (<prefix>.<token>.>), but not a rank's
// subject (<prefix>.<token>.*), which the gateways' consumers read.
func sinkMarkSubject(prefix, token string) string { return prefix + "." + token + ".sink.start" }

// mark stores the pass's marker, an empty message stamped as the batches
// are, before the pass publishes anything else: an announcing sink whose
// engine has relayed nothing yet (a fresh start, an idle engine) would
// otherwise leave nothing on the stream to bear its announcements out, and
// a gateway would take neither them nor its member. A failure ends the
// pass (the next one tries again).
func (s *Sink) mark(ctx context.Context) error {
	msg := nats.NewMsg(sinkMarkSubject(s.opts.SubjectPrefix, s.token))
	s.stamp(msg)
	ctx, cancel := context.WithTimeout(ctx, s.opts.AckTimeout)
	defer cancel()
	pa, err := s.js.PublishMsg(ctx, msg)
	if err != nil {
		return fmt.Errorf("storing the sink's marker on %s: %w", msg.Subject, err)
	}
	s.noteSeq(pa.Sequence)
	return nil
}

// maxMarkEvery bounds how long an announcing sink stores nothing: an idle
// engine's marker must outlive no age limit of the stream, or a gateway
// started once it aged out could not take the relay's member until its
// engine works again.
const maxMarkEvery = 10 * time.Minute

// markInterval is how long a sink may store nothing on a stream whose
// messages live maxAge (0: for ever): a quarter of it, at most
// maxMarkEvery.
func markInterval(maxAge time.Duration) time.Duration {
	if maxAge <= 0 {
		return maxMarkEvery
	}
	return min(maxMarkEvery, max(maxAge/4, time.Millisecond))
}

// remark stores a marker whenever a pass has stored nothing for markEvery
// (an idle engine), so that the stream always holds a message of the
// sink's to bear its announcements out. The stream's other limits (a
// message or byte cap) can still push an idle worker's messages out; its
// next marker stores one again.
func (s *Sink) remark(ctx context.Context) {
	for {
		every := time.Duration(s.markEvery.Load())
		if every <= 0 {
			every = maxMarkEvery // no pass has looked at the stream yet
		}
		if !sleep(ctx, min(every/4, time.Second)) {
			return
		}
		at := s.storedAt.Load()
		if s.pass.Load() == 0 || at == 0 || time.Since(time.Unix(0, at)) < every || !s.nc.IsConnected() {
			continue
		}
		if err := s.mark(ctx); err != nil && ctx.Err() == nil {
			s.log.Warn("the sink's marker not stored; its announcements may not be borne out by the stream", "err", err)
		}
	}
}
