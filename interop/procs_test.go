package interop

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/kvrelay/kvrelay/proto/kvpb"
	"github.com/kvrelay/kvrelay/testkit/pyenv"
)

// The machine is shared and has two cores: every wait is generous, and a
// wait that runs out fails with the logs that explain it.
const (
	startTimeout = 60 * time.Second
	waitTimeout  = 45 * time.Second
	pollEvery    = 50 * time.Millisecond
)

// ansi matches the colour escapes SMG's gateway writes even to a pipe.
var ansi = regexp.MustCompile(`\x1b\[[0-9;]*[A-Za-z]`)

// proc is a child process whose stdout and stderr are collected line by
// line, colour escapes stripped.
type proc struct {
	name string
	cmd  *exec.Cmd
	done chan struct{}

	mu    sync.Mutex
	lines []string
	exit  error
}

// startProc starts cmd in its own process group and kills the group at
// cleanup; a failed test logs the tail of its output.
func startProc(t testing.TB, name string, cmd *exec.Cmd) *proc {
	t.Helper()
	p := &proc{name: name, cmd: cmd, done: make(chan struct{})}
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	outR, outW := io.Pipe()
	cmd.Stdout, cmd.Stderr = outW, outW
	if err := cmd.Start(); err != nil {
		t.Fatalf("start %s (%s): %v", name, cmd.Path, err)
	}
	readerDone := make(chan struct{})
	go func() {
		defer close(readerDone)
		sc := bufio.NewScanner(outR)
		sc.Buffer(make([]byte, 64<<10), 8<<20)
		for sc.Scan() {
			line := ansi.ReplaceAllString(sc.Text(), "")
			p.mu.Lock()
			p.lines = append(p.lines, line)
			p.mu.Unlock()
		}
		_, _ = io.Copy(io.Discard, outR)
	}()
	go func() {
		err := cmd.Wait()
		_ = outW.Close()
		<-readerDone
		p.mu.Lock()
		p.exit = err
		p.mu.Unlock()
		close(p.done)
	}()
	t.Cleanup(func() {
		p.kill()
		if dir := os.Getenv("INTEROP_LOG_DIR"); dir != "" {
			// Full logs for a human, one file per process.
			file := filepath.Join(dir, strings.NewReplacer("/", "_", " ", "_").Replace(t.Name()+"-"+name)+".log")
			_ = os.WriteFile(file, []byte(strings.Join(p.snapshotLines(), "\n")+"\n"), 0o644)
		}
		if t.Failed() {
			t.Logf("--- last lines of %s ---\n%s", name, p.tail(60))
		}
	})
	return p
}

// kill ends the process group (the process and anything it spawned) and
// waits for the process to be reaped.
func (p *proc) kill() {
	select {
	case <-p.done:
		return
	default:
	}
	if p.cmd.Process != nil {
		_ = syscall.Kill(-p.cmd.Process.Pid, syscall.SIGKILL)
	}
	select {
	case <-p.done:
	case <-time.After(15 * time.Second):
	}
}

// exited reports whether the process has ended, with its exit error.
func (p *proc) exited() (bool, error) {
	select {
	case <-p.done:
		p.mu.Lock()
		defer p.mu.Unlock()
		return true, p.exit
	default:
		return false, nil
	}
}

func (p *proc) snapshotLines() []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]string(nil), p.lines...)
}

func (p *proc) tail(n int) string {
	lines := p.snapshotLines()
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

// matching returns the lines that match re, in order.
func (p *proc) matching(re *regexp.Regexp) []string {
	var out []string
	for _, l := range p.snapshotLines() {
		if re.MatchString(l) {
			out = append(out, l)
		}
	}
	return out
}

// waitLine waits for a line matching re and returns it.
func (p *proc) waitLine(t testing.TB, re *regexp.Regexp, timeout time.Duration) string {
	t.Helper()
	var found string
	waitFor(t, timeout, func() (bool, string) {
		if m := p.matching(re); len(m) > 0 {
			found = m[0]
			return true, ""
		}
		if done, err := p.exited(); done {
			t.Fatalf("%s exited (%v) before logging /%s/; its output:\n%s", p.name, err, re, p.tail(60))
		}
		return false, fmt.Sprintf("%s has not logged /%s/", p.name, re)
	}, p)
	return found
}

// readyPort waits for the JSON line {"ready": true, "port": N} that the
// testdata servers print, and returns N.
func (p *proc) readyPort(t testing.TB) int {
	t.Helper()
	line := p.waitLine(t, regexp.MustCompile(`"ready": ?true`), startTimeout)
	var ready struct {
		Port int `json:"port"`
	}
	if err := json.Unmarshal([]byte(line), &ready); err != nil || ready.Port == 0 {
		t.Fatalf("%s: bad ready line %q: %v", p.name, line, err)
	}
	return ready.Port
}

// waitFor polls cond until it holds. On timeout it fails the test with
// cond's last explanation and the tails of the given processes' logs.
func waitFor(t testing.TB, timeout time.Duration, cond func() (bool, string), logs ...*proc) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		ok, why := cond()
		if ok {
			return
		}
		if time.Now().After(deadline) {
			var sb strings.Builder
			fmt.Fprintf(&sb, "gave up after %v: %s", timeout, why)
			for _, p := range logs {
				fmt.Fprintf(&sb, "\n--- last lines of %s ---\n%s", p.name, p.tail(40))
			}
			t.Fatal(sb.String())
		}
		time.Sleep(pollEvery)
	}
}

