package natsevents

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvrelay/kvrelay/internal/logthrottle"
	"github.com/kvrelay/kvrelay/internal/natsconn"
	"github.com/kvrelay/kvrelay/internal/natslog"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/kvrelay/kvrelay/gateway/monitor"
	"github.com/kvrelay/kvrelay/proto/kvpb"
)

// SourceOptions configures a Source.
type SourceOptions struct {
	URL           string
	Stream        string // DefaultStream
	SubjectPrefix string // DefaultSubjectPrefix
	// Names maps a gateway worker ID to the name its relay's sink
	// publishes under (kvrelay serve --nats-worker); a worker not listed
	// is looked up by its address (host:port).
	Names map[string]string
	// RetryWait is the pause between reconnect attempts (1 s).
	RetryWait time.Duration
	// SwitchBackEvery is how often a worker following its gRPC stream
	// checks whether JetStream can serve it exactly again (2 s).
	SwitchBackEvery time.Duration
	// SilentAfter is how long a worker's sink, once heard, may go without
	// announcing itself before the worker is moved to its gRPC stream (0:
	// DefaultSilentIntervals of the interval the sink announces);
	// SilenceCheckEvery is how often a JetStream-served worker checks it
	// (250 ms).
	SilentAfter       time.Duration
	SilenceCheckEvery time.Duration
	// MaxSnapshotBytes bounds a snapshot's encoded size, an object's or
	// a snapshot's chunks on the stream together
	// (DefaultMaxSnapshotBytes); a larger one is refused (guard.go).
	MaxSnapshotBytes uint64
	// ChunkWait is how long a snapshot's next chunk on the stream may
	// take before the snapshot is refused as incomplete (10 s).
	ChunkWait   time.Duration
	NATSOptions []nats.Option
	Registerer  prometheus.Registerer
	Logger      *slog.Logger
}

// Source opens a gateway's worker subscriptions from the JetStream stream
// the workers' sinks publish, and from each worker's gRPC stream where that
// cannot be exact: NATS unreachable, no snapshot of the worker yet, or the
// stream no longer holding the snapshot's tail. Its Open is a
// monitor.StreamOpener.
type Source struct {
	opts SourceOptions
	log  *slog.Logger
	// peerLog is log throttled, for the lines a peer on NATS can drive
	// (logthrottle: a few a minute per message).
	peerLog *slog.Logger
	nc      *nats.Conn
	js      jetstream.JetStream
	mode    *prometheus.GaugeVec
	// alive tracks the sinks' announcements (alive.go), loads their load
	// records (loads.go).
	alive *aliveTracker
	loads *loadTracker

	mu sync.Mutex
	// lost is closed when the connection drops, ending every stream read
	// from NATS; a new one is made when it is back.
	lost chan struct{}
	// epoch counts reconnects (and an unreachable start): after one, a
	// worker's snapshot object of that moment is stale (epochs holds the
	// epoch each worker was last checked in), so that what the sinks could
	// not publish meanwhile is covered by a newer object, not read as a
	// gap.
	epoch  uint64
	epochs map[string]uint64
	// stale: by worker ID, the snapshot object (its NUID) not to serve:
	// the one there when NATS came back or the worker's sink went silent,
	// or the one the worker's index diverged on (repair.go). Any other
	// object was written since, and is served; one is asked for
	// (request.go).
	stale   map[string]staleObject
	repairs *prometheus.CounterVec
	// stopVerifier ends the announcements' verifier; verifierDone is
	// closed when it returned.
	stopVerifier context.CancelFunc
	verifierDone chan struct{}
	// rejected counts refused snapshots and batches (guard.go).
	rejected *prometheus.CounterVec
}

// staleObject is a snapshot object not to serve, and why.
type staleObject struct {
	nuid, why string
}

