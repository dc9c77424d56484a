// Package server serves relays over gRPC: SubscribeKvEvents under each
// engine's real service name, the gRPC health and reflection services, and
// optionally a transparent proxy to the engine's own servicer for every other
// RPC.
//
// Status codes follow what SMG's gateway expects: OUT_OF_RANGE for a cursor
// the relay cannot resume (the gateway resubscribes from zero), DATA_LOSS for
// a publisher restart or a subscriber the history can no longer refill, and
// UNIMPLEMENTED when the engine's events are off.
package server

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/keepalive"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/reflection"
	"google.golang.org/grpc/status"

	"github.com/kvrelay/kvrelay/engines"
	"github.com/kvrelay/kvrelay/engines/load"
	"github.com/kvrelay/kvrelay/internal/latencyprobe"
	"github.com/kvrelay/kvrelay/internal/logthrottle"
	"github.com/kvrelay/kvrelay/internal/quietio"
	"github.com/kvrelay/kvrelay/proto/kvpb"
	"github.com/kvrelay/kvrelay/relay"
)

// Stream is one subscriber's batches, as a relay hands them out.
type Stream interface {
	Next(ctx context.Context) (*kvpb.KvEventBatch, error)
	Close()
}

// Service is one engine's SubscribeKvEvents endpoint.
type Service struct {
	Engine engines.Engine
	// Subscribe opens a subscriber stream. Nil means the engine's events are
	// off, and every call gets UNIMPLEMENTED with Engine.DisabledMessage.
	Subscribe func(ctx context.Context, req *kvpb.SubscribeKvEventsRequest) (Stream, error)
	// Ready reports whether the relay is connected to every DP rank; the
	// health service says SERVING only then.
	Ready func() bool
	// Load, when set, is the engine's load per DP rank (a load.Poller):
	// every batch carries its rank's record and a quiet stream gets
	// load_only batches, as SMG's servicers send them.
	Load LoadSource
}

// LoadSource is the engine's load as a stream reads it: the newest record
// per rank, and a channel closed when some rank's record changed.
type LoadSource interface {
	load.Source
	Updated() <-chan struct{}
}

// RelayService serves rel's stream as engine's service: every caller that
// serves a relay wires it the same way.
func RelayService(engine engines.Engine, rel *relay.Relay) Service {
	return Service{
		Engine: engine,
		Subscribe: func(ctx context.Context, req *kvpb.SubscribeKvEventsRequest) (Stream, error) {
			return rel.Subscribe(ctx, req)
		},
		Ready: rel.Ready,
	}
}

// Options configure a Server.
type Options struct {
	Services []Service
	// Upstreams maps an engine name (a Service's Engine.Name) to the address
	// of that engine's own gRPC servicer. The other methods of the engine's
	// own service (generation, abort, tokenizer, model info...) are
	// forwarded there; other services are refused. Empty: no proxy.
	Upstreams map[string]string
	// Proxy says how the proxy dials and what it forwards.
	Proxy ProxyOptions
	// ServerOptions are added to the server's own: transport credentials
	// and interceptors (TLS, allow-lists) come from the caller.
	ServerOptions []grpc.ServerOption
	// Reflection registers the gRPC reflection service (grpcurl). It lists
	// every service, so a caller turns it on for loopback or trusted
	// listeners only.
	Reflection bool
	Logger     *slog.Logger
	Registerer prometheus.Registerer
	// ShutdownGrace bounds how long Stop waits for in-flight sends.
	ShutdownGrace time.Duration
	// Limits bound what subscribers may hold; zero fields take the
	// defaults (DefaultLimits).
	Limits Limits
}

