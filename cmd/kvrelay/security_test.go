package main

import (
	"context"
	"crypto/tls"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/signal"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/crypto/bcrypt"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"

	"github.com/kvrelay/kvrelay/internal/tlsconfig"
	"github.com/kvrelay/kvrelay/proto/kvpb"
	"github.com/kvrelay/kvrelay/testkit/apiclient"
	"github.com/kvrelay/kvrelay/testkit/enginepeer"
	"github.com/kvrelay/kvrelay/testkit/kvstream"
	"github.com/kvrelay/kvrelay/testkit/logbuf"
	"github.com/kvrelay/kvrelay/testkit/testpki"
)

// testPKI is a CA, a server certificate for 127.0.0.1/localhost and client
// certificates for an allowed gateway and an intruder, as files.
type testPKI struct {
	dir               string
	ca                *testpki.CA
	caFile            string
	server            testpki.Files
	gateway, intruder testpki.Files
	gatewayID         string
}

func newTestPKI(t *testing.T) *testPKI {
	t.Helper()
	p := &testPKI{dir: t.TempDir(), ca: testpki.NewCA(t, "test CA"), gatewayID: "spiffe://cluster.local/ns/llm/sa/gateway"}
	p.caFile = p.ca.WriteCA(t, p.dir, "ca")
	p.server = p.ca.Issue(t, testpki.Leaf{CommonName: "kvrelay", DNSNames: []string{"localhost"}, Server: true}).WriteFiles(t, p.dir, "server")
	p.gateway = p.ca.Issue(t, testpki.Leaf{CommonName: "gateway", URIs: []string{p.gatewayID}}).WriteFiles(t, p.dir, "gateway")
	p.intruder = p.ca.Issue(t, testpki.Leaf{CommonName: "batch-job", URIs: []string{"spiffe://cluster.local/ns/batch/sa/job"}}).WriteFiles(t, p.dir, "intruder")
	return p
}

// httpsClient trusts the test CA; basic auth is added per request.
func (p *testPKI) httpsClient() *http.Client {
	return &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: p.ca.Pool(), ServerName: "localhost"}}}
}

