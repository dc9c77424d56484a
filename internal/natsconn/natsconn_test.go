package natsconn

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nkeys"
	"go.uber.org/goleak"

	"github.com/kvrelay/kvrelay/testkit/logbuf"
	"github.com/kvrelay/kvrelay/testkit/testnats"
	"github.com/kvrelay/kvrelay/testkit/testpki"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func writeFile(t *testing.T, dir, name, content string) string {
	t.Helper()
	p := filepath.Join(dir, name)
	testpki.WriteFile(t, p, []byte(content))
	return p
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(testnats.Timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// connect dials with cfg's options after a component's usual ones.
func connect(t *testing.T, url string, cfg *Config, log *logbuf.Buffer) *nats.Conn {
	t.Helper()
	opts, err := cfg.Options(slogTo(log))
	if err != nil {
		t.Fatalf("Options: %v", err)
	}
	base := []nats.Option{nats.RetryOnFailedConnect(true), nats.MaxReconnects(-1), nats.ReconnectWait(10 * time.Millisecond)}
	nc, err := nats.Connect(url, append(base, opts...)...)
	if err != nil {
		t.Fatalf("connect: %v", err)
	}
	t.Cleanup(nc.Close)
	return nc
}

func TestAuthenticatedConnections(t *testing.T) {
	dir := t.TempDir()
	user, _ := nkeys.CreateUser()
	seed, _ := user.Seed()
	pub, _ := user.PublicKey()
	other, _ := nkeys.CreateUser()
	otherSeed, _ := other.Seed()

	ca := testpki.NewCA(t, "nats-ca")
	wrongCA := testpki.NewCA(t, "someone-else")
	srvCert := ca.Issue(t, testpki.Leaf{CommonName: "nats", DNSNames: []string{"localhost"}, Server: true})
	client := ca.Issue(t, testpki.Leaf{CommonName: "relay-a"}).WriteFiles(t, dir, "client")
	strangerClient := wrongCA.Issue(t, testpki.Leaf{CommonName: "stranger"}).WriteFiles(t, dir, "stranger")
	caFile := ca.WriteCA(t, dir, "ca")
	wrongCAFile := wrongCA.WriteCA(t, dir, "wrong-ca")

	passwordSrv := testnats.Start(t, testnats.Config{NoJetStream: true, Configure: func(o *server.Options) {
		o.Users = []*server.User{{Username: "relay-a", Password: "right horse battery"}}
	}})
	tokenSrv := testnats.Start(t, testnats.Config{NoJetStream: true, Configure: func(o *server.Options) {
		o.Authorization = "t0ken-value"
	}})
	nkeySrv := testnats.Start(t, testnats.Config{NoJetStream: true, Configure: func(o *server.Options) {
		o.Nkeys = []*server.NkeyUser{{Nkey: pub}}
	}})
	mtlsSrv := testnats.Start(t, testnats.Config{NoJetStream: true, Configure: func(o *server.Options) {
		pool := x509.NewCertPool()
		pool.AddCert(ca.Cert)
		o.TLS, o.TLSVerify = true, true
		o.TLSConfig = &tls.Config{
			Certificates: []tls.Certificate{srvCert.TLS(t)}, ClientCAs: pool,
			ClientAuth: tls.RequireAndVerifyClientCert, MinVersion: tls.VersionTLS12,
		}
	}})

	env := func(kv ...string) func(string) string {
		return func(k string) string {
			for i := 0; i < len(kv); i += 2 {
				if kv[i] == k {
					return kv[i+1]
				}
			}
			return ""
		}
	}
	for _, tc := range []struct {
		name      string
		url       string
		cfg       Config
		wantConn  bool
		wantCause string // in the one ERROR line of a refused connection
	}{
		{"password from a file", passwordSrv.URL(), Config{User: "relay-a", PasswordFile: writeFile(t, dir, "pw", "right horse battery\n")}, true, ""},
		{"password from the environment", passwordSrv.URL(), Config{User: "relay-a", Getenv: env(EnvPassword, "right horse battery")}, true, ""},
		{"wrong password", passwordSrv.URL(), Config{User: "relay-a", PasswordFile: writeFile(t, dir, "pw-wrong", "wrong")}, false, "authorization violation"},
		{"no credentials", passwordSrv.URL(), Config{}, false, "authorization violation"},
		{"token from a file", tokenSrv.URL(), Config{TokenFile: writeFile(t, dir, "token", "t0ken-value")}, true, ""},
		{"token from the environment", tokenSrv.URL(), Config{Getenv: env(EnvToken, "t0ken-value")}, true, ""},
		{"wrong token", tokenSrv.URL(), Config{TokenFile: writeFile(t, dir, "token-wrong", "guess")}, false, "authorization violation"},
		{"nkey seed", nkeySrv.URL(), Config{NKeySeed: writeFile(t, dir, "seed", string(seed))}, true, ""},
		{"another nkey", nkeySrv.URL(), Config{NKeySeed: writeFile(t, dir, "other-seed", string(otherSeed))}, false, "authorization violation"},
		{"mTLS", "tls://localhost:" + port(mtlsSrv.URL()), Config{CA: caFile, Cert: client.Cert, Key: client.Key}, true, ""},
		{"mTLS without a client certificate", "tls://localhost:" + port(mtlsSrv.URL()), Config{CA: caFile}, false, "TLS handshake refused"},
		{"client certificate of another CA", "tls://localhost:" + port(mtlsSrv.URL()), Config{CA: caFile, Cert: strangerClient.Cert, Key: strangerClient.Key}, false, "TLS handshake refused"},
		{"server not signed by the CA given", "tls://localhost:" + port(mtlsSrv.URL()), Config{CA: wrongCAFile, Cert: client.Cert, Key: client.Key}, false, "not signed by a CA in --nats-tls-ca"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var log logbuf.Buffer
			nc := connect(t, tc.url, &tc.cfg, &log)
			if tc.wantConn {
				waitFor(t, "connected", nc.IsConnected)
				if s := log.String(); strings.Contains(s, "ERROR") {
					t.Fatalf("error logged on a good connection: %s", s)
				}
				return
			}
			// Many attempts (10 ms apart), one line.
			waitFor(t, "the refusal logged", func() bool { return strings.Contains(log.String(), tc.wantCause) })
			attempts := nc.Stats().Reconnects
			waitFor(t, "more attempts", func() bool { return nc.Stats().Reconnects >= attempts+5 })
			if nc.IsConnected() {
				t.Fatal("connected without the right credential")
			}
			if n := strings.Count(log.String(), "connection refused; retrying"); n != 1 {
				t.Fatalf("%d error lines for one cause, want 1:\n%s", n, log.String())
			}
		})
	}
}

func TestRotatedPasswordIsUsedAtTheNextAttempt(t *testing.T) {
	dir := t.TempDir()
	srv := testnats.Start(t, testnats.Config{NoJetStream: true, Configure: func(o *server.Options) {
		o.Users = []*server.User{{Username: "gw", Password: "new"}}
	}})
	pw := writeFile(t, dir, "pw", "old")
	var log logbuf.Buffer
	nc := connect(t, srv.URL(), &Config{User: "gw", PasswordFile: pw}, &log)
	waitFor(t, "the refusal logged", func() bool { return strings.Contains(log.String(), "authorization violation") })
	writeFile(t, dir, "pw", "new")
	waitFor(t, "connected with the rotated password", nc.IsConnected)
}

func TestCheck(t *testing.T) {
	for _, tc := range []struct {
		name string
		cfg  Config
		want string
	}{
		{"nothing", Config{}, ""},
		{"two alternatives", Config{Creds: "a", NKeySeed: "b"}, "alternatives"},
		{"password without user", Config{PasswordFile: "p"}, "needs --nats-user"},
		{"user without password", Config{User: "u"}, "--nats-user needs"},
		{"cert without key", Config{Cert: "c"}, "go together"},
		// A config file's block names its keys instead.
		{"keys: two alternatives", Config{Creds: "a", TokenFile: "b", Names: KeyNames("nats.")}, "nats.creds, nats.nkey_seed, nats.user and nats.token_file"},
		{"keys: password without user", Config{PasswordFile: "p", Names: KeyNames("nats.")}, "nats.password_file needs nats.user"},
		{"keys: cert without key", Config{Cert: "c", Names: KeyNames("nats.")}, "nats.tls.cert and nats.tls.key go together"},
	} {
		err := tc.cfg.Check()
		if (err == nil) != (tc.want == "") || err != nil && !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: Check() = %v, want %q", tc.name, err, tc.want)
		}
	}
}

