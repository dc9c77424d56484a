package main

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"regexp"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/kvrelay/kvrelay/internal/freeport"
	"github.com/kvrelay/kvrelay/sim"
	"github.com/kvrelay/kvrelay/testkit/apiclient"
	"github.com/kvrelay/kvrelay/testkit/logbuf"
	"github.com/kvrelay/kvrelay/testkit/testnats"
)

// TestServeNATSFeedsGatewayNATSEvents: `kvrelay serve --nats` publishes a
// simulated engine's batches to JetStream, and `kvrelay gateway --nats
// --nats-events`, whose only address for the worker is dead, indexes the
// engine's blocks from the stream and says it reads them from NATS.
func TestServeNATSFeedsGatewayNATSEvents(t *testing.T) {
	// As verifyNoLeaks, less zmq4's PUB writer, which outlives its
	// socket's Close (the simulator's publisher; see relay's TestMain).
	opt := goleak.IgnoreCurrent()
	t.Cleanup(func() {
		http.DefaultClient.CloseIdleConnections()
		goleak.VerifyNone(t, opt, goleak.IgnoreAnyFunction("github.com/go-zeromq/zmq4.(*pubMWriter).run"))
	})
	// max_payload takes a snapshot chunk (NATS's default 1 MiB does not).
	ns := testnats.Start(t, testnats.Config{MaxPayload: 8 << 20})

	// Two streams on one server, as two model groups would have them: the
	// default, and one with its own stream and subject prefix (JetStream
	// refuses a second stream over the first one's subjects).
	// Issue 30: events over JetStream with placements off (and so none
	// shared) is a gateway that takes --placement-weight 0.
	for _, tc := range []struct {
		name, stream, subjects string
		gatewayExtra           []string
		placementsShared       bool
	}{
		{"default stream", "", "", nil, true},
		{"a model group's own stream", "KVRELAY_EVENTS_LLAMA", "kvrelay.llama-events", nil, true},
		{"placements off", "KVRELAY_EVENTS_NOPL", "kvrelay.nopl-events", []string{"--placement-weight", "0", "--nats-share-load=false"}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var serveArgs, gatewayArgs []string
			if tc.stream != "" {
				serveArgs = []string{"--nats-stream", tc.stream, "--nats-events-subject-prefix", tc.subjects}
				gatewayArgs = serveArgs
			}
			metrics := feedGatewayOverNATS(t, ns.URL(), serveArgs, append(gatewayArgs, tc.gatewayExtra...))
			if got := strings.Contains(metrics, "kvrelay_gateway_placements_shared_total"); got != tc.placementsShared {
				t.Errorf("the gateway's metrics have placements shared over NATS: %v, want %v", got, tc.placementsShared)
			}
		})
	}
}

