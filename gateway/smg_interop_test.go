package gateway

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"os/exec"
	"strconv"
	"testing"
	"time"

	"github.com/kvrelay/kvrelay/gateway/picker"
	"github.com/kvrelay/kvrelay/internal/freeport"
	"github.com/kvrelay/kvrelay/sim"
	"github.com/kvrelay/kvrelay/testkit/logbuf"
	"github.com/kvrelay/kvrelay/testkit/pyenv"
)

// pyRelay is SMG's own Python relay (smg_grpc_servicer.kv_relay behind a
// gRPC server, testdata/smg/py_relay_server.py): a server that predates
// rank_cursors, keeps no history, and refuses any non-zero cursor.
type pyRelay struct {
	cmd    *exec.Cmd
	port   int
	stderr logbuf.Buffer
}

// startTCPEngine starts a simulated vLLM engine of dp ranks publishing on
// loopback TCP (the Python relays dial it), closed at the test's end, and
// returns its live and replay endpoints for rank 0.
func startTCPEngine(t *testing.T, dp int) (eng *sim.Engine, endpoint, replay string) {
	t.Helper()
	base := freeport.ForTest(t, 2*dp)
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	eng, err := sim.Start(ctx, sim.Options{
		Engine: "vllm", DPSize: dp, BlockSize: 16, CapacityBlocks: 256,
		KVEventsConfig: fmt.Sprintf(`{"enable_kv_cache_events": true, "endpoint": "tcp://*:%d", "replay_endpoint": "tcp://*:%d"}`, base, base+dp),
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { eng.Close() })
	return eng, fmt.Sprintf("tcp://127.0.0.1:%d", base), fmt.Sprintf("tcp://127.0.0.1:%d", base+dp)
}

func startPyRelay(t *testing.T, endpoint, replay string, dp, port int, extra ...string) *pyRelay {
	t.Helper()
	args := append([]string{"--engine", "vllm", "--endpoint", endpoint, "--replay-endpoint", replay,
		"--dp-size", strconv.Itoa(dp), "--port", strconv.Itoa(port)}, extra...)
	return startPyScript(t, "py_relay_server.py", args, nil)
}

// startPyScript runs one of testdata/smg's servers and waits for the
// {"ready": true, "port": N} line it prints when it listens; onLine, if
// set, gets every other line of its stdout.
func startPyScript(t *testing.T, script string, args []string, onLine func([]byte)) *pyRelay {
	t.Helper()
	cmd := pyenv.Command(t, pyenv.Script("smg", script), args...)
	p := &pyRelay{cmd: cmd}
	cmd.Stderr = &p.stderr
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.stop)
	ready := make(chan int, 1)
	go func() {
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			var msg struct {
				Ready bool `json:"ready"`
				Port  int  `json:"port"`
			}
			if json.Unmarshal(sc.Bytes(), &msg) == nil && msg.Ready {
				ready <- msg.Port
			} else if onLine != nil {
				onLine(sc.Bytes())
			}
		}
	}()
	select {
	case p.port = <-ready:
	case <-time.After(30 * time.Second):
		t.Fatalf("%s did not start; stderr:\n%s", script, p.log())
	}
	return p
}

func (p *pyRelay) stop() {
	if p.cmd.ProcessState == nil {
		_ = p.cmd.Process.Kill()
		_ = p.cmd.Wait()
	}
}

func (p *pyRelay) log() string { return p.stderr.String() }

// TestSMGPythonRelay runs the monitor against SMG's Python servicer relay:
// the index follows a two-rank engine exactly, and after the relay restarts
// the monitor's resume request (cursor and rank_cursors) is refused with
// OUT_OF_RANGE, which clears the worker and resubscribes from zero.
func TestSMGPythonRelay(t *testing.T) {
	const dp = 2
	eng, endpoint, replay := startTCPEngine(t, dp)
	py := startPyRelay(t, endpoint, replay, dp, 0)

	g, reg, _ := startGatewayAt(t, fmt.Sprintf("127.0.0.1:%d", py.port))
	eventually(t, "streaming", func() bool { return workerStatus(t, g, "P").State == "streaming" })
	// The Python relay has no history: only what is published after its SUB
	// sockets connect reaches the gateway, so probe until every rank's
	// probes get through.
	for i := 0; len(workerStatus(t, g, "P").Ranks) < dp; i++ {
		if i == 400 {
			t.Fatalf("nothing relayed; relay log:\n%s", py.log())
		}
		step(t, eng, i%dp, tokens(700_000+16*i, 16))
		time.Sleep(25 * time.Millisecond)
	}
	// Everything the engine did before the first relayed batch is unknown
	// to the gateway, so start from a clean engine state.
	if err := eng.Fault(sim.Fault{Kind: sim.FaultResetCache}); err != nil {
		t.Fatal(err)
	}
	workload(t, eng, 40)
	prompt := tokens(30_000, 16*9)
	step(t, eng, 1, prompt)
	assertExact(t, g, map[string]*sim.Engine{"P": eng}, "through SMG's relay")
	assertRoutes(t, g, "through SMG's relay", map[string][]uint32{"P": prompt})

	// Restart the relay on the same port: the monitor resumes with its
	// cursors, the relay refuses, the monitor clears and starts over.
	port := py.port
	py.stop()
	py = startPyRelay(t, endpoint, replay, dp, port)
	eventually(t, "out_of_range resync", func() bool {
		return counter(t, reg, "kvrelay_gateway_resyncs_total", map[string]string{"worker": "P", "reason": "out_of_range"}) >= 1
	})
	eventually(t, "streaming again", func() bool { return workerStatus(t, g, "P").State == "streaming" })
	// Again only what is published after the new SUB sockets connect gets
	// through: probe with new prompts until one does.
	applied := workerStatus(t, g, "P").BatchesApplied
	for i := 0; workerStatus(t, g, "P").BatchesApplied == applied; i++ {
		if i == 400 {
			t.Fatalf("nothing relayed after the resync: %+v; relay log:\n%s", workerStatus(t, g, "P"), py.log())
		}
		step(t, eng, i%dp, tokens(800_000+16*i, 16))
		time.Sleep(25 * time.Millisecond)
	}
	fresh := tokens(60_000, 16*5)
	step(t, eng, 0, fresh)
	eventually(t, "new events indexed after the resync", func() bool {
		d, err := g.Route(RouteRequest{Model: "llama", TokenIDs: fresh})
		return err == nil && d.Reason == picker.ReasonHit && d.MatchedBlocks["P"] == 5
	})
}
