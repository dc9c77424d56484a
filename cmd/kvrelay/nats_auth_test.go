package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/goleak"

	"github.com/kvrelay/kvrelay/gateway/partitionsync"
	"github.com/kvrelay/kvrelay/internal/freeport"
	"github.com/kvrelay/kvrelay/sim"
	"github.com/kvrelay/kvrelay/testkit/apiclient"
	"github.com/kvrelay/kvrelay/testkit/logbuf"
	"github.com/kvrelay/kvrelay/testkit/testnats"
	"github.com/kvrelay/kvrelay/testkit/testpki"
)

// TestFleetOnConfinedNATS runs two relays and a gateway on a nats-server
// loaded with exactly deploy/nats/kvrelay.conf (TLS with client
// certificates, a password per role, per-user permissions), everything
// from flags, and shows that the fleet works, that relay A's credentials
// cannot publish relay B's events or a placement, that a gateway's cannot
// publish events, that a client without a certificate or without a
// password cannot connect, and that no password reaches a log.
func TestFleetOnConfinedNATS(t *testing.T) {
	opt := goleak.IgnoreCurrent()
	t.Cleanup(func() {
		http.DefaultClient.CloseIdleConnections()
		goleak.VerifyNone(t, opt, goleak.IgnoreAnyFunction("github.com/go-zeromq/zmq4.(*pubMWriter).run"))
	})
	dir := t.TempDir()
	ca := testpki.NewCA(t, "kvrelay-nats-ca")
	srvFiles := ca.Issue(t, testpki.Leaf{CommonName: "nats", DNSNames: []string{"localhost"}, Server: true}).WriteFiles(t, dir, "server")
	caFile := ca.WriteCA(t, dir, "ca")
	client := map[string]testpki.Files{}
	for _, role := range []string{"relay-a", "relay-b", "gateway"} {
		client[role] = ca.Issue(t, testpki.Leaf{CommonName: role}).WriteFiles(t, dir, role)
	}
	passwords := map[string]string{"relay-a": "pw-a-7f3e9c", "relay-b": "pw-b-21d0aa", "gateway": "pw-gw-c4b812"}
	t.Setenv("KVRELAY_NATS_TLS_CERT", srvFiles.Cert)
	t.Setenv("KVRELAY_NATS_TLS_KEY", srvFiles.Key)
	t.Setenv("KVRELAY_NATS_TLS_CA", caFile)
	t.Setenv("KVRELAY_NATS_RELAY_A_PASSWORD", passwords["relay-a"])
	t.Setenv("KVRELAY_NATS_RELAY_B_PASSWORD", passwords["relay-b"])
	t.Setenv("KVRELAY_NATS_GATEWAY_PASSWORD", passwords["gateway"])
	t.Setenv("KVRELAY_NATS_PASSWORD", "") // the password flags, not the environment
	pwFile := func(role string) string {
		p := filepath.Join(dir, role+".password")
		if err := os.WriteFile(p, []byte(passwords[role]+"\n"), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	// max_payload takes a snapshot chunk (NATS's default 1 MiB does not).
	ns := testnats.Start(t, testnats.Config{ConfigFile: "../../deploy/nats/kvrelay.conf", MaxPayload: 8 << 20})
	url := ns.URL()
	auth := func(role string) []string {
		return []string{"--nats", url, "--nats-user", role, "--nats-password-file", pwFile(role),
			"--nats-tls-ca", caFile, "--nats-tls-cert", client[role].Cert, "--nats-tls-key", client[role].Key}
	}

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	engines := map[string]*sim.Engine{}
	var relays []*background
	for _, name := range []string{"a", "b"} {
		live := freeport.ForTest(t, 2)
		cfg := fmt.Sprintf(`{"enable_kv_cache_events": true, "endpoint": "tcp://*:%d", "replay_endpoint": "tcp://*:%d"}`, live, live+1)
		eng, err := sim.Start(ctx, sim.Options{Engine: "vllm", BlockSize: 16, CapacityBlocks: 128, KVEventsConfig: cfg})
		if err != nil {
			t.Fatal(err)
		}
		defer eng.Close()
		engines[name] = eng
		args := append([]string{"serve", "--engine", "vllm", "--kv-events-config", cfg, "--listen", freeAddr(t),
			"--metrics-listen", "", "--nats-worker", "engine-" + name}, auth("relay-"+name)...)
		if name == "b" {
			// A member, taken by the gateway's --workers-from-nats once
			// the stream bears it out: the address the gateway already
			// knows engine b by (the sources share the worker).
			args = append(args, "--nats-member", "grpc://127.0.0.1:2")
		}
		relays = append(relays, runInBackground(t, args...))
	}
	gw := runInBackground(t, append([]string{"gateway", "--listen", "127.0.0.1:0",
		"--worker", "grpc://127.0.0.1:1", "--worker", "grpc://127.0.0.1:2", "--nats-events", "--workers-from-nats",
		"--nats-worker-name", "grpc://127.0.0.1:1=engine-a", "--nats-worker-name", "grpc://127.0.0.1:2=engine-b"}, auth("gateway")...)...)

	// The fleet works: the gateway indexes both engines through JetStream
	// alone (the workers' gRPC addresses are dead).
	addrRE := regexp.MustCompile(`gateway listening\"? addr=(\S+)`)
	var addr string
	deadline := time.Now().Add(60 * time.Second)
	for {
		if addr == "" {
			if m := addrRE.FindStringSubmatch(gw.stderr.String()); m != nil {
				addr = m[1]
			}
		}
		for _, eng := range engines {
			if _, err := eng.RunWorkload(5); err != nil {
				t.Fatal(err)
			}
		}
		if addr != "" {
			m := apiclient.Get(t, "http://"+addr+"/metrics")
			if strings.Contains(m, `kvrelay_gateway_events_source{source="nats",worker="grpc://127.0.0.1:1"} 1`) &&
				strings.Contains(m, `kvrelay_gateway_events_source{source="nats",worker="grpc://127.0.0.1:2"} 1`) &&
				indexBlocksAll(apiclient.Get(t, "http://"+addr+"/v1/workers")) == 2 {
				break
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("the gateway never indexed both engines over NATS; relay a:\n%s\nrelay b:\n%s\ngateway:\n%s",
				relays[0].stderr.String(), relays[1].stderr.String(), gw.stderr.String())
		}
		time.Sleep(20 * time.Millisecond)
	}

	// The gateway checks the relays' announcements and snapshot objects
	// against the stream (natsevents/alive.go, guard.go): the
	// configuration lets it read single messages of the stream.
	for deadline := time.Now().Add(60 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		m := apiclient.Get(t, "http://"+addr+"/metrics")
		if strings.Contains(m, `kvrelay_gateway_events_announcements_checked_total{sink="engine-a"}`) &&
			strings.Contains(m, `kvrelay_gateway_events_announcements_checked_total{sink="engine-b"}`) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the gateway never bore out an announcement of each relay against the stream; gateway:\n%s", gw.stderr.String())
		}
	}
	// And relay b's member (natsevents/members.go): its announcement is
	// checked against the stream too.
	for deadline := time.Now().Add(60 * time.Second); !strings.Contains(gw.stderr.String(), "borne out by its stream; the member joins"); time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("the gateway never took relay b's member; gateway:\n%s", gw.stderr.String())
		}
	}
	for _, line := range strings.Split(apiclient.Get(t, "http://"+addr+"/metrics"), "\n") {
		if strings.Contains(line, `reason="unverifiable"`) && !strings.HasSuffix(line, " 0") {
			t.Errorf("the gateway could not check some announcements against the stream: %s", line)
		}
	}

	// Hostile clients.
	dial := func(role string, withCert, withPassword bool) (*nats.Conn, *asyncErrs, error) {
		errs := &asyncErrs{}
		opts := []nats.Option{nats.RootCAs(caFile), nats.ErrorHandler(errs.add), nats.Timeout(5 * time.Second)}
		if withCert {
			opts = append(opts, nats.ClientCert(client[role].Cert, client[role].Key))
		}
		if withPassword {
			opts = append(opts, nats.UserInfo(role, passwords[role]))
		}
		nc, err := nats.Connect(url, opts...)
		if err == nil {
			t.Cleanup(nc.Close)
		}
		return nc, errs, err
	}
	if _, _, err := dial("relay-a", false, true); err == nil {
		t.Error("connected without a client certificate")
	}
	if _, _, err := dial("relay-a", true, false); !errors.Is(err, nats.ErrAuthorization) {
		t.Errorf("without a password: %v, want an authorization violation", err)
	}
	for _, tc := range []struct{ role, subject string }{
		{"relay-a", "kvrelay.events.engine-b.0"},
		{"relay-a", "kvrelay.events-alive.engine-b"},
		{"relay-a", "kvrelay.placements.default"},
		{"relay-a", "$JS.API.STREAM.DELETE.KVRELAY_EVENTS"},
		{"gateway", "kvrelay.events.engine-a.0"},
		{"gateway", "kvrelay.events-alive.engine-a"},
		{"gateway", "$JS.API.STREAM.PURGE.KVRELAY_EVENTS"},
		{"relay-a", "kvrelay.tier.lookup.4.0"},
		{"relay-a", "kvrelay.tier.blue.lookup.4.0"},
	} {
		nc, errs, err := dial(tc.role, true, true)
		if err != nil {
			t.Fatalf("%s with its own credentials: %v", tc.role, err)
		}
		if err := nc.Publish(tc.subject, []byte("forged")); err != nil {
			t.Fatal(err)
		}
		if err := nc.Flush(); err != nil {
			t.Fatal(err)
		}
		want := `Permissions Violation for Publish to "` + tc.subject + `"`
		deadline := time.Now().Add(20 * time.Second)
		for !errs.has(want) {
			if time.Now().After(deadline) {
				t.Fatalf("%s published %s unrefused", tc.role, tc.subject)
			}
			time.Sleep(5 * time.Millisecond)
		}
		nc.Close()
	}
	// A partitioned tier's lookup (--partitions): one gateway answers its
	// partition's subject in its queue group, another asks and is answered,
	// on the default --partition-subject-prefix and on another one below it
	// (a tier of another P started beside the old one, docs/partitioned-tier.md);
	// and its presence subject, which a replica holding back asks.
	for _, subject := range []string{
		partitionsync.LookupSubject(partitionsync.DefaultSubjectPrefix, 16, 3), partitionsync.LookupSubject("kvrelay.tier.blue", 16, 3),
		partitionsync.PresenceSubject(partitionsync.DefaultSubjectPrefix, 16, 3),
	} {
		answerer, errs, err := dial("gateway", true, true)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := answerer.QueueSubscribe(subject, partitionsync.QueueGroup(16, 3), func(m *nats.Msg) { _ = m.Respond([]byte("answer")) }); err != nil {
			t.Fatal(err)
		}
		if err := answerer.Flush(); err != nil {
			t.Fatal(err)
		}
		asker, askErrs, err := dial("gateway", true, true)
		if err != nil {
			t.Fatal(err)
		}
		reply, err := asker.Request(subject, []byte("query"), 10*time.Second)
		if err != nil || string(reply.Data) != "answer" {
			t.Errorf("a gateway's lookup to another partition on %s: %v (errors: answerer %v, asker %v)", subject, err, errs.errs, askErrs.errs)
		}
		answerer.Close()
		asker.Close()
	}
	// And through JetStream: relay A's forged batch for B is not stored.
	nc, _, err := dial("relay-a", true, true)
	if err != nil {
		t.Fatal(err)
	}
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	pctx, pcancel := context.WithTimeout(ctx, 5*time.Second)
	_, err = js.Publish(pctx, "kvrelay.events.engine-b.0", []byte("forged"))
	pcancel()
	if err == nil {
		t.Error("relay A's credentials stored an event on relay B's subject")
	}

	gw.stop(t)
	for _, r := range relays {
		r.stop(t)
	}
	// Confined, the fleet is refused nothing it does.
	for name, out := range map[string]string{"relay a": relays[0].stderr.String(), "relay b": relays[1].stderr.String(), "gateway": gw.stderr.String()} {
		if strings.Contains(out, "Permissions Violation") || strings.Contains(out, "level=ERROR") {
			t.Errorf("the %s was refused or failed:\n%s", name, out)
		}
	}
	for role, pw := range passwords {
		for name, out := range map[string]string{"relay a": relays[0].stderr.String(), "relay b": relays[1].stderr.String(), "gateway": gw.stderr.String()} {
			if strings.Contains(out, pw) {
				t.Errorf("%s's password in the %s's log", role, name)
			}
		}
	}
}