// Limits bound the resources subscribers can take. Every field's zero value
// means its default.
type Limits struct {
	// MaxStreamsPerConn is HTTP/2's SETTINGS_MAX_CONCURRENT_STREAMS: every
	// concurrent call on one connection, proxied ones included. A
	// well-behaved client waits for a free stream; one that ignores the
	// setting gets its stream refused by the transport.
	MaxStreamsPerConn uint32
	// MaxSubscribersPerPeer caps the SubscribeKvEvents streams open from one
	// remote IP address across all its connections; more are refused with
	// RESOURCE_EXHAUSTED.
	MaxSubscribersPerPeer int
	// MaxSubscribers caps the SubscribeKvEvents streams open on this
	// listener; more are refused with RESOURCE_EXHAUSTED.
	MaxSubscribers int
	// SendStall ends a stream whose one pending message has not gone out
	// for this long (the client stopped reading and its flow-control window
	// is full), with RESOURCE_EXHAUSTED. The subscriber's slot is freed once
	// the transport lets go of the blocked send.
	SendStall time.Duration
	// MaxSendMsgBytes is the largest message sent; a batch above it ends
	// that subscriber's stream with RESOURCE_EXHAUSTED. Gateways must
	// accept at least this much.
	MaxSendMsgBytes int
}

// DefaultLimits are the limits a zero Limits field takes.
var DefaultLimits = Limits{
	// Proxied inference calls share the gateway's connection, so this is
	// well above the few subscriptions one gateway opens.
	MaxStreamsPerConn:     1024,
	MaxSubscribersPerPeer: 64,
	MaxSubscribers:        256,
	SendStall:             30 * time.Second,
	// A batch is never split (a gateway drops a repeated sequence as
	// stale), so the cap must fit the largest batch an engine publishes;
	// gateway/monitor accepts the same by default.
	MaxSendMsgBytes: 1 << 30,
}

func (l Limits) withDefaults() Limits {
	d := DefaultLimits
	if l.MaxStreamsPerConn == 0 {
		l.MaxStreamsPerConn = d.MaxStreamsPerConn
	}
	if l.MaxSubscribersPerPeer == 0 {
		l.MaxSubscribersPerPeer = d.MaxSubscribersPerPeer
	}
	if l.MaxSubscribers == 0 {
		l.MaxSubscribers = d.MaxSubscribers
	}
	if l.SendStall == 0 {
		l.SendStall = d.SendStall
	}
	if l.MaxSendMsgBytes == 0 {
		l.MaxSendMsgBytes = d.MaxSendMsgBytes
	}
	return l
}

// Server is one gRPC listener's worth of relays.
type Server struct {
	grpc     *grpc.Server
	health   *health.Server
	services []Service
	proxy    *proxy // nil without an upstream
	log      *slog.Logger
	peerLog  *slog.Logger // throttled: lines each client can drive
	grace    time.Duration
	conns    []*grpc.ClientConn
	metrics  *serverMetrics
	limits   Limits
	slots    *subscriberSlots

	// shutdown ends every open stream with UNAVAILABLE, so GracefulStop does
	// not wait forever on server streams that never finish by themselves.
	shutdownCtx context.Context
	shutdown    context.CancelFunc
	stopOnce    sync.Once
	healthDone  chan struct{}
	watching    sync.Once // starts the health watcher once, from Serve
	watched     atomic.Bool
}

