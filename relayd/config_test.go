package relayd

import (
	"bytes"
	"encoding/json"
	"log/slog"
	"strings"
	"testing"

	"github.com/kvrelay/kvrelay/engines/sglang"
	"github.com/kvrelay/kvrelay/engines/vllm"
)

func TestResolveAllowsUnknownKeysWhenTold(t *testing.T) {
	rs, err := Resolve([]RelayConfig{{Engine: "vllm", Listen: "127.0.0.1:0", AllowUnknownConfigKeys: true,
		KVEventsConfig: json.RawMessage(`{"enable_kv_cache_events": true, "kv_connector": "x"}`)}})
	if err != nil {
		t.Fatal(err)
	}
	var logs bytes.Buffer
	logEndpoints(slog.New(slog.NewTextHandler(&logs, nil)), rs[0])
	if !strings.Contains(logs.String(), `unknown key \"kv_connector\"`) {
		t.Fatalf("no warning about the allowed key:\n%s", logs.String())
	}
}

func TestLogEndpoints(t *testing.T) {
	cases := []struct {
		name     string
		config   string
		dp       int
		wantWarn bool
		want     []string
	}{
		{"wildcard binds", `{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5657"}`, 2, false,
			[]string{`rank=0 publisher=tcp://127.0.0.1:5557 replay=tcp://127.0.0.1:5657`, `rank=1 publisher=tcp://127.0.0.1:5558 replay=tcp://127.0.0.1:5658`}},
		{"loopback address connects", `{"enable_kv_cache_events": true, "endpoint": "tcp://127.0.0.1:5557"}`, 1, true,
			[]string{`rank=0 publisher=tcp://127.0.0.1:5557 replay=none`}},
		{"0.0.0.0 connects too", `{"enable_kv_cache_events": true, "endpoint": "tcp://0.0.0.0:5557"}`, 1, true, nil},
		{"ipc binds", `{"enable_kv_cache_events": true, "endpoint": "ipc:///run/vllm/kv"}`, 1, false,
			[]string{`rank=0 publisher=ipc:///run/vllm/kv replay=none`}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			kv, err := vllm.ParseConfig(tc.config)
			if err != nil {
				t.Fatal(err)
			}
			var logs bytes.Buffer
			logEndpoints(slog.New(slog.NewTextHandler(&logs, nil)), Relay{RelayConfig: RelayConfig{Name: "r", DPSize: tc.dp}, Engine: vllm.Engine, KV: kv})
			warned := strings.Contains(logs.String(), "level=WARN") && strings.Contains(logs.String(), "will connect its publisher")
			if warned != tc.wantWarn {
				t.Errorf("warned = %v, want %v:\n%s", warned, tc.wantWarn, logs.String())
			}
			for _, w := range tc.want {
				if !strings.Contains(logs.String(), w) {
					t.Errorf("logs lack %q:\n%s", w, logs.String())
				}
			}
		})
	}
}

// The example config in deploy/ passes every start-time check.
func TestTheExampleConfigResolves(t *testing.T) {
	f, err := ReadFile("../deploy/kvrelay.json.example")
	if err != nil {
		t.Fatal(err)
	}
	rs, err := Resolve(f.Relays)
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range rs {
		if !r.KV.Enabled || r.UnknownKeys != nil {
			t.Errorf("relay %s: enabled %v, unknown keys %v", r.Name, r.KV.Enabled, r.UnknownKeys)
		}
	}
}

// Report mode "full" with the re-announcements left in the stream warns at
// start that gateways must apply the same rule, or their digests diverge.
func TestWarnsThatGatewaysNeedTheReportModeRule(t *testing.T) {
	for _, tc := range []struct {
		name                   string
		full, suppress, warned bool
	}{
		{"report mode off", false, false, false},
		{"full, re-announcements relayed", true, false, true},
		{"full, re-announcements suppressed", true, true, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var logs bytes.Buffer
			warnReportModeDigests(slog.New(slog.NewTextHandler(&logs, nil)),
				Relay{RelayConfig: RelayConfig{Name: "r", ReportModeFull: tc.full, SuppressReannounced: tc.suppress}})
			warned := strings.Contains(logs.String(), "level=WARN") && strings.Contains(logs.String(), "kvrelay gateway --report-mode-full")
			if warned != tc.warned {
				t.Errorf("warned = %v, want %v:\n%s", warned, tc.warned, logs.String())
			}
		})
	}
}