func writeText(t *testing.T, path, text string) string {
	t.Helper()
	if err := os.WriteFile(path, []byte(text), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

// TestServeOverMutualTLS runs `kvrelay serve` with mTLS and an allow-list on
// its gRPC listener and TLS with basic auth on its metrics listener, against a
// real engine peer, and reads it with `kvrelay tail` as an allowed gateway, a
// plaintext client, a client without a certificate and an intruder.
func TestServeOverMutualTLS(t *testing.T) {
	verifyNoLeaks(t)
	p := newTestPKI(t)
	hash, err := bcrypt.GenerateFromPassword([]byte("s3cret"), bcrypt.MinCost)
	if err != nil {
		t.Fatal(err)
	}
	webConfig := writeText(t, filepath.Join(p.dir, "web.yml"), fmt.Sprintf("tls_server_config:\n  cert_file: %s\n  key_file: %s\nbasic_auth_users:\n  prometheus: %s\n", p.server.Cert, p.server.Key, hash))

	peer := enginepeer.Start(t, enginepeer.Options{Engine: enginepeer.VLLM, DPSize: 1})
	grpcAddr, httpAddr := freeAddr(t), freeAddr(t)
	cfg := fmt.Sprintf(`{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": %q, "replay_endpoint": %q}`, peer.PubEndpoint(0), peer.ReplayEndpoint(0))
	srv := runInBackground(t, "serve", "--engine", "vllm", "--kv-events-config", cfg,
		"--listen", grpcAddr, "--metrics-listen", httpAddr, "--replay-timeout", "2s",
		"--tls-cert", p.server.Cert, "--tls-key", p.server.Key, "--tls-client-ca", p.caFile,
		"--tls-allow", p.gatewayID+",cn:someone-else", "--web.config.file", webConfig)
	ctx := srv.ctx

	client := p.httpsClient()
	get := func(path string, auth bool) (int, string) {
		req, _ := http.NewRequest(http.MethodGet, "https://"+httpAddr+path, nil)
		if auth {
			req.SetBasicAuth("prometheus", "s3cret")
		}
		resp, err := client.Do(req)
		if err != nil {
			return 0, err.Error()
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(body)
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		if code, _ := get("/healthz", true); code == http.StatusOK {
			break
		}
		select {
		case code := <-srv.done:
			t.Fatalf("serve exited with %d:\n%s", code, srv.stderr.String())
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("kvrelay serve never became healthy over HTTPS; stderr:\n%s", srv.stderr.String())
		}
		time.Sleep(50 * time.Millisecond)
	}
	if code, _ := get("/metrics", false); code != http.StatusUnauthorized {
		t.Fatalf("/metrics without credentials: %d, want 401", code)
	}
	// A plaintext request to the TLS server gets a 400 answer, not data.
	if resp, err := http.Get("http://" + httpAddr + "/metrics"); err == nil {
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode == http.StatusOK || strings.Contains(string(body), "kvrelay_") {
			t.Fatalf("plaintext /metrics answered %d with metrics", resp.StatusCode)
		}
	}
	if _, err := peer.Publish(0, enginepeer.Stored(nil, []int64{1, 2, 3, 4}, enginepeer.U64(7))); err != nil {
		t.Fatal(err)
	}

	tail := func(args ...string) (int, string, string) {
		var out, errOut logbuf.Buffer
		tctx, tcancel := context.WithTimeout(ctx, 30*time.Second)
		defer tcancel()
		code := dispatch(tctx, append([]string{"tail", "--service", "vllm", "-n", "1"}, args...), strings.NewReader(""), &out, &errOut)
		return code, out.String(), errOut.String()
	}
	tests := []struct {
		name     string
		args     []string
		wantCode int
		wantErr  string
	}{
		{"allowed gateway", []string{"--addr", "grpcs://" + grpcAddr, "--tls-ca", p.caFile, "--tls-cert", p.gateway.Cert, "--tls-key", p.gateway.Key, "--tls-server-name", "localhost"}, 0, ""},
		{"plaintext client", []string{"--addr", grpcAddr}, 1, "Unavailable"},
		{"no client certificate", []string{"--addr", "grpcs://" + grpcAddr, "--tls-ca", p.caFile}, 1, "Unavailable"},
		{"outside the allow-list", []string{"--addr", "grpcs://" + grpcAddr, "--tls-ca", p.caFile, "--tls-cert", p.intruder.Cert, "--tls-key", p.intruder.Key}, 1, "PermissionDenied"},
	}
	for _, tt := range tests {
		code, out, errOut := tail(tt.args...)
		if code != tt.wantCode || !strings.Contains(errOut, tt.wantErr) {
			t.Fatalf("%s: exit %d, stderr %q; want exit %d naming %q", tt.name, code, errOut, tt.wantCode, tt.wantErr)
		}
		if tt.wantCode == 0 && !strings.Contains(out, "stores=1") {
			t.Fatalf("%s: tail printed %q", tt.name, out)
		}
	}
	_, metrics := get("/metrics", true)
	for _, reason := range []string{tlsconfig.ReasonIdentityNotAllowed, tlsconfig.ReasonNoClientCert, tlsconfig.ReasonHandshake} {
		if !strings.Contains(metrics, `kvrelay_tls_refused_total{listener="`+grpcAddr+`",reason="`+reason+`"}`) {
			t.Errorf("/metrics has no refusal counted as %s", reason)
		}
	}

	srv.stop(t)
}

// TestGatewayCommandOverMutualTLS: `kvrelay gateway` subscribes to one
// worker over mTLS (grpcs://, an allow-list on the worker) and one in
// plaintext, routes a cached prompt to the TLS worker, and serves its own
// HTTP API over TLS from --web.config.file.
func TestGatewayCommandOverMutualTLS(t *testing.T) {
	verifyNoLeaks(t)
	p := newTestPKI(t)
	workerTLS, err := tlsconfig.NewListener(tlsconfig.Server{Cert: p.server.Cert, Key: p.server.Key, ClientCA: p.caFile, Allow: []string{p.gatewayID}}, "worker", nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	plain, secured := kvstream.Start(t), kvstream.Start(t, workerTLS.GRPCServerOptions()...)
	webConfig := writeText(t, filepath.Join(p.dir, "web.yml"), fmt.Sprintf("tls_server_config:\n  cert_file: %s\n  key_file: %s\n", p.server.Cert, p.server.Key))

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var stderr logbuf.Buffer
	exit := make(chan int, 1)
	go func() {
		exit <- dispatch(ctx, []string{"gateway",
			"--worker", "grpc://" + plain.Addr + ",model=m",
			"--worker", "grpcs://" + secured.Addr + ",model=m",
			"--worker-tls-ca", p.caFile, "--worker-tls-cert", p.gateway.Cert, "--worker-tls-key", p.gateway.Key, "--worker-tls-server-name", "localhost",
			"--listen", "127.0.0.1:0", "--web.config.file", webConfig,
		}, nil, io.Discard, &stderr)
	}()
	addrRE := regexp.MustCompile(`gateway listening\"? addr=(\S+)`)
	var addr string
	deadline := time.Now().Add(20 * time.Second)
	for addr == "" {
		if m := addrRE.FindStringSubmatch(stderr.String()); m != nil {
			addr = m[1]
		} else if time.Now().After(deadline) {
			t.Fatalf("no listening line in %q", stderr.String())
		} else {
			time.Sleep(5 * time.Millisecond)
		}
	}
	prompt := kvstream.SeqTokens(7, 48)
	secured.Batches <- kvstream.StoreTokens(1, 16, prompt)
	client := p.httpsClient()
	// Wait on the index, not by routing: every route places the prompt.
	for {
		resp, err := client.Get("https://" + addr + "/v1/workers")
		if err != nil {
			t.Fatalf("workers over HTTPS: %v", err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if strings.Contains(string(body), `"index_blocks":3`) || time.Now().After(deadline) {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	resp, err := client.Post("https://"+addr+"/v1/route", "application/json", strings.NewReader(`{"model":"m","token_ids":`+apiclient.TokensJSON(prompt)+`}`))
	if err != nil {
		t.Fatalf("route over HTTPS: %v", err)
	}
	out := map[string]any{}
	_ = json.NewDecoder(resp.Body).Decode(&out)
	resp.Body.Close()
	if out["worker"] != "grpcs://"+secured.Addr || out["reason"] != "event_hit" {
		t.Fatalf("route %v; stderr:\n%s", out, stderr.String())
	}
	cancel()
	select {
	case code := <-exit:
		if code != 0 {
			t.Errorf("exit %d; stderr %s", code, stderr.String())
		}
	case <-time.After(10 * time.Second):
		t.Fatal("gateway did not stop")
	}
}

func TestSecurityFlagsNameTheProblem(t *testing.T) {
	p := newTestPKI(t)
	enabled := `{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://127.0.0.1:5557"}`
	serve := []string{"serve", "--engine", "vllm", "--kv-events-config", enabled, "--metrics-listen", "", "--listen", "127.0.0.1:0"}
	bad := filepath.Join(p.dir, "bad.pem")
	writeText(t, bad, "not a certificate")
	tests := []struct {
		name string
		args []string
		want string
	}{
		{"cert without key", append(serve, "--tls-cert", p.server.Cert), "key"},
		{"client CA without cert", append(serve, "--tls-client-ca", p.caFile), "client CA needs"},
		{"allow-list without client CA", append(serve, "--tls-cert", p.server.Cert, "--tls-key", p.server.Key, "--tls-allow", "cn:x"), "needs a client CA"},
		{"bad allow entry", append(serve, "--tls-cert", p.server.Cert, "--tls-key", p.server.Key, "--tls-client-ca", p.caFile, "--tls-allow", "gateway"), "spiffe://"},
		{"unreadable certificate", append(serve, "--tls-cert", bad, "--tls-key", p.server.Key), bad},
		{"upstream TLS on a plaintext upstream", append(serve, "--upstream", "127.0.0.1:1", "--upstream-tls-ca", p.caFile), "grpcs://"},
		{"bad reflection", append(serve, "--reflection", "maybe"), "reflection"},
		{"missing web config", append(serve, "--web.config.file", filepath.Join(p.dir, "none.yml")), "--web.config.file"},
		{"gateway worker TLS without grpcs", []string{"gateway", "--worker", "grpc://h:1", "--worker-tls-ca", p.caFile}, "grpcs://"},
		{"gateway missing CA", []string{"gateway", "--worker", "grpcs://h:1", "--worker-tls-ca", filepath.Join(p.dir, "none.pem")}, "none.pem"},
		{"tail TLS on plaintext", []string{"tail", "--addr", "h:1", "--tls-ca", p.caFile}, "grpcs://"},
		{"config: one listener, two TLS settings", []string{"serve", "--metrics-listen", "", "--config", writeText(t, filepath.Join(p.dir, "two.json"), fmt.Sprintf(`{"relays": [
			{"name": "a", "engine": "vllm", "kv_events_config": {"enable_kv_cache_events": true, "endpoint": "tcp://127.0.0.1:1"}, "listen": "127.0.0.1:0", "tls": {"cert": %q, "key": %q}},
			{"name": "b", "engine": "sglang", "kv_events_config": {"publisher": "zmq", "endpoint": "tcp://127.0.0.1:3"}, "listen": "127.0.0.1:0"}]}`, p.server.Cert, p.server.Key))}, "different TLS settings"},
		{"config: bad upstream_tls", []string{"serve", "--config", writeText(t, filepath.Join(p.dir, "up.json"), `{"relays": [
			{"engine": "vllm", "kv_events_config": {}, "listen": "127.0.0.1:0", "upstream": "grpcs://127.0.0.1:1", "upstream_tls": {"cert": "c.pem"}}]}`)}, "key"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var stderr logbuf.Buffer
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			code := dispatch(ctx, tt.args, strings.NewReader(""), io.Discard, &stderr)
			if code == 0 || !strings.Contains(stderr.String(), tt.want) {
				t.Fatalf("exit %d, stderr %q; want a failure naming %q", code, stderr.String(), tt.want)
			}
		})
	}
}

// TestServeCertificateRotation: a stream opened over mTLS stays up while the
// server certificate rotates; a rotation whose files do not load (a
// certificate written before its key) is refused by SIGHUP naming the file,
// and handshakes keep getting the old certificate; once the key arrives the
// next handshake gets the new one.
func TestServeCertificateRotation(t *testing.T) {
	verifyNoLeaks(t)
	p := newTestPKI(t)
	peer := enginepeer.Start(t, enginepeer.Options{Engine: enginepeer.VLLM, DPSize: 1})
	grpcAddr, httpAddr := freeAddr(t), freeAddr(t)
	cfg := fmt.Sprintf(`{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": %q, "replay_endpoint": %q}`, peer.PubEndpoint(0), peer.ReplayEndpoint(0))
	srv := runInBackground(t, "serve", "--engine", "vllm", "--kv-events-config", cfg,
		"--listen", grpcAddr, "--metrics-listen", httpAddr, "--replay-timeout", "2s",
		"--tls-cert", p.server.Cert, "--tls-key", p.server.Key, "--tls-client-ca", p.caFile)
	ctx := srv.ctx
	waitUntil(t, 30*time.Second, "kvrelay serve to become healthy", &srv.stderr, func() bool {
		resp, err := http.Get("http://" + httpAddr + "/healthz")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	})

	gw, err := tls.LoadX509KeyPair(p.gateway.Cert, p.gateway.Key)
	if err != nil {
		t.Fatal(err)
	}
	clientTLS := &tls.Config{RootCAs: p.ca.Pool(), ServerName: "localhost", Certificates: []tls.Certificate{gw}}
	servedCN := func() string {
		t.Helper()
		c := clientTLS.Clone()
		c.NextProtos = []string{"h2"}
		conn, err := tls.Dial("tcp", grpcAddr, c)
		if err != nil {
			t.Fatalf("handshake: %v", err)
		}
		defer conn.Close()
		return conn.ConnectionState().PeerCertificates[0].Subject.CommonName
	}
	cc, err := grpc.NewClient(grpcAddr, grpc.WithTransportCredentials(credentials.NewTLS(clientTLS)))
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()
	sctx, scancel := context.WithCancel(ctx)
	defer scancel()
	stream, err := kvpb.NewVllmEngineClient(cc).SubscribeKvEvents(sctx, &kvpb.SubscribeKvEventsRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := peer.Publish(0, enginepeer.Stored(nil, []int64{1, 2, 3, 4}, enginepeer.U64(1))); err != nil {
		t.Fatal(err)
	}
	if _, err := stream.Recv(); err != nil {
		t.Fatalf("first batch: %v", err)
	}
	if cn := servedCN(); cn != "kvrelay" {
		t.Fatalf("served %q before the rotation", cn)
	}

	// Half a rotation: the new certificate without its key.
	rotated := p.ca.Issue(t, testpki.Leaf{CommonName: "kvrelay-rotated", DNSNames: []string{"localhost"}, Server: true})
	testpki.WriteFile(t, p.server.Cert, rotated.CertPEM)
	hup := make(chan os.Signal, 1)
	signal.Notify(hup, syscall.SIGHUP) // our own process must not die of it
	defer signal.Stop(hup)
	waitUntil(t, 20*time.Second, "SIGHUP to report the failed reload", &srv.stderr, func() bool {
		if err := syscall.Kill(os.Getpid(), syscall.SIGHUP); err != nil {
			t.Fatal(err)
		}
		return strings.Contains(srv.stderr.String(), "certificate reload failed") && strings.Contains(srv.stderr.String(), p.server.Cert)
	})
	if cn := servedCN(); cn != "kvrelay" {
		t.Fatalf("served %q after a rotation that does not load, want the old certificate", cn)
	}
	// The key arrives: the next handshake gets the new certificate.
	testpki.WriteFile(t, p.server.Key, rotated.KeyPEM)
	if cn := servedCN(); cn != "kvrelay-rotated" {
		t.Fatalf("served %q after the rotation completed", cn)
	}
	// The stream opened before the rotation still delivers.
	if _, err := peer.Publish(0, enginepeer.Stored(nil, []int64{5, 6, 7, 8}, enginepeer.U64(2))); err != nil {
		t.Fatal(err)
	}
	if _, err := stream.Recv(); err != nil {
		t.Fatalf("the stream opened before the rotation ended: %v", err)
	}
	scancel()
	srv.stop(t)
}

// waitUntil polls cond until it holds or d passes.
func waitUntil(t *testing.T, d time.Duration, what string, logs *logbuf.Buffer, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s; log:\n%s", what, logs.String())
		}
		time.Sleep(50 * time.Millisecond)
	}
}
