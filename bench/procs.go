package bench

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
)

// procUsage is a process's CPU time and memory as /proc reports them.
type procUsage struct {
	CPU     time.Duration // user + system, every thread
	RSS     int64         // bytes, now
	PeakRSS int64         // bytes, the high-water mark (VmHWM)
	// Context switches summed over the process's threads
	// (/proc/PID/task/*/status): a thread that sleeps and is woken counts
	// a voluntary one; nonvoluntary ones are preemptions.
	VoluntaryCtx, NonvoluntaryCtx int64
}

// clockTicks is USER_HZ, 100 on every Linux architecture Go supports.
const clockTicks = 100

func readProcUsage(pid int) (procUsage, error) {
	var u procUsage
	stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return u, fmt.Errorf("cpu of pid %d: %w", pid, err)
	}
	// The command name may hold spaces and parentheses: fields start after
	// the last ')'. utime and stime are fields 14 and 15 (1-based).
	rest := stat[bytes.LastIndexByte(stat, ')')+1:]
	f := strings.Fields(string(rest))
	if len(f) < 13 {
		return u, fmt.Errorf("cpu of pid %d: short /proc stat", pid)
	}
	ut, err1 := strconv.ParseInt(f[11], 10, 64)
	st, err2 := strconv.ParseInt(f[12], 10, 64)
	if err1 != nil || err2 != nil {
		return u, fmt.Errorf("cpu of pid %d: bad /proc stat", pid)
	}
	u.CPU = time.Duration(ut+st) * time.Second / clockTicks
	status, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return u, fmt.Errorf("memory of pid %d: %w", pid, err)
	}
	for _, line := range strings.Split(string(status), "\n") {
		name, val, ok := strings.Cut(line, ":")
		if !ok {
			continue
		}
		var dst *int64
		switch name {
		case "VmRSS":
			dst = &u.RSS
		case "VmHWM":
			dst = &u.PeakRSS
		default:
			continue
		}
		kb, err := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(val), " kB"), 10, 64)
		if err != nil {
			return u, fmt.Errorf("memory of pid %d: %s: %w", pid, line, err)
		}
		*dst = kb << 10
	}
	u.VoluntaryCtx, u.NonvoluntaryCtx = threadContextSwitches(pid)
	return u, nil
}

// threadContextSwitches sums the context switches of pid's threads that
// are alive now (those of threads that ended are lost; the Go runtime keeps
// its threads). Zero when /proc does not say.
func threadContextSwitches(pid int) (voluntary, nonvoluntary int64) {
	tasks, _ := filepath.Glob(fmt.Sprintf("/proc/%d/task/*/status", pid))
	for _, path := range tasks {
		status, err := os.ReadFile(path)
		if err != nil {
			continue // the thread ended
		}
		for _, line := range strings.Split(string(status), "\n") {
			name, val, ok := strings.Cut(line, ":")
			if !ok {
				continue
			}
			n, err := strconv.ParseInt(strings.TrimSpace(val), 10, 64)
			if err != nil {
				continue
			}
			switch name {
			case "voluntary_ctxt_switches":
				voluntary += n
			case "nonvoluntary_ctxt_switches":
				nonvoluntary += n
			}
		}
	}
	return voluntary, nonvoluntary
}

// tailBuffer keeps the last bytes a child wrote to stderr, for errors.
type tailBuffer struct {
	mu  sync.Mutex
	buf []byte
	max int
}

func (t *tailBuffer) Write(p []byte) (int, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.buf = append(t.buf, p...)
	if len(t.buf) > t.max {
		t.buf = append(t.buf[:0], t.buf[len(t.buf)-t.max:]...)
	}
	return len(p), nil
}

func (t *tailBuffer) String() string {
	t.mu.Lock()
	defer t.mu.Unlock()
	return string(t.buf)
}

// child is a process the bench started, with its stdout as lines.
type child struct {
	name   string
	cmd    *exec.Cmd
	stdin  io.WriteCloser
	lines  chan []byte
	stderr *tailBuffer
	done   chan struct{}
}

