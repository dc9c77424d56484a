package main

import (
	"context"
	"encoding/json"
	"flag"
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

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nkeys"
	"go.uber.org/goleak"

	"github.com/kvrelay/kvrelay/internal/freeport"
	"github.com/kvrelay/kvrelay/natsevents"
	"github.com/kvrelay/kvrelay/relayd"
	"github.com/kvrelay/kvrelay/sim"
	"github.com/kvrelay/kvrelay/testkit/logbuf"
	"github.com/kvrelay/kvrelay/testkit/testnats"
)

// writeConfig writes a serve --config file: relays (JSON objects) and,
// unless nil, the "nats" block.
func writeConfig(t *testing.T, natsBlock any, relays ...map[string]any) string {
	t.Helper()
	f := map[string]any{"relays": relays}
	if natsBlock != nil {
		f["nats"] = natsBlock
	}
	b, err := json.Marshal(f)
	if err != nil {
		t.Fatal(err)
	}
	p := filepath.Join(t.TempDir(), "kvrelay.json")
	if err := os.WriteFile(p, b, 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

// relayEntry is one vLLM relay of a --config file, publishing at
// tcp://*:live (replay live+1), plus extra keys.
func relayEntry(name string, live int, listen string, extra ...any) map[string]any {
	r := map[string]any{
		"name": name, "engine": "vllm", "listen": listen,
		"kv_events_config": fmt.Sprintf(`{"enable_kv_cache_events": true, "endpoint": "tcp://*:%d", "replay_endpoint": "tcp://*:%d"}`, live, live+1),
	}
	for i := 0; i+1 < len(extra); i += 2 {
		r[extra[i].(string)] = extra[i+1]
	}
	return r
}

func serveConfig(t *testing.T, path string, flags ...string) (int, string) {
	t.Helper()
	var stderr logbuf.Buffer
	code := dispatch(context.Background(), append([]string{"serve", "--config", path, "--metrics-listen", ""}, flags...), strings.NewReader(""), io.Discard, &stderr)
	return code, stderr.String()
}

// TestServeConfigNATSKeys: the "nats" block and each relay's nats_worker
// and nats_member mean what the flags do; what is wrong with them is
// refused before anything connects, naming the key (or the flag that
// clashes with the file).
func TestServeConfigNATSKeys(t *testing.T) {
	t.Setenv("KVRELAY_NATS_PASSWORD", "")
	t.Setenv("KVRELAY_NATS_TOKEN", "")
	dir := t.TempDir()
	pw := filepath.Join(dir, "pw")
	if err := os.WriteFile(pw, []byte("x\n"), 0o600); err != nil {
		t.Fatal(err)
	}

	// Parsed: every key reaches the sink, and what is left out is the
	// flags' default.
	var natsFlags *serveNATSFlags
	parse := func(t *testing.T, path string, args ...string) (relayd.File, relayd.NATSSink, error) {
		t.Helper()
		fs := flag.NewFlagSet("serve", flag.ContinueOnError)
		natsFlags = addServeNATSFlags(fs)
		if err := fs.Parse(args); err != nil {
			t.Fatal(err)
		}
		var given []string
		fs.Visit(func(f *flag.Flag) { given = append(given, f.Name) })
		f, err := relayd.ReadFile(path)
		if err != nil {
			return f, relayd.NATSSink{}, err
		}
		sink, err := natsFlags.forConfig(f, given)
		return f, sink, err
	}
	full := writeConfig(t, map[string]any{"url": "nats://127.0.0.1:4222", "stream": "GROUP_A", "events_subject_prefix": "group-a.events",
		"alive_every": "250ms", "user": "relay", "password_file": pw, "tls": map[string]string{"ca": pw}},
		relayEntry("a", 5557, "127.0.0.1:50061", "nats_worker", "engine-a", "nats_member", "grpc://10.0.0.1:50061,model=m"),
		relayEntry("b", 5657, "127.0.0.1:50062"))
	f, sink, err := parse(t, full)
	if err != nil {
		t.Fatal(err)
	}
	if sink.URL != "nats://127.0.0.1:4222" || sink.Stream != "GROUP_A" || sink.SubjectPrefix != "group-a.events" || sink.AliveEvery != 250*time.Millisecond || sink.NATSOptions == nil {
		t.Errorf("sink %+v", sink)
	}
	if f.Relays[0].NATSWorker != "engine-a" || f.Relays[0].NATSMember != "grpc://10.0.0.1:50061,model=m" || f.Relays[1].NATSWorker != "" {
		t.Errorf("relays' keys: %+v", f.Relays)
	}
	if _, sink, err = parse(t, writeConfig(t, map[string]any{"url": "nats://127.0.0.1:4222"}, relayEntry("a", 5557, "127.0.0.1:50061"))); err != nil {
		t.Fatal(err)
	}
	if sink.Stream != natsevents.DefaultStream || sink.SubjectPrefix != natsevents.DefaultSubjectPrefix || sink.AliveEvery != natsevents.DefaultAliveEvery {
		t.Errorf("defaults: %+v", sink)
	}
	if _, sink, err = parse(t, writeConfig(t, map[string]any{"url": "nats://127.0.0.1:4222", "alive_every": "0s"}, relayEntry("a", 5557, "127.0.0.1:50061"))); err != nil || sink.AliveEvery != 0 {
		t.Errorf("alive_every 0s: %v, %v (want never)", sink.AliveEvery, err)
	}
	// Without a block, the --nats… flags serve every relay of the file.
	if _, sink, err = parse(t, writeConfig(t, nil, relayEntry("a", 5557, "127.0.0.1:50061", "nats_worker", "engine-a")),
		"--nats", "nats://127.0.0.1:4222", "--nats-stream", "FROM_FLAGS"); err != nil || sink.URL != "nats://127.0.0.1:4222" || sink.Stream != "FROM_FLAGS" {
		t.Errorf("flags with a file without a block: %+v, %v", sink, err)
	}
	// The example in deploy/ has a block that passes.
	if _, sink, err = parse(t, "../../deploy/kvrelay.json.example"); err != nil || sink.URL == "" {
		t.Errorf("the example's block: %+v, %v", sink, err)
	}

	// Refused, naming the key.
	url := map[string]any{"url": "nats://127.0.0.1:1"}
	with := func(kv ...any) map[string]any {
		b := map[string]any{"url": "nats://127.0.0.1:1"}
		for i := 0; i+1 < len(kv); i += 2 {
			b[kv[i].(string)] = kv[i+1]
		}
		return b
	}
	one := func(extra ...any) map[string]any { return relayEntry("a", 5557, "127.0.0.1:0", extra...) }
	for _, tc := range []struct {
		name   string
		block  any
		relays []map[string]any
		flags  []string
		want   string
	}{
		{"unknown key in the block", with("usr", "relay"), nil, nil, `unknown field "usr"`},
		{"unknown key in its tls", with("tls", map[string]string{"ca_file": pw}), nil, nil, `unknown field "ca_file"`},
		{"no url", map[string]any{"stream": "S"}, nil, nil, "nats.url is required"},
		{"alive_every not a duration", with("alive_every", "often"), nil, nil, `nats.alive_every "often": not a duration`},
		{"alive_every above a minute", with("alive_every", "2m"), nil, nil, `nats.alive_every "2m": want 0 (off) or 1ms to 1m`},
		{"two credentials", with("creds", pw, "token_file", pw), nil, nil, "nats.creds, nats.nkey_seed, nats.user and nats.token_file (or $KVRELAY_NATS_TOKEN) are alternatives"},
		{"user without password_file", with("user", "relay"), nil, nil, "nats.user needs nats.password_file"},
		{"password_file without user", with("password_file", pw), nil, nil, "nats.password_file needs nats.user"},
		{"tls cert without key", with("tls", map[string]string{"cert": pw}), nil, nil, "nats.tls.cert and nats.tls.key go together"},
		{"malformed member", url, []map[string]any{one("nats_member", "10.0.0.1:50061")}, nil, `relay "a": nats_member:`},
		{"member never announced", with("alive_every", "0s"), []map[string]any{one("nats_member", "grpc://10.0.0.1:50061")}, nil,
			`relay "a": nats_member: it is announced, which nats.alive_every 0 turns off`},
		{"nats_worker without a sink", nil, []map[string]any{one("nats_worker", "engine-a")}, nil, `relay "a": nats_worker and nats_member need a "nats" block`},
		{"a flag beside the block", url, nil, []string{"--nats-user", "relay"}, `--nats-user cannot be combined with the "nats" block`},
		{"--nats beside the block", url, nil, []string{"--nats", "nats://127.0.0.1:2"}, `--nats cannot be combined with the "nats" block`},
		{"--nats-worker with --config", nil, nil, []string{"--nats", "nats://127.0.0.1:1", "--nats-worker", "w"}, "--nats-worker cannot be combined with --config"},
		{"--nats-member with --config", url, nil, []string{"--nats-member", "grpc://h:1"}, "--nats-member cannot be combined with --config"},
		{"two relays under one worker name", url, []map[string]any{one("nats_worker", "w"), relayEntry("b", 5657, "127.0.0.1:0", "nats_worker", "w")}, nil,
			`relays "a" and "b" would both publish to NATS as worker "w"`},
		{"two relays on one port by default", url, []map[string]any{
			{"name": "a", "engine": "vllm", "listen": "127.0.0.1:0", "kv_events_config": `{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557"}`},
			{"name": "b", "engine": "sglang", "listen": "127.0.0.1:0", "kv_events_config": `{"publisher": "zmq", "endpoint": "tcp://*:5657"}`}}, nil,
			`give each its own nats_worker`},
		{"unreadable password file", with("user", "relay", "password_file", filepath.Join(dir, "missing")), nil, nil, "nats.password_file: open "},
	} {
		t.Run(tc.name, func(t *testing.T) {
			relays := tc.relays
			if relays == nil {
				relays = []map[string]any{one()}
			}
			code, stderr := serveConfig(t, writeConfig(t, tc.block, relays...), tc.flags...)
			if code == 0 || !strings.Contains(stderr, tc.want) {
				t.Fatalf("exit %d, stderr %q; want a failure naming %q", code, stderr, tc.want)
			}
		})
	}
}

// TestServeConfigRefusesALiteralPassword: a password or token written in
// the file (in its key or in the URL) is refused, saying where it goes
// instead, and the refusal does not repeat it.
func TestServeConfigRefusesALiteralPassword(t *testing.T) {
	const secret = "correct-horse-7731"
	for _, tc := range []struct {
		name  string
		block map[string]any
		want  string
	}{
		{"password", map[string]any{"url": "nats://127.0.0.1:1", "user": "relay", "password": secret}, "nats.password: a password is never written in the config; put it in a file named by nats.password_file"},
		{"empty password", map[string]any{"url": "nats://127.0.0.1:1", "user": "relay", "password": ""}, "nats.password:"},
		{"token", map[string]any{"url": "nats://127.0.0.1:1", "token": secret}, "nats.token: a token is never written in the config; put it in a file named by nats.token_file"},
		{"password in the url", map[string]any{"url": "nats://relay:" + secret + "@127.0.0.1:1"}, "nats.url: it carries a credential"},
		{"token in the url", map[string]any{"url": "nats://" + secret + "@127.0.0.1:1"}, "nats.url: it carries a credential"},
		{"password in a url without a scheme", map[string]any{"url": "relay:" + secret + "@127.0.0.1:1"}, "nats.url: it carries a credential"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			code, stderr := serveConfig(t, writeConfig(t, tc.block, relayEntry("a", 5557, "127.0.0.1:0")))
			if code != 2 || !strings.Contains(stderr, tc.want) {
				t.Fatalf("exit %d, stderr %q; want exit 2 saying %q", code, stderr, tc.want)
			}
			if strings.Contains(stderr, secret) {
				t.Fatalf("the refusal repeats the secret: %q", stderr)
			}
		})
	}
}

// TestServeConfigPublishesToAuthenticatedNATS: one serve --config with two
// relays publishes both engines' events, each under its nats_worker, to a
// JetStream server that wants a password (nats.user and
// nats.password_file), where a subscriber authenticated by nkey sees them;
// relay a announces its nats_member. With a wrong password the same file
// gets one ERROR line per relay, naming the cause in the file's keys,
// however often the sinks retry; no log has the password or a URL with
// one.
func TestServeConfigPublishesToAuthenticatedNATS(t *testing.T) {
	opt := goleak.IgnoreCurrent()
	t.Cleanup(func() {
		http.DefaultClient.CloseIdleConnections()
		// As in TestFleetOnConfinedNATS: the simulated engines' ZeroMQ
		// publishers leave their writer behind.
		goleak.VerifyNone(t, opt, goleak.IgnoreAnyFunction("github.com/go-zeromq/zmq4.(*pubMWriter).run"))
	})
	t.Setenv("KVRELAY_NATS_PASSWORD", "")
	t.Setenv("KVRELAY_NATS_TOKEN", "")
	const password, wrong = "relay-pw-5e1c0b", "not-the-pw-93aa"
	dir := t.TempDir()
	user, _ := nkeys.CreateUser()
	seed, _ := user.Seed()
	pub, _ := user.PublicKey()
	ns := testnats.Start(t, testnats.Config{MaxPayload: 8 << 20, Configure: func(o *server.Options) {
		o.Users = []*server.User{{Username: "relay", Password: password}}
		o.Nkeys = []*server.NkeyUser{{Nkey: pub}}
	}})
	write := func(name, content string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(content), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	rightFile, wrongFile := write("pw", password+"\n"), write("wrong-pw", wrong+"\n")

	// The subscriber, by nkey.
	nkeyOpt, err := nats.NkeyOptionFromSeed(write("seed", string(seed)))
	if err != nil {
		t.Fatal(err)
	}
	nc, err := nats.Connect(ns.URL(), nkeyOpt)
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	var mu sync.Mutex
	seen := map[string]int{}
	members := map[string]string{} // alive subject -> member announced
	sub, err := nc.Subscribe("kvrelay.>", func(m *nats.Msg) {
		mu.Lock()
		defer mu.Unlock()
		seen[m.Subject]++
		if strings.HasPrefix(m.Subject, "kvrelay.events-alive.") {
			members[m.Subject] = m.Header.Get(natsevents.MemberHeader)
		}
	})
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Unsubscribe()
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var engines []*sim.Engine
	var relays []map[string]any
	for _, name := range []string{"a", "b"} {
		live := freeport.ForTest(t, 2)
		eng, err := sim.Start(ctx, sim.Options{Engine: "vllm", BlockSize: 16, CapacityBlocks: 128,
			KVEventsConfig: fmt.Sprintf(`{"enable_kv_cache_events": true, "endpoint": "tcp://*:%d", "replay_endpoint": "tcp://*:%d"}`, live, live+1)})
		if err != nil {
			t.Fatal(err)
		}
		defer eng.Close()
		engines = append(engines, eng)
		extra := []any{"nats_worker", "engine-" + name}
		if name == "a" {
			extra = append(extra, "nats_member", "grpc://127.0.0.1:50061")
		}
		relays = append(relays, relayEntry(name, live, freeAddr(t), extra...))
	}
	block := func(pwFile string) map[string]any {
		return map[string]any{"url": ns.URL(), "alive_every": "100ms", "user": "relay", "password_file": pwFile}
	}

	srv := runInBackground(t, "serve", "--metrics-listen", "", "--config", writeConfig(t, block(rightFile), relays...))
	deadline := time.Now().Add(60 * time.Second)
	for {
		for _, eng := range engines {
			if _, err := eng.RunWorkload(3); err != nil {
				t.Fatal(err)
			}
		}
		mu.Lock()
		done := seen["kvrelay.events.engine-a.0"] > 0 && seen["kvrelay.events.engine-b.0"] > 0 && seen["kvrelay.events-alive.engine-b"] > 0 &&
			members["kvrelay.events-alive.engine-a"] == "grpc://127.0.0.1:50061"
		got := fmt.Sprint(seen, members)
		mu.Unlock()
		if done {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the subscriber never saw both relays' events and a's member; subjects and members %s; serve:\n%s", got, srv.stderr.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
	srv.stop(t)
	mu.Lock()
	if m := members["kvrelay.events-alive.engine-b"]; m != "" {
		t.Errorf("relay b announced member %q; only a has a nats_member", m)
	}
	mu.Unlock()
	logs := srv.stderr.String()
	if strings.Contains(logs, "level=ERROR") {
		t.Errorf("an ERROR with the right password:\n%s", logs)
	}

	// A wrong password: one ERROR line per relay, across several retries.
	connections := func() uint64 {
		v, err := ns.Server().Varz(nil)
		if err != nil {
			t.Fatal(err)
		}
		return v.TotalConnections
	}
	before := connections()
	bad := runInBackground(t, "serve", "--metrics-listen", "", "--config", writeConfig(t, block(wrongFile), relays...))
	errorLine := regexp.MustCompile(`level=ERROR msg="nats: connection refused; retrying".*relay=(\S+)`)
	const cause = `cause="credentials refused by the server (authorization violation): check nats.creds, nats.nkey_seed, nats.user/nats.password_file or nats.token_file"`
	perRelay := func() map[string]int {
		n := map[string]int{}
		for _, line := range strings.Split(bad.stderr.String(), "\n") {
			if m := errorLine.FindStringSubmatch(line); m != nil {
				n[m[1]]++
				if !strings.Contains(line, cause) {
					t.Errorf("the ERROR line does not name the cause in the file's keys:\n%s", line)
				}
			}
		}
		return n
	}
	deadline = time.Now().Add(60 * time.Second)
	for n := perRelay(); n["a"] == 0 || n["b"] == 0; n = perRelay() {
		if time.Now().After(deadline) {
			t.Fatalf("no ERROR line for each relay:\n%s", bad.stderr.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
	// Each sink retries every second: wait for three more refused
	// connections each, then count again.
	for connections() < before+8 {
		if time.Now().After(deadline) {
			t.Fatalf("the sinks stopped retrying:\n%s", bad.stderr.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
	bad.stop(t)
	if n := perRelay(); n["a"] != 1 || n["b"] != 1 || len(n) != 2 {
		t.Errorf("ERROR lines by relay %v, want one each:\n%s", n, bad.stderr.String())
	}
	logs += bad.stderr.String()
	for _, s := range []string{password, wrong} {
		if strings.Contains(logs, s) {
			t.Errorf("%q in the logs:\n%s", s, logs)
		}
	}
	if regexp.MustCompile(`nats://[^\s"/]*@`).MatchString(logs) {
		t.Errorf("a NATS URL with userinfo in the logs:\n%s", logs)
	}
}

// TestServeConfigRefusesAFlagTheFileAlsoGives: a process-wide setting
// given both in the --config file and as a flag is refused, naming both,
// instead of the flag losing silently to the file.
func TestServeConfigRefusesAFlagTheFileAlsoGives(t *testing.T) {
	for _, tc := range []struct{ key, value, flag string }{
		{"metrics_listen", "127.0.0.1:0", "--metrics-listen"},
		{"log_level", "debug", "--log-level"},
		{"log_format", "json", "--log-format"},
		{"web_config_file", "web.yml", "--web.config.file"},
	} {
		t.Run(tc.key, func(t *testing.T) {
			b, err := json.Marshal(map[string]any{tc.key: tc.value, "relays": []map[string]any{relayEntry("a", 5557, "127.0.0.1:0")}})
			if err != nil {
				t.Fatal(err)
			}
			path := filepath.Join(t.TempDir(), "kvrelay.json")
			if err := os.WriteFile(path, b, 0o600); err != nil {
				t.Fatal(err)
			}
			var stderr logbuf.Buffer
			// A serve that takes the flags runs until the context ends.
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			code := dispatch(ctx, []string{"serve", "--config", path, tc.flag, "x"}, strings.NewReader(""), io.Discard, &stderr)
			want := tc.flag + " cannot be combined with " + tc.key + " in --config"
			if code != 2 || !strings.Contains(stderr.String(), want) {
				t.Fatalf("exit %d, stderr %q; want exit 2 saying %q", code, stderr.String(), want)
			}
		})
	}
}