// NewSource connects without waiting for the server.
func NewSource(opts SourceOptions) (*Source, error) {
	var err error
	if opts.Stream, opts.SubjectPrefix, err = streamDefaults(opts.Stream, opts.SubjectPrefix); err != nil {
		return nil, err
	}
	if opts.RetryWait <= 0 {
		opts.RetryWait = time.Second
	}
	if opts.SwitchBackEvery <= 0 {
		opts.SwitchBackEvery = 2 * time.Second
	}
	if opts.SilenceCheckEvery <= 0 {
		opts.SilenceCheckEvery = 250 * time.Millisecond
	}
	if opts.MaxSnapshotBytes == 0 {
		opts.MaxSnapshotBytes = DefaultMaxSnapshotBytes
	}
	if opts.ChunkWait <= 0 {
		opts.ChunkWait = 10 * time.Second
	}
	if opts.Logger == nil {
		opts.Logger = slog.New(slog.DiscardHandler)
	}
	peerLog := logthrottle.Wrap(opts.Logger)
	s := &Source{opts: opts, log: opts.Logger, peerLog: peerLog, lost: make(chan struct{}), alive: newAliveTracker(opts.SilentAfter, opts.Logger), loads: newLoadTracker(opts.Logger),
		epochs: map[string]uint64{}, stale: map[string]staleObject{}, repairs: newRepairCounter(), rejected: newRejectCounter()}
	s.mode = prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "kvrelay_gateway_events_source",
		Help: "1 for the source a worker's KV events come from on this replica: nats (the JetStream stream) or grpc (the worker's own stream)."},
		[]string{"worker", "source"})
	if opts.Registerer != nil {
		for _, c := range []prometheus.Collector{s.mode, s.alive.silences, s.alive.mismatched, s.alive.checked, s.loads.received, s.repairs, s.rejected} {
			if err := opts.Registerer.Register(c); err != nil {
				return nil, fmt.Errorf("natsevents: %w", err)
			}
		}
	}
	nopts := append([]nats.Option{
		nats.DisconnectErrHandler(func(_ *nats.Conn, err error) {
			s.mu.Lock()
			select {
			case <-s.lost:
			default:
				close(s.lost)
			}
			s.mu.Unlock()
			s.log.Warn("NATS lost; workers read from JetStream fall back to their gRPC streams", "err", natslog.RedactError(err))
		}),
		nats.ReconnectHandler(func(*nats.Conn) {
			s.mu.Lock()
			s.lost = make(chan struct{})
			s.epoch++
			s.mu.Unlock()
			s.alive.reconnected()
			s.log.Info("NATS is back; workers return to JetStream at their next subscription once a snapshot newer than the outage is there")
		}),
	}, opts.NATSOptions...)
	if s.nc, err = natsconn.Connect(opts.URL, "kvrelay-gateway events", opts.RetryWait, s.log, nopts...); err != nil {
		return nil, fmt.Errorf("natsevents: %w", err)
	}
	if !s.nc.IsConnected() {
		// Unreachable at start: the sinks may have lost it too, so as
		// after a reconnect, only a snapshot written once it is back will do.
		s.mu.Lock()
		s.epoch++
		s.mu.Unlock()
		s.log.Warn("NATS unreachable; workers follow their gRPC streams until it answers", "url", natslog.RedactURL(opts.URL))
	}
	if s.js, err = jetstream.New(s.nc); err != nil {
		s.nc.Close()
		return nil, fmt.Errorf("natsevents: %w", err)
	}
	check := newStreamCheck(s.js, opts.Stream, opts.SubjectPrefix)
	s.alive.verify = func(ctx context.Context, token string, a announcement) (string, error) {
		return check.verify(ctx, token, a, nil)
	}
	vctx, stop := context.WithCancel(context.Background())
	s.stopVerifier, s.verifierDone = stop, make(chan struct{})
	go func() { defer close(s.verifierDone); s.alive.runVerifier(vctx) }()
	// A subscription made before the server answers is sent when it does.
	if s.alive.sub, err = s.nc.Subscribe(aliveFilter(opts.SubjectPrefix), s.alive.handle); err != nil {
		s.Close()
		return nil, fmt.Errorf("natsevents: subscribe to the sinks' announcements: %w", err)
	}
	if s.loads.sub, err = s.nc.Subscribe(loadFilter(opts.SubjectPrefix), s.loads.handle); err != nil {
		s.Close()
		return nil, fmt.Errorf("natsevents: subscribe to the sinks' load records: %w", err)
	}
	return s, nil
}

