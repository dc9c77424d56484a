package interop

import (
	"fmt"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"testing"

	"github.com/kvrelay/kvrelay/testkit/enginepeer"
	"github.com/kvrelay/kvrelay/testkit/pyenv"
)

// liveSet is the set of blocks an engine holds, per rank, as a test
// publishes them: what a gateway's index must mirror.
type liveSet map[int]map[int64]bool

// chainPublisher returns publish(rank, n): the next n chainBatch steps of
// rank (counted in next, which a test resets when the engine restarts),
// sent through the engine peer and applied to live.
func chainPublisher(t *testing.T, peer *enginepeer.Peer, live liveSet, next []int) func(rank, n int) {
	return func(rank, n int) {
		t.Helper()
		for ; n > 0; n-- {
			evs := chainBatch(rank, next[rank])
			next[rank]++
			peerEvs := make([]enginepeer.Event, len(evs))
			for j, e := range evs {
				peerEvs[j] = e.peer()
			}
			if _, err := peer.Publish(rank, peerEvs...); err != nil {
				t.Fatalf("publish: %v", err)
			}
			live.apply(rank, evs)
		}
	}
}

func (l liveSet) apply(rank int, evs []testEvent) {
	if l[rank] == nil {
		l[rank] = map[int64]bool{}
	}
	for _, e := range evs {
		switch e.kind {
		case "stored":
			for _, h := range e.hashes {
				l[rank][h.fold()] = true
			}
		case "removed":
			for _, h := range e.hashes {
				delete(l[rank], h.fold())
			}
		case "cleared":
			l[rank] = map[int64]bool{}
		}
	}
}

func (l liveSet) count() int {
	n := 0
	for _, r := range l {
		n += len(r)
	}
	return n
}

// chainBatch is batch i of rank's KV-cache life in the gateway test: a
// two-block store chained on the previous batch's last block (16-token
// blocks, the block size the gateway must learn), and from the third batch
// on, the removal of an older block. Hashes are distinct across ranks.
func chainBatch(rank, i int) []testEvent {
	h := func(j int) blockHash { return uh(uint64(rank+1)<<40 | uint64(j)) }
	toks := make([]int64, 32)
	for j := range toks {
		toks[j] = int64(1000*rank + 32*i + j)
	}
	st := testEvent{kind: "stored", hashes: []blockHash{h(2*i + 1), h(2*i + 2)}, tokens: toks, blockSize: 16}
	if i > 0 {
		p := h(2 * i)
		st.parent = &p
	}
	evs := []testEvent{st}
	if i >= 2 {
		evs = append(evs, testEvent{kind: "removed", hashes: []blockHash{h(2*i - 3)}})
	}
	return evs
}