// New builds a server; Serve starts it.
func New(opts Options) (*Server, error) {
	if len(opts.Services) == 0 {
		return nil, errors.New("server: no services")
	}
	seen := map[string]bool{}
	for _, svc := range opts.Services {
		name := svc.Engine.ServiceName
		if name == "" {
			return nil, fmt.Errorf("server: engine %q has no service name", svc.Engine.Name)
		}
		if seen[name] {
			return nil, fmt.Errorf("server: two relays serve %s on one listener; gateways could not tell them apart (give each its own listener)", name)
		}
		seen[name] = true
	}
	log := opts.Logger
	if log == nil {
		log = slog.Default()
	}
	grace := opts.ShutdownGrace
	if grace <= 0 {
		grace = 5 * time.Second
	}
	metrics, err := newServerMetrics(opts.Registerer)
	if err != nil {
		return nil, err
	}
	limits := opts.Limits.withDefaults()
	if limits.MaxSubscribers < 0 || limits.MaxSubscribersPerPeer < 0 || limits.SendStall < 0 || limits.MaxSendMsgBytes < 0 {
		return nil, fmt.Errorf("server: negative limit in %+v", opts.Limits)
	}
	s := &Server{
		services: opts.Services, log: log, peerLog: logthrottle.Wrap(log), grace: grace, metrics: metrics, healthDone: make(chan struct{}),
		limits: limits, slots: newSubscriberSlots(limits.MaxSubscribers, limits.MaxSubscribersPerPeer),
	}
	s.shutdownCtx, s.shutdown = context.WithCancel(context.Background())

	serverOpts := []grpc.ServerOption{
		// SMG's gateway pings every second; the default enforcement (one
		// ping per 5 minutes) would answer it with GOAWAY too_many_pings.
		grpc.KeepaliveEnforcementPolicy(keepalive.EnforcementPolicy{MinTime: 500 * time.Millisecond, PermitWithoutStream: true}),
		// Find gateways that vanished without closing their connection.
		grpc.KeepaliveParams(keepalive.ServerParameters{Time: 10 * time.Second, Timeout: keepaliveTimeout}),
		// One engine batch may exceed gRPC's 4 MiB default, and it is never
		// split.
		grpc.MaxSendMsgSize(limits.MaxSendMsgBytes),
		grpc.MaxConcurrentStreams(limits.MaxStreamsPerConn),
	}
	if len(opts.Upstreams) > 0 {
		p := &proxy{upstreams: map[string]*grpc.ClientConn{}, dropAuthorization: opts.Proxy.DropAuthorization}
		for _, svc := range opts.Services {
			addr, ok := opts.Upstreams[svc.Engine.Name]
			if !ok {
				continue
			}
			creds := opts.Proxy.Credentials[svc.Engine.Name]
			if creds == nil {
				creds = insecure.NewCredentials()
			}
			cc, err := grpc.NewClient(addr, grpc.WithTransportCredentials(creds))
			if err != nil {
				s.closeConns()
				return nil, fmt.Errorf("server: upstream %q for %s: %w", addr, svc.Engine.Name, err)
			}
			s.conns = append(s.conns, cc)
			p.upstreams[svc.Engine.ServiceName] = cc
			for _, extra := range opts.Proxy.ExtraServices[svc.Engine.Name] {
				// kvrelay's own services (health, reflection) would shadow
				// the entry: say so rather than forward nothing.
				ownService := seen[extra] || extra == healthpb.Health_ServiceDesc.ServiceName || strings.HasPrefix(extra, "grpc.reflection.")
				if _, taken := p.upstreams[extra]; taken || ownService {
					s.closeConns()
					return nil, fmt.Errorf("server: service %s is forwarded twice or served by kvrelay", extra)
				}
				p.upstreams[extra] = cc
			}
		}
		s.proxy = p
	}
	// Every call to a service nobody registered comes here: the proxy's
	// when an upstream serves it, else an UNIMPLEMENTED (the code SMG's
	// gateway and grpc-go give) that names what this relay does serve, so
	// a worker given the wrong service= or tail --service is told the fix.
	serverOpts = append(serverOpts, grpc.UnknownServiceHandler(s.unknownService))
	serverOpts = append(serverOpts, opts.ServerOptions...)
	// Typed messages go through the proto codec; pre-encoded batches and
	// proxied frames go through as bytes.
	serverOpts = append(serverOpts, grpc.ForceServerCodecV2(newPassthroughCodec()))
	s.grpc = grpc.NewServer(serverOpts...)
	for i := range s.services {
		if err := s.register(&s.services[i]); err != nil {
			s.closeConns()
			return nil, err
		}
	}
	s.health = health.NewServer()
	healthpb.RegisterHealthServer(s.grpc, s.health)
	if opts.Reflection {
		reflection.Register(s.grpc)
	}
	s.updateHealth()
	return s, nil
}

func (s *Server) register(svc *Service) error {
	h := &handler{server: s, svc: svc}
	switch svc.Engine.ServiceName {
	case kvpb.VllmEngine_ServiceDesc.ServiceName:
		kvpb.RegisterVllmEngineServer(s.grpc, vllmService{h: h})
	case kvpb.SglangScheduler_ServiceDesc.ServiceName:
		kvpb.RegisterSglangSchedulerServer(s.grpc, sglangService{h: h})
	case kvpb.TokenSpeedScheduler_ServiceDesc.ServiceName:
		kvpb.RegisterTokenSpeedSchedulerServer(s.grpc, tokenspeedService{h: h})
	default:
		return fmt.Errorf("server: no gRPC service is declared for %s", svc.Engine.ServiceName)
	}
	return nil
}

