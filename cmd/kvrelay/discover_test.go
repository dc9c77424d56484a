package main

import (
	"context"
	"crypto/tls"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/emptypb"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/kvrelay/kvrelay/testkit/enginepeer"
	"github.com/kvrelay/kvrelay/testkit/logbuf"
	"github.com/kvrelay/kvrelay/testkit/testpki"
)

// fakeSGLangServicer answers SglangScheduler.GetServerInfo on loopback as
// SMG's servicer does for SGLang: server_args (field 1) is the engine's
// ServerArgs as a Struct, with kv_events_config and dp_size among them.
// opts configure the server (TLS credentials).
func fakeSGLangServicer(t *testing.T, serverArgs map[string]any, opts ...grpc.ServerOption) string {
	t.Helper()
	return fakeSGLangServicerOn(t, "127.0.0.1:0", serverArgs, opts...)
}

// fakeSGLangServicerOn is fakeSGLangServicer listening on listen.
func fakeSGLangServicerOn(t *testing.T, listen string, serverArgs map[string]any, opts ...grpc.ServerOption) string {
	t.Helper()
	s, err := structpb.NewStruct(serverArgs)
	if err != nil {
		t.Fatal(err)
	}
	raw, err := proto.Marshal(s)
	if err != nil {
		t.Fatal(err)
	}
	resp := protowire.AppendBytes(protowire.AppendTag(nil, 1, protowire.BytesType), raw)
	lis, err := net.Listen("tcp", listen)
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer(opts...)
	srv.RegisterService(&grpc.ServiceDesc{
		ServiceName: "sglang.grpc.scheduler.SglangScheduler",
		HandlerType: (*any)(nil),
		Methods: []grpc.MethodDesc{{
			MethodName: "GetServerInfo",
			Handler: func(_ any, _ context.Context, dec func(any) error, _ grpc.UnaryServerInterceptor) (any, error) {
				if err := dec(&emptypb.Empty{}); err != nil {
					return nil, err
				}
				out := &emptypb.Empty{}
				out.ProtoReflect().SetUnknown(resp)
				return out, nil
			},
		}},
	}, struct{}{})
	go func() { _ = srv.Serve(lis) }()
	t.Cleanup(srv.Stop)
	return lis.Addr().String()
}

// kvrelay serve without --kv-events-config learns the publishers of SGLang
// 0.5.23's own publisher module (two DP ranks) from the engine's servicer
// (--upstream), and relays both ranks.
func TestServeLearnsEngineReleasePublishersFromUpstream(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a Python peer")
	}
	verifyNoLeaks(t)
	rel, err := enginepeer.ReleaseOf(enginepeer.SGLang)
	if err != nil {
		t.Fatal(err)
	}
	peer := enginepeer.Start(t, enginepeer.Options{Engine: enginepeer.SGLang, DPSize: 2, Release: rel})
	cfg, _ := json.Marshal(map[string]any{
		"publisher": "zmq",
		"endpoint":  strings.Replace(peer.PubEndpoint(0), "127.0.0.1", "*", 1),
		// SGLang binds its ROUTER on any host spelling; advertise the wildcard.
		"replay_endpoint": strings.Replace(peer.ReplayEndpoint(0), "127.0.0.1", "*", 1),
	})
	upstream := fakeSGLangServicer(t, map[string]any{"kv_events_config": string(cfg), "dp_size": 2, "model_path": "m"})

	grpcAddr := freeAddr(t)
	srv := runInBackground(t, "serve", "--engine", "sglang", "--upstream", upstream,
		"--listen", grpcAddr, "--metrics-listen", "", "--replay-timeout", "2s")
	ctx := srv.ctx
	// The peer's startup clears (seq 0 of each rank) plus one store each.
	for rank := 0; rank < 2; rank++ {
		if _, err := peer.Publish(rank, enginepeer.Stored(nil, []int64{1, 2, 3, 4}, enginepeer.I64(int64(rank+1)))); err != nil {
			t.Fatal(err)
		}
	}
	var out, errOut logbuf.Buffer
	deadline := time.Now().Add(30 * time.Second)
	for {
		out, errOut = logbuf.Buffer{}, logbuf.Buffer{}
		tctx, tcancel := context.WithTimeout(ctx, 10*time.Second)
		code := dispatch(tctx, []string{"tail", "--addr", grpcAddr, "--service", "sglang", "--json", "-n", "4"}, strings.NewReader(""), &out, &errOut)
		tcancel()
		if code == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("tail never succeeded: %s; serve stderr:\n%s", errOut.String(), srv.stderr.String())
		}
		time.Sleep(100 * time.Millisecond)
	}
	ranks := map[float64]int{}
	for _, line := range strings.Split(strings.TrimSpace(out.String()), "\n") {
		var b map[string]any
		if err := json.Unmarshal([]byte(line), &b); err != nil {
			t.Fatalf("tail line is not JSON: %q", line)
		}
		rank, _ := b["dpRank"].(float64)
		ranks[rank]++
	}
	if ranks[0] != 2 || ranks[1] != 2 {
		t.Fatalf("want each rank's clear and store, got %v:\n%s", ranks, out.String())
	}
	if want := fmt.Sprintf("learned from %s", upstream); !strings.Contains(srv.stderr.String(), want) || !strings.Contains(srv.stderr.String(), "--dp-size 2") {
		t.Errorf("serve did not say what it learned; stderr:\n%s", srv.stderr.String())
	}
	srv.stop(t)
}