func startChild(name string, argv []string, stderrTee io.Writer) (*child, error) {
	cmd := exec.Command(argv[0], argv[1:]...)
	// Its own process group, so that a stop reaches what it forks too.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return nil, fmt.Errorf("%s: stdin: %w", name, err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return nil, fmt.Errorf("%s: stdout: %w", name, err)
	}
	c := &child{name: name, cmd: cmd, stdin: stdin, lines: make(chan []byte, 1024),
		stderr: &tailBuffer{max: 16 << 10}, done: make(chan struct{})}
	cmd.Stderr = c.stderr
	if stderrTee != nil {
		cmd.Stderr = io.MultiWriter(c.stderr, stderrTee)
	}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("%s: start %s: %w", name, argv[0], err)
	}
	readerDone := make(chan struct{})
	go func() {
		defer close(readerDone)
		defer close(c.lines)
		sc := bufio.NewScanner(stdout)
		sc.Buffer(make([]byte, 64<<10), 4<<20)
		for sc.Scan() {
			c.lines <- append([]byte(nil), sc.Bytes()...)
		}
		// Drain so the child never blocks on a full pipe.
		_, _ = io.Copy(io.Discard, stdout)
	}()
	go func() {
		// Wait closes stdout, so it may run only after the reader is done.
		<-readerDone
		_ = cmd.Wait()
		close(c.done)
	}()
	return c, nil
}

