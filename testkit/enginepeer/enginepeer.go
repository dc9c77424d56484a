// Package enginepeer runs testdata/peer/engine_peer.py, a real pyzmq/libzmq
// fake of the vLLM, SGLang and TokenSpeed KV-event publishers, and drives it
// from Go tests. A Peer owns one process with one PUB (and optionally one
// replay ROUTER) per data-parallel rank; its methods map one to one onto the
// script's JSON-lines commands, documented at the top of the script.
//
// Every method waits for the script's answer, which it writes only after the
// message was handed to libzmq, so a test can publish and then expect the
// message on a connected SUB. PUB/SUB has no "subscriber attached" signal, so
// tests that need the first message must publish until something arrives.
//
// Methods return errors instead of failing the test so they can be called from
// any goroutine. Start registers a t.Cleanup that kills the process; every
// read has a timeout, so a stuck peer fails the test instead of hanging it.
package enginepeer

import (
	"bufio"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/kvrelay/kvrelay/testkit/logbuf"
	"github.com/kvrelay/kvrelay/testkit/pyenv"
)

// Engines the script can imitate.
const (
	VLLM       = "vllm"
	SGLang     = "sglang"
	TokenSpeed = "tokenspeed"
)

// Options configure the fake engine. Zero values give the engines' defaults,
// except that endpoints default to free loopback ports.
type Options struct {
	Engine string // VLLM, SGLang or TokenSpeed; required
	DPSize int    // ranks; default 1
	// Endpoint is the base PUB endpoint in the engines' syntax; rank r uses
	// port+r. Default "tcp://*:0": the script picks a free base port.
	Endpoint string
	// ReplayEndpoint is the base ROUTER endpoint. Default "tcp://*:0"
	// unless NoReplay is set (then no ROUTER, as the engines' default).
	ReplayEndpoint string
	NoReplay       bool
	BufferSteps    int    // replay ring size in batches; default 10000
	Topic          string // topic frame; default ""
	HWM            int    // PUB high-water mark; default 100000
	// Wire is "map" or "array" (legacy layouts); default map for vLLM and
	// SGLang, array for TokenSpeed.
	Wire string
	// StartupClear is "batch", "prepend" or "none"; default batch for SGLang
	// (seq 0 is a lone AllBlocksCleared published at startup), else none.
	StartupClear string
	// Timeout bounds each command's answer; default 30 s.
	Timeout time.Duration
	// Release, when set, runs that engine release's own publisher module
	// (testdata/engines/release_peer.py over the files fetch.py extracted)
	// instead of the imitation; see Releases. Wire is then the release's.
	Release *Release
	// OSPorts keeps a tcp://*:0 endpoint for the release's publisher to bind
	// (vLLM 0.33+ lets the OS assign each rank's port); only with Release.
	OSPorts bool
}

// RankEndpoints are the connect endpoints of one rank.
type RankEndpoints struct {
	Rank   int    `json:"rank"`
	Pub    string `json:"pub"`
	Replay string `json:"replay"` // empty without a ROUTER
	// Reported is what a release's own publisher says its endpoints are
	// (vLLM's get_publisher_config, SGLang's describe_local_source); nil
	// for the imitation and for releases that report nothing.
	Reported *ReportedEndpoints `json:"reported"`
}

// ReportedEndpoints are a publisher's own account of where it listens.
type ReportedEndpoints struct {
	Pub    string `json:"pub"`
	Replay string `json:"replay"`
}

// Peer is a running engine_peer.py process.
type Peer struct {
	opts   Options
	cmd    *exec.Cmd
	stdin  io.WriteCloser
	lines  chan []byte
	stderr *logbuf.Buffer
	ranks  []RankEndpoints

	mu     sync.Mutex // serializes commands: one question, one answer
	nextID int
	closed bool
	done   chan struct{} // closed when the process has exited
}

// Start launches the script and waits for its ready line. It fails the test
// if the peer does not come up within the timeout.
func Start(t testing.TB, opts Options) *Peer {
	t.Helper()
	p, err := start(t, opts)
	if err != nil {
		t.Fatalf("enginepeer: %v", err)
	}
	return p
}