// Where the engine does not tell (vLLM), or contradicts --dp-size, serve
// stops with an error naming what to pass.
func TestServeDiscoveryErrors(t *testing.T) {
	cfg := `{"publisher": "zmq", "endpoint": "tcp://*:5557"}`
	cases := []struct {
		name string
		args []string
		want string
	}{
		{"vllm advertises nothing", []string{"--engine", "vllm", "--upstream", "127.0.0.1:1"}, "--kv-events-config"},
		{"dp-size contradicts", []string{"--engine", "sglang", "--dp-size", "3", "--upstream",
			fakeSGLangServicer(t, map[string]any{"kv_events_config": cfg, "dp_size": 2})}, "runs 2 publishers"},
		{"events off", []string{"--engine", "sglang", "--upstream",
			fakeSGLangServicer(t, map[string]any{"kv_events_config": nil})}, "publishes no KV events"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			var stderr logbuf.Buffer
			code := dispatch(context.Background(), append([]string{"serve", "--metrics-listen", ""}, tc.args...), strings.NewReader(""), io.Discard, &stderr)
			if code == 0 || !strings.Contains(stderr.String(), tc.want) {
				t.Fatalf("exit %d, stderr %q; want a failure naming %q", code, stderr.String(), tc.want)
			}
		})
	}
}

// Discovery dials the engine's servicer as the proxy does: grpcs:// with
// the --upstream-tls-* settings (it passed the raw grpcs:// target to a
// plaintext client, which failed as "too many colons" for two minutes), and
// plain HOST:PORT as before. Serve then runs with what it learned.
func TestServeDiscoversOverTLSAndPlaintext(t *testing.T) {
	dir := t.TempDir()
	ca := testpki.NewCA(t, "engine CA")
	caFile := ca.WriteCA(t, dir, "ca")
	serverCert := ca.Issue(t, testpki.Leaf{CommonName: "engine", DNSNames: []string{"localhost"}, IPs: []net.IP{net.IPv4(127, 0, 0, 1)}, Server: true})
	serverTLS := grpc.Creds(credentials.NewTLS(&tls.Config{Certificates: []tls.Certificate{serverCert.TLS(t)}, MinVersion: tls.VersionTLS12}))
	cfg := `{"publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5657"}`
	args := map[string]any{"kv_events_config": cfg, "dp_size": 2}
	for _, tc := range []struct {
		name     string
		upstream func() string
		flags    []string
	}{
		{"plaintext", func() string { return fakeSGLangServicer(t, args) }, nil},
		{"grpc:// plaintext", func() string { return "grpc://" + fakeSGLangServicer(t, args) }, nil},
		{"grpcs:// with the upstream CA", func() string { return "grpcs://" + fakeSGLangServicer(t, args, serverTLS) },
			[]string{"--upstream-tls-ca", caFile}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			upstream := tc.upstream()
			ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
			defer cancel()
			var stderr logbuf.Buffer
			done := make(chan int, 1)
			go func() {
				done <- dispatch(ctx, append([]string{"serve", "--engine", "sglang", "--upstream", upstream,
					"--listen", freeAddr(t), "--metrics-listen", ""}, tc.flags...), strings.NewReader(""), io.Discard, &stderr)
			}()
			// A loopback upstream: the wildcard binds are dialled on
			// loopback, as before.
			want := []string{"learned from " + upstream + ": --kv-events-config '" + cfg + "' --dp-size 2",
				"rank=1 publisher=tcp://127.0.0.1:5558 replay=tcp://127.0.0.1:5658"}
			for !strings.Contains(stderr.String(), want[0]) || !strings.Contains(stderr.String(), want[1]) {
				select {
				case code := <-done:
					t.Fatalf("serve exit %d before learning the config; stderr:\n%s", code, stderr.String())
				case <-time.After(10 * time.Millisecond):
				}
			}
			cancel()
			select {
			case code := <-done:
				if code != 0 && ctx.Err() == nil {
					t.Fatalf("serve exit %d; stderr:\n%s", code, stderr.String())
				}
				if strings.Contains(stderr.String(), "dialling them at the upstream's host") || strings.Contains(stderr.String(), "will connect its publisher") {
					t.Errorf("endpoints moved or misread for a loopback upstream; stderr:\n%s", stderr.String())
				}
			case <-time.After(30 * time.Second):
				t.Fatal("serve did not shut down")
			}
		})
	}
}