func TestMissingFilesFailAtStart(t *testing.T) {
	missing := filepath.Join(t.TempDir(), "absent")
	for _, cfg := range []Config{
		{Creds: missing}, {NKeySeed: missing}, {User: "u", PasswordFile: missing}, {TokenFile: missing},
		{CA: missing}, {Cert: missing, Key: missing},
	} {
		if _, err := cfg.Options(nil); err == nil {
			t.Errorf("%+v: no error for a missing file", cfg)
		} else if !strings.Contains(err.Error(), "--nats-") {
			t.Errorf("%+v: error %q names no flag", cfg, err)
		}
		cfg.Names = KeyNames("nats.")
		if _, err := cfg.Options(nil); err == nil || !strings.Contains(err.Error(), "nats.") || strings.Contains(err.Error(), "--nats-") {
			t.Errorf("%+v: error %v does not name the key alone", cfg, err)
		}
	}
	if _, err := os.Stat(missing); err == nil {
		t.Fatal("the file exists")
	}
}

func port(url string) string { return url[strings.LastIndex(url, ":")+1:] }

func slogTo(w *logbuf.Buffer) *slog.Logger { return slog.New(slog.NewTextHandler(w, nil)) }

// TestSecretGivenForItsFileIsNotEchoed: an nkey seed given where its
// file's path goes (--nats-nkey-seed SU…, nats.nkey_seed) is refused
// without printing it: the error says what went wrong and keeps the seed
// out of the log it reaches.
func TestSecretGivenForItsFileIsNotEchoed(t *testing.T) {
	user, err := nkeys.CreateUser()
	if err != nil {
		t.Fatal(err)
	}
	seed, err := user.Seed()
	if err != nil {
		t.Fatal(err)
	}
	for _, names := range []Names{{}, KeyNames("nats.")} {
		cfg := Config{NKeySeed: string(seed), Names: names}
		_, err := cfg.Options(nil)
		if err == nil {
			t.Fatal("a seed accepted as its file's path")
		}
		if strings.Contains(err.Error(), string(seed)) || strings.Contains(err.Error(), string(seed[:20])) {
			t.Errorf("the error shows the seed: %v", err)
		}
		if !strings.Contains(err.Error(), cfg.names().NKeySeed) || !strings.Contains(err.Error(), "not a file") {
			t.Errorf("the error %q does not say the seed was given instead of its file", err)
		}
	}
}

// TestSecretGivenForAFileIsNotEchoed: a password or token given where
// its file's path goes (--nats-password-file hunter2) names no file that
// exists; the error says so without printing the value, which may be the
// secret. A missing file given with a directory is still named.
func TestSecretGivenForAFileIsNotEchoed(t *testing.T) {
	const secret = "hunter2-s3cret"
	for _, cfg := range []Config{
		{User: "u", PasswordFile: secret}, {TokenFile: secret}, {Creds: secret},
	} {
		for _, names := range []Names{{}, KeyNames("nats.")} {
			cfg.Names = names
			_, err := cfg.Options(nil)
			if err == nil {
				t.Fatalf("%+v accepted", cfg)
			}
			if strings.Contains(err.Error(), secret) {
				t.Errorf("the error shows the value given: %v", err)
			}
			if !errors.Is(err, fs.ErrNotExist) {
				t.Errorf("the error %v does not wrap fs.ErrNotExist", err)
			}
		}
	}
	missing := filepath.Join(t.TempDir(), "password")
	if _, err := (&Config{User: "u", PasswordFile: missing}).Options(nil); err == nil || !strings.Contains(err.Error(), missing) {
		t.Errorf("a missing file with a directory: %v, want it named", err)
	}
}