// A config learned from an engine on another host has its wildcard binds
// dialled at that host; explicit hosts and ipc:// stay as the engine gave
// them.
func TestPublishersOnHost(t *testing.T) {
	for _, tc := range []struct {
		name, config, host string
		wantEndpoint       string
		wantReplay         string // "" when the config has none
		moved              int
	}{
		{"star", `{"publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5657", "topic": "kv"}`, "10.0.0.5",
			"tcp://10.0.0.5:5557", "tcp://10.0.0.5:5657", 2},
		{"0.0.0.0", `{"endpoint": "tcp://0.0.0.0:5557"}`, "engine-0.internal", "tcp://engine-0.internal:5557", "", 1},
		{"ipv6 any", `{"endpoint": "tcp://[::]:5557", "replay_endpoint": "tcp://:::5657"}`, "fd00::5",
			"tcp://[fd00::5]:5557", "tcp://[fd00::5]:5657", 2},
		{"explicit host kept", `{"endpoint": "tcp://10.0.0.7:5557", "replay_endpoint": "tcp://*:5657"}`, "10.0.0.5",
			"tcp://10.0.0.7:5557", "tcp://10.0.0.5:5657", 1},
		{"ipc kept", `{"endpoint": "ipc:///run/sglang/kv"}`, "10.0.0.5", "ipc:///run/sglang/kv", "", 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, changed, err := PublishersOnHost(tc.config, tc.host)
			if err != nil {
				t.Fatal(err)
			}
			if len(changed) != tc.moved {
				t.Errorf("changed %q, want %d endpoints", changed, tc.moved)
			}
			if tc.moved == 0 && got != tc.config {
				t.Errorf("config rewritten without a change: %s", got)
			}
			var obj map[string]any
			if err := json.Unmarshal([]byte(got), &obj); err != nil {
				t.Fatalf("%q: %v", got, err)
			}
			if obj["endpoint"] != tc.wantEndpoint {
				t.Errorf("endpoint %v, want %s", obj["endpoint"], tc.wantEndpoint)
			}
			if replay, _ := obj["replay_endpoint"].(string); replay != tc.wantReplay {
				t.Errorf("replay_endpoint %q, want %q", replay, tc.wantReplay)
			}
			for k, v := range map[string]any{"publisher": "zmq", "topic": "kv"} {
				if strings.Contains(tc.config, `"`+k+`"`) && obj[k] != v {
					t.Errorf("%s %v, want %v kept", k, obj[k], v)
				}
			}
		})
	}
	if _, _, err := PublishersOnHost(`[1]`, "h"); err == nil || !strings.Contains(err.Error(), "kv-events-config") {
		t.Errorf("a config that is not an object: err %v", err)
	}
}

// Endpoints discovery moved to the upstream's host were wildcard binds: no
// warning that the engine connects instead of binding.
func TestLogEndpointsOfPublishersOnTheUpstreamHost(t *testing.T) {
	for _, moved := range []bool{false, true} {
		kv, err := sglang.ParseConfig(`{"publisher": "zmq", "endpoint": "tcp://10.0.0.5:5557"}`)
		if err != nil {
			t.Fatal(err)
		}
		var logs bytes.Buffer
		logEndpoints(slog.New(slog.NewTextHandler(&logs, nil)), Relay{
			RelayConfig: RelayConfig{Name: "r", DPSize: 1, PublishersOnUpstreamHost: moved}, Engine: sglang.Engine, KV: kv})
		if warned := strings.Contains(logs.String(), "will connect its publisher"); warned == moved {
			t.Errorf("moved %v: warned %v:\n%s", moved, warned, logs.String())
		}
		if !strings.Contains(logs.String(), "publisher=tcp://10.0.0.5:5557") {
			t.Errorf("moved %v: the endpoint is not dialled at the upstream's host:\n%s", moved, logs.String())
		}
	}
}