func start(t testing.TB, opts Options) (*Peer, error) {
	if opts.Engine == "" {
		return nil, errors.New("Options.Engine is required")
	}
	if opts.DPSize <= 0 {
		opts.DPSize = 1
	}
	if opts.Endpoint == "" {
		opts.Endpoint = "tcp://*:0"
	}
	if opts.ReplayEndpoint == "" && !opts.NoReplay {
		opts.ReplayEndpoint = "tcp://*:0"
	}
	if opts.Timeout <= 0 {
		opts.Timeout = 30 * time.Second
	}
	args := []string{
		"--engine", opts.Engine,
		"--dp-size", strconv.Itoa(opts.DPSize),
		"--endpoint", opts.Endpoint,
		"--topic", opts.Topic,
	}
	if !opts.NoReplay {
		args = append(args, "--replay-endpoint", opts.ReplayEndpoint)
	}
	if opts.BufferSteps > 0 {
		args = append(args, "--buffer-steps", strconv.Itoa(opts.BufferSteps))
	}
	if opts.HWM > 0 {
		args = append(args, "--hwm", strconv.Itoa(opts.HWM))
	}
	if opts.Wire != "" {
		args = append(args, "--wire", opts.Wire)
	}
	if opts.StartupClear != "" {
		args = append(args, "--startup-clear", opts.StartupClear)
	}
	script := pyenv.Script("peer", "engine_peer.py")
	if opts.Release != nil {
		dir := opts.Release.dir(t)
		script = pyenv.Script("engines", "release_peer.py")
		args = append(args, "--release", dir)
		if opts.OSPorts {
			args = append(args, "--os-ports")
		}
	}
	cmd := pyenv.Command(t, script, args...)
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return nil, fmt.Errorf("stdin pipe: %w", err)
	}
	// An os.Pipe we own rather than cmd.StdoutPipe: Wait closes the latter,
	// which could lose answers still buffered when the process exits.
	stdout, stdoutW, err := os.Pipe()
	if err != nil {
		return nil, fmt.Errorf("stdout pipe: %w", err)
	}
	cmd.Stdout = stdoutW
	p := &Peer{
		opts:   opts,
		cmd:    cmd,
		stdin:  stdin,
		lines:  make(chan []byte, 64),
		stderr: &logbuf.Buffer{},
		done:   make(chan struct{}),
	}
	cmd.Stderr = p.stderr
	err = cmd.Start()
	_ = stdoutW.Close() // the child holds its own copy
	if err != nil {
		_ = stdout.Close()
		return nil, fmt.Errorf("start %s: %w", cmd.Path, err)
	}
	go p.readLines(stdout)
	go func() {
		_ = cmd.Wait()
		close(p.done)
	}()
	t.Cleanup(func() {
		p.kill()
		if t.Failed() {
			t.Logf("engine peer stderr:\n%s", p.stderr.String())
		}
	})

	line, err := p.readLine(opts.Timeout)
	if err != nil {
		p.kill()
		return nil, fmt.Errorf("waiting for ready: %w (stderr: %s)", err, p.stderr.String())
	}
	var ready struct {
		Op    string          `json:"op"`
		Error string          `json:"error"`
		Ranks []RankEndpoints `json:"ranks"`
	}
	if err := json.Unmarshal(line, &ready); err != nil || ready.Op != "ready" {
		p.kill()
		return nil, fmt.Errorf("bad ready line %q: %v %s (stderr: %s)", line, err, ready.Error, p.stderr.String())
	}
	p.ranks = ready.Ranks
	return p, nil
}

func (p *Peer) readLines(r io.ReadCloser) {
	defer close(p.lines)
	defer r.Close()
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), 16<<20)
	for sc.Scan() {
		p.lines <- append([]byte(nil), sc.Bytes()...)
	}
}

func (p *Peer) readLine(timeout time.Duration) ([]byte, error) {
	timer := time.NewTimer(timeout)
	defer timer.Stop()
	select {
	case line, ok := <-p.lines:
		if !ok {
			return nil, errors.New("peer exited")
		}
		return line, nil
	case <-timer.C:
		return nil, fmt.Errorf("no answer within %v", timeout)
	}
}

// kill ends the process and waits for it, at most a few seconds.
func (p *Peer) kill() {
	// Kill before taking the lock: a command stuck waiting for an answer
	// holds it, and the process's exit closes stdout, which releases it.
	if p.cmd.Process != nil {
		_ = p.cmd.Process.Kill()
	}
	p.mu.Lock()
	p.closed = true
	p.mu.Unlock()
	_ = p.stdin.Close()
	select {
	case <-p.done:
	case <-time.After(10 * time.Second):
	}
	// Drain so the line reader goroutine can finish.
	for range p.lines {
	}
}

// Ranks returns every rank's connect endpoints.
func (p *Peer) Ranks() []RankEndpoints { return append([]RankEndpoints(nil), p.ranks...) }

// PubEndpoint is rank's live PUB as a connect endpoint (tcp://127.0.0.1:P).
func (p *Peer) PubEndpoint(rank int) string { return p.ranks[rank].Pub }

// ReplayEndpoint is rank's replay ROUTER as a connect endpoint; empty when the
// peer runs without replay.
func (p *Peer) ReplayEndpoint(rank int) string { return p.ranks[rank].Replay }