// TestSMGGatewayConsumesKvrelay runs SMG's real gateway (`smg launch`,
// cache_aware, a grpc:// worker URL) against `kvrelay serve`, which proxies
// every other RPC to a stub vLLM servicer and relays a two-rank vLLM peer's
// KV events. The gateway's own logs and metrics must show that it
// subscribes, learns the block size from our events, indexes exactly the
// blocks the engine holds, and after a kvrelay restart resyncs from our
// snapshot to the same set.
func TestSMGGatewayConsumesKvrelay(t *testing.T) {
	const dp = 2
	kvrelayBin(t) // first: a tree that does not build fails before anything starts
	smgBin := filepath.Join(filepath.Dir(pyenv.Python(t)), "smg")
	if _, err := os.Stat(smgBin); err != nil {
		t.Fatalf("SMG's gateway launcher %s: %v (pip install smg into the venv)", smgBin, err)
	}

	peer := enginepeer.Start(t, enginepeer.Options{Engine: enginepeer.VLLM, DPSize: dp})
	stub := startProc(t, "stub_servicer", pyenv.Command(t, pyenv.Script("smg", "stub_servicer.py"), "--port", "0"))
	stubAddr := fmt.Sprintf("127.0.0.1:%d", stub.readyPort(t))

	kvCfg := fmt.Sprintf(`{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:%d", "replay_endpoint": "tcp://*:%d"}`,
		endpointPort(t, peer.PubEndpoint(0)), endpointPort(t, peer.ReplayEndpoint(0)))
	kvPort := freePort(t)
	// A short history, so that after the restart the gateway's cursor has
	// left it and only a snapshot can resync the gateway.
	kvArgs := []string{"--upstream", stubAddr, "--history-batches", "4"}
	kv := startKvrelay(t, "kvrelay serve", "vllm", kvCfg, dp, kvPort, kvArgs...)

	live := liveSet{}
	next := make([]int, dp) // the next chainBatch index per rank
	publish := chainPublisher(t, peer, live, next)
	// The engine ran before the gateway came: kvrelay has it from seq 0.
	publish(0, 2)
	publish(1, 1)

	workerURL := fmt.Sprintf("grpc://127.0.0.1:%d", kvPort)
	smgCmd, metricsURL := smgGatewayCommand(t, smgBin, workerURL)
	smg := startProc(t, "smg gateway", smgCmd)
	logs := []*proc{smg, kv.proc, stub}

	// 1. The gateway registers the worker (through kvrelay's proxy to the
	// stub) and subscribes to KV events at kvrelay.
	smg.waitLine(t, regexp.MustCompile(`Starting KV event subscription.*`+regexp.QuoteMeta(workerURL)), startTimeout)
	smg.waitLine(t, regexp.MustCompile(`KV event stream connected`), waitTimeout)
	// 2. It learns the block size from our events.
	smg.waitLine(t, regexp.MustCompile(`Learned block_size from KV event.*block_size=16`), waitTimeout)
	// 3. Its index holds what the engine holds, first from the history,
	// then from live batches.
	waitIndex(t, metricsURL, live.count(), "after the history", logs...)
	publish(0, 3)
	publish(1, 4)
	waitIndex(t, metricsURL, live.count(), "after live batches", logs...)
	before := gatewayMetrics(t, metricsURL)
	snapshotsBefore, _ := metricSum(before, "smg_kv_event_resyncs_total", map[string]string{"reason": "snapshot"})

	// 4. kvrelay dies; the engine moves on (stores and removals); kvrelay
	// comes back on the same port, primes from the engine's replay ring, and
	// the gateway, whose cursor has left the 4-batch history, is refused
	// (OUT_OF_RANGE), resubscribes from zero and gets our snapshot.
	kv.kill()
	publish(0, 5)
	publish(1, 3)
	kv2 := startKvrelay(t, "kvrelay serve (restarted)", "vllm", kvCfg, dp, kvPort, kvArgs...)
	logs = []*proc{smg, kv2.proc, stub}
	waitFor(t, waitTimeout, func() (bool, string) {
		ms, err := scrape(metricsURL)
		if err != nil {
			return false, err.Error()
		}
		snaps, _ := metricSum(ms, "smg_kv_event_resyncs_total", map[string]string{"reason": "snapshot"})
		return snaps > snapshotsBefore, fmt.Sprintf("smg_kv_event_resyncs_total{reason=\"snapshot\"} is still %g; gateway KV metrics:\n%s",
			snaps, describe(ms, "smg_kv_"))
	}, logs...)
	waitIndex(t, metricsURL, live.count(), "after the restart's snapshot", logs...)
	// kvrelay says it served a snapshot, not history.
	kv2.waitLine(t, regexp.MustCompile(`serving a snapshot`), waitTimeout)

	// 5. Live batches keep flowing after the resync.
	publish(0, 2)
	publish(1, 2)
	waitIndex(t, metricsURL, live.count(), "after live batches past the snapshot", logs...)

	// 6. The engine's rank 0 restarts (a new process: counter back at 0, its
	// cache gone). kvrelay sees the sequence regress, drops rank 0's record
	// and ends the stream with DATA_LOSS; the gateway clears the worker,
	// comes back at 0 and is resynced by a snapshot that holds rank 1's
	// blocks and the new incarnation's.
	dataLossBefore, _ := metricSum(gatewayMetrics(t, metricsURL), "smg_kv_event_resyncs_total", map[string]string{"reason": "data_loss"})
	if err := peer.Restart(0); err != nil {
		t.Fatalf("restart rank 0: %v", err)
	}
	live[0] = map[int64]bool{}
	next[0] = 0
	// kvrelay's SUB reconnects to the new PUB, and what the engine publishes
	// before that lands is dropped (kvrelay later replays it from the new
	// ring): the engine keeps working until kvrelay notices the restart,
	// either from a live sequence below its cursor (11) or from its
	// catch-up replay after the reconnect. It stays below the old cursor:
	// a new counter that had caught up with the old one could pass for
	// the old incarnation, which no relay can tell without an epoch.
	waitFor(t, waitTimeout, func() (bool, string) {
		ms, err := scrape(metricsURL)
		if err != nil {
			return false, err.Error()
		}
		n, _ := metricSum(ms, "smg_kv_event_resyncs_total", map[string]string{"reason": "data_loss"})
		if n <= dataLossBefore && next[0] < 6 {
			publish(0, 1)
		}
		return n > dataLossBefore, fmt.Sprintf("smg_kv_event_resyncs_total{reason=\"data_loss\"} is still %g; gateway KV metrics:\n%s", n, describe(ms, "smg_kv_"))
	}, logs...)
	waitIndex(t, metricsURL, live.count(), "after the engine's rank 0 restarted", logs...)
	publish(0, 1)
	publish(1, 1)
	waitIndex(t, metricsURL, live.count(), "after live batches past the engine restart", logs...)

	// The way there, in the gateway's own counters: one refused resume
	// (our OUT_OF_RANGE, on the call), one DATA_LOSS for the engine
	// restart, a snapshot resync after each, and no batch the gateway had
	// to count as missed.
	after := gatewayMetrics(t, metricsURL)
	t.Logf("gateway KV metrics at the end:\n%s", describe(after, "smg_kv_"))
	for _, c := range []struct {
		name   string
		labels map[string]string
		want   float64
	}{
		{"smg_kv_event_resyncs_total", map[string]string{"reason": "out_of_range"}, 1},
		{"smg_kv_event_resyncs_total", map[string]string{"reason": "snapshot"}, snapshotsBefore + 2},
		{"smg_kv_event_resyncs_total", map[string]string{"reason": "data_loss"}, 1},
		{"smg_kv_event_resyncs_total", map[string]string{"reason": "publisher_restart"}, 0},
		{"smg_kv_event_missed_batches_total", nil, 0},
	} {
		if got, _ := metricSum(after, c.name, c.labels); got != c.want {
			t.Errorf("%s%v = %g, want %g", c.name, c.labels, got, c.want)
		}
	}
	// The worker's other RPCs reached the stub through kvrelay's proxy; the
	// KV stream never did.
	if len(stub.matching(regexp.MustCompile(`"call": "GetModelInfo"`))) == 0 {
		t.Errorf("the stub servicer never answered GetModelInfo: kvrelay's --upstream proxy did not carry the gateway's registration")
	}
	if m := stub.matching(regexp.MustCompile(`SubscribeKvEvents`)); len(m) > 0 {
		t.Errorf("SubscribeKvEvents reached the stub servicer, not kvrelay: %v", m)
	}
	smg.waitLine(t, regexp.MustCompile(`KV event replay cursor expired; clearing worker state and requesting a current snapshot`), waitTimeout)
	smg.waitLine(t, regexp.MustCompile(`KV event relay snapshot applied; continuing with live events`), waitTimeout)
}