// Close closes the connection (after the monitor stopped).
func (s *Source) Close() {
	s.stopVerifier()
	<-s.verifierDone
	s.nc.Close()
}

func (s *Source) name(w monitor.Worker) string {
	if n, ok := s.opts.Names[w.ID]; ok {
		return n
	}
	return w.Addr
}

func (s *Source) setMode(w monitor.Worker, src string) {
	other := "grpc"
	if src == "grpc" {
		other = "nats"
	}
	s.mode.WithLabelValues(w.ID, src).Set(1)
	s.mode.WithLabelValues(w.ID, other).Set(0)
}

// Open is a monitor.StreamOpener: the worker's snapshot and stream tail
// from JetStream when that is exact, else its gRPC stream.
func (s *Source) Open(ctx context.Context, w monitor.Worker, req *kvpb.SubscribeKvEventsRequest, viaGRPC monitor.SubscribeFunc) (monitor.BatchStream, error) {
	st, err := s.openJetStream(ctx, w)
	if err == nil {
		s.setMode(w, "nats")
		return st, nil
	}
	if ctx.Err() != nil {
		return nil, ctx.Err()
	}
	s.log.Info("worker follows its gRPC stream", "worker", w.ID, "why", err)
	s.setMode(w, "grpc")
	gctx, cancel := context.WithCancelCause(ctx)
	gs, err := viaGRPC(gctx, req)
	if err != nil {
		cancel(nil)
		return nil, err
	}
	go s.watchForSwitchBack(gctx, cancel, w)
	return &grpcStream{BatchStream: gs, ctx: gctx}, nil
}

// errSwitchBack ends a worker's gRPC stream once JetStream can serve it.
var errSwitchBack = errors.New("JetStream can serve this worker exactly again")

// watchForSwitchBack ends the gRPC stream (cancel) as soon as JetStream
// has a snapshot of w it can serve exactly; the monitor then subscribes
// again, and Open takes the JetStream path.
func (s *Source) watchForSwitchBack(ctx context.Context, cancel context.CancelCauseFunc, w monitor.Worker) {
	t := time.NewTicker(s.opts.SwitchBackEvery)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		if _, err := s.snapshotInfo(ctx, w); err == nil {
			s.log.Info("switching the worker back to JetStream", "worker", w.ID)
			cancel(errSwitchBack)
			return
		}
	}
}

// grpcStream is a worker's gRPC stream that the source may end to switch
// it back to JetStream: that end reads as UNAVAILABLE, so the monitor
// resubscribes at once, keeping its cursors.
type grpcStream struct {
	monitor.BatchStream
	ctx context.Context
}

func (g *grpcStream) Recv() (*kvpb.KvEventBatch, error) {
	b, err := g.BatchStream.Recv()
	if err != nil && errors.Is(context.Cause(g.ctx), errSwitchBack) {
		return nil, status.Error(codes.Unavailable, errSwitchBack.Error())
	}
	return b, err
}

// snapshotRef is a snapshot object found servable: its bucket, stream
// sequence and NUID (which changes at every write).
type snapshotRef struct {
	obs  jetstream.ObjectStore
	seq  uint64
	nuid string
	// size is the object's size; stream the events stream and lastSeq
	// its last sequence when the object was looked at (guard.go).
	size    uint64
	stream  jetstream.Stream
	lastSeq uint64
}