// keepaliveTimeout is how long a ping may go unanswered before the
// connection is closed; it is also the connections' TCP_USER_TIMEOUT, as
// gRPC sets it.
const keepaliveTimeout = 5 * time.Second

// Serve accepts connections on lis until Stop. It also keeps the health
// service in step with the relays' readiness.
func (s *Server) Serve(lis net.Listener) error {
	s.watching.Do(func() {
		s.watched.Store(true)
		go s.watchHealth()
	})
	// A stream's writes are raw socket calls (see package quietio): at an
	// engine's pacing each batch's write would otherwise wake the runtime's
	// monitor thread.
	err := s.grpc.Serve(quietio.Listener(lis, keepaliveTimeout))
	if errors.Is(err, grpc.ErrServerStopped) {
		return nil
	}
	return err
}

func (s *Server) watchHealth() {
	defer close(s.healthDone)
	t := time.NewTicker(250 * time.Millisecond)
	defer t.Stop()
	for {
		select {
		case <-s.shutdownCtx.Done():
			return
		case <-t.C:
			s.updateHealth()
		}
	}
}

func (s *Server) updateHealth() {
	all := healthpb.HealthCheckResponse_SERVING
	for _, svc := range s.services {
		st := healthpb.HealthCheckResponse_SERVING
		if svc.Subscribe != nil && (svc.Ready == nil || !svc.Ready()) {
			st = healthpb.HealthCheckResponse_NOT_SERVING
			all = st
		}
		s.health.SetServingStatus(svc.Engine.ServiceName, st)
	}
	s.health.SetServingStatus("", all)
}

// Stop ends every stream with UNAVAILABLE, lets in-flight sends finish, and
// closes the listener; after the grace period it closes connections hard.
func (s *Server) Stop() {
	s.stopOnce.Do(func() {
		s.health.Shutdown()
		s.shutdown()
		done := make(chan struct{})
		go func() {
			s.grpc.GracefulStop()
			close(done)
		}()
		select {
		case <-done:
		case <-time.After(s.grace):
			s.log.Warn("graceful stop timed out; closing connections", "grace", s.grace)
			s.grpc.Stop()
			<-done
		}
		s.closeConns()
		if s.watched.Load() {
			<-s.healthDone // it returns once shutdownCtx is done
		}
	})
}

func (s *Server) closeConns() {
	for _, cc := range s.conns {
		_ = cc.Close()
	}
}

// handler serves SubscribeKvEvents for one engine.
type handler struct {
	server *Server
	svc    *Service
}

func (h *handler) subscribe(req *kvpb.SubscribeKvEventsRequest, stream grpc.ServerStreamingServer[kvpb.KvEventBatch]) error {
	service := h.svc.Engine.ServiceName
	if h.svc.Subscribe == nil {
		h.server.metrics.ended.WithLabelValues(service, codes.Unimplemented.String()).Inc()
		return status.Error(codes.Unimplemented, h.svc.Engine.DisabledMessage)
	}
	peerKey := peerHost(stream.Context())
	if reason, err := h.server.slots.take(peerKey); err != nil {
		h.server.metrics.cut.WithLabelValues(service, reason).Inc()
		h.server.metrics.ended.WithLabelValues(service, codes.ResourceExhausted.String()).Inc()
		h.server.peerLog.Warn("subscriber stream refused", "service", service, "peer", peerKey, "reason", err)
		return status.Error(codes.ResourceExhausted, err.Error())
	}
	ctx, cancel := context.WithCancel(stream.Context())
	stop := context.AfterFunc(h.server.shutdownCtx, cancel)

	h.server.metrics.active.WithLabelValues(service).Inc()
	defer h.server.metrics.active.WithLabelValues(service).Dec()

	// The pump sends from its own goroutine so that this one can end the
	// stream when a send stalls: gRPC-Go blocks a send on flow control
	// until the client reads, and only the end of the handler (which
	// cancels the transport stream) unblocks it. The subscriber's slot is
	// freed when the pump is really gone, so clients that stall stream
	// after stream still meet the caps.
	p := &pump{h: h, stream: stream}
	done := make(chan error, 1)
	go func() {
		defer h.server.slots.give(peerKey)
		defer stop()
		defer cancel()
		done <- p.run(ctx, req)
	}()
	err := h.watch(ctx, p, done)
	st := h.statusOf(stream.Context(), err)
	h.server.metrics.ended.WithLabelValues(service, st.Code().String()).Inc()
	if st.Code() != codes.OK && st.Code() != codes.Canceled {
		h.server.peerLog.Info("subscriber stream ended", "service", service, "code", st.Code().String(), "reason", st.Message())
	}
	return st.Err()
}

