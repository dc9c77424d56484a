package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kvrelay/kvrelay/testkit/enginepeer"
	"github.com/kvrelay/kvrelay/testkit/logbuf"
)

func TestServeBadFlagsNameTheFlag(t *testing.T) {
	dir := t.TempDir()
	write := func(name, body string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(body), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	enabled := `{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557"}`
	cases := []struct {
		name string
		args []string
		want string
	}{
		{"no engine", []string{"--kv-events-config", enabled}, "--engine"},
		{"unknown engine", []string{"--engine", "trt", "--kv-events-config", enabled}, "engine"},
		{"no config", []string{"--engine", "vllm"}, "--kv-events-config"},
		{"bad json", []string{"--engine", "vllm", "--kv-events-config", "{nope"}, "kv-events-config"},
		{"bad dp size", []string{"--engine", "vllm", "--kv-events-config", enabled, "--dp-size", "0"}, "dp-size"},
		{"ipc at rank 1", []string{"--engine", "vllm", "--kv-events-config", `{"enable_kv_cache_events": true, "endpoint": "ipc:///tmp/kv"}`, "--dp-size", "2"}, "rank 1"},
		{"bad listen", []string{"--engine", "vllm", "--kv-events-config", enabled, "--listen", "nowhere"}, "listen"},
		{"bad upstream", []string{"--engine", "vllm", "--kv-events-config", enabled, "--upstream", "nohost"}, "upstream"},
		{"negative history", []string{"--engine", "vllm", "--kv-events-config", enabled, "--history-batches", "-1"}, "history-batches"},
		{"suppression without report mode full", []string{"--engine", "vllm", "--kv-events-config", enabled, "--suppress-reannounced-stores"}, "suppress-reannounced-stores needs report-mode-full"},
		{"report mode flag with config", []string{"--config", write("e.json", `{"relays": []}`), "--report-mode-full"}, "--report-mode-full cannot be combined"},
		{"bad log level", []string{"--engine", "vllm", "--kv-events-config", enabled, "--log-level", "loud"}, "--log-level"},
		{"zero message size", []string{"--engine", "vllm", "--kv-events-config", enabled, "--max-message-bytes", "0"}, "--max-message-bytes"},
		{"queue below one message", []string{"--engine", "vllm", "--kv-events-config", enabled, "--max-message-bytes", "1000", "--zmq-queue-bytes", "999"}, "--zmq-queue-bytes"},
		{"negative replay batches", []string{"--engine", "vllm", "--kv-events-config", enabled, "--replay-max-batches", "-1"}, "--replay-max-batches"},
		{"zero replay bytes", []string{"--engine", "vllm", "--kv-events-config", enabled, "--replay-max-bytes", "0"}, "--replay-max-bytes"},
		{"zero replay time", []string{"--engine", "vllm", "--kv-events-config", enabled, "--replay-max-time", "0s"}, "--replay-max-time"},
		{"unknown flag", []string{"--engines", "vllm"}, "engines"},
		{"zero subscribers", []string{"--engine", "vllm", "--kv-events-config", enabled, "--max-subscribers", "0"}, "--max-subscribers"},
		{"zero per peer", []string{"--engine", "vllm", "--kv-events-config", enabled, "--max-subscribers-per-peer", "0"}, "--max-subscribers-per-peer"},
		{"zero streams per conn", []string{"--engine", "vllm", "--kv-events-config", enabled, "--max-streams-per-conn", "0"}, "--max-streams-per-conn"},
		{"no stall timeout", []string{"--engine", "vllm", "--kv-events-config", enabled, "--subscriber-stall-timeout", "0s"}, "--subscriber-stall-timeout"},
		{"send cap under 4 MiB", []string{"--engine", "vllm", "--kv-events-config", enabled, "--max-send-msg-bytes", "1000"}, "--max-send-msg-bytes"},
		{"bad gomaxprocs", []string{"--engine", "vllm", "--kv-events-config", enabled, "--gomaxprocs", "some"}, `--gomaxprocs "some"`},
		{"zero gomaxprocs", []string{"--engine", "vllm", "--kv-events-config", enabled, "--gomaxprocs", "0"}, "--gomaxprocs"},
		{"zero record cap", []string{"--engine", "vllm", "--kv-events-config", enabled, "--record-max-entries", "0"}, "--record-max-entries"},
		{"config and flags", []string{"--config", write("a.json", `{"relays": []}`), "--engine", "vllm"}, "--engine cannot be combined"},
		{"config unknown field", []string{"--config", write("b.json", `{"relays": [{"engine": "vllm", "kv_events_config": {}, "listen": ":1", "colour": "red"}]}`)}, "colour"},
		{"config empty", []string{"--config", write("c.json", `{"relays": []}`)}, "relays"},
		{"config missing file", []string{"--config", filepath.Join(dir, "none.json")}, "--config"},
		{"config same service twice on one listener", []string{"--config", write("d.json", `{"metrics_listen": "", "relays": [
			{"name": "a", "engine": "vllm", "kv_events_config": {"enable_kv_cache_events": true, "endpoint": "tcp://127.0.0.1:1"}, "listen": "127.0.0.1:0"},
			{"name": "b", "engine": "vllm", "kv_events_config": {"enable_kv_cache_events": true, "endpoint": "tcp://127.0.0.1:3"}, "listen": "127.0.0.1:0"}]}`)}, "own listener"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			var stderr logbuf.Buffer
			code := dispatch(context.Background(), append([]string{"serve"}, tc.args...), strings.NewReader(""), io.Discard, &stderr)
			if code == 0 {
				t.Fatalf("exit 0, want a failure; stderr: %s", stderr.String())
			}
			if !strings.Contains(stderr.String(), tc.want) {
				t.Fatalf("stderr %q does not name %q", stderr.String(), tc.want)
			}
		})
	}
}