// snapshotInfo checks, without downloading it, that w's snapshot object
// exists, was written since NATS came back or the worker's sink went
// silent, is not one the worker's index diverged on, and that the stream
// still holds its tail.
func (s *Source) snapshotInfo(ctx context.Context, w monitor.Worker) (snapshotRef, error) {
	if !s.nc.IsConnected() {
		return snapshotRef{}, errNotConnected
	}
	octx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	stream, err := s.js.Stream(octx, s.opts.Stream)
	if err != nil {
		return snapshotRef{}, fmt.Errorf("stream %s: %w", s.opts.Stream, err)
	}
	info, err := stream.Info(octx)
	if err != nil {
		return snapshotRef{}, fmt.Errorf("stream %s: %w", s.opts.Stream, err)
	}
	token := WorkerToken(s.name(w))
	obs, err := s.js.ObjectStore(octx, BucketFor(s.opts.Stream))
	if err != nil {
		return snapshotRef{}, fmt.Errorf("snapshot bucket %s: %w", BucketFor(s.opts.Stream), err)
	}
	oi, ierr := obs.GetInfo(octx, token)
	nuid := ""
	if ierr == nil {
		nuid = oi.NUID
	}
	// The first check after a reconnect, or after a silence found here or
	// by the worker's JetStream subscription, marks the object there now
	// stale: only one written since is served.
	silent := s.alive.check(token, w.ID)
	silenced := s.alive.takeSilence(token)
	s.mu.Lock()
	reconnected := s.epochs[w.ID] != s.epoch
	s.epochs[w.ID] = s.epoch
	if (reconnected || silenced) && nuid != "" {
		why := "written before NATS came back"
		if silenced {
			why = "written before the worker's sink went silent"
		}
		s.stale[w.ID] = staleObject{nuid: nuid, why: why}
	}
	stale := s.stale[w.ID]
	s.mu.Unlock()
	if silent != nil {
		return snapshotRef{}, silent
	}
	if ierr != nil {
		s.requestSnapshot(token)
		return snapshotRef{}, fmt.Errorf("snapshot of %s in %s: %w", s.name(w), BucketFor(s.opts.Stream), ierr)
	}
	if stale.nuid == nuid {
		s.requestSnapshot(token)
		return snapshotRef{}, fmt.Errorf("the snapshot object of %s was %s; waiting for a newer one", s.name(w), stale.why)
	}
	seq, err := strconv.ParseUint(oi.Metadata[streamSeqKey], 10, 64)
	if err != nil {
		return snapshotRef{}, fmt.Errorf("snapshot of %s: no stream sequence in its metadata: %w", s.name(w), err)
	}
	if info.State.Msgs > 0 && info.State.FirstSeq > seq+1 {
		return snapshotRef{}, fmt.Errorf("the stream starts at sequence %d, after the snapshot of %s at %d: its tail is gone", info.State.FirstSeq, s.name(w), seq)
	}
	if oi.Size > s.opts.MaxSnapshotBytes {
		err := refuse(reasonSize, "the snapshot object of %s takes %d bytes, at most %d taken", s.name(w), oi.Size, s.opts.MaxSnapshotBytes)
		s.refused(w, nuid, err)
		return snapshotRef{}, err
	}
	if seq > info.State.LastSeq {
		// Written after the stream was looked at, or forged: look again.
		if info, err = stream.Info(octx); err != nil {
			return snapshotRef{}, fmt.Errorf("stream %s: %w", s.opts.Stream, err)
		}
	}
	if seq > info.State.LastSeq {
		err := refuse(reasonObjectSequence, "the snapshot object of %s says stream sequence %d, the stream's last is %d", s.name(w), seq, info.State.LastSeq)
		s.refused(w, nuid, err)
		return snapshotRef{}, err
	}
	return snapshotRef{obs: obs, seq: seq, nuid: nuid, size: oi.Size, stream: stream, lastSeq: info.State.LastSeq}, nil
}

