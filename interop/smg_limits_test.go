package interop

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/kvrelay/kvrelay/testkit/enginepeer"
	"github.com/kvrelay/kvrelay/testkit/pyenv"
)

// bigBatch publishes one batch storing n chained blocks of 16 tokens on
// rank 0, hashes from first on: 131,072 of them encode to about 6.5 MB, one
// real engine batch that a relay never splits.
func bigBatch(t *testing.T, peer *enginepeer.Peer, first uint64, n int) {
	t.Helper()
	ev := testEvent{kind: "stored", blockSize: 16, tokens: make([]int64, 16*n), hashes: make([]blockHash, n)}
	for i := range ev.hashes {
		ev.hashes[i] = uh(1<<40 | (first + uint64(i)))
	}
	for i := range ev.tokens {
		ev.tokens[i] = int64((int(first)*16 + i) % 150_000)
	}
	if first > 1 {
		p := uh(1<<40 | (first - 1))
		ev.parent = &p
	}
	if _, err := peer.Publish(0, ev.peer()); err != nil {
		t.Fatalf("publish %d blocks: %v", n, err)
	}
}

// TestGatewaysTakeAMillionBlockSnapshotAndA131kBlockBatch measures what
// gateways accept from kvrelay: a state snapshot of 1,048,576 blocks (kvrelay
// keeps every chunk under 4 MiB; with 8 batches behind the cursor most chunks
// are stamped 0) and one live batch of 131,072 blocks (about 8 MB, over the 4
// MiB that gRPC clients accept by default, and never split: a gateway drops a
// repeated sequence as stale). Our gateway takes both. So does SMG's gateway
// (smg 1.13.0 from the venv): measured here, its KV subscription decodes
// messages over 4 MiB (the smg-project/smg mirror at f8daa88, older, builds
// its clients with tonic's 4 MiB default). The test fails if that changes.
func TestGatewaysTakeAMillionBlockSnapshotAndA131kBlockBatch(t *testing.T) {
	if os.Getenv("KVRELAY_HEAVY_INTEROP") == "" {
		t.Skip("publishes 1.2 M blocks through SMG's gateway (minutes, ~2 GiB); set KVRELAY_HEAVY_INTEROP=1 to run it")
	}
	kvrelayBin(t)
	smgBin := filepath.Join(filepath.Dir(pyenv.Python(t)), "smg")
	if _, err := os.Stat(smgBin); err != nil {
		t.Fatalf("SMG's gateway launcher %s: %v (pip install smg into the venv)", smgBin, err)
	}
	peer := enginepeer.Start(t, enginepeer.Options{Engine: enginepeer.VLLM, DPSize: 1, Timeout: 5 * time.Minute})
	stub := startProc(t, "stub_servicer", pyenv.Command(t, pyenv.Script("smg", "stub_servicer.py"), "--port", "0"))
	stubAddr := fmt.Sprintf("127.0.0.1:%d", stub.readyPort(t))
	kvCfg := fmt.Sprintf(`{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:%d", "replay_endpoint": "tcp://*:%d"}`,
		endpointPort(t, peer.PubEndpoint(0)), endpointPort(t, peer.ReplayEndpoint(0)))
	kvPort := freePort(t)
	kv := startKvrelay(t, "kvrelay serve", "vllm", kvCfg, 1, kvPort, "--upstream", stubAddr, "--history-batches", "2")

	// 1. The engine holds 1,048,576 blocks before any gateway comes, and
	// the history no longer starts at its first batch: a gateway gets a
	// snapshot.
	const per = 131_072
	batches := 8
	if os.Getenv("KVRELAY_HEAVY_INTEROP") == "batch" {
		batches = 1 // only the live batch's part is of interest
	}
	for i := 0; i < batches; i++ {
		bigBatch(t, peer, uint64(i*per+1), per)
	}
	held := batches * per
	waitFor(t, startTimeout, func() (bool, string) {
		ms, err := scrape(kv.metrics + "/metrics")
		if err != nil {
			return false, err.Error()
		}
		n, _ := metricSum(ms, "kvrelay_record_blocks", nil)
		return int(n) == held, fmt.Sprintf("kvrelay_record_blocks %g, want %d", n, held)
	}, kv.proc)

	workerURL := fmt.Sprintf("grpc://127.0.0.1:%d", kvPort)
	ourPort := freePort(t)
	smgCmd, smgMetrics := smgGatewayCommand(t, smgBin, workerURL)
	smg := startProc(t, "smg gateway", smgCmd)
	ours := startProc(t, "kvrelay gateway", exec.Command(kvrelayBin(t), "gateway",
		"--worker", workerURL, "--listen", fmt.Sprintf("127.0.0.1:%d", ourPort)))
	ourMetrics := fmt.Sprintf("http://127.0.0.1:%d/metrics", ourPort)
	logs := []*proc{smg, ours, kv.proc}
	smg.waitLine(t, regexp.MustCompile(`KV event stream connected`), startTimeout)
	waitIndexes := func(want int, when string) {
		t.Helper()
		waitFor(t, 3*startTimeout, func() (bool, string) {
			smgMs, err := scrape(smgMetrics)
			if err != nil {
				return false, err.Error()
			}
			ourMs, err := scrape(ourMetrics)
			if err != nil {
				return false, err.Error()
			}
			s, _ := metricSum(smgMs, "smg_kv_index_blocks", nil)
			o, _ := metricSum(ourMs, "kvrelay_gateway_index_blocks", nil)
			return int(s) == want && int(o) == want, fmt.Sprintf("%s: SMG indexes %g blocks, ours %g, want %d", when, s, o, want)
		}, logs...)
	}
	// 2. Both take the snapshot.
	waitIndexes(held, "the 1 M-block snapshot")
	if batches > 2 {
		// More batches than the history keeps: the state came as a snapshot.
		line := kv.waitLine(t, regexp.MustCompile(`serving a snapshot`), waitTimeout)
		snaps, _ := metricSum(gatewayMetrics(t, smgMetrics), "smg_kv_event_resyncs_total", map[string]string{"reason": "snapshot"})
		if snaps < 1 {
			t.Fatalf("SMG's gateway counts no snapshot resync; kvrelay: %s", line)
		}
		t.Logf("kvrelay: %s", line)
	}
	t.Logf("SMG's gateway and ours hold the %d-block state", held)

	// 3. One live batch of 131,072 blocks. Ours takes it; SMG's refuses a
	// message over its 4 MiB decode limit, and retries.
	bigBatch(t, peer, uint64(held+1), per)
	waitFor(t, 3*startTimeout, func() (bool, string) {
		ms, err := scrape(ourMetrics)
		if err != nil {
			return false, err.Error()
		}
		o, _ := metricSum(ms, "kvrelay_gateway_index_blocks", nil)
		return int(o) == held+per, fmt.Sprintf("our gateway indexes %g blocks, want %d", o, held+per)
	}, logs...)
	waitFor(t, 2*startTimeout, func() (bool, string) {
		ms, err := scrape(smgMetrics)
		if err != nil {
			return false, err.Error()
		}
		n, _ := metricSum(ms, "smg_kv_index_blocks", nil)
		lines := smg.matching(regexp.MustCompile(`(?i)kv.event|too large|exhaust|decod`))
		if len(lines) > 20 {
			lines = lines[len(lines)-20:]
		}
		return int(n) == held+per, fmt.Sprintf("SMG's gateway indexes %g blocks after the 131,072-block batch, want %d; its KV metrics:\n%s\nits KV log lines:\n%s",
			n, held+per, describe(ms, "smg_kv_"), strings.Join(lines, "\n"))
	}, logs...)
	ms, err := scrape(kv.metrics + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	histBytes, _ := metricSum(ms, "kvrelay_history_bytes", nil)
	histEntries, _ := metricSum(ms, "kvrelay_history_entries", nil)
	if histEntries > 0 && histBytes/histEntries <= 4<<20 {
		t.Fatalf("the batches average %.0f encoded bytes: not over 4 MiB, so this measures nothing", histBytes/histEntries)
	}
	t.Logf("SMG's gateway and ours took the %d-block snapshot and a live batch of %d blocks (%.1f MB encoded)", held, per, histBytes/histEntries/1e6)
}
