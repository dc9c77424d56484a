package tlsconfig

import (
	"context"
	"crypto/tls"
	"net"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"

	"github.com/kvrelay/kvrelay/testkit/testpki"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// pki is a CA, a server certificate for 127.0.0.1 and two client identities,
// written to a temporary directory.
type pki struct {
	dir            string
	ca             *testpki.CA
	caFile         string
	server         testpki.Files
	allowed, other testpki.Issued
}

func newPKI(t *testing.T) *pki {
	t.Helper()
	p := &pki{dir: t.TempDir(), ca: testpki.NewCA(t, "kvrelay test CA")}
	p.caFile = p.ca.WriteCA(t, p.dir, "ca")
	p.server = p.ca.Issue(t, testpki.Leaf{CommonName: "relay", DNSNames: []string{"localhost"}, Server: true}).WriteFiles(t, p.dir, "server")
	p.allowed = p.ca.Issue(t, testpki.Leaf{CommonName: "gateway-a", URIs: []string{"spiffe://prod.example/ns/llm/sa/gateway"}})
	p.other = p.ca.Issue(t, testpki.Leaf{CommonName: "intruder", URIs: []string{"spiffe://prod.example/ns/batch/sa/job"}})
	return p
}

// serveHealth runs a gRPC server with the health service behind l.
func serveHealth(t *testing.T, l *Listener) (string, *health.Server) {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer(l.GRPCServerOptions()...)
	hs := health.NewServer()
	healthpb.RegisterHealthServer(srv, hs)
	done := make(chan struct{})
	go func() { defer close(done); _ = srv.Serve(lis) }()
	t.Cleanup(func() { srv.Stop(); <-done })
	return lis.Addr().String(), hs
}

func clientCreds(t *testing.T, p *pki, cert *testpki.Issued) credentials.TransportCredentials {
	t.Helper()
	cfg := &tls.Config{RootCAs: p.ca.Pool(), ServerName: "localhost"}
	if cert != nil {
		// Sent whatever CAs the server asks for: Go's client would
		// otherwise send no certificate to a server that names another CA.
		c := cert.TLS(t)
		cfg.GetClientCertificate = func(*tls.CertificateRequestInfo) (*tls.Certificate, error) { return &c, nil }
	}
	return credentials.NewTLS(cfg)
}

func check(t *testing.T, addr string, creds credentials.TransportCredentials) error {
	t.Helper()
	cc, err := grpc.NewClient(addr, grpc.WithTransportCredentials(creds))
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	_, err = healthpb.NewHealthClient(cc).Check(ctx, &healthpb.HealthCheckRequest{})
	return err
}

func TestListenerRefusals(t *testing.T) {
	p := newPKI(t)
	tests := []struct {
		name       string
		cfg        Server
		creds      func() credentials.TransportCredentials
		wantCode   codes.Code
		wantReason string // counted in kvrelay_tls_refused_total
	}{
		{"tls, plaintext client", Server{Cert: p.server.Cert, Key: p.server.Key},
			func() credentials.TransportCredentials { return insecure.NewCredentials() }, codes.Unavailable, ReasonHandshake},
		{"tls, tls client", Server{Cert: p.server.Cert, Key: p.server.Key},
			func() credentials.TransportCredentials { return clientCreds(t, p, nil) }, codes.OK, ""},
		{"mtls, client without certificate", Server{Cert: p.server.Cert, Key: p.server.Key, ClientCA: p.caFile},
			func() credentials.TransportCredentials { return clientCreds(t, p, nil) }, codes.Unavailable, ReasonNoClientCert},
		{"mtls, certificate from another CA", Server{Cert: p.server.Cert, Key: p.server.Key, ClientCA: p.caFile},
			func() credentials.TransportCredentials {
				stranger := testpki.NewCA(t, "other CA").Issue(t, testpki.Leaf{CommonName: "gateway-a"})
				return clientCreds(t, p, &stranger)
			}, codes.Unavailable, ReasonHandshake},
		{"mtls, any certified client", Server{Cert: p.server.Cert, Key: p.server.Key, ClientCA: p.caFile},
			func() credentials.TransportCredentials { return clientCreds(t, p, &p.other) }, codes.OK, ""},
		{"allow-list, listed SPIFFE ID", Server{Cert: p.server.Cert, Key: p.server.Key, ClientCA: p.caFile, Allow: []string{"spiffe://prod.example/ns/llm/sa/gateway"}},
			func() credentials.TransportCredentials { return clientCreds(t, p, &p.allowed) }, codes.OK, ""},
		{"allow-list, client outside it", Server{Cert: p.server.Cert, Key: p.server.Key, ClientCA: p.caFile, Allow: []string{"spiffe://prod.example/ns/llm/*", "cn:gateway-b"}},
			func() credentials.TransportCredentials { return clientCreds(t, p, &p.other) }, codes.PermissionDenied, ReasonIdentityNotAllowed},
		{"allow-list by common name", Server{Cert: p.server.Cert, Key: p.server.Key, ClientCA: p.caFile, Allow: []string{"cn:intruder"}},
			func() credentials.TransportCredentials { return clientCreds(t, p, &p.other) }, codes.OK, ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			reg := prometheus.NewRegistry()
			m, err := NewMetrics(reg)
			if err != nil {
				t.Fatal(err)
			}
			l, err := NewListener(tt.cfg, "test", m, nil)
			if err != nil {
				t.Fatal(err)
			}
			addr, _ := serveHealth(t, l)
			err = check(t, addr, tt.creds())
			if got := status.Code(err); got != tt.wantCode {
				t.Fatalf("status %v (%v), want %v", got, err, tt.wantCode)
			}
			if tt.wantReason == "" {
				return
			}
			// The server counts a failed handshake after the client gave up
			// on it: wait for the count.
			deadline := time.Now().Add(20 * time.Second)
			for testutil.ToFloat64(m.refused.WithLabelValues("test", tt.wantReason)) != 1 {
				if time.Now().After(deadline) {
					t.Fatalf("kvrelay_tls_refused_total{reason=%q} never reached 1", tt.wantReason)
				}
				time.Sleep(10 * time.Millisecond)
			}
		})
	}
}