// freePort returns a loopback TCP port nobody listens on right now.
func freePort(t testing.TB) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("free port: %v", err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

// startPyRelay runs testdata/smg/py_relay_server.py: SMG's Python relay as a
// gRPC server, following dp ranks from the given base endpoints; extra
// flags are appended (--load-file).
func startPyRelay(t testing.TB, engine, endpoint, replay string, dp int, extra ...string) (*proc, string) {
	t.Helper()
	args := append([]string{"--engine", engine, "--endpoint", endpoint, "--dp-size", strconv.Itoa(dp), "--port", "0"}, extra...)
	if replay != "" {
		args = append(args, "--replay-endpoint", replay)
	}
	p := startProc(t, "py_relay_server", pyenv.Command(t, pyenv.Script("smg", "py_relay_server.py"), args...))
	return p, fmt.Sprintf("127.0.0.1:%d", p.readyPort(t))
}

// kvrelayServe is one `kvrelay serve` process.
type kvrelayServe struct {
	*proc
	addr    string
	metrics string // http://host:port
}

// startKvrelay runs `kvrelay serve` on the given ports; extra flags are
// appended. It returns once the relay is connected to every rank
// (/healthz answers ok).
func startKvrelay(t testing.TB, name, engine, kvConfig string, dp, port int, extra ...string) *kvrelayServe {
	t.Helper()
	metricsPort := freePort(t)
	args := append([]string{"serve",
		"--engine", engine,
		"--kv-events-config", kvConfig,
		"--dp-size", strconv.Itoa(dp),
		"--listen", fmt.Sprintf("127.0.0.1:%d", port),
		"--metrics-listen", fmt.Sprintf("127.0.0.1:%d", metricsPort),
		"--log-level", "debug",
	}, extra...)
	p := startProc(t, name, exec.Command(kvrelayBin(t), args...))
	k := &kvrelayServe{proc: p, addr: fmt.Sprintf("127.0.0.1:%d", port), metrics: fmt.Sprintf("http://127.0.0.1:%d", metricsPort)}
	p.waitLine(t, regexp.MustCompile(`serving SubscribeKvEvents`), startTimeout)
	waitFor(t, startTimeout, func() (bool, string) {
		body, err := httpGet(k.metrics + "/healthz")
		if err != nil {
			return false, fmt.Sprintf("kvrelay /healthz: %v", err)
		}
		return strings.HasPrefix(body, "ok"), "kvrelay /healthz: " + strings.TrimSpace(body)
	}, p)
	return k
}

func httpGet(url string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return "", err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return "", err
	}
	if resp.StatusCode != http.StatusOK {
		return string(b), fmt.Errorf("%s: %s: %s", url, resp.Status, strings.TrimSpace(string(b)))
	}
	return string(b), nil
}

// sample is one Prometheus sample of the text exposition format.
type sample struct {
	name   string
	labels map[string]string
	value  float64
}

var sampleLine = regexp.MustCompile(`^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)`)
var labelPair = regexp.MustCompile(`([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"`)

// scrape reads a /metrics page.
func scrape(url string) ([]sample, error) {
	body, err := httpGet(url)
	if err != nil {
		return nil, err
	}
	var out []sample
	for _, line := range strings.Split(body, "\n") {
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		m := sampleLine.FindStringSubmatch(line)
		if m == nil {
			continue
		}
		v, err := strconv.ParseFloat(m[4], 64)
		if err != nil {
			continue
		}
		s := sample{name: m[1], labels: map[string]string{}, value: v}
		for _, lp := range labelPair.FindAllStringSubmatch(m[3], -1) {
			s.labels[lp[1]] = lp[2]
		}
		out = append(out, s)
	}
	return out, nil
}

// metricSum adds up the samples of name whose labels include want; found is
// false when no sample matched.
func metricSum(samples []sample, name string, want map[string]string) (sum float64, found bool) {
	for _, s := range samples {
		if s.name != name {
			continue
		}
		ok := true
		for k, v := range want {
			if s.labels[k] != v {
				ok = false
				break
			}
		}
		if ok {
			sum += s.value
			found = true
		}
	}
	return sum, found
}