func freeAddr(t *testing.T) string {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer lis.Close()
	return lis.Addr().String()
}

// TestServeRelaysAPeerToTail runs the daemon against a pyzmq engine peer, reads
// its stream with `kvrelay tail`, checks /debug/status and /metrics, and stops
// it the way SIGTERM does (context cancel).
func TestServeRelaysAPeerToTail(t *testing.T) {
	verifyNoLeaks(t)
	peer := enginepeer.Start(t, enginepeer.Options{Engine: enginepeer.VLLM, DPSize: 2})
	grpcAddr, httpAddr := freeAddr(t), freeAddr(t)
	cfg := fmt.Sprintf(`{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": %q, "replay_endpoint": %q}`,
		strings.Replace(peer.PubEndpoint(0), "127.0.0.1", "*", 1), peer.ReplayEndpoint(0))

	srv := runInBackground(t, "serve", "--engine", "vllm", "--kv-events-config", cfg, "--dp-size", "2",
		"--listen", grpcAddr, "--metrics-listen", httpAddr, "--replay-timeout", "2s")
	ctx := srv.ctx

	get := func(path string) (int, string) {
		resp, err := http.Get("http://" + httpAddr + path)
		if err != nil {
			return 0, err.Error()
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(body)
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		if code, _ := get("/healthz"); code == http.StatusOK {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("kvrelay serve never became healthy; stderr:\n%s", srv.stderr.String())
		}
		time.Sleep(50 * time.Millisecond)
	}
	for rank := 0; rank < 2; rank++ {
		for i := 0; i < 2; i++ {
			if _, err := peer.Publish(rank, enginepeer.Stored(nil, []int64{1, 2, 3, 4}, enginepeer.U64(uint64(10*rank+i+1)))); err != nil {
				t.Fatal(err)
			}
		}
	}

	var out, errOut logbuf.Buffer
	tctx, tcancel := context.WithTimeout(ctx, 30*time.Second)
	defer tcancel()
	if code := dispatch(tctx, []string{"tail", "--addr", grpcAddr, "--service", "vllm", "--json", "-n", "4"}, strings.NewReader(""), &out, &errOut); code != 0 {
		t.Fatalf("tail exit %d: %s", code, errOut.String())
	}
	lines := strings.Split(strings.TrimSpace(out.String()), "\n")
	if len(lines) != 4 {
		t.Fatalf("tail printed %d lines, want 4:\n%s", len(lines), out.String())
	}
	ranks := map[float64]int{}
	for _, line := range lines {
		var b map[string]any
		if err := json.Unmarshal([]byte(line), &b); err != nil {
			t.Fatalf("tail line is not JSON: %q", line)
		}
		rank, _ := b["dpRank"].(float64)
		ranks[rank]++
	}
	if ranks[0] != 2 || ranks[1] != 2 {
		t.Fatalf("want 2 batches of each rank, got %v", ranks)
	}

	code, status := get("/debug/status")
	if code != http.StatusOK || !strings.Contains(status, `"rank": 1`) || !strings.Contains(status, `"record_blocks": 4`) {
		t.Fatalf("/debug/status %d:\n%s", code, status)
	}
	code, metrics := get("/metrics")
	if code != http.StatusOK || !strings.Contains(metrics, "kvrelay_") || !strings.Contains(metrics, `relay="vllm"`) {
		t.Fatalf("/metrics %d lacks kvrelay_ series:\n%.2000s", code, metrics)
	}

	srv.stop(t)
}

// Relays on two listeners start: each listener registers its gRPC series
// under its own listener label (one metric name must have one label set,
// which once stopped a two-listener config at start-up).
func TestServeRunsRelaysOnTwoListeners(t *testing.T) {
	verifyNoLeaks(t)
	dir := t.TempDir()
	grpcA, grpcB, httpAddr := freeAddr(t), freeAddr(t), freeAddr(t)
	cfg := fmt.Sprintf(`{"metrics_listen": %q, "relays": [
		{"name": "a", "engine": "vllm", "kv_events_config": {"enable_kv_cache_events": true, "endpoint": "tcp://127.0.0.1:1"}, "listen": %q},
		{"name": "b", "engine": "sglang", "kv_events_config": {"publisher": "zmq", "endpoint": "tcp://127.0.0.1:3"}, "listen": %q}]}`,
		httpAddr, grpcA, grpcB)
	path := filepath.Join(dir, "kvrelay.json")
	if err := os.WriteFile(path, []byte(cfg), 0o600); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var stderr logbuf.Buffer
	done := make(chan int, 1)
	go func() {
		done <- dispatch(ctx, []string{"serve", "--config", path}, strings.NewReader(""), io.Discard, &stderr)
	}()
	deadline := time.Now().Add(20 * time.Second)
	for {
		resp, err := http.Get("http://" + httpAddr + "/metrics")
		if err == nil {
			body, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if strings.Contains(string(body), `relay="a"`) && strings.Contains(string(body), `relay="b"`) {
				break
			}
		}
		select {
		case code := <-done:
			t.Fatalf("serve exited with %d; stderr:\n%s", code, stderr.String())
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("both relays never showed in /metrics; stderr:\n%s", stderr.String())
		}
		time.Sleep(50 * time.Millisecond)
	}
	cancel()
	if code := <-done; code != 0 {
		t.Fatalf("serve exit %d; stderr:\n%s", code, stderr.String())
	}
}
