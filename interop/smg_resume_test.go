package interop

import (
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"regexp"
	"sync"
	"testing"

	"github.com/kvrelay/kvrelay/testkit/enginepeer"
	"github.com/kvrelay/kvrelay/testkit/pyenv"
)

// gatedForwarder forwards TCP connections to a backend port. While it is
// held, a new connection waits before it reaches the backend, so a test
// decides when a reconnecting gateway gets through.
type gatedForwarder struct {
	ln      net.Listener
	backend string

	mu    sync.Mutex
	open  chan struct{} // closed while connections pass
	conns map[net.Conn]struct{}
}

func startGatedForwarder(t testing.TB, backend string) *gatedForwarder {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	f := &gatedForwarder{ln: ln, backend: backend, open: make(chan struct{}), conns: map[net.Conn]struct{}{}}
	close(f.open)
	var wg sync.WaitGroup
	t.Cleanup(func() {
		ln.Close()
		wg.Wait()
	})
	wg.Go(func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			wg.Go(func() { f.serve(c) })
		}
	})
	return f
}

func (f *gatedForwarder) port() int { return f.ln.Addr().(*net.TCPAddr).Port }

func (f *gatedForwarder) hold() {
	f.mu.Lock()
	f.open = make(chan struct{})
	f.mu.Unlock()
}

func (f *gatedForwarder) release() {
	f.mu.Lock()
	close(f.open)
	f.mu.Unlock()
}

// drop ends every forwarded connection, as a network blip would.
func (f *gatedForwarder) drop() {
	f.mu.Lock()
	for c := range f.conns {
		c.Close()
	}
	f.mu.Unlock()
}

func (f *gatedForwarder) serve(c net.Conn) {
	defer c.Close()
	f.mu.Lock()
	open := f.open
	f.conns[c] = struct{}{}
	f.mu.Unlock()
	defer func() {
		f.mu.Lock()
		delete(f.conns, c)
		f.mu.Unlock()
	}()
	<-open
	b, err := net.Dial("tcp", f.backend)
	if err != nil {
		return
	}
	defer b.Close()
	done := make(chan struct{}, 2)
	go func() { _, _ = io.Copy(b, c); done <- struct{}{} }()
	go func() { _, _ = io.Copy(c, b); done <- struct{}{} }()
	<-done // either side ended: end both (the deferred closes)
}

// TestSMGGatewayResumesExactlyAcrossAKvrelayRestart is issue 14.1 through
// SMG's real gateway: a history large enough to hold the gateway's cursor,
// kvrelay killed while the engine moves on, started again on the same port,
// its two ranks primed from the engine's replays in a fixed order (the
// other rank's replay ROUTER is paused until the first rank is primed), and
// only then the gateway let through to resume with rank 0's cursor. In both
// orders kvrelay must refuse the cursor (before the fix, rank 1 primed first
// lost rank 1's batches past the cursor, and rank 0 primed first sent rank
// 1's from 0, which the gateway read as a restart and cleared the worker):
// the gateway resyncs from our snapshot and its index ends equal to the
// engine's blocks, with no batch missed and no publisher restart seen.
func TestSMGGatewayResumesExactlyAcrossAKvrelayRestart(t *testing.T) {
	const dp = 2
	kvrelayBin(t)
	smgBin := filepath.Join(filepath.Dir(pyenv.Python(t)), "smg")
	if _, err := os.Stat(smgBin); err != nil {
		t.Fatalf("SMG's gateway launcher %s: %v (pip install smg into the venv)", smgBin, err)
	}
	for _, tc := range []struct {
		first, later int
	}{
		{first: 1, later: 0},
		{first: 0, later: 1},
	} {
		t.Run(fmt.Sprintf("rank %d primes first", tc.first), func(t *testing.T) {
			peer := enginepeer.Start(t, enginepeer.Options{Engine: enginepeer.VLLM, DPSize: dp})
			stub := startProc(t, "stub_servicer", pyenv.Command(t, pyenv.Script("smg", "stub_servicer.py"), "--port", "0"))
			stubAddr := fmt.Sprintf("127.0.0.1:%d", stub.readyPort(t))
			kvCfg := fmt.Sprintf(`{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:%d", "replay_endpoint": "tcp://*:%d"}`,
				endpointPort(t, peer.PubEndpoint(0)), endpointPort(t, peer.ReplayEndpoint(0)))
			kvPort := freePort(t)
			kvArgs := []string{"--upstream", stubAddr} // the default history: 10,000 batches
			kv := startKvrelay(t, "kvrelay serve", "vllm", kvCfg, dp, kvPort, kvArgs...)
			fwd := startGatedForwarder(t, fmt.Sprintf("127.0.0.1:%d", kvPort))

			live := liveSet{}
			next := make([]int, dp) // the next chainBatch index per rank
			publish := chainPublisher(t, peer, live, next)
			publish(0, 3)
			publish(1, 3)

			workerURL := fmt.Sprintf("grpc://127.0.0.1:%d", fwd.port())
			smgCmd, metricsURL := smgGatewayCommand(t, smgBin, workerURL)
			smg := startProc(t, "smg gateway", smgCmd)
			logs := []*proc{smg, kv.proc, stub}
			smg.waitLine(t, regexp.MustCompile(`KV event stream connected`), startTimeout)
			for i := 0; i < 10; i++ { // the ranks step together
				publish(0, 1)
				publish(1, 1)
			}
			waitIndex(t, metricsURL, live.count(), "before the kill", logs...)
			ms := gatewayMetrics(t, metricsURL)
			refusedBefore, _ := metricSum(ms, "smg_kv_event_resyncs_total", map[string]string{"reason": "out_of_range"})

			// kill -9; the engine moves on, rank 1 further than rank 0.
			fwd.hold()
			kv.kill()
			publish(0, 4)
			publish(1, 12)
			if err := peer.PauseReplay(tc.later); err != nil {
				t.Fatal(err)
			}
			kv2 := startKvrelay(t, "kvrelay serve (restarted)", "vllm", kvCfg, dp, kvPort, kvArgs...)
			logs = []*proc{smg, kv2.proc, stub}
			kv2.waitLine(t, regexp.MustCompile(fmt.Sprintf(`primed from the publisher's replay.*rank=%d `, tc.first)), waitTimeout)
			if err := peer.ResumeReplay(tc.later); err != nil {
				t.Fatal(err)
			}
			kv2.waitLine(t, regexp.MustCompile(fmt.Sprintf(`primed from the publisher's replay.*rank=%d `, tc.later)), waitTimeout)
			fwd.release()

			waitIndex(t, metricsURL, live.count(), "after the restart", logs...)
			publish(0, 2)
			publish(1, 2)
			waitIndex(t, metricsURL, live.count(), "after live batches past the restart", logs...)

			after := gatewayMetrics(t, metricsURL)
			refused, _ := metricSum(after, "smg_kv_event_resyncs_total", map[string]string{"reason": "out_of_range"})
			missed, _ := metricSum(after, "smg_kv_event_missed_batches_total", nil)
			restarts, _ := metricSum(after, "smg_kv_event_resyncs_total", map[string]string{"reason": "publisher_restart"})
			kvRefused := len(kv2.matching(regexp.MustCompile(`subscriber refused`))) > 0
			t.Logf("gateway KV metrics at the end:\n%s", describe(after, "smg_kv_"))
			if refused != refusedBefore+1 || !kvRefused {
				t.Errorf("rank 0's cursor refused: gateway counted %g more, kvrelay logged %v; want 1, true", refused-refusedBefore, kvRefused)
			}
			if missed != 0 || restarts != 0 {
				t.Errorf("smg_kv_event_missed_batches_total = %g, resyncs{publisher_restart} = %g; want 0, 0", missed, restarts)
			}
		})
	}
}