// Stderr returns what the script wrote to stderr so far (logs, tracebacks).
func (p *Peer) Stderr() string { return p.stderr.String() }

// call sends one command and decodes the answer's fields into out.
func (p *Peer) call(cmd map[string]any, out any) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return errors.New("enginepeer: peer is closed")
	}
	p.nextID++
	id := p.nextID
	cmd["id"] = id
	b, err := json.Marshal(cmd)
	if err != nil {
		return fmt.Errorf("enginepeer: encode %v: %w", cmd["op"], err)
	}
	if _, err := p.stdin.Write(append(b, '\n')); err != nil {
		return fmt.Errorf("enginepeer: send %v: %w", cmd["op"], err)
	}
	for {
		line, err := p.readLine(p.opts.Timeout)
		if err != nil {
			return fmt.Errorf("enginepeer: %v: %w", cmd["op"], err)
		}
		var head struct {
			Op    string `json:"op"`
			ID    *int   `json:"id"`
			Error string `json:"error"`
		}
		if err := json.Unmarshal(line, &head); err != nil {
			return fmt.Errorf("enginepeer: bad answer %q: %w", line, err)
		}
		if head.ID == nil || *head.ID != id {
			continue // a stale answer to an earlier, timed-out command
		}
		if head.Op == "error" {
			return fmt.Errorf("enginepeer: %v: %s", cmd["op"], head.Error)
		}
		if out == nil {
			return nil
		}
		if err := json.Unmarshal(line, out); err != nil {
			return fmt.Errorf("enginepeer: decode answer %q: %w", line, err)
		}
		return nil
	}
}

// Hash is a block hash as the engine puts it on the wire: an unsigned or
// signed 64-bit integer, or raw digest bytes (vLLM with int hashes off).
type Hash struct {
	u      uint64
	signed bool
	digest []byte
}

// U64 is an unsigned hash (vLLM's and TokenSpeed's form).
func U64(v uint64) Hash { return Hash{u: v} }

// I64 is a signed hash (SGLang's form; negatives encode as msgpack ints).
func I64(v int64) Hash { return Hash{u: uint64(v), signed: true} }

// Digest is a raw-bytes hash.
func Digest(b []byte) Hash { return Hash{digest: append([]byte(nil), b...)} }

// MarshalJSON writes the script's hash syntax: a number or {"bytes": hex}.
func (h Hash) MarshalJSON() ([]byte, error) {
	if h.digest != nil {
		return json.Marshal(map[string]string{"bytes": hex.EncodeToString(h.digest)})
	}
	if h.signed {
		return []byte(strconv.FormatInt(int64(h.u), 10)), nil
	}
	return []byte(strconv.FormatUint(h.u, 10)), nil
}

// Event is one KV event in the script's engine-neutral form; the script
// encodes it in the configured engine's struct layout.
type Event struct {
	Type      string  `json:"type"` // "stored", "removed" or "cleared"
	Hashes    []Hash  `json:"hashes,omitempty"`
	Tokens    []int64 `json:"tokens,omitempty"`
	Parent    *Hash   `json:"parent,omitempty"`
	BlockSize int     `json:"block_size,omitempty"` // default len(Tokens)/len(Hashes)
	Medium    *string `json:"medium,omitempty"`     // default "GPU"; nil pointer = default
	// Fields sets engine struct fields by their wire name (lora_name,
	// extra_keys, group_idx, cache_salt, token_ids for bigram pairs, ...).
	// A name the engine's struct lacks is an error.
	Fields map[string]any `json:"fields,omitempty"`
}

// Stored is a BlockStored event with the given chain parent (nil at a root).
func Stored(parent *Hash, tokens []int64, hashes ...Hash) Event {
	return Event{Type: "stored", Parent: parent, Tokens: tokens, Hashes: hashes}
}

// Removed is a BlockRemoved event.
func Removed(hashes ...Hash) Event { return Event{Type: "removed", Hashes: hashes} }

// Cleared is an AllBlocksCleared event.
func Cleared() Event { return Event{Type: "cleared"} }

// Published describes what happened to one batch.
type Published struct {
	Seq      uint64 `json:"seq"`
	Live     bool   `json:"live"`     // sent on the PUB (false after DropNext/BurnNext)
	Buffered bool   `json:"buffered"` // in the replay ring (false after BurnNext)
}

// Publish sends one batch of events on rank's PUB and records it in the
// replay ring, like one engine scheduler step.
func (p *Peer) Publish(rank int, events ...Event) (Published, error) {
	if events == nil {
		events = []Event{}
	}
	var out Published
	err := p.call(map[string]any{"op": "publish", "rank": rank, "events": events}, &out)
	return out, err
}