// feedGatewayOverNATS runs a simulated engine, kvrelay serve --nats and
// kvrelay gateway --nats-events (each with its extra flags) until the
// gateway has indexed the engine's blocks through JetStream alone (its
// worker's gRPC address is dead). It returns the gateway's metrics then.
func feedGatewayOverNATS(t *testing.T, natsURL string, serveArgs, gatewayArgs []string) (metrics string) {
	eng, cfg := startSimVLLM(t)

	srv := runInBackground(t, append([]string{"serve", "--engine", "vllm", "--kv-events-config", cfg, "--listen", freeAddr(t),
		"--metrics-listen", "", "--nats", natsURL, "--nats-worker", "engine-a"}, serveArgs...)...)
	gw := runInBackground(t, append([]string{"gateway", "--worker", "grpc://127.0.0.1:1", "--listen", "127.0.0.1:0",
		"--nats", natsURL, "--nats-events", "--nats-worker-name", "grpc://127.0.0.1:1=engine-a"}, gatewayArgs...)...)
	addrRE := regexp.MustCompile(`gateway listening\"? addr=(\S+)`)
	var addr string
	deadline := time.Now().Add(30 * time.Second)
	for blocks := 0; ; {
		if addr == "" {
			if m := addrRE.FindStringSubmatch(gw.stderr.String()); m != nil {
				addr = m[1]
			}
		}
		if _, err := eng.RunWorkload(5); err != nil {
			t.Fatal(err)
		}
		if addr != "" {
			m := apiclient.Get(t, "http://"+addr+"/metrics")
			metrics = m
			if strings.Contains(m, `kvrelay_gateway_events_source{source="nats",worker="grpc://127.0.0.1:1"} 1`) &&
				strings.Contains(apiclient.Get(t, "http://"+addr+"/v1/workers"), `"index_blocks"`) {
				fmt.Sscan(indexBlocks(apiclient.Get(t, "http://"+addr+"/v1/workers")), &blocks)
				if blocks > 0 {
					break
				}
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("the gateway never indexed the engine over NATS; serve:\n%s\ngateway:\n%s", srv.stderr.String(), gw.stderr.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
	gw.stop(t)
	srv.stop(t)
	return metrics
}

// startSimVLLM starts a simulated vLLM engine (one rank, block size 16)
// publishing on free loopback ports until the test ends, and returns it
// with the --kv-events-config that reaches it.
func startSimVLLM(t *testing.T) (*sim.Engine, string) {
	t.Helper()
	live := freeport.ForTest(t, 2)
	ctx, cancel := context.WithCancel(context.Background())
	cfg := fmt.Sprintf(`{"enable_kv_cache_events": true, "endpoint": "tcp://*:%d", "replay_endpoint": "tcp://*:%d"}`, live, live+1)
	eng, err := sim.Start(ctx, sim.Options{Engine: "vllm", BlockSize: 16, CapacityBlocks: 128, KVEventsConfig: cfg})
	if err != nil {
		cancel()
		t.Fatal(err)
	}
	t.Cleanup(func() { cancel(); _ = eng.Close() })
	return eng, cfg
}

var indexBlocksRE = regexp.MustCompile(`"index_blocks":\s*(\d+)`)

func indexBlocks(workersJSON string) string {
	if m := indexBlocksRE.FindStringSubmatch(workersJSON); m != nil {
		return m[1]
	}
	return "0"
}

// TestNATSEventsFlagsRefused: the JetStream flags refuse what they cannot do,
// naming the flag, before anything starts.
func TestNATSEventsFlagsRefused(t *testing.T) {
	for _, tc := range []struct {
		name string
		args []string
		want string
	}{
		{"serve worker name without --nats", []string{"serve", "--engine", "vllm", "--kv-events-config", `{"enable_kv_cache_events": true}`, "--nats-worker", "a"}, "--nats-worker needs --nats"},
		{"gateway --nats-events without --nats", []string{"gateway", "--worker", "grpc://127.0.0.1:1", "--nats-events"}, "--nats-events needs --nats"},
		{"gateway worker name without --nats-events", []string{"gateway", "--worker", "grpc://127.0.0.1:1", "--nats-worker-name", "a=b"}, "--nats-worker-name needs --nats-events"},
		{"serve subject prefix without --nats", []string{"serve", "--engine", "vllm", "--kv-events-config", `{"enable_kv_cache_events": true}`, "--nats-events-subject-prefix", "x.y"}, "--nats-events-subject-prefix needs --nats"},
		{"gateway subject prefix without --nats-events", []string{"gateway", "--worker", "grpc://127.0.0.1:1", "--nats-events-subject-prefix", "x.y"}, "--nats-events-subject-prefix needs --nats-events"},
		{"serve announcement interval without --nats", []string{"serve", "--engine", "vllm", "--kv-events-config", `{"enable_kv_cache_events": true}`, "--nats-alive-every", "2s"}, "--nats-alive-every needs --nats"},
		{"serve announcement interval above a minute", []string{"serve", "--engine", "vllm", "--kv-events-config", `{"enable_kv_cache_events": true}`, "--nats", "nats://127.0.0.1:1", "--nats-alive-every", "2m"}, "--nats-alive-every 2m0s"},
		{"serve member without --nats", []string{"serve", "--engine", "vllm", "--kv-events-config", `{"enable_kv_cache_events": true}`, "--nats-member", "grpc://h:1"}, "--nats-member needs --nats"},
		{"serve malformed member", []string{"serve", "--engine", "vllm", "--kv-events-config", `{"enable_kv_cache_events": true}`, "--nats", "nats://127.0.0.1:1", "--nats-member", "h:1"}, "--nats-member"},
		{"gateway malformed worker name", []string{"gateway", "--worker", "grpc://127.0.0.1:1", "--nats-worker-name", "ab"}, "WORKER=NAME"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var stderr logbuf.Buffer
			code := dispatch(context.Background(), tc.args, strings.NewReader(""), io.Discard, &stderr)
			if code == 0 || !strings.Contains(stderr.String(), tc.want) {
				t.Fatalf("exit %d, stderr %q; want a failure naming %q", code, stderr.String(), tc.want)
			}
		})
	}
}