// errSendStalled ends a stream whose client stopped reading.
var errSendStalled = errors.New("send stalled")

// watch waits for the pump to end, or ends the stream itself when one send
// has made no progress for the stall limit.
func (h *handler) watch(ctx context.Context, p *pump, done <-chan error) error {
	limit := h.server.limits.SendStall
	tick := time.NewTicker(max(limit/4, time.Millisecond))
	defer tick.Stop()
	var (
		lastSent  = p.sent.Load()
		unchanged time.Duration
	)
	for {
		select {
		case err := <-done:
			return err
		case <-tick.C:
			sent := p.sent.Load()
			if sent != lastSent || !p.sending.Load() {
				lastSent, unchanged = sent, 0
				continue
			}
			unchanged += limit / 4
			if unchanged < limit {
				continue
			}
			h.server.metrics.cut.WithLabelValues(h.svc.Engine.ServiceName, "send_stalled").Inc()
			return fmt.Errorf("%w: kvrelay ended this stream: the subscriber read nothing for %v while a batch waited to be sent; resubscribe with your cursor and keep reading", errSendStalled, limit)
		}
	}
}

// pump moves one subscription's batches onto its gRPC stream. sent counts
// finished sends and sending marks one in progress, for the watchdog.
type pump struct {
	h       *handler
	stream  grpc.ServerStreamingServer[kvpb.KvEventBatch]
	sent    atomic.Uint64
	sending atomic.Bool
}

func (p *pump) send(b *kvpb.KvEventBatch, payload, suffix []byte) error {
	p.sending.Store(true)
	var err error
	if payload == nil {
		err = p.stream.Send(b)
	} else {
		// The relay encoded the batch once for every subscriber; the
		// server codec sends those bytes as they are, and this
		// subscriber's suffix (its load record) after them.
		err = p.stream.SendMsg(&frame{payload: payload, suffix: suffix})
	}
	p.sent.Add(1)
	p.sending.Store(false)
	if c := status.Code(err); c == codes.Unavailable || c == codes.Canceled {
		// The transport ends a send to a client that closed its
		// connection with UNAVAILABLE ("transport is closing"), sometimes
		// before the call's context says so: the client went away.
		return fmt.Errorf("%w: %w", errClientGone, err)
	}
	return err
}

// errClientGone marks a send that failed because the client left.
var errClientGone = errors.New("the subscriber went away")

func (p *pump) run(ctx context.Context, req *kvpb.SubscribeKvEventsRequest) error {
	// A refusal (OUT_OF_RANGE for a cursor the history cannot serve) must
	// be the call's own status, before any header: SMG's gateway resets its
	// cursors and resubscribes from zero only when the call itself fails
	// with OUT_OF_RANGE; after headers it retries the same cursor forever
	// (interop.TestSMGGatewayConsumesKvrelay).
	sub, err := p.h.svc.Subscribe(ctx, req)
	if err != nil {
		return err
	}
	defer sub.Close()
	// Gateways wait for the response headers to know the call was accepted
	// before the first event, which may be long in coming.
	if err := p.stream.SendHeader(metadata.MD{}); err != nil {
		return err
	}
	if src := p.h.svc.Load; src != nil {
		return p.runStamped(ctx, sub, src)
	}
	enc, encoded := sub.(encodedStream)
	keyed, _ := sub.(liveKeyed)
	for {
		var (
			b       *kvpb.KvEventBatch
			payload []byte
			err     error
		)
		if encoded {
			payload, err = enc.NextEncoded(ctx)
		} else {
			b, err = sub.Next(ctx)
		}
		if err != nil {
			return err
		}
		rank, seq, live := liveKey(b, keyed)
		if err := p.sendMarked(b, payload, nil, rank, seq, live); err != nil {
			return err
		}
	}
}