// PublishAt is Publish with a fixed batch timestamp (seconds since the
// epoch), for byte-exact comparisons.
func (p *Peer) PublishAt(rank int, ts float64, events ...Event) (Published, error) {
	if events == nil {
		events = []Event{}
	}
	var out Published
	err := p.call(map[string]any{"op": "publish", "rank": rank, "events": events, "ts": ts}, &out)
	return out, err
}

// PublishRaw publishes payload byte for byte as rank's next batch: it gets
// a seq and enters the replay ring like Publish, so golden vectors can be
// replayed through a real publisher.
func (p *Peer) PublishRaw(rank int, payload []byte) (Published, error) {
	var out Published
	err := p.call(map[string]any{"op": "publish_raw", "rank": rank, "payload": hex.EncodeToString(payload)}, &out)
	return out, err
}

// PublishMany publishes count batches on rank as fast as possible, or at most
// rate batches per second when rate > 0. With no events, each batch holds one
// BlockStored whose hash is seq+1. It returns the first and last seq used.
func (p *Peer) PublishMany(rank, count int, rate float64, events ...Event) (first, last uint64, err error) {
	cmd := map[string]any{"op": "publish_many", "rank": rank, "count": count, "rate": rate}
	if len(events) > 0 {
		cmd["events"] = events
	}
	var out struct {
		First uint64 `json:"first_seq"`
		Last  uint64 `json:"last_seq"`
	}
	err = p.call(cmd, &out)
	return out.First, out.Last, err
}

// DropNext makes rank's next n publishes consume a seq and enter the replay
// ring without going out live, like a PUB high-water-mark drop.
func (p *Peer) DropNext(rank, n int) error {
	return p.call(map[string]any{"op": "drop_next", "rank": rank, "count": n}, nil)
}

// BurnNext makes rank's next n publishes consume a seq that is neither sent
// nor buffered, like a failed send in the engines.
func (p *Peer) BurnNext(rank, n int) error {
	return p.call(map[string]any{"op": "burn_next", "rank": rank, "count": n}, nil)
}

// SendRaw sends the frames as one message on rank's PUB without consuming a
// seq, for malformed-message tests.
func (p *Peer) SendRaw(rank int, frames ...[]byte) error {
	hexFrames := make([]string, len(frames))
	for i, f := range frames {
		hexFrames[i] = hex.EncodeToString(f)
	}
	return p.call(map[string]any{"op": "send_raw", "rank": rank, "frames": hexFrames}, nil)
}

// Restart replaces rank's PUB and ROUTER with fresh sockets on the same ports,
// resets its seq to 0 and empties its ring: a new engine incarnation.
// SGLang peers publish their startup AllBlocksCleared again.
func (p *Peer) Restart(rank int) error {
	return p.call(map[string]any{"op": "restart", "rank": rank}, nil)
}

// TruncateReplay makes rank's replays send only their first n replies and no
// end marker (SGLang's HWM truncation). n < 0 restores full replays.
func (p *Peer) TruncateReplay(rank, n int) error {
	return p.call(map[string]any{"op": "truncate_replay", "rank": rank, "n": n}, nil)
}

// PauseReplay stops rank from reading its ROUTER; requests wait unanswered.
func (p *Peer) PauseReplay(rank int) error {
	return p.call(map[string]any{"op": "pause_replay", "rank": rank}, nil)
}

// ResumeReplay undoes PauseReplay; waiting requests are then answered.
func (p *Peer) ResumeReplay(rank int) error {
	return p.call(map[string]any{"op": "resume_replay", "rank": rank}, nil)
}

// RankStatus is one rank's publisher state.
type RankStatus struct {
	Rank      int     `json:"rank"`
	NextSeq   uint64  `json:"next_seq"`
	RingLen   int     `json:"ring_len"`
	RingFirst *uint64 `json:"ring_first"` // nil when the ring is empty
	RingLast  *uint64 `json:"ring_last"`
	Replays   int     `json:"replays"` // replay requests served
	Paused    bool    `json:"paused"`
	Truncate  int     `json:"truncate"`
}

// Status reports every rank's state.
func (p *Peer) Status() ([]RankStatus, error) {
	var out struct {
		Ranks []RankStatus `json:"ranks"`
	}
	err := p.call(map[string]any{"op": "status"}, &out)
	return out.Ranks, err
}

// Close asks the script to quit and waits for it; t.Cleanup also does this,
// so calling Close is only needed to stop the engine mid-test.
func (p *Peer) Close() error {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return nil
	}
	_, werr := p.stdin.Write([]byte("{\"op\":\"quit\"}\n"))
	p.mu.Unlock()
	if werr == nil {
		select {
		case <-p.done:
		case <-time.After(p.opts.Timeout):
		}
	}
	p.kill()
	return nil
}
