package natsevents

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvrelay/kvrelay/internal/logthrottle"
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
	NATSOptions       []nats.Option
	Registerer        prometheus.Registerer
	Logger            *slog.Logger
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
	if opts.Logger == nil {
		opts.Logger = slog.New(slog.DiscardHandler)
	}
	peerLog := logthrottle.Wrap(opts.Logger)
	s := &Source{opts: opts, log: opts.Logger, peerLog: peerLog, lost: make(chan struct{}), alive: newAliveTracker(opts.SilentAfter, opts.Logger), loads: newLoadTracker(opts.Logger),
		epochs: map[string]uint64{}, stale: map[string]staleObject{}, repairs: newRepairCounter()}
	s.mode = prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "kvrelay_gateway_events_source",
		Help: "1 for the source a worker's KV events come from on this replica: nats (the JetStream stream) or grpc (the worker's own stream)."},
		[]string{"worker", "source"})
	if opts.Registerer != nil {
		for _, c := range []prometheus.Collector{s.mode, s.alive.silences, s.loads.received, s.repairs} {
			if err := opts.Registerer.Register(c); err != nil {
				return nil, fmt.Errorf("natsevents: %w", err)
			}
		}
	}
	nopts := append([]nats.Option{
		nats.Name("kvrelay-gateway events"),
		nats.RetryOnFailedConnect(true),
		nats.MaxReconnects(-1),
		nats.ReconnectWait(opts.RetryWait),
		natslog.AsyncErrors(s.log),
		nats.DisconnectErrHandler(func(_ *nats.Conn, err error) {
			s.mu.Lock()
			select {
			case <-s.lost:
			default:
				close(s.lost)
			}
			s.mu.Unlock()
			s.log.Warn("NATS lost; workers read from JetStream fall back to their gRPC streams", "err", err)
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
	if s.nc, err = nats.Connect(opts.URL, nopts...); err != nil {
		return nil, fmt.Errorf("natsevents: connect %s: %w", natslog.RedactURL(opts.URL), natslog.RedactError(err))
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
	// A subscription made before the server answers is sent when it does.
	if s.alive.sub, err = s.nc.Subscribe(aliveFilter(opts.SubjectPrefix), s.alive.handle); err != nil {
		s.nc.Close()
		return nil, fmt.Errorf("natsevents: subscribe to the sinks' announcements: %w", err)
	}
	if s.loads.sub, err = s.nc.Subscribe(loadFilter(opts.SubjectPrefix), s.loads.handle); err != nil {
		s.nc.Close()
		return nil, fmt.Errorf("natsevents: subscribe to the sinks' load records: %w", err)
	}
	return s, nil
}

// Close closes the connection (after the monitor stopped).
func (s *Source) Close() { s.nc.Close() }

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
	return snapshotRef{obs: obs, seq: seq, nuid: nuid}, nil
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
	obs, seq := ref.obs, ref.seq
	octx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	token := WorkerToken(s.name(w))
	// A read that overlaps the sink replacing the object waits for chunks
	// the replacement purged: it is given a few seconds, then the newest
	// object is read again.
	var data []byte
	for attempt := 1; ; attempt++ {
		gctx, gcancel := context.WithTimeout(octx, 5*time.Second)
		data, err = obs.GetBytes(gctx, token)
		gcancel()
		if err == nil || attempt == 3 || octx.Err() != nil {
			break
		}
		s.log.Debug("reading the snapshot again", "worker", w.ID, "err", err)
	}
	if err != nil {
		return nil, fmt.Errorf("snapshot of %s in %s: %w", s.name(w), BucketFor(s.opts.Stream), err)
	}
	snap, err := decodeSnapshot(data)
	if err != nil {
		return nil, fmt.Errorf("snapshot of %s: %w", s.name(w), err)
	}
	if snap.StreamSeq < seq {
		// Replaced between the two reads by an older one: cannot happen
		// with one sink per worker, and is not served if it does.
		return nil, fmt.Errorf("snapshot of %s: its body says stream sequence %d, its metadata %d", s.name(w), snap.StreamSeq, seq)
	}
	chunks := make([]*kvpb.KvEventBatch, 0, len(snap.Chunks))
	for i, c := range snap.Chunks {
		b := &kvpb.KvEventBatch{}
		if err := proto.Unmarshal(c, b); err != nil || b.GetSnapshot() == nil {
			return nil, fmt.Errorf("snapshot of %s: chunk %d is not a snapshot chunk (%v)", s.name(w), i, err)
		}
		chunks = append(chunks, b)
	}
	cons, err := s.js.OrderedConsumer(octx, s.opts.Stream, jetstream.OrderedConsumerConfig{
		FilterSubjects: []string{workerFilter(s.opts.SubjectPrefix, token)},
		DeliverPolicy:  jetstream.DeliverByStartSequencePolicy,
		OptStartSeq:    snap.StreamSeq + 1,
	})
	if err != nil {
		return nil, fmt.Errorf("consumer of %s: %w", s.name(w), err)
	}
	it, err := cons.Messages()
	if err != nil {
		return nil, fmt.Errorf("consumer of %s: %w", s.name(w), err)
	}
	js := &jsStream{chunks: chunks, it: it, done: make(chan struct{}), log: s.log.With("worker", w.ID), peerLog: s.peerLog.With("worker", w.ID), loads: s.loads.attach(token),
		diverged: func() { s.distrust(w, ref.nuid, snap.StreamSeq) }}
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
// with the sink's load records as load_only batches between them.
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
			j.once.Do(func() { close(j.done) })
			if j.lostNATS.Load() {
				return nil, status.Error(codes.Unavailable, "NATS connection lost")
			}
			if j.silent.Load() {
				return nil, status.Error(codes.Unavailable, errSinkSilent.Error())
			}
			return nil, status.Errorf(codes.Unavailable, "JetStream consumer ended: %v", err)
		}
		b := &kvpb.KvEventBatch{}
		if err := proto.Unmarshal(msg.Data(), b); err != nil {
			// Skipped: if it mattered, admission sees its sequence
			// missing, as it would a gap on a gRPC stream.
			j.peerLog.Warn("undecodable message on the stream; skipped", "subject", msg.Subject(), "err", err)
			continue
		}
		j.log.Debug("from JetStream", "subject", msg.Subject(), "rank", b.GetDpRank(), "sequence", b.GetSequenceNumber(), "snapshot", b.GetSnapshot() != nil)
		j.loads.delivered(b)
		return b, nil
	}
}