var errNotConnected = errors.New("NATS is not connected")

func (s *Source) openJetStream(ctx context.Context, w monitor.Worker) (*jsStream, error) {
	s.mu.Lock()
	lost := s.lost
	s.mu.Unlock()
	ref, err := s.snapshotInfo(ctx, w)
	if err != nil {
		return nil, err
	}
	obs := ref.obs
	octx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	token := WorkerToken(s.name(w))
	// A read that overlaps the sink replacing the object waits for chunks
	// the replacement purged: it is given a few seconds, then the newest
	// object is read again.
	var data []byte
	for attempt := 1; ; attempt++ {
		gctx, gcancel := context.WithTimeout(octx, 5*time.Second)
		data, err = s.readObject(gctx, obs, token, &ref)
		gcancel()
		if err == nil || refusalReason(err) != "" || attempt == 3 || octx.Err() != nil {
			break
		}
		s.log.Debug("reading the snapshot again", "worker", w.ID, "err", err)
	}
	if err != nil {
		if refusalReason(err) != "" {
			s.refused(w, ref.nuid, err)
		}
		return nil, fmt.Errorf("snapshot of %s in %s: %w", s.name(w), BucketFor(s.opts.Stream), err)
	}
	chunks, snapSeq, err := s.checkObject(octx, w, ref, data)
	if err != nil {
		if refusalReason(err) != "" {
			s.refused(w, ref.nuid, err)
		}
		return nil, fmt.Errorf("snapshot of %s: %w", s.name(w), err)
	}
	cursors := rankCursors{}
	for _, c := range chunks {
		cursors[c.GetDpRank()] = c.GetSequenceNumber()
	}
	cons, err := s.js.OrderedConsumer(octx, s.opts.Stream, jetstream.OrderedConsumerConfig{
		FilterSubjects: []string{workerFilter(s.opts.SubjectPrefix, token)},
		DeliverPolicy:  jetstream.DeliverByStartSequencePolicy,
		OptStartSeq:    snapSeq + 1,
	})
	if err != nil {
		return nil, fmt.Errorf("consumer of %s: %w", s.name(w), err)
	}
	// The client buffers at most 4 of the server's largest messages per
	// worker (nats.go's default is 500 messages, whatever their size: a
	// flood of large messages, forged or not, would be read ahead into
	// the heap). A pull asks for at least half of it, so any message fits.
	it, err := cons.Messages(jetstream.PullMaxBytes(prefetchBytes(s.nc.MaxPayload())))
	if err != nil {
		return nil, fmt.Errorf("consumer of %s: %w", s.name(w), err)
	}
	js := &jsStream{chunks: chunks, it: it, done: make(chan struct{}), log: s.log.With("worker", w.ID), peerLog: s.peerLog.With("worker", w.ID), loads: s.loads.attach(token),
		diverged: func() { s.distrust(w, ref.nuid, snapSeq) },
		cursors:  cursors, maxBytes: s.opts.MaxSnapshotBytes, chunkWait: s.opts.ChunkWait,
		refused: func(err error) { s.refused(w, ref.nuid, err) }}
	go func() {
		defer it.Stop()
		defer s.loads.detach(token, js.loads)
		check := time.NewTicker(s.opts.SilenceCheckEvery)
		defer check.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-lost:
				js.lostNATS.Store(true)
				return
			case <-js.done:
				return
			case <-check.C:
				// The stream of a silent sink no longer moves: ending the
				// subscription sends the monitor back to Open, which takes
				// the gRPC path while the sink stays silent.
				if err := s.alive.check(token, w.ID); err != nil {
					js.silent.Store(true)
					return
				}
			}
		}
	}()
	return js, nil
}