// indexBlocksAll counts the workers of /v1/workers with blocks indexed.
func indexBlocksAll(workersJSON string) int {
	n := 0
	for _, m := range indexBlocksRE.FindAllStringSubmatch(workersJSON, -1) {
		if m[1] != "0" {
			n++
		}
	}
	return n
}

type asyncErrs struct {
	mu   sync.Mutex
	errs []string
}

func (a *asyncErrs) add(_ *nats.Conn, _ *nats.Subscription, err error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.errs = append(a.errs, err.Error())
}

func (a *asyncErrs) has(s string) bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	for _, e := range a.errs {
		if strings.Contains(e, s) {
			return true
		}
	}
	return false
}

// TestNATSURLCredentialsNeverLogged: a password written in the --nats URL
// still works, but the relay and the gateway warn about it and never log
// it, whether NATS answers or not.
func TestNATSURLCredentialsNeverLogged(t *testing.T) {
	verifyNoLeaks(t)
	const secret = "hunter2-in-the-url"
	dead := "nats://gw:" + secret + "@127.0.0.1:" + fmt.Sprint(freeport.ForTest(t, 1))
	gw := runInBackground(t, "gateway", "--listen", "127.0.0.1:0", "--worker", "grpc://127.0.0.1:1",
		"--nats", dead, "--nats-events")
	deadline := time.Now().Add(20 * time.Second)
	for !strings.Contains(gw.stderr.String(), "NATS unreachable") {
		if time.Now().After(deadline) {
			t.Fatalf("no unreachable line:\n%s", gw.stderr.String())
		}
		time.Sleep(10 * time.Millisecond)
	}
	gw.stop(t)
	out := gw.stderr.String()
	if strings.Contains(out, secret) {
		t.Fatalf("the URL's password is in the log:\n%s", out)
	}
	if !strings.Contains(out, "visible in ps") || !strings.Contains(out, "REDACTED@127.0.0.1") {
		t.Fatalf("no warning about the URL's credential, or no redacted URL:\n%s", out)
	}
}