// TestSMGGatewayResumeOnTheSameKvrelay: the gateway's connection breaks
// while kvrelay keeps running. After the ranks stepped together, kvrelay
// serves rank 0's cursor (at most rank 1's own cursor batch comes again,
// which the gateway drops as stale). After rank 1 relayed several batches
// past rank 0's last one, it refuses it: serving them again made SMG's
// gateway read a restarted publisher and clear the worker (before the fix,
// the index ended 8 blocks short out of 20).
func TestSMGGatewayResumeOnTheSameKvrelay(t *testing.T) {
	const dp = 2
	kvrelayBin(t)
	smgBin := filepath.Join(filepath.Dir(pyenv.Python(t)), "smg")
	peer := enginepeer.Start(t, enginepeer.Options{Engine: enginepeer.VLLM, DPSize: dp})
	stub := startProc(t, "stub_servicer", pyenv.Command(t, pyenv.Script("smg", "stub_servicer.py"), "--port", "0"))
	stubAddr := fmt.Sprintf("127.0.0.1:%d", stub.readyPort(t))
	kvCfg := fmt.Sprintf(`{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:%d", "replay_endpoint": "tcp://*:%d"}`,
		endpointPort(t, peer.PubEndpoint(0)), endpointPort(t, peer.ReplayEndpoint(0)))
	kvPort := freePort(t)
	kv := startKvrelay(t, "kvrelay serve", "vllm", kvCfg, dp, kvPort, "--upstream", stubAddr)
	fwd := startGatedForwarder(t, fmt.Sprintf("127.0.0.1:%d", kvPort))
	live := liveSet{}
	next := make([]int, dp) // the next chainBatch index per rank
	publish := chainPublisher(t, peer, live, next)
	workerURL := fmt.Sprintf("grpc://127.0.0.1:%d", fwd.port())
	smgCmd, metricsURL := smgGatewayCommand(t, smgBin, workerURL)
	smg := startProc(t, "smg gateway", smgCmd)
	logs := []*proc{smg, kv.proc, stub}
	smg.waitLine(t, regexp.MustCompile(`KV event stream connected`), startTimeout)
	resyncs := func(reason string) float64 {
		n, _ := metricSum(gatewayMetrics(t, metricsURL), "smg_kv_event_resyncs_total", map[string]string{"reason": reason})
		return n
	}
	for i := 0; i < 5; i++ { // the ranks step together
		publish(0, 1)
		waitIndex(t, metricsURL, live.count(), "rank 0 stepped", logs...)
		publish(1, 1)
		waitIndex(t, metricsURL, live.count(), "rank 1 stepped", logs...)
	}
	fwd.drop()
	smg.waitLine(t, regexp.MustCompile(`KV event stream connected.*start_seq=4`), waitTimeout)
	publish(0, 1)
	publish(1, 1)
	waitIndex(t, metricsURL, live.count(), "after a blip with the ranks in step", logs...)
	if n := resyncs("out_of_range"); n != 0 {
		t.Fatalf("the cursor of a gateway in step was refused (%g out_of_range resyncs)", n)
	}

	publish(1, 4) // rank 0 idle
	waitIndex(t, metricsURL, live.count(), "rank 1 ahead", logs...)
	fwd.drop()
	waitFor(t, waitTimeout, func() (bool, string) {
		n := resyncs("out_of_range")
		return n == 1, fmt.Sprintf("out_of_range resyncs %g, want 1", n)
	}, logs...)
	publish(0, 1)
	publish(1, 1)
	waitIndex(t, metricsURL, live.count(), "after a blip with rank 1 ahead", logs...)
	if n := resyncs("publisher_restart"); n != 0 {
		t.Errorf("the gateway saw %g publisher restarts, want 0", n)
	}
}
