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
	"google.golang.org/grpc/reflection"
	"google.golang.org/grpc/status"

	"github.com/kvrelay/kvrelay/engines"
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
}

// Server is one gRPC listener's worth of relays.
type Server struct {
	grpc     *grpc.Server
	health   *health.Server
	services []Service
	log      *slog.Logger
	grace    time.Duration
	conns    []*grpc.ClientConn
	metrics  *serverMetrics

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
	s := &Server{services: opts.Services, log: log, grace: grace, metrics: metrics, healthDone: make(chan struct{})}
	s.shutdownCtx, s.shutdown = context.WithCancel(context.Background())

	serverOpts := []grpc.ServerOption{
		// SMG's gateway pings every second; the default enforcement (one
		// ping per 5 minutes) would answer it with GOAWAY too_many_pings.
		grpc.KeepaliveEnforcementPolicy(keepalive.EnforcementPolicy{MinTime: 500 * time.Millisecond, PermitWithoutStream: true}),
		// Find gateways that vanished without closing their connection.
		grpc.KeepaliveParams(keepalive.ServerParameters{Time: 10 * time.Second, Timeout: 5 * time.Second}),
		// Snapshot chunks of large states exceed the 4 MiB default.
		grpc.MaxSendMsgSize(1 << 30),
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
		serverOpts = append(serverOpts, grpc.UnknownServiceHandler(p.handle))
	}
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

// Serve accepts connections on lis until Stop. It also keeps the health
// service in step with the relays' readiness.
func (s *Server) Serve(lis net.Listener) error {
	s.watching.Do(func() {
		s.watched.Store(true)
		go s.watchHealth()
	})
	err := s.grpc.Serve(lis)
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
	ctx, cancel := context.WithCancel(stream.Context())
	defer cancel()
	stop := context.AfterFunc(h.server.shutdownCtx, cancel)
	defer stop()

	h.server.metrics.active.WithLabelValues(service).Inc()
	defer h.server.metrics.active.WithLabelValues(service).Dec()

	err := h.pump(ctx, req, stream)
	st := h.statusOf(err)
	h.server.metrics.ended.WithLabelValues(service, st.Code().String()).Inc()
	if st.Code() != codes.OK && st.Code() != codes.Canceled {
		h.server.log.Info("subscriber stream ended", "service", service, "code", st.Code().String(), "reason", st.Message())
	}
	return st.Err()
}

func (h *handler) pump(ctx context.Context, req *kvpb.SubscribeKvEventsRequest, stream grpc.ServerStreamingServer[kvpb.KvEventBatch]) error {
	// A refusal (OUT_OF_RANGE for a cursor the history cannot serve) must
	// be the call's own status, before any header: SMG's gateway resets its
	// cursors and resubscribes from zero only when the call itself fails
	// with OUT_OF_RANGE; after headers it retries the same cursor forever
	// (interop.TestSMGGatewayConsumesKvrelay).
	sub, err := h.svc.Subscribe(ctx, req)
	if err != nil {
		return err
	}
	defer sub.Close()
	// Gateways wait for the response headers to know the call was accepted
	// before the first event, which may be long in coming.
	if err := stream.SendHeader(metadata.MD{}); err != nil {
		return err
	}
	enc, encoded := sub.(encodedStream)
	for {
		if encoded {
			// The relay encoded the batch once for every subscriber; the
			// server codec sends those bytes as they are.
			b, payload, err := enc.NextEncoded(ctx)
			if err != nil {
				return err
			}
			if b != nil && payload == nil {
				err = stream.Send(b)
			} else {
				err = stream.SendMsg(&frame{payload: payload})
			}
			if err != nil {
				return err
			}
			continue
		}
		b, err := sub.Next(ctx)
		if err != nil {
			return err
		}
		if err := stream.Send(b); err != nil {
			return err
		}
	}
}

// encodedStream is a Stream that can hand out batches already encoded.
type encodedStream interface {
	NextEncoded(ctx context.Context) (*kvpb.KvEventBatch, []byte, error)
}

// statusOf maps the relay's errors to the codes SMG's gateway acts on.
func (h *handler) statusOf(err error) *status.Status {
	switch {
	case err == nil:
		return status.New(codes.OK, "")
	case h.server.shutdownCtx.Err() != nil:
		return status.New(codes.Unavailable, "kvrelay is shutting down; resubscribe to another relay or after its restart")
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
	}
	if reg != nil {
		for _, c := range []prometheus.Collector{m.active, m.ended} {
			if err := reg.Register(c); err != nil {
				return nil, fmt.Errorf("server: register metrics: %w", err)
			}
		}
	}
	return m, nil
}
