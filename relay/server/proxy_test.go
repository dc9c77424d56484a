package server_test

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"net"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	reflectionpb "google.golang.org/grpc/reflection/grpc_reflection_v1"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/kvrelay/kvrelay/engines/vllm"
	"github.com/kvrelay/kvrelay/internal/tlsconfig"
	"github.com/kvrelay/kvrelay/relay/server"
	"github.com/kvrelay/kvrelay/testkit/testpki"
)

// recordingUpstream is an engine servicer that answers every method of the
// services it is given with the metadata it received (as JSON), and counts
// the calls that reached it.
type recordingUpstream struct {
	addr  string
	calls atomic.Int64
}

func startRecordingUpstream(t *testing.T, services []string, opts ...grpc.ServerOption) *recordingUpstream {
	t.Helper()
	u := &recordingUpstream{}
	s := grpc.NewServer(opts...)
	for _, name := range services {
		desc := grpc.ServiceDesc{ServiceName: name, HandlerType: (*any)(nil)}
		for _, m := range []string{"GetModelInfo", "FlushCache", "Shutdown"} {
			desc.Methods = append(desc.Methods, grpc.MethodDesc{
				MethodName: m,
				Handler: func(_ any, ctx context.Context, dec func(any) error, _ grpc.UnaryServerInterceptor) (any, error) {
					u.calls.Add(1)
					if err := dec(&wrapperspb.StringValue{}); err != nil {
						return nil, err
					}
					md, _ := metadata.FromIncomingContext(ctx)
					b, _ := json.Marshal(md)
					return wrapperspb.String(string(b)), nil
				},
			})
		}
		s.RegisterService(&desc, struct{}{})
	}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { defer close(done); _ = s.Serve(lis) }()
	t.Cleanup(func() { s.Stop(); <-done })
	u.addr = lis.Addr().String()
	return u
}

// startProxyServer runs a kvrelay server for vLLM (events off: no engine
// needed) with opts and returns a client connection to it.
func startProxyServer(t *testing.T, opts server.Options, dial credentials.TransportCredentials) *grpc.ClientConn {
	t.Helper()
	opts.Services = []server.Service{{Engine: vllm.Engine}}
	opts.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
	srv, err := server.New(opts)
	if err != nil {
		t.Fatalf("server.New: %v", err)
	}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { defer close(done); _ = srv.Serve(lis) }()
	if dial == nil {
		dial = insecure.NewCredentials()
	}
	cc, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(dial))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cc.Close(); srv.Stop(); <-done })
	return cc
}

// invoke calls method and returns the metadata the upstream saw.
func invoke(t *testing.T, cc *grpc.ClientConn, method string, md ...string) (metadata.MD, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	ctx = metadata.AppendToOutgoingContext(ctx, md...)
	out := &wrapperspb.StringValue{}
	if err := cc.Invoke(ctx, method, wrapperspb.String("x"), out); err != nil {
		return nil, err
	}
	var seen metadata.MD
	if err := json.Unmarshal([]byte(out.GetValue()), &seen); err != nil {
		t.Fatalf("upstream answer %q: %v", out.GetValue(), err)
	}
	return seen, nil
}