func TestNATSAuthFlagsRefused(t *testing.T) {
	pw := filepath.Join(t.TempDir(), "pw")
	if err := os.WriteFile(pw, []byte("x"), 0o600); err != nil {
		t.Fatal(err)
	}
	serve := []string{"serve", "--engine", "vllm", "--kv-events-config", `{"enable_kv_cache_events": true}`}
	for _, tc := range []struct {
		name string
		args []string
		want string
	}{
		{"serve credentials without --nats", append(serve, "--nats-user", "a", "--nats-password-file", pw), "need --nats"},
		{"gateway TLS without --nats", []string{"gateway", "--worker", "grpc://127.0.0.1:1", "--nats-tls-ca", pw}, "need --nats"},
		{"serve two credentials", append(serve, "--nats", "nats://127.0.0.1:1", "--nats-creds", pw, "--nats-token-file", pw), "alternatives"},
		{"gateway user without password", []string{"gateway", "--worker", "grpc://127.0.0.1:1", "--nats", "nats://127.0.0.1:1", "--nats-user", "gw"}, "--nats-user needs"},
		{"gateway certificate without key", []string{"gateway", "--worker", "grpc://127.0.0.1:1", "--nats", "nats://127.0.0.1:1", "--nats-tls-cert", pw}, "go together"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Setenv("KVRELAY_NATS_PASSWORD", "")
			t.Setenv("KVRELAY_NATS_TOKEN", "")
			var stderr logbuf.Buffer
			code := dispatch(context.Background(), tc.args, strings.NewReader(""), io.Discard, &stderr)
			if code == 0 || !strings.Contains(stderr.String(), tc.want) {
				t.Fatalf("exit %d, stderr %q; want a failure naming %q", code, stderr.String(), tc.want)
			}
		})
	}
}
