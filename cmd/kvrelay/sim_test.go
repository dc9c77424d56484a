package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/kvrelay/kvrelay/internal/freeport"
	"github.com/kvrelay/kvrelay/sim"
	"github.com/kvrelay/kvrelay/testkit/logbuf"
)

func TestSimFlagErrors(t *testing.T) {
	ok := `{"enable_kv_cache_events": true}`
	tests := []struct {
		args []string
		want string
	}{
		{[]string{}, "--engine is required"},
		{[]string{"--engine", "trtllm", "--kv-events-config", ok}, "--engine"},
		{[]string{"--engine", "vllm"}, "--kv-events-config is required"},
		{[]string{"--engine", "vllm", "--kv-events-config", `{"enable_kv_cache_events": tru`}, "--kv-events-config"},
		{[]string{"--engine", "vllm", "--kv-events-config", `{}`}, "disabled"},
		{[]string{"--engine", "sglang", "--kv-events-config", ok}, "disabled"},
		{[]string{"--engine", "vllm", "--kv-events-config", ok, "--wire", "array5"}, "--wire"},
		{[]string{"--engine", "vllm", "--kv-events-config", ok, "--dp-size", "0"}, "--dp-size"},
		{[]string{"--engine", "vllm", "--kv-events-config", ok, "--rate", "-1"}, "--rate"},
		{[]string{"--engine", "vllm", "--kv-events-config", ok, "--capacity-blocks", "0"}, "--capacity-blocks"},
		{[]string{"--engine", "vllm", "--kv-events-config", ok, "--block-size", "0"}, "--block-size"},
		{[]string{"--engine", "vllm", "--kv-events-config", ok, "--drop-every", "-3"}, "--drop-every"},
		{[]string{"--engine", "vllm", "--kv-events-config", ok, "--log-level", "loud"}, "--log-level"},
		{[]string{"--engine", "vllm", "--kv-events-config", ok, "--no-such-flag"}, "no-such-flag"},
		{[]string{"--engine", "vllm", "--kv-events-config", ok, "extra"}, "unexpected argument"},
	}
	for _, tc := range tests {
		var stderr bytes.Buffer
		code := dispatch(context.Background(), append([]string{"sim"}, tc.args...), nil, &bytes.Buffer{}, &stderr)
		if code != 2 || !strings.Contains(stderr.String(), tc.want) {
			t.Errorf("%v: exit %d, stderr %q (want 2 mentioning %q)", tc.args, code, stderr.String(), tc.want)
		}
	}
}

// TestSimRuns starts the subcommand with two ranks and a control endpoint,
// waits until its workload has filled both ranks' caches, and stops it by
// cancelling its context.
func TestSimRuns(t *testing.T) {
	// Live ports base, base+1; replay base+2, base+3; control base+4.
	base := freeport.ForTest(t, 5)
	ctl := fmt.Sprintf("127.0.0.1:%d", base+4)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	stderr := &logbuf.Buffer{}
	done := make(chan int, 1)
	go func() {
		done <- dispatch(ctx, []string{"sim", "--engine", "sglang", "--dp-size", "2", "--rate", "400",
			"--step-interval", "10ms", "--block-size", "8", "--system-prompt-tokens", "32", "--tokens-per-turn", "8",
			"--kv-events-config", fmt.Sprintf(`{"publisher": "zmq", "endpoint": "tcp://*:%d", "replay_endpoint": "tcp://*:%d"}`, base, base+2),
			"--control", ctl}, nil, &bytes.Buffer{}, stderr)
	}()
	client := &http.Client{Timeout: 2 * time.Second}
	defer client.CloseIdleConnections()
	deadline := time.Now().Add(10 * time.Second)
	for {
		select {
		case code := <-done:
			t.Fatalf("sim exited early with %d: %s", code, stderr.String())
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("the sim's ranks never filled: %s", stderr.String())
		}
		time.Sleep(50 * time.Millisecond)
		resp, err := client.Get("http://" + ctl + "/live")
		if err != nil {
			continue
		}
		var live sim.LiveJSON
		err = json.NewDecoder(resp.Body).Decode(&live)
		resp.Body.Close()
		if err != nil {
			t.Fatal(err)
		}
		if len(live.Ranks) != 2 {
			t.Fatalf("ranks %d", len(live.Ranks))
		}
		if len(live.Ranks[0].Blocks) > 0 && len(live.Ranks[1].Blocks) > 0 && live.Ranks[1].NextSeq > 1 {
			break
		}
	}
	cancel()
	select {
	case code := <-done:
		if code != 0 {
			t.Fatalf("exit %d: %s", code, stderr.String())
		}
	case <-time.After(5 * time.Second):
		t.Fatal("sim did not stop after its context was cancelled")
	}
	if !strings.Contains(stderr.String(), fmt.Sprintf("tcp://127.0.0.1:%d", base+1)) {
		t.Fatalf("rank 1's endpoint not logged: %s", stderr.String())
	}
}