func TestProxyForwardsOnlyTheEngineService(t *testing.T) {
	up := startRecordingUpstream(t, []string{"vllm.grpc.engine.VllmEngine", "anything.Admin", "sglang.grpc.scheduler.SglangScheduler", "smg.worker.v1.WorkerControl", "vllm.grpc.engine.Other"})
	cc := startProxyServer(t, server.Options{
		Upstreams: map[string]string{"vllm": up.addr},
		Proxy:     server.ProxyOptions{ExtraServices: map[string][]string{"vllm": {"smg.worker.v1.WorkerControl"}}},
	}, nil)
	tests := []struct {
		method string
		want   codes.Code
	}{
		{"/vllm.grpc.engine.VllmEngine/GetModelInfo", codes.OK},
		{"/vllm.grpc.engine.VllmEngine/FlushCache", codes.OK},   // the engine's own method: its call
		{"/smg.worker.v1.WorkerControl/GetModelInfo", codes.OK}, // configured extra service
		{"/anything.Admin/Shutdown", codes.Unimplemented},
		{"/sglang.grpc.scheduler.SglangScheduler/FlushCache", codes.Unimplemented},
		{"/vllm.grpc.engine.Other/Shutdown", codes.Unimplemented}, // same package, another service
		{"/vllm.grpc.engine.VllmEngine", codes.Unimplemented},
	}
	for _, tt := range tests {
		t.Run(tt.method, func(t *testing.T) {
			before := up.calls.Load()
			_, err := invoke(t, cc, tt.method)
			if got := status.Code(err); got != tt.want {
				t.Fatalf("%s: %v (%v), want %v", tt.method, got, err, tt.want)
			}
			reached := up.calls.Load() - before
			if (tt.want == codes.OK) != (reached == 1) {
				t.Fatalf("%s reached the upstream %d times", tt.method, reached)
			}
		})
	}
}

func TestProxyRefusesForwardingKvrelaysOwnServices(t *testing.T) {
	for _, extra := range []string{"vllm.grpc.engine.VllmEngine", "grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection"} {
		_, err := server.New(server.Options{
			Services:  []server.Service{{Engine: vllm.Engine}},
			Upstreams: map[string]string{"vllm": "127.0.0.1:1"},
			Proxy:     server.ProxyOptions{ExtraServices: map[string][]string{"vllm": {extra}}},
		})
		if err == nil || !strings.Contains(err.Error(), extra) {
			t.Errorf("forwarding %s: %v, want an error naming it", extra, err)
		}
	}
}

func TestProxyMetadata(t *testing.T) {
	up := startRecordingUpstream(t, []string{"vllm.grpc.engine.VllmEngine"})
	for _, drop := range []bool{false, true} {
		cc := startProxyServer(t, server.Options{
			Upstreams: map[string]string{"vllm": up.addr},
			Proxy:     server.ProxyOptions{DropAuthorization: drop},
		}, nil)
		seen, err := invoke(t, cc, "/vllm.grpc.engine.VllmEngine/GetModelInfo",
			"authorization", "Bearer k", "cookie", "session=1", "x-forwarded-for", "6.6.6.6",
			"forwarded", "for=6.6.6.6", "x-real-ip", "6.6.6.6", "x-forwarded-client-cert", "URI=spiffe://forged",
			"proxy-authorization", "Basic eA==", "x-request-id", "r1")
		if err != nil {
			t.Fatal(err)
		}
		for _, k := range []string{"cookie", "forwarded", "x-real-ip", "x-forwarded-client-cert", "proxy-authorization"} {
			if v := seen.Get(k); len(v) > 0 {
				t.Errorf("the upstream saw %s: %q", k, v)
			}
		}
		if got := seen.Get("x-forwarded-for"); len(got) != 1 || got[0] != "127.0.0.1" {
			t.Errorf("x-forwarded-for %q, want the real peer 127.0.0.1 only", got)
		}
		if got := seen.Get("x-request-id"); len(got) != 1 || got[0] != "r1" {
			t.Errorf("x-request-id %q did not pass", got)
		}
		auth := seen.Get("authorization")
		if drop && len(auth) != 0 || !drop && (len(auth) != 1 || auth[0] != "Bearer k") {
			t.Errorf("DropAuthorization=%v: authorization %q", drop, auth)
		}
	}
}