// jsStream is one subscription served from JetStream: the snapshot's
// chunks, then the worker's messages after it, as a relay would serve them,
// with the sink's load records as load_only batches between them. A
// snapshot on the stream is read whole and checked before its first chunk
// is handed out (guard.go).
type jsStream struct {
	loads    *loadFeed
	chunks   []*kvpb.KvEventBatch
	it       jetstream.MessagesContext
	done     chan struct{}
	once     sync.Once
	lostNATS atomic.Bool
	silent   atomic.Bool // ended because the worker's sink went silent
	log      *slog.Logger
	peerLog  *slog.Logger // throttled: what a message on the stream drives
	diverged func()
	// cursors is the last sequence handed out per rank; maxBytes and
	// chunkWait bound a snapshot on the stream; refused reports a refusal
	// (counted, logged, the object distrusted), which ends the stream.
	cursors   rankCursors
	maxBytes  uint64
	chunkWait time.Duration
	refused   func(error)
}

// Diverged is monitor.DivergenceNotifier: the index this stream fed
// diverged from the relay's digest, and the worker resyncs.
func (j *jsStream) Diverged() { j.diverged() }

func (j *jsStream) Header() (metadata.MD, error) { return metadata.MD{}, nil }

func (j *jsStream) Recv() (*kvpb.KvEventBatch, error) {
	if len(j.chunks) > 0 {
		b := j.chunks[0]
		j.chunks[0] = nil
		j.chunks = j.chunks[1:]
		return b, nil
	}
	for {
		if b := j.loads.next(); b != nil {
			return b, nil
		}
		msg, err := j.it.Next(jetstream.NextContext(j.loads.waitCtx()))
		if err != nil && j.loads.woken(err) {
			continue // a load record arrived
		}
		if err != nil {
			return nil, j.end(err)
		}
		b, ok := j.decode(msg)
		if !ok {
			continue
		}
		if err := checkSubject(msg.Subject(), b); err != nil {
			return nil, j.refuse(err)
		}
		if b.GetSnapshot() != nil {
			chunks, err := j.collect(msg, b)
			if err != nil {
				if refusalReason(err) != "" {
					return nil, j.refuse(err)
				}
				return nil, err
			}
			// As the monitor does on a snapshot: the chunks' cursors,
			// and none for a rank without chunks.
			j.cursors = rankCursors{}
			for _, c := range chunks {
				j.cursors[c.GetDpRank()] = c.GetSequenceNumber()
			}
			j.chunks = chunks[1:]
			return chunks[0], nil
		}
		if err := j.cursors.checkBatch(b); err != nil {
			return nil, j.refuse(err)
		}
		j.cursors[b.GetDpRank()] = b.GetSequenceNumber()
		j.loads.delivered(b)
		return b, nil
	}
}

// decode reads a message of the stream; false for one that does not
// decode, which is skipped: if it mattered, admission sees its sequence
// missing, as it would a gap on a gRPC stream.
func (j *jsStream) decode(msg jetstream.Msg) (*kvpb.KvEventBatch, bool) {
	b := &kvpb.KvEventBatch{}
	if err := proto.Unmarshal(msg.Data(), b); err != nil {
		j.peerLog.Warn("undecodable message on the stream; skipped", "subject", msg.Subject(), "err", err)
		return nil, false
	}
	j.log.Debug("from JetStream", "subject", msg.Subject(), "rank", b.GetDpRank(), "sequence", b.GetSequenceNumber(), "snapshot", b.GetSnapshot() != nil)
	return b, true
}

