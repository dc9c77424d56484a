package main

import (
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"
	"golang.org/x/crypto/bcrypt"

	"github.com/kvrelay/kvrelay/testkit/apiclient"
	"github.com/kvrelay/kvrelay/testkit/kvstream"
	"github.com/kvrelay/kvrelay/testkit/logbuf"
	"github.com/kvrelay/kvrelay/testkit/testnats"
)

// startGatewayCmd runs `kvrelay gateway args…` in the test and returns its
// HTTP address; the command stops, cleanly, when the test ends.
func startGatewayCmd(t *testing.T, args ...string) (addr string, stderr *logbuf.Buffer) {
	t.Helper()
	b := runInBackground(t, append([]string{"gateway", "--listen", "127.0.0.1:0"}, args...)...)
	t.Cleanup(func() { b.stop(t) })
	return listeningAddr(t, &b.stderr), &b.stderr
}

// listeningAddr waits for the gateway's "listening" line.
func listeningAddr(t *testing.T, stderr *logbuf.Buffer) string {
	t.Helper()
	addrRE := regexp.MustCompile(`gateway listening\"? addr=(\S+)`)
	deadline := time.Now().Add(10 * time.Second)
	for {
		if m := addrRE.FindStringSubmatch(stderr.String()); m != nil {
			return m[1]
		}
		if time.Now().After(deadline) {
			t.Fatalf("no listening line in %q", stderr.String())
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func call(t *testing.T, method, url, body, user, pass string) (int, string) {
	t.Helper()
	req, err := http.NewRequest(method, url, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	if user != "" {
		req.SetBasicAuth(user, pass)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// TestGatewayMembershipFileAndAdmin: workers come from a file and the admin
// API (behind basic auth) while the gateway runs.
func TestGatewayMembershipFileAndAdmin(t *testing.T) {
	verifyNoLeaks(t)
	e1, e2, e3 := kvstream.Start(t), kvstream.Start(t), kvstream.Start(t)
	dir := t.TempDir()
	file := filepath.Join(dir, "workers")
	if err := os.WriteFile(file, []byte("# fleet\ngrpc://"+e1.Addr+",model=m\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	hash, err := bcrypt.GenerateFromPassword([]byte("s3cret"), bcrypt.MinCost)
	if err != nil {
		t.Fatal(err)
	}
	webConfig := filepath.Join(dir, "web.yml")
	if err := os.WriteFile(webConfig, []byte("basic_auth_users:\n  ops: "+string(hash)+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	addr, _ := startGatewayCmd(t, "--worker-file", file, "--worker-file-interval", "20ms", "--web.config.file", webConfig)
	base := "http://" + addr
	workers := func() string { _, b := call(t, "GET", base+"/v1/workers", "", "ops", "s3cret"); return b }
	if !strings.Contains(workers(), e1.Addr) {
		t.Fatalf("the file's worker is missing: %s", workers())
	}
	// The file grows: e2 joins.
	if err := os.WriteFile(file+".new", []byte("grpc://"+e1.Addr+",model=m\ngrpc://"+e2.Addr+",model=m\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(file+".new", file); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for !strings.Contains(workers(), e2.Addr) {
		if time.Now().After(deadline) {
			t.Fatalf("e2 never joined: %s", workers())
		}
		time.Sleep(10 * time.Millisecond)
	}
	// The admin API: refused without the password, served with it.
	if code, body := call(t, "POST", base+"/v1/workers", `{"worker": "grpc://`+e3.Addr+`,model=m"}`, "", ""); code != http.StatusUnauthorized {
		t.Fatalf("unauthenticated admin call: %d %s", code, body)
	}
	if code, body := call(t, "POST", base+"/v1/workers", `{"worker": "grpc://`+e3.Addr+`,model=m"}`, "ops", "s3cret"); code != http.StatusCreated {
		t.Fatalf("admin add: %d %s", code, body)
	}
	if code, body := call(t, "POST", base+"/v1/workers", `{"worker": "`+e3.Addr+`"}`, "ops", "s3cret"); code != http.StatusBadRequest || !strings.Contains(body, "want grpc://HOST:PORT") {
		t.Fatalf("malformed admin add: %d %s", code, body)
	}
	if code, body := call(t, "POST", base+"/v1/workers/drain", `{"worker": "grpc://`+e1.Addr+`"}`, "ops", "s3cret"); code != http.StatusAccepted {
		t.Fatalf("admin drain: %d %s", code, body)
	}
	// e1 drains (the file still lists it: it stays, drained); routes go
	// to e2 and e3 only.
	for i := range 20 {
		code, body := call(t, "POST", base+"/v1/route", `{"model":"m","token_ids":[`+strings.Repeat("1,", i)+`7],"track":true}`, "ops", "s3cret")
		if code != http.StatusOK || strings.Contains(body, e1.Addr) {
			t.Fatalf("route %d after the drain: %d %s", i, code, body)
		}
	}
	_, metrics := call(t, "GET", base+"/metrics", "", "ops", "s3cret")
	for _, want := range []string{
		`kvrelay_gateway_membership_changes_total{op="add",source="file"} 2`,
		`kvrelay_gateway_membership_changes_total{op="add",source="admin"} 1`,
		`kvrelay_gateway_membership_changes_total{op="drain",source="admin"} 1`,
	} {
		if !strings.Contains(metrics, want) {
			t.Errorf("metrics lack %s", want)
		}
	}
}

// TestGatewayAdminRefusedUnprotected: without a web config that
// authenticates, the admin API answers 403 saying why, unless
// --admin-api-unprotected.
func TestGatewayAdminRefusedUnprotected(t *testing.T) {
	verifyNoLeaks(t)
	e1 := kvstream.Start(t)
	addr, _ := startGatewayCmd(t, "--worker", "grpc://"+e1.Addr)
	code, body := call(t, "POST", "http://"+addr+"/v1/workers", `{"worker": "grpc://127.0.0.1:9"}`, "", "")
	if code != http.StatusForbidden || !strings.Contains(body, "--web.config.file") {
		t.Fatalf("unprotected admin call: %d %s", code, body)
	}
	addr, stderr := startGatewayCmd(t, "--worker", "grpc://"+e1.Addr, "--admin-api-unprotected")
	if code, body := call(t, "POST", "http://"+addr+"/v1/workers", `{"worker": "grpc://127.0.0.1:9"}`, "", ""); code != http.StatusCreated {
		t.Fatalf("--admin-api-unprotected: %d %s", code, body)
	}
	if !strings.Contains(stderr.String(), "without authentication") {
		t.Fatal("no warning for the unprotected admin API")
	}
}

// TestServeAnnouncesAMemberToTheGateway: `kvrelay serve --nats
// --nats-member` makes its engine a worker of `kvrelay gateway --nats
// --workers-from-nats`, which subscribes to the relay and indexes the
// engine's blocks; when the relay stops, the worker leaves.
func TestServeAnnouncesAMemberToTheGateway(t *testing.T) {
	opt := goleak.IgnoreCurrent()
	t.Cleanup(func() {
		http.DefaultClient.CloseIdleConnections()
		goleak.VerifyNone(t, opt, goleak.IgnoreAnyFunction("github.com/go-zeromq/zmq4.(*pubMWriter).run"))
	})
	ns := testnats.Start(t, testnats.Config{MaxPayload: 8 << 20})
	eng, cfg := startSimVLLM(t)
	listen := freeAddr(t)
	member := "grpc://" + listen + ",model=m,service=vllm"
	srv := runInBackground(t, "serve", "--engine", "vllm", "--kv-events-config", cfg, "--listen", listen,
		"--metrics-listen", "", "--nats", ns.URL(), "--nats-member", member, "--nats-alive-every", "50ms")
	addr, gwErr := startGatewayCmd(t, "--nats", ns.URL(), "--workers-from-nats")
	workers := func() string { return apiclient.Get(t, "http://"+addr+"/v1/workers") }
	deadline := time.Now().Add(30 * time.Second)
	for {
		if _, err := eng.RunWorkload(5); err != nil {
			t.Fatal(err)
		}
		var blocks int
		w := workers()
		fmt.Sscan(indexBlocks(w), &blocks)
		if strings.Contains(w, `"id":"grpc://`+listen+`"`) && strings.Contains(w, `"model":"m"`) && blocks > 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the announced worker never joined and indexed; serve:\n%s\ngateway:\n%s", srv.stderr.String(), gwErr.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
	srv.stop(t)
	for strings.Contains(workers(), listen) {
		if time.Now().After(deadline.Add(30 * time.Second)) {
			t.Fatalf("the stopped relay's worker never left: %s", workers())
		}
		time.Sleep(20 * time.Millisecond)
	}
	if !strings.Contains(gwErr.String(), "stopped announcing") {
		t.Errorf("no log of the member leaving:\n%s", gwErr.String())
	}
}