// readLine returns the child's next stdout line. The children answer one
// line per command, far fewer than the channel holds, so the reader never
// blocks on it.
func (c *child) readLine(ctx context.Context, timeout time.Duration) ([]byte, error) {
	t := time.NewTimer(timeout)
	defer t.Stop()
	select {
	case l, ok := <-c.lines:
		if !ok {
			return nil, fmt.Errorf("%s exited: %s", c.name, c.stderrTail())
		}
		return l, nil
	case <-t.C:
		return nil, fmt.Errorf("%s: no answer within %v: %s", c.name, timeout, c.stderrTail())
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

func (c *child) stderrTail() string {
	s := strings.TrimSpace(c.stderr.String())
	if len(s) > 2000 {
		s = "…" + s[len(s)-2000:]
	}
	if s == "" {
		return "(no stderr)"
	}
	return s
}

func (c *child) pid() int { return c.cmd.Process.Pid }

// stop asks politely (SIGTERM to the group), then kills.
func (c *child) stop() {
	_ = c.stdin.Close()
	pgid := -c.cmd.Process.Pid
	_ = syscall.Kill(pgid, syscall.SIGTERM)
	select {
	case <-c.done:
		return
	case <-time.After(5 * time.Second):
	}
	_ = syscall.Kill(pgid, syscall.SIGKILL)
	<-c.done
}

// publisher drives bench/publisher.py.
type publisher struct {
	*child
	ranks []struct {
		Rank   int    `json:"rank"`
		Pub    string `json:"pub"`
		Replay string `json:"replay"`
	}
	payloadBytes []int
}

// publishResult is one "run" command's answer.
type publishResult struct {
	First    []uint64 `json:"first"`
	Last     []uint64 `json:"last"`
	Sent     int      `json:"sent"`
	Elapsed  float64  `json:"elapsed"`
	Achieved float64  `json:"achieved"`
}

func startPublisher(ctx context.Context, env *environment, dpSize int) (*publisher, error) {
	c, err := startChild("publisher", []string{env.python, "-u", filepath.Join(env.repo, "bench", "publisher.py"),
		"--dp-size", strconv.Itoa(dpSize), "--blocks", strconv.Itoa(storeBlocks), "--block-size", strconv.Itoa(blockSize),
		"--window", strconv.Itoa(evictWindow)}, nil)
	if err != nil {
		return nil, err
	}
	p := &publisher{child: c}
	line, err := c.readLine(ctx, 60*time.Second)
	if err != nil {
		c.stop()
		return nil, err
	}
	var ready struct {
		Op           string `json:"op"`
		PayloadBytes []int  `json:"payload_bytes"`
	}
	if err := json.Unmarshal(line, &ready); err != nil || ready.Op != "ready" {
		c.stop()
		return nil, fmt.Errorf("publisher: bad ready line %q: %v", line, err)
	}
	var r struct {
		Ranks []struct {
			Rank   int    `json:"rank"`
			Pub    string `json:"pub"`
			Replay string `json:"replay"`
		} `json:"ranks"`
	}
	if err := json.Unmarshal(line, &r); err != nil || len(r.Ranks) != dpSize {
		c.stop()
		return nil, fmt.Errorf("publisher: bad ranks in %q: %v", line, err)
	}
	p.ranks = r.Ranks
	p.payloadBytes = ready.PayloadBytes
	return p, nil
}

// run publishes at rate batches/s for seconds. burst is how many batches
// go out back to back between looks at the clock: 1 (or 0) sends every
// batch at its own time; 32 is the stream the bench published before
// 2026-12-03 (see bench/publisher.py).
func (p *publisher) run(ctx context.Context, rate float64, seconds float64, burst int) (publishResult, error) {
	var res publishResult
	cmd, _ := json.Marshal(map[string]any{"op": "run", "rate": rate, "seconds": seconds, "burst": max(burst, 1)})
	if _, err := p.stdin.Write(append(cmd, '\n')); err != nil {
		return res, fmt.Errorf("publisher: %w", err)
	}
	line, err := p.readLine(ctx, time.Duration(seconds*float64(time.Second))*4+30*time.Second)
	if err != nil {
		return res, err
	}
	var head struct {
		Op    string `json:"op"`
		Error string `json:"error"`
	}
	if err := json.Unmarshal(line, &head); err != nil {
		return res, fmt.Errorf("publisher: bad answer %q: %w", line, err)
	}
	if head.Op != "done" {
		return res, fmt.Errorf("publisher: %s", head.Error)
	}
	if err := json.Unmarshal(line, &res); err != nil {
		return res, fmt.Errorf("publisher: bad answer %q: %w", line, err)
	}
	return res, nil
}

// relayProc is one relay under test, serving SubscribeKvEvents at addr.
type relayProc interface {
	addr() string
	// pid is the process to measure; 0 when the relay shares the bench's
	// process and its CPU and memory cannot be told apart.
	pid() int
	stop()
}

type childRelay struct {
	*child
	address string
}

func (c *childRelay) addr() string { return c.address }

// startKvrelay runs `kvrelay serve` for the publisher's ranks.
func startKvrelay(ctx context.Context, env *environment, pub *publisher) (relayProc, error) {
	cfg, _ := json.Marshal(map[string]any{
		"enable_kv_cache_events": true, "publisher": "zmq",
		"endpoint": pub.ranks[0].Pub, "replay_endpoint": pub.ranks[0].Replay,
	})
	argv := append(append([]string(nil), env.serveCommand...),
		"--engine", "vllm", "--kv-events-config", string(cfg), "--dp-size", strconv.Itoa(len(pub.ranks)),
		"--listen", "127.0.0.1:0", "--metrics-listen=", "--log-format", "json", "--log-level", "info")
	c, err := startChild("kvrelay serve", argv, nil)
	if err != nil {
		return nil, err
	}
	// The listen address is in the log line that announces it.
	deadline := time.Now().Add(60 * time.Second)
	for time.Now().Before(deadline) {
		for _, line := range strings.Split(c.stderr.String(), "\n") {
			var rec struct {
				Msg    string `json:"msg"`
				Listen string `json:"listen"`
			}
			if json.Unmarshal([]byte(line), &rec) == nil && rec.Msg == "serving SubscribeKvEvents" && rec.Listen != "" {
				return &childRelay{child: c, address: rec.Listen}, nil
			}
		}
		select {
		case <-c.done:
			return nil, fmt.Errorf("kvrelay serve exited: %s", c.stderrTail())
		case <-ctx.Done():
			c.stop()
			return nil, ctx.Err()
		case <-time.After(20 * time.Millisecond):
		}
	}
	c.stop()
	return nil, fmt.Errorf("kvrelay serve did not announce its listener: %s", c.stderrTail())
}

// startPyRelay runs SMG's Python relay behind its gRPC server.
func startPyRelay(ctx context.Context, env *environment, pub *publisher) (relayProc, error) {
	c, err := startChild("python relay", []string{env.python, "-u", filepath.Join(env.repo, "testdata", "smg", "py_relay_server.py"),
		"--engine", "vllm", "--endpoint", pub.ranks[0].Pub, "--replay-endpoint", pub.ranks[0].Replay,
		"--dp-size", strconv.Itoa(len(pub.ranks)), "--port", "0"}, nil)
	if err != nil {
		return nil, err
	}
	line, err := c.readLine(ctx, 90*time.Second)
	if err != nil {
		c.stop()
		return nil, err
	}
	var ready struct {
		Ready bool `json:"ready"`
		Port  int  `json:"port"`
	}
	if err := json.Unmarshal(line, &ready); err != nil || !ready.Ready || ready.Port == 0 {
		c.stop()
		return nil, fmt.Errorf("python relay: bad ready line %q: %v", line, err)
	}
	return &childRelay{child: c, address: fmt.Sprintf("127.0.0.1:%d", ready.Port)}, nil
}
