package interop

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"regexp"
	"testing"
	"time"

	"github.com/kvrelay/kvrelay/testkit/enginepeer"
	"github.com/kvrelay/kvrelay/testkit/pyenv"
)

// TestSMGGatewayUsesKvrelaysLoadRecords: kvrelay reads the engine's load
// and stamps the records on its stream; SMG's real gateway, consuming
// kvrelay, takes them as the worker's pushed load: it skips its own GetLoads
// polls because the push is fresh, and its per-rank cache-hit-rate gauge
// shows each rank's figure. Two sources: the servicer's GetLoads (a stub on
// SMG's generated messages, the figures SMG's own polls would get too), and
// the engine's HTTP /v1/loads with other figures than the servicer's, so
// that the gauge can show them only from kvrelay's records.
func TestSMGGatewayUsesKvrelaysLoadRecords(t *testing.T) {
	const dp = 2
	kvrelayBin(t)
	smgBin := filepath.Join(filepath.Dir(pyenv.Python(t)), "smg")
	if _, err := os.Stat(smgBin); err != nil {
		t.Fatalf("SMG's gateway launcher %s: %v (pip install smg into the venv)", smgBin, err)
	}
	engineHTTP := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		fmt.Fprint(w, `{"loads": [{"dp_rank": 0, "num_running_reqs": 3, "num_waiting_reqs": 1, "token_usage": 0.25, "gen_throughput": 200.0, "cache_hit_rate": 0.875},
		                          {"dp_rank": 1, "num_running_reqs": 1, "num_waiting_reqs": 0, "token_usage": 0.125, "gen_throughput": 50.0, "cache_hit_rate": 0.125}]}`)
	}))
	defer engineHTTP.Close()
	cases := []struct {
		name       string
		flags      []string
		hit0, hit1 float64
	}{
		{"getloads", nil, 0.625, 0.375},
		{"engine-metrics-url", []string{"--engine-metrics-url", engineHTTP.URL}, 0.875, 0.125},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			peer := enginepeer.Start(t, enginepeer.Options{Engine: enginepeer.VLLM, DPSize: dp})
			loads := `{"0": {"num_running_reqs": 3, "num_waiting_reqs": 1, "token_usage": 0.25, "gen_throughput": 200.0, "cache_hit_rate": 0.625, "max_running_requests": 64, "num_used_tokens": 100, "max_total_num_tokens": 400},
			           "1": {"num_running_reqs": 1, "num_waiting_reqs": 0, "token_usage": 0.125, "gen_throughput": 50.0, "cache_hit_rate": 0.375, "max_running_requests": 64, "num_used_tokens": 50, "max_total_num_tokens": 400}}`
			stub := startProc(t, "stub_servicer", pyenv.Command(t, pyenv.Script("smg", "stub_servicer.py"), "--port", "0", "--loads", loads))
			stubAddr := fmt.Sprintf("127.0.0.1:%d", stub.readyPort(t))
			kvCfg := fmt.Sprintf(`{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:%d", "replay_endpoint": "tcp://*:%d"}`,
				endpointPort(t, peer.PubEndpoint(0)), endpointPort(t, peer.ReplayEndpoint(0)))
			kvPort := freePort(t)
			kv := startKvrelay(t, "kvrelay serve", "vllm", kvCfg, dp, kvPort, append([]string{"--upstream", stubAddr}, tc.flags...)...)
			live := liveSet{}
			publish := chainPublisher(t, peer, live, make([]int, dp))
			publish(0, 1)
			publish(1, 1)

			workerURL := fmt.Sprintf("grpc://127.0.0.1:%d", kvPort)
			smgCmd, metricsURL := smgGatewayCommand(t, smgBin, workerURL)
			smg := startProc(t, "smg gateway", smgCmd)
			logs := []*proc{smg, kv.proc, stub}
			smg.waitLine(t, regexp.MustCompile(`KV event stream connected`), waitTimeout)
			waitIndex(t, metricsURL, live.count(), "after the history", logs...)

			// Heartbeats renew only the rank of the stream's last batch (SMG's
			// servicer rule), so on an idle two-rank engine one rank's record
			// ages past the gateway's poll tick. An engine at work publishes on
			// every rank; so does this one while the test waits.
			lastBusy := time.Now()
			waitFor(t, waitTimeout, func() (bool, string) {
				if time.Since(lastBusy) > 2*time.Second {
					publish(0, 1)
					publish(1, 1)
					lastBusy = time.Now()
				}
				ms, err := scrape(metricsURL)
				if err != nil {
					return false, err.Error()
				}
				skipped, _ := metricSum(ms, "smg_engine_load_polls_total", map[string]string{"mode": "skipped_fresh_push"})
				hit0, ok0 := metricSum(ms, "smg_engine_cache_hit_rate", map[string]string{"dp_rank": "0"})
				hit1, ok1 := metricSum(ms, "smg_engine_cache_hit_rate", map[string]string{"dp_rank": "1"})
				done := skipped > 0 && ok0 && ok1 && hit0 == tc.hit0 && hit1 == tc.hit1
				return done, fmt.Sprintf("want skipped_fresh_push > 0 and hit rates %g, %g: polls skipped %g, cache hit rate rank 0 %g (%v), rank 1 %g (%v); gateway engine metrics:\n%s",
					tc.hit0, tc.hit1, skipped, hit0, ok0, hit1, ok1, describe(ms, "smg_engine_"))
			}, logs...)
			calls := len(stub.matching(regexp.MustCompile(`"call": "GetLoads"`)))
			if tc.flags == nil && calls == 0 {
				t.Errorf("the stub servicer never answered GetLoads: kvrelay's load source did not read it")
			}
		})
	}
}