func TestProxyOverTLS(t *testing.T) {
	dir := t.TempDir()
	ca := testpki.NewCA(t, "ca")
	caFile := ca.WriteCA(t, dir, "ca")
	relayCert := ca.Issue(t, testpki.Leaf{CommonName: "relay", DNSNames: []string{"localhost"}, Server: true}).WriteFiles(t, dir, "relay")
	engineCert := ca.Issue(t, testpki.Leaf{CommonName: "engine", DNSNames: []string{"localhost"}, Server: true}).WriteFiles(t, dir, "engine")
	relayClient := ca.Issue(t, testpki.Leaf{CommonName: "relay-client", URIs: []string{"spiffe://td/kvrelay"}}).WriteFiles(t, dir, "relay-client")
	gateway := ca.Issue(t, testpki.Leaf{CommonName: "gw", URIs: []string{"spiffe://td/gateway"}}).WriteFiles(t, dir, "gateway")
	intruder := ca.Issue(t, testpki.Leaf{CommonName: "job", URIs: []string{"spiffe://td/batch-job"}}).WriteFiles(t, dir, "intruder")

	// The engine's servicer requires a client certificate (mTLS).
	engineTLS, err := tlsconfig.NewListener(tlsconfig.Server{Cert: engineCert.Cert, Key: engineCert.Key, ClientCA: caFile, Allow: []string{"spiffe://td/kvrelay"}}, "engine", nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	up := startRecordingUpstream(t, []string{"vllm.grpc.engine.VllmEngine"}, engineTLS.GRPCServerOptions()...)

	relayTLS, err := tlsconfig.NewListener(tlsconfig.Server{Cert: relayCert.Cert, Key: relayCert.Key, ClientCA: caFile, Allow: []string{"spiffe://td/gateway"}}, "relay", nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	upstreamDialer, err := tlsconfig.NewDialer(tlsconfig.Client{CA: caFile, Cert: relayClient.Cert, Key: relayClient.Key, ServerName: "localhost"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	gatewayDialer, err := tlsconfig.NewDialer(tlsconfig.Client{CA: caFile, Cert: gateway.Cert, Key: gateway.Key, ServerName: "localhost"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	cc := startProxyServer(t, server.Options{
		Upstreams:     map[string]string{"vllm": up.addr},
		Proxy:         server.ProxyOptions{Credentials: map[string]credentials.TransportCredentials{"vllm": upstreamDialer.Credentials()}},
		ServerOptions: relayTLS.GRPCServerOptions(),
	}, gatewayDialer.Credentials())
	seen, err := invoke(t, cc, "/vllm.grpc.engine.VllmEngine/GetModelInfo")
	if err != nil {
		t.Fatalf("a call through the TLS proxy: %v", err)
	}
	if xfcc := strings.Join(seen.Get("x-forwarded-client-cert"), ","); !strings.Contains(xfcc, "URI=spiffe://td/gateway") {
		t.Fatalf("x-forwarded-client-cert %q does not name the gateway", xfcc)
	}

	// The allow-list guards proxied calls too: an identity outside it never
	// reaches the engine.
	intruderDialer, err := tlsconfig.NewDialer(tlsconfig.Client{CA: caFile, Cert: intruder.Cert, Key: intruder.Key, ServerName: "localhost"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	icc, err := grpc.NewClient(strings.TrimPrefix(cc.Target(), "passthrough:///"), grpc.WithTransportCredentials(intruderDialer.Credentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer icc.Close()
	before := up.calls.Load()
	if _, err := invoke(t, icc, "/vllm.grpc.engine.VllmEngine/GetModelInfo"); status.Code(err) != codes.PermissionDenied {
		t.Fatalf("an identity outside the allow-list through the proxy: %v, want PERMISSION_DENIED", err)
	}
	if up.calls.Load() != before {
		t.Fatal("a refused caller's call reached the upstream")
	}
}

func TestReflectionIsOptIn(t *testing.T) {
	for _, on := range []bool{false, true} {
		cc := startProxyServer(t, server.Options{Reflection: on}, nil)
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		stream, err := reflectionpb.NewServerReflectionClient(cc).ServerReflectionInfo(ctx)
		if err == nil {
			// io.EOF from Send means the server already ended the stream (an
			// unknown service is answered at once): its status comes from Recv.
			if serr := stream.Send(&reflectionpb.ServerReflectionRequest{MessageRequest: &reflectionpb.ServerReflectionRequest_ListServices{}}); !errors.Is(serr, io.EOF) {
				err = serr
			}
		}
		if err == nil {
			_, err = stream.Recv()
		}
		cancel()
		if on && err != nil || !on && status.Code(err) != codes.Unimplemented {
			t.Fatalf("Reflection=%v: %v", on, err)
		}
	}
}