// collect reads the rest of the snapshot whose chunk first (of msg) came
// on the stream, and checks it whole. A chunk 0 inside it starts it again
// (a pass of the sink that broke off mid-snapshot, followed by the next
// pass's snapshot: the broken one never reached the index).
func (j *jsStream) collect(msg jetstream.Msg, first *kvpb.KvEventBatch) ([]*kvpb.KvEventBatch, error) {
	var (
		check  snapshotCheck
		chunks []*kvpb.KvEventBatch
	)
	start := func(b *kvpb.KvEventBatch, size int) error {
		check = snapshotCheck{maxBytes: j.maxBytes, ceiling: j.cursors.ceiling}
		chunks = nil
		return j.addChunk(&check, &chunks, b, size)
	}
	if err := start(first, len(msg.Data())); err != nil {
		return nil, err
	}
	for !check.complete() {
		ctx, cancel := context.WithTimeout(context.Background(), j.chunkWait)
		next, err := j.it.Next(jetstream.NextContext(ctx))
		timedOut := ctx.Err() != nil
		cancel()
		if err != nil && timedOut {
			return nil, refuse(reasonChunkIncomplete, "chunk %d of %d did not come within %s", check.next, check.count, j.chunkWait)
		}
		if err != nil {
			return nil, j.end(err)
		}
		b, ok := j.decode(next)
		if !ok {
			return nil, refuse(reasonChunkOrder, "an undecodable message where chunk %d of %d was due", check.next, check.count)
		}
		if err := checkSubject(next.Subject(), b); err != nil {
			return nil, err
		}
		if snap := b.GetSnapshot(); snap != nil && snap.GetIndex() == 0 {
			j.log.Debug("a snapshot on the stream broke off; the next one starts", "chunks", check.next, "of", check.count)
			err = start(b, len(next.Data()))
		} else {
			err = j.addChunk(&check, &chunks, b, len(next.Data()))
		}
		if err != nil {
			return nil, err
		}
	}
	if err := check.finish(); err != nil {
		return nil, err
	}
	return chunks, nil
}

func (j *jsStream) addChunk(check *snapshotCheck, chunks *[]*kvpb.KvEventBatch, b *kvpb.KvEventBatch, size int) error {
	if err := check.add(b, size); err != nil {
		return err
	}
	*chunks = append(*chunks, b)
	return nil
}

// refuse reports a refused message and ends the stream with it.
func (j *jsStream) refuse(err error) error {
	j.refused(err)
	j.once.Do(func() { close(j.done) })
	return status.Errorf(codes.Unavailable, "refused from JetStream: %v", err)
}

// end ends the stream on the consumer's error.
func (j *jsStream) end(err error) error {
	j.once.Do(func() { close(j.done) })
	if j.lostNATS.Load() {
		return status.Error(codes.Unavailable, "NATS connection lost")
	}
	if j.silent.Load() {
		return status.Error(codes.Unavailable, errSinkSilent.Error())
	}
	return status.Errorf(codes.Unavailable, "JetStream consumer ended: %v", err)
}

// readObject reads worker token's newest snapshot object, refusing one
// larger than MaxSnapshotBytes before reading it (and reading no more than
// that if its size lies); ref takes the NUID and size of the object read,
// which may be newer than the one looked at.
func (s *Source) readObject(ctx context.Context, obs jetstream.ObjectStore, token string, ref *snapshotRef) ([]byte, error) {
	r, err := obs.Get(ctx, token)
	if err != nil {
		return nil, err
	}
	defer r.Close()
	info, err := r.Info()
	if err != nil {
		return nil, err
	}
	ref.nuid, ref.size = info.NUID, info.Size
	limit := s.opts.MaxSnapshotBytes
	if info.Size > limit {
		return nil, refuse(reasonSize, "the object takes %d bytes, at most %d taken", info.Size, limit)
	}
	// The client checks the size and digest at the end; a limit one
	// past the cap stops an object whose size lies.
	data, err := io.ReadAll(io.LimitReader(r, int64(limit)+1))
	if err != nil {
		return nil, err
	}
	if uint64(len(data)) > limit {
		return nil, refuse(reasonSize, "the object holds more than %d bytes", limit)
	}
	return data, nil
}