// sendMarked sends a batch and, for a live one, marks the latency probe's
// last two stages around the send.
func (p *pump) sendMarked(b *kvpb.KvEventBatch, payload, suffix []byte, rank int32, seq uint64, live bool) error {
	if live {
		latencyprobe.Mark(latencyprobe.Dequeued, rank, seq)
	}
	if err := p.send(b, payload, suffix); err != nil {
		return err
	}
	if live {
		latencyprobe.Mark(latencyprobe.Written, rank, seq)
	}
	return nil
}

// encodedStream is a Stream that can hand out batches already encoded.
type encodedStream interface {
	NextEncoded(ctx context.Context) ([]byte, error)
}

// liveKeyed is a Stream that tells which live batch it handed out last
// (relay.Subscription.LiveKey), for the latency probe's marks.
type liveKeyed interface {
	LiveKey() (rank int32, seq uint64, ok bool)
}

// liveKey is the rank and sequence the latency probe marks for the batch
// just taken: the message's own, or the stream's word for encoded bytes.
func liveKey(b *kvpb.KvEventBatch, keyed liveKeyed) (int32, uint64, bool) {
	switch {
	case b != nil:
		return b.GetDpRank(), b.GetSequenceNumber(), true
	case keyed != nil:
		return keyed.LiveKey()
	}
	return 0, 0, false
}

// statusOf maps the relay's errors to the codes SMG's gateway acts on.
// client is the call's own context: once it is done, the client went away
// (or its deadline passed), whatever error the send that noticed it got.
func (h *handler) statusOf(client context.Context, err error) *status.Status {
	switch {
	case err == nil:
		return status.New(codes.OK, "")
	case h.server.shutdownCtx.Err() != nil:
		return status.New(codes.Unavailable, "kvrelay is shutting down; resubscribe to another relay or after its restart")
	case errors.Is(err, errSendStalled):
		return status.New(codes.ResourceExhausted, err.Error())
	case errors.Is(client.Err(), context.DeadlineExceeded):
		return status.New(codes.DeadlineExceeded, "the subscriber's deadline passed")
	case client.Err() != nil, errors.Is(err, errClientGone):
		// A send to a client that disconnected fails with UNAVAILABLE
		// ("transport is closing"); the client cancelled all the same.
		return status.New(codes.Canceled, "the subscriber went away")
	case errors.Is(err, relay.ErrOutOfRange):
		return status.New(codes.OutOfRange, err.Error())
	case errors.Is(err, relay.ErrDataLoss):
		return status.New(codes.DataLoss, err.Error())
	case errors.Is(err, relay.ErrDisabled):
		return status.New(codes.Unimplemented, h.svc.Engine.DisabledMessage)
	case errors.Is(err, context.DeadlineExceeded):
		return status.New(codes.DeadlineExceeded, "the subscriber's deadline passed")
	case errors.Is(err, context.Canceled):
		return status.New(codes.Canceled, "the subscriber went away")
	}
	if st, ok := status.FromError(err); ok {
		return st
	}
	return status.New(codes.Internal, err.Error())
}

// unknownService answers a call to a service this server does not
// register: forwarded to the engine's servicer when an upstream serves it,
// otherwise UNIMPLEMENTED naming the KV event services served here.
func (s *Server) unknownService(srv any, stream grpc.ServerStream) error {
	method, _ := grpc.MethodFromServerStream(stream)
	if s.proxy != nil && s.proxy.conn(method) != nil {
		return s.proxy.handle(srv, stream)
	}
	service, name := strings.TrimPrefix(method, "/"), ""
	if i := strings.LastIndex(service, "/"); i >= 0 {
		service, name = service[:i], service[i+1:]
	}
	var served []string
	for _, svc := range s.services {
		if svc.Engine.ServiceName == service {
			// A served service's other methods land here too: the
			// service is right, the method is the engine's.
			s.log.Debug("call to a method not served", "method", method)
			return status.Errorf(codes.Unimplemented, "method %s is not served by kvrelay (it forwards it only with --upstream)", name)
		}
		served = append(served, fmt.Sprintf("%s (%s)", svc.Engine.Name, svc.Engine.ServiceName))
	}
	msg := fmt.Sprintf("unknown service %s: this kvrelay serves SubscribeKvEvents as %s; name that service on the client (a gateway worker's service=, kvrelay tail --service)",
		service, strings.Join(served, ", "))
	if s.proxy != nil {
		msg += "; it forwards " + s.proxy.services() + " to the engine"
	}
	s.log.Debug("call to an unknown service", "method", method)
	return status.Error(codes.Unimplemented, msg)
}