// describe renders the samples of the named metrics, for failure messages.
func describe(samples []sample, prefix string) string {
	var lines []string
	for _, s := range samples {
		if !strings.HasPrefix(s.name, prefix) {
			continue
		}
		var ls []string
		for k, v := range s.labels {
			ls = append(ls, fmt.Sprintf("%s=%q", k, v))
		}
		sort.Strings(ls)
		lines = append(lines, fmt.Sprintf("%s{%s} %g", s.name, strings.Join(ls, ","), s.value))
	}
	sort.Strings(lines)
	return strings.Join(lines, "\n")
}

// kvStream is a SubscribeKvEvents call read in the background.
type kvStream struct {
	name   string
	cancel context.CancelFunc
	cc     *grpc.ClientConn
	done   chan struct{}

	mu      sync.Mutex
	batches []*kvpb.KvEventBatch
	err     error
}

// subscribeKv opens SubscribeKvEvents on addr under service (vllm, sglang
// or tokenspeed) and collects every batch until the test ends.
func subscribeKv(t testing.TB, name, addr, service string, req *kvpb.SubscribeKvEventsRequest) *kvStream {
	t.Helper()
	cc, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatalf("%s: dial %s: %v", name, addr, err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	s := &kvStream{name: name, cancel: cancel, cc: cc, done: make(chan struct{})}
	t.Cleanup(s.close)
	var stream grpc.ServerStreamingClient[kvpb.KvEventBatch]
	switch service {
	case "vllm":
		stream, err = kvpb.NewVllmEngineClient(cc).SubscribeKvEvents(ctx, req)
	case "sglang":
		stream, err = kvpb.NewSglangSchedulerClient(cc).SubscribeKvEvents(ctx, req)
	case "tokenspeed":
		stream, err = kvpb.NewTokenSpeedSchedulerClient(cc).SubscribeKvEvents(ctx, req)
	default:
		err = fmt.Errorf("unknown service %q", service)
	}
	if err != nil {
		close(s.done)
		t.Fatalf("%s: SubscribeKvEvents on %s: %v", name, addr, err)
	}
	// The call resolves when the server sends its headers; both relays send
	// them before any event, so after this the subscription is in place.
	if _, err := stream.Header(); err != nil {
		close(s.done)
		t.Fatalf("%s: SubscribeKvEvents headers from %s: %v", name, addr, err)
	}
	go func() {
		defer close(s.done)
		for {
			b, err := stream.Recv()
			s.mu.Lock()
			if err != nil {
				s.err = err
				s.mu.Unlock()
				return
			}
			s.batches = append(s.batches, b)
			s.mu.Unlock()
		}
	}()
	return s
}

func (s *kvStream) close() {
	s.cancel()
	<-s.done
	_ = s.cc.Close()
}

// snapshot returns the batches so far and the stream's error, if it ended.
func (s *kvStream) snapshot() ([]*kvpb.KvEventBatch, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]*kvpb.KvEventBatch(nil), s.batches...), s.err
}

// waitBatches waits until cond holds on the batches received so far. A
// stream that ends fails the wait at once.
func (s *kvStream) waitBatches(t testing.TB, what string, cond func([]*kvpb.KvEventBatch) bool, logs ...*proc) []*kvpb.KvEventBatch {
	t.Helper()
	var got []*kvpb.KvEventBatch
	waitFor(t, waitTimeout, func() (bool, string) {
		bs, err := s.snapshot()
		got = bs
		if cond(bs) {
			return true, ""
		}
		if err != nil {
			t.Fatalf("%s: stream ended (%v) before %s; %d batches received", s.name, err, what, len(bs))
		}
		return false, fmt.Sprintf("%s: %s (%d batches so far)", s.name, what, len(bs))
	}, logs...)
	return got
}

// smgGatewayCommand is SMG's gateway with the cache_aware policy over
// workerURL, on a free port, its Prometheus endpoint on another, and no
// tokenizer (the stubs have none, and the gateway would otherwise fetch one
// over the network); metricsURL is that endpoint.
func smgGatewayCommand(t testing.TB, smgBin, workerURL string) (cmd *exec.Cmd, metricsURL string) {
	t.Helper()
	smgPort, promPort := freePort(t), freePort(t)
	cmd = exec.Command(smgBin, "launch",
		"--host", "127.0.0.1", "--port", strconv.Itoa(smgPort),
		"--worker-urls", workerURL, "--policy", "cache_aware",
		"--prometheus-port", strconv.Itoa(promPort), "--prometheus-host", "127.0.0.1",
		"--disable-tokenizer-autoload", "--log-level", "debug")
	return cmd, fmt.Sprintf("http://127.0.0.1:%d/metrics", promPort)
}
