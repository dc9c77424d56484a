package webserve

import (
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kvrelay/kvrelay/testkit/logbuf"
	"github.com/kvrelay/kvrelay/testkit/testpki"
)

// TestServeDefaultsHoldBadClients: a server with neither a
// ReadHeaderTimeout nor an ErrorLog gets DefaultReadHeaderTimeout and a
// throttled error log: 200 clients that speak plain text to its TLS port
// yield a few lines, not one each.
func TestServeDefaultsHoldBadClients(t *testing.T) {
	dir := t.TempDir()
	ca := testpki.NewCA(t, "test")
	f := ca.Issue(t, testpki.Leaf{CommonName: "localhost", Server: true}).WriteFiles(t, dir, "server")
	cfg := filepath.Join(dir, "web.yml")
	if err := os.WriteFile(cfg, []byte("tls_server_config:\n  cert_file: "+f.Cert+"\n  key_file: "+f.Key+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var logs logbuf.Buffer
	srv := &http.Server{Handler: http.NotFoundHandler()}
	done := make(chan error, 1)
	go func() { done <- Serve(srv, lis, cfg, slog.New(slog.NewTextHandler(&logs, nil))) }()
	const bad = 200
	for range bad {
		c, err := net.Dial("tcp", lis.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		// Not a TLS hello: the server answers and closes.
		_, _ = c.Write([]byte("GET / HTTP/1.1\r\nHost: x\r\n\r\n"))
		_, _ = c.Read(make([]byte, 512))
		c.Close()
	}
	deadline := time.Now().Add(10 * time.Second)
	for !strings.Contains(logs.String(), "TLS handshake error") {
		if time.Now().After(deadline) {
			t.Fatalf("no handshake error logged: %q", logs.String())
		}
		time.Sleep(10 * time.Millisecond)
	}
	// Every handshake has failed once the last client read its answer;
	// the log got at most the throttle's burst of them.
	if err := srv.Close(); err != nil {
		t.Error(err)
	}
	if err := <-done; err != nil {
		t.Errorf("Serve: %v", err)
	}
	if srv.ReadHeaderTimeout != DefaultReadHeaderTimeout {
		t.Errorf("ReadHeaderTimeout %v, want %v", srv.ReadHeaderTimeout, DefaultReadHeaderTimeout)
	}
	if n := strings.Count(logs.String(), `msg="http: TLS handshake error"`); n > 5 {
		t.Errorf("%d lines for %d bad handshakes, want at most 5:\n%s", n, bad, logs.String())
	}
}

// TestServeKeepsTheCallersSettings: a server's own ReadHeaderTimeout and
// ErrorLog stay.
func TestServeKeepsTheCallersSettings(t *testing.T) {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	el := slog.NewLogLogger(slog.DiscardHandler, slog.LevelError)
	srv := &http.Server{Handler: http.NotFoundHandler(), ReadHeaderTimeout: 3 * time.Second, ErrorLog: el}
	done := make(chan error, 1)
	go func() { done <- Serve(srv, lis, "", slog.New(slog.DiscardHandler)) }()
	// A request served means Serve has set the server up.
	for deadline := time.Now().Add(10 * time.Second); ; {
		resp, err := http.Get("http://" + lis.Addr().String())
		if err == nil {
			resp.Body.Close()
			break
		}
		if time.Now().After(deadline) {
			t.Fatal(err)
		}
		time.Sleep(10 * time.Millisecond)
	}
	if err := srv.Close(); err != nil {
		t.Error(err)
	}
	if err := <-done; err != nil {
		t.Errorf("Serve: %v", err)
	}
	if srv.ReadHeaderTimeout != 3*time.Second || srv.ErrorLog != el {
		t.Errorf("the caller's settings replaced: %v, %p", srv.ReadHeaderTimeout, srv.ErrorLog)
	}
}