// One small type per service: each generated interface wants its own
// Unimplemented embedding, and two embeddings in one type would clash.
type vllmService struct {
	kvpb.UnimplementedVllmEngineServer
	h *handler
}

func (s vllmService) SubscribeKvEvents(req *kvpb.SubscribeKvEventsRequest, stream grpc.ServerStreamingServer[kvpb.KvEventBatch]) error {
	return s.h.subscribe(req, stream)
}

type sglangService struct {
	kvpb.UnimplementedSglangSchedulerServer
	h *handler
}

func (s sglangService) SubscribeKvEvents(req *kvpb.SubscribeKvEventsRequest, stream grpc.ServerStreamingServer[kvpb.KvEventBatch]) error {
	return s.h.subscribe(req, stream)
}

type tokenspeedService struct {
	kvpb.UnimplementedTokenSpeedSchedulerServer
	h *handler
}

func (s tokenspeedService) SubscribeKvEvents(req *kvpb.SubscribeKvEventsRequest, stream grpc.ServerStreamingServer[kvpb.KvEventBatch]) error {
	return s.h.subscribe(req, stream)
}

type serverMetrics struct {
	active *prometheus.GaugeVec
	ended  *prometheus.CounterVec
	cut    *prometheus.CounterVec
}

func newServerMetrics(reg prometheus.Registerer) (*serverMetrics, error) {
	m := &serverMetrics{
		active: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "kvrelay_grpc_streams",
			Help: "SubscribeKvEvents streams open now.",
		}, []string{"service"}),
		ended: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvrelay_grpc_streams_ended_total",
			Help: "SubscribeKvEvents streams that ended, by gRPC status code.",
		}, []string{"service", "code"}),
		cut: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvrelay_grpc_streams_limited_total",
			Help: "SubscribeKvEvents streams refused or ended by a limit, by reason: peer_limit, total_limit (refused at subscribe), send_stalled (the client stopped reading).",
		}, []string{"service", "reason"}),
	}
	if reg != nil {
		for _, c := range []prometheus.Collector{m.active, m.ended, m.cut} {
			if err := reg.Register(c); err != nil {
				return nil, fmt.Errorf("server: register metrics: %w", err)
			}
		}
	}
	return m, nil
}

// subscriberSlots counts open SubscribeKvEvents streams, in total and per
// remote host.
type subscriberSlots struct {
	mu      sync.Mutex
	total   int
	perPeer map[string]int
	maxAll  int
	maxPeer int
}

func newSubscriberSlots(maxAll, maxPeer int) *subscriberSlots {
	return &subscriberSlots{perPeer: map[string]int{}, maxAll: maxAll, maxPeer: maxPeer}
}

// take reserves a slot for peer, or says which limit refuses it.
func (s *subscriberSlots) take(peer string) (reason string, err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.total >= s.maxAll {
		return "total_limit", fmt.Errorf("kvrelay serves at most %d SubscribeKvEvents streams on this listener (--max-subscribers); close one or raise the limit", s.maxAll)
	}
	if s.perPeer[peer] >= s.maxPeer {
		return "peer_limit", fmt.Errorf("kvrelay serves at most %d SubscribeKvEvents streams to %s (--max-subscribers-per-peer); close one or raise the limit", s.maxPeer, peer)
	}
	s.total++
	s.perPeer[peer]++
	return "", nil
}

func (s *subscriberSlots) give(peer string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.total--
	if s.perPeer[peer]--; s.perPeer[peer] <= 0 {
		delete(s.perPeer, peer)
	}
}

// peerHost is the remote host of the call: the IP address without the port,
// so that one client's connections count together.
func peerHost(ctx context.Context) string {
	p, ok := peer.FromContext(ctx)
	if !ok || p.Addr == nil {
		return "unknown"
	}
	if host, _, err := net.SplitHostPort(p.Addr.String()); err == nil {
		return host
	}
	return p.Addr.String()
}