// servedLeafCN handshakes with addr and returns the server certificate's CN.
func servedLeafCN(t *testing.T, p *pki, addr string) string {
	t.Helper()
	c := p.allowed.TLS(t)
	conn, err := tls.Dial("tcp", addr, &tls.Config{RootCAs: p.ca.Pool(), ServerName: "localhost", NextProtos: []string{"h2"}, Certificates: []tls.Certificate{c}})
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	return conn.ConnectionState().PeerCertificates[0].Subject.CommonName
}

func TestRotationDuringOpenStream(t *testing.T) {
	p := newPKI(t)
	l, err := NewListener(Server{Cert: p.server.Cert, Key: p.server.Key, ClientCA: p.caFile}, "test", nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	addr, hs := serveHealth(t, l)
	cc, err := grpc.NewClient(addr, grpc.WithTransportCredentials(clientCreds(t, p, &p.allowed)))
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	hs.SetServingStatus("svc", healthpb.HealthCheckResponse_SERVING)
	watch, err := healthpb.NewHealthClient(cc).Watch(ctx, &healthpb.HealthCheckRequest{Service: "svc"})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := watch.Recv(); err != nil {
		t.Fatal(err)
	}
	if cn := servedLeafCN(t, p, addr); cn != "relay" {
		t.Fatalf("served %q before the rotation", cn)
	}

	// Rotate: a new certificate, noticed by the next handshake's stat.
	p.ca.Issue(t, testpki.Leaf{CommonName: "relay-rotated", DNSNames: []string{"localhost"}, Server: true}).WriteFiles(t, p.dir, "server")
	if cn := servedLeafCN(t, p, addr); cn != "relay-rotated" {
		t.Fatalf("the next handshake served %q, want the rotated certificate", cn)
	}
	// The stream opened before the rotation is still up.
	hs.SetServingStatus("svc", healthpb.HealthCheckResponse_NOT_SERVING)
	got, err := watch.Recv()
	if err != nil {
		t.Fatalf("the open stream ended at the rotation: %v", err)
	}
	if got.Status != healthpb.HealthCheckResponse_NOT_SERVING {
		t.Fatalf("stream says %v", got.Status)
	}
}

func TestBadRotationKeepsTheOldCertificate(t *testing.T) {
	p := newPKI(t)
	reg := prometheus.NewRegistry()
	m, _ := NewMetrics(reg)
	l, err := NewListener(Server{Cert: p.server.Cert, Key: p.server.Key}, "test", m, nil)
	if err != nil {
		t.Fatal(err)
	}
	addr, _ := serveHealth(t, l)
	// A certificate whose key does not match: the rotation went wrong.
	wrong := p.ca.Issue(t, testpki.Leaf{CommonName: "relay-wrong", DNSNames: []string{"localhost"}, Server: true})
	testpki.WriteFile(t, p.server.Cert, wrong.CertPEM)

	err = l.Reload()
	if err == nil || !strings.Contains(err.Error(), p.server.Cert) {
		t.Fatalf("Reload error %v does not name %s", err, p.server.Cert)
	}
	if cn := servedLeafCN(t, p, addr); cn != "relay" {
		t.Fatalf("served %q after a failed rotation, want the old certificate", cn)
	}
	if got := testutil.ToFloat64(m.reloadFailures.WithLabelValues("test")); got < 1 {
		t.Fatalf("reload failures counted %v", got)
	}
	// Completing the rotation (the key arrives) puts the new pair in service.
	testpki.WriteFile(t, p.server.Key, wrong.KeyPEM)
	if cn := servedLeafCN(t, p, addr); cn != "relay-wrong" {
		t.Fatalf("served %q after the rotation completed", cn)
	}
	// A missing file is named too.
	if err := os.Remove(p.server.Key); err != nil {
		t.Fatal(err)
	}
	if err := l.Reload(); err == nil || !strings.Contains(err.Error(), p.server.Key) {
		t.Fatalf("Reload error %v does not name %s", err, p.server.Key)
	}
}

// A client's CA bundle rotates without a restart: a server signed by a new
// CA is refused until the bundle file names that CA, then accepted by the
// next connection of the same Dialer.
func TestDialerCABundleRotation(t *testing.T) {
	p := newPKI(t)
	newCA := testpki.NewCA(t, "next CA")
	dir := t.TempDir()
	server := newCA.Issue(t, testpki.Leaf{CommonName: "relay", DNSNames: []string{"localhost"}, Server: true}).WriteFiles(t, dir, "server")
	l, err := NewListener(Server{Cert: server.Cert, Key: server.Key}, "test", nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	addr, _ := serveHealth(t, l)
	bundle := p.caFile // the old CA only
	d, err := NewDialer(Client{CA: bundle, ServerName: "localhost"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	creds := d.Credentials() // one for the whole test, as a long-lived gateway holds it
	if err := check(t, addr, creds); status.Code(err) != codes.Unavailable {
		t.Fatalf("a server from an untrusted CA: %v, want UNAVAILABLE", err)
	}
	testpki.WriteFile(t, bundle, append(append([]byte{}, p.ca.CertPEM...), newCA.CertPEM...))
	if err := check(t, addr, creds); err != nil {
		t.Fatalf("after the bundle gained the new CA: %v", err)
	}
	// A bundle that does not load keeps the previous one (and Reload says
	// which file).
	testpki.WriteFile(t, bundle, []byte("garbage"))
	if err := d.Reload(); err == nil || !strings.Contains(err.Error(), bundle) {
		t.Fatalf("Reload error %v does not name %s", err, bundle)
	}
	if err := check(t, addr, creds); err != nil {
		t.Fatalf("after a bad bundle: %v, want the previous bundle in service", err)
	}
}

func TestServerCheck(t *testing.T) {
	tests := []struct {
		name    string
		cfg     Server
		wantErr string
	}{
		{"plaintext", Server{}, ""},
		{"tls", Server{Cert: "c", Key: "k"}, ""},
		{"cert without key", Server{Cert: "c"}, "key"},
		{"client CA without TLS", Server{ClientCA: "ca"}, "client CA needs"},
		{"allow without client CA", Server{Cert: "c", Key: "k", Allow: []string{"cn:x"}}, "needs a client CA"},
		{"allow without TLS", Server{Allow: []string{"cn:x"}}, "needs TLS"},
		{"bad allow entry", Server{Cert: "c", Key: "k", ClientCA: "ca", Allow: []string{"gateway"}}, "want spiffe"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := tt.cfg.Check()
			if tt.wantErr == "" && err != nil || tt.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tt.wantErr)) {
				t.Fatalf("Check() = %v, want %q", err, tt.wantErr)
			}
		})
	}
}

func TestAllowList(t *testing.T) {
	ca := testpki.NewCA(t, "ca")
	cert := ca.Issue(t, testpki.Leaf{CommonName: "gw", DNSNames: []string{"Gateway.Example.org"}, URIs: []string{"spiffe://td/ns/llm/sa/gw"}}).Cert
	tests := []struct {
		entries []string
		want    bool
		wantErr bool
	}{
		{[]string{"spiffe://td/ns/llm/sa/gw"}, true, false},
		{[]string{"spiffe://td/ns/llm/*"}, true, false},
		{[]string{"spiffe://td/ns/batch/*"}, false, false},
		{[]string{"spiffe://td/ns/llm/sa/gw2"}, false, false},
		{[]string{"spiffe://td/ns/llm/sa"}, false, false}, // no implied prefix
		{[]string{"uri:spiffe://td/ns/llm/sa/gw"}, true, false},
		{[]string{"dns:gateway.example.org"}, true, false},
		{[]string{"dns:example.org"}, false, false},
		{[]string{"cn:gw"}, true, false},
		{[]string{"cn:GW"}, false, false},
		{[]string{"cn:other", "dns:gateway.example.org"}, true, false},
		{[]string{"gw"}, false, true},
		{[]string{"cn:"}, false, true},
		{[]string{"spiffe://*"}, false, true},
		{[]string{"dns:*.example.org"}, false, true},
	}
	for _, tt := range tests {
		a, err := ParseAllowList(tt.entries)
		if (err != nil) != tt.wantErr {
			t.Errorf("ParseAllowList(%q) error %v, want error %v", tt.entries, err, tt.wantErr)
			continue
		}
		if err == nil && a.Permits(cert) != tt.want {
			t.Errorf("%q permits %s = %v, want %v", tt.entries, Identity(cert), !tt.want, tt.want)
		}
	}
}

func TestParseTarget(t *testing.T) {
	tests := []struct {
		in      string
		addr    string
		tls     bool
		wantErr bool
	}{
		{"127.0.0.1:50051", "127.0.0.1:50051", false, false},
		{"grpc://h:1", "h:1", false, false},
		{"grpcs://h:1", "h:1", true, false},
		{"grpcs://[::1]:1", "[::1]:1", true, false},
		{"grpcs://h:1/x", "", false, true},
		{"h", "", false, true},
		{"grpcs://h", "", false, true},
		{":1", "", false, true},
		{"0://", "", false, true},
		{"http://h:1", "", false, true},
		{"h:http", "", false, true},
		{"h:0", "", false, true},
		{"h:70000", "", false, true},
	}
	for _, tt := range tests {
		addr, useTLS, err := ParseTarget(tt.in)
		if (err != nil) != tt.wantErr || addr != tt.addr || useTLS != tt.tls {
			t.Errorf("ParseTarget(%q) = %q, %v, %v", tt.in, addr, useTLS, err)
		}
	}
}
