package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/kvrelay/kvrelay/internal/freeport"
	"github.com/kvrelay/kvrelay/testkit/enginepeer"
	"github.com/kvrelay/kvrelay/testkit/logbuf"
)

// Configurations the engines accept (or that only fail later) that leave
// kvrelay nothing to reach are refused at start, naming the problem.
func TestServeRefusesUnreachableConfigs(t *testing.T) {
	cases := []struct {
		name string
		args []string
		want string
	}{
		{"misspelt key", []string{"--kv-events-config", `{"enable_kv_cache_events": true, "endpont": "tcp://*:6000"}`},
			`unknown key "endpont" (did you mean "endpoint"?)`},
		{"udp endpoint", []string{"--kv-events-config", `{"enable_kv_cache_events": true, "endpoint": "udp://*:5557"}`},
			"cannot use udp://"},
		{"replay on rank 1's publisher port", []string{"--dp-size", "2", "--kv-events-config",
			`{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}`},
			"rank 1's endpoint tcp://127.0.0.1:5558 is also rank 0's replay_endpoint"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			var stderr logbuf.Buffer
			args := append([]string{"serve", "--engine", "vllm", "--listen", "127.0.0.1:0", "--metrics-listen", ""}, tc.args...)
			code := dispatch(context.Background(), args, strings.NewReader(""), io.Discard, &stderr)
			if code != 2 {
				t.Fatalf("exit %d, want 2; stderr: %s", code, stderr.String())
			}
			if !strings.Contains(stderr.String(), tc.want) {
				t.Fatalf("stderr %q does not say %q", stderr.String(), tc.want)
			}
		})
	}
}

func TestServeRefusesABadHistoryVariable(t *testing.T) {
	t.Setenv("SMG_KV_EVENT_HISTORY_BATCHES", "abc")
	var stderr logbuf.Buffer
	code := dispatch(context.Background(), []string{"serve", "--engine", "vllm", "--listen", "127.0.0.1:0", "--metrics-listen", "",
		"--kv-events-config", `{"enable_kv_cache_events": true}`}, strings.NewReader(""), io.Discard, &stderr)
	if code == 0 || !strings.Contains(stderr.String(), `$SMG_KV_EVENT_HISTORY_BATCHES=\"abc\": want a positive integer`) {
		t.Fatalf("exit %d; stderr %q does not name the variable", code, stderr.String())
	}
}

// Every JSON log line of a running relay carries each key once (the relay
// adds its "relay" key; serve once added it too).
func TestServeJSONLogsHaveNoDuplicateKeys(t *testing.T) {
	verifyNoLeaks(t)
	peer := enginepeer.Start(t, enginepeer.Options{Engine: enginepeer.VLLM, DPSize: 1})
	cfg := fmt.Sprintf(`{"enable_kv_cache_events": true, "endpoint": %q, "replay_endpoint": %q}`,
		strings.Replace(peer.PubEndpoint(0), "127.0.0.1", "*", 1), strings.Replace(peer.ReplayEndpoint(0), "127.0.0.1", "*", 1))
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var logs logbuf.Buffer
	done := make(chan int, 1)
	go func() {
		done <- dispatch(ctx, []string{"serve", "--engine", "vllm", "--kv-events-config", cfg, "--listen", freeAddr(t),
			"--metrics-listen", "", "--log-format", "json"}, strings.NewReader(""), io.Discard, &logs)
	}()
	deadline := time.Now().Add(30 * time.Second)
	// The relay's own logger adds "engine" (and "relay") to every line.
	for !strings.Contains(logs.String(), `"engine":"vllm"`) {
		if time.Now().After(deadline) {
			t.Fatalf("the relay logged nothing; logs:\n%s", logs.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
	cancel()
	<-done
	for _, line := range strings.Split(strings.TrimSpace(logs.String()), "\n") {
		if dup := duplicateKey(t, line); dup != "" {
			t.Errorf("key %q twice in %s", dup, line)
		}
	}
	if !strings.Contains(logs.String(), `"msg":"rank endpoints"`) {
		t.Errorf("no rank endpoints line:\n%s", logs.String())
	}
}

// duplicateKey returns a key that occurs twice in the JSON object line.
func duplicateKey(t *testing.T, line string) string {
	dec := json.NewDecoder(strings.NewReader(line))
	if tok, err := dec.Token(); err != nil || tok != json.Delim('{') {
		t.Fatalf("log line is not a JSON object: %s", line)
	}
	seen := map[string]bool{}
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			t.Fatalf("%s: %v", line, err)
		}
		key := tok.(string)
		if seen[key] {
			return key
		}
		seen[key] = true
		var skip json.RawMessage
		if err := dec.Decode(&skip); err != nil {
			t.Fatalf("%s: %v", line, err)
		}
	}
	return ""
}

// /metrics carries the build and every failure counter at 0 before any
// publisher was reached.
func TestServeMetricsBeforeTheFirstEvent(t *testing.T) {
	verifyNoLeaks(t)
	httpAddr := freeAddr(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var logs logbuf.Buffer
	done := make(chan int, 1)
	go func() {
		// Nothing listens at the endpoint: the relay keeps retrying.
		done <- dispatch(ctx, []string{"serve", "--engine", "vllm", "--dp-size", "2", "--listen", freeAddr(t),
			"--metrics-listen", httpAddr, "--kv-events-config", fmt.Sprintf(`{"enable_kv_cache_events": true, "endpoint": "tcp://*:%d"}`, freePortPair(t))},
			strings.NewReader(""), io.Discard, &logs)
	}()
	var body string
	deadline := time.Now().Add(30 * time.Second)
	for {
		resp, err := http.Get("http://" + httpAddr + "/metrics")
		if err == nil {
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			body = string(b)
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("/metrics never answered; logs:\n%s", logs.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
	cancel()
	<-done
	for _, want := range []string{
		`kvrelay_build_info{goversion="go`,
		`kvrelay_publisher_gaps_total{engine="vllm",rank="1",relay="vllm"} 0`,
		`kvrelay_batches_lost_total{engine="vllm",rank="0",relay="vllm"} 0`,
		`kvrelay_publisher_restarts_total{engine="vllm",rank="1",reason="sequence_regression",relay="vllm"} 0`,
		`kvrelay_events_dropped_total{engine="vllm",reason="malformed",relay="vllm"} 0`,
	} {
		if !strings.Contains(body, want) {
			t.Errorf("/metrics lacks %s", want)
		}
	}
}

// freePortPair is a port p with p and p+1 free now (rank 0 and rank 1).
func freePortPair(t *testing.T) int {
	t.Helper()
	p, err := freeport.Range(2)
	if err != nil {
		t.Fatal(err)
	}
	return p
}