// waitIndex waits until the gateway's smg_kv_index_blocks equals want.
func waitIndex(t testing.TB, metricsURL string, want int, when string, logs ...*proc) {
	t.Helper()
	waitFor(t, waitTimeout, func() (bool, string) {
		ms, err := scrape(metricsURL)
		if err != nil {
			return false, err.Error()
		}
		got, found := metricSum(ms, "smg_kv_index_blocks", nil)
		return found && int(got) == want, fmt.Sprintf("%s: smg_kv_index_blocks is %g (present %v), the engine holds %d; gateway KV metrics:\n%s",
			when, got, found, want, describe(ms, "smg_kv_"))
	}, logs...)
}

func gatewayMetrics(t testing.TB, metricsURL string) []sample {
	t.Helper()
	ms, err := scrape(metricsURL)
	if err != nil {
		t.Fatalf("gateway metrics: %v", err)
	}
	return ms
}

// endpointPort is the port of a tcp://host:port endpoint.
func endpointPort(t testing.TB, ep string) int {
	t.Helper()
	u, err := url.Parse(ep)
	if err != nil {
		t.Fatalf("endpoint %q: %v", ep, err)
	}
	p, err := strconv.Atoi(u.Port())
	if err != nil {
		t.Fatalf("endpoint %q: %v", ep, err)
	}
	return p
}