// The upstream TLS settings are checked before discovery, as for the proxy.
func TestServeDiscoveryRefusesTLSSettingsForAPlaintextUpstream(t *testing.T) {
	var stderr logbuf.Buffer
	code := dispatch(context.Background(), []string{"serve", "--metrics-listen", "", "--engine", "sglang",
		"--upstream", "127.0.0.1:1", "--upstream-tls-ca", "ca.pem"}, strings.NewReader(""), io.Discard, &stderr)
	if code != 2 || !strings.Contains(stderr.String(), "is plaintext (use grpcs://HOST:PORT)") {
		t.Fatalf("exit %d, stderr %q", code, stderr.String())
	}
}

// An upstream on another address than loopback (this host's own
// non-loopback address, so the test needs no second machine): the learned
// wildcard binds are dialled at the upstream's address, and serve says so.
func TestServeDialsDiscoveredWildcardsAtTheUpstreamHost(t *testing.T) {
	var ip net.IP
	addrs, _ := net.InterfaceAddrs()
	for _, a := range addrs {
		if n, ok := a.(*net.IPNet); ok && n.IP.To4() != nil && !n.IP.IsLoopback() && !n.IP.IsLinkLocalUnicast() {
			ip = n.IP
			break
		}
	}
	if ip == nil {
		t.Skip("no non-loopback IPv4 address on this host")
	}
	cfg := `{"publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5657"}`
	upstream := fakeSGLangServicerOn(t, net.JoinHostPort(ip.String(), "0"), map[string]any{"kv_events_config": cfg, "dp_size": 2})
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	var stderr logbuf.Buffer
	done := make(chan int, 1)
	go func() {
		done <- dispatch(ctx, []string{"serve", "--engine", "sglang", "--upstream", upstream,
			"--listen", freeAddr(t), "--metrics-listen", ""}, strings.NewReader(""), io.Discard, &stderr)
	}()
	want := []string{
		"dialling them at the upstream's host: endpoint tcp://*:5557 -> tcp://" + ip.String() + ":5557, replay_endpoint tcp://*:5657 -> tcp://" + ip.String() + ":5657",
		"rank=1 publisher=tcp://" + ip.String() + ":5558 replay=tcp://" + ip.String() + ":5658",
	}
	for !strings.Contains(stderr.String(), want[0]) || !strings.Contains(stderr.String(), want[1]) {
		select {
		case code := <-done:
			t.Fatalf("serve exit %d; stderr lacks %q:\n%s", code, want, stderr.String())
		case <-ctx.Done():
			t.Fatalf("stderr lacks %q:\n%s", want, stderr.String())
		case <-time.After(10 * time.Millisecond):
		}
	}
	if strings.Contains(stderr.String(), "will connect its publisher") {
		t.Errorf("the moved wildcard binds read as connecting endpoints:\n%s", stderr.String())
	}
	cancel()
	select {
	case <-done:
	case <-time.After(30 * time.Second):
		t.Fatal("serve did not shut down")
	}
}