// checkObject decodes a snapshot object and checks it (guard.go): its
// stream sequence against the stream's, its chunks as a whole and each
// chunk's sequence against the stream's newest message of its rank.
func (s *Source) checkObject(ctx context.Context, w monitor.Worker, ref snapshotRef, data []byte) ([]*kvpb.KvEventBatch, uint64, error) {
	snap, err := decodeSnapshot(data)
	if err != nil {
		return nil, 0, &refusal{reason: reasonMalformed, err: err}
	}
	if snap.StreamSeq < ref.seq {
		// Replaced between the two reads by an older one: cannot happen
		// with one sink per worker, and is not served if it does.
		return nil, 0, fmt.Errorf("its body says stream sequence %d, its metadata %d", snap.StreamSeq, ref.seq)
	}
	if snap.StreamSeq > ref.lastSeq {
		// Written after the stream was looked at, or forged: look again.
		info, err := ref.stream.Info(ctx)
		if err != nil {
			return nil, 0, fmt.Errorf("stream %s: %w", s.opts.Stream, err)
		}
		if snap.StreamSeq > info.State.LastSeq {
			return nil, 0, refuse(reasonObjectSequence, "the object says stream sequence %d, the stream's last is %d", snap.StreamSeq, info.State.LastSeq)
		}
	}
	token := WorkerToken(s.name(w))
	newest := map[int32]uint64{}
	check := snapshotCheck{maxBytes: s.opts.MaxSnapshotBytes, ceiling: func(rank int32) (uint64, bool, error) {
		if top, ok := newest[rank]; ok {
			return top, true, nil
		}
		m, err := ref.stream.GetLastMsgForSubject(ctx, rankSubject(s.opts.SubjectPrefix, token, rank))
		if errors.Is(err, jetstream.ErrMsgNotFound) {
			// Aged out of the stream (a rank idle for longer than its
			// retention): nothing to bound it by.
			return 0, false, nil
		}
		if err != nil {
			return 0, false, fmt.Errorf("the stream's newest message of rank %d: %w", rank, err)
		}
		h, err := batchHeader(m.Data)
		if err != nil {
			return 0, false, fmt.Errorf("the stream's newest message of rank %d: %w", rank, err)
		}
		newest[rank] = h.GetSequenceNumber()
		return h.GetSequenceNumber(), true, nil
	}}
	chunks := make([]*kvpb.KvEventBatch, 0, len(snap.Chunks))
	for i, c := range snap.Chunks {
		b := &kvpb.KvEventBatch{}
		if err := proto.Unmarshal(c, b); err != nil {
			return nil, 0, &refusal{reason: reasonMalformed, err: fmt.Errorf("chunk %d: %w", i, err)}
		}
		if err := check.add(b, len(c)); err != nil {
			return nil, 0, err
		}
		chunks = append(chunks, b)
	}
	if err := check.finish(); err != nil {
		return nil, 0, err
	}
	return chunks, snap.StreamSeq, nil
}

// refused counts and logs a refused snapshot or batch of w and stops
// serving the snapshot object nuid (the one refused, or the one the
// stream that carried the refused message was read after): w follows its
// gRPC stream, its blocks kept, until another object is written, which is
// asked for (as after a divergence, repair.go).
func (s *Source) refused(w monitor.Worker, nuid string, err error) {
	reason := refusalReason(err)
	s.rejected.WithLabelValues(w.ID, reason).Inc()
	if nuid != "" {
		s.mu.Lock()
		s.stale[w.ID] = staleObject{nuid: nuid, why: "served when an inconsistent snapshot or batch was refused (" + reason + ")"}
		s.mu.Unlock()
	}
	s.requestSnapshot(WorkerToken(s.name(w)))
	s.peerLog.Warn("refused a snapshot or batch inconsistent with the worker's stream; the worker keeps its blocks and follows its gRPC stream until another snapshot object is written",
		"worker", w.ID, "reason", reason, "err", err)
}

// prefetchBytes is what a worker's consumer may buffer: 4 of the server's
// largest messages (at least 4 MiB, should the server not have said yet).
func prefetchBytes(maxPayload int64) int {
	return int(4 * max(maxPayload, 1<<20))
}
