package relayd

import (
	"encoding/json"
	"strings"
	"testing"
	"time"
)

func TestResolveLoadSource(t *testing.T) {
	cases := []struct {
		name     string
		cfg      RelayConfig
		wantKind string
		wantErr  string
	}{
		{"nothing to read", RelayConfig{}, "", ""},
		{"upstream: its GetLoads", RelayConfig{Upstream: "127.0.0.1:50051"}, "getloads", ""},
		{"URL wins over upstream", RelayConfig{Upstream: "127.0.0.1:50051", EngineMetricsURL: "http://127.0.0.1:8000"}, "http", ""},
		{"off", RelayConfig{Upstream: "127.0.0.1:50051", LoadSource: "off"}, "", ""},
		{"getloads without upstream", RelayConfig{LoadSource: "getloads"}, "", "needs an upstream"},
		{"http without URL", RelayConfig{LoadSource: "http"}, "", "needs engine-metrics-url"},
		{"unknown source", RelayConfig{LoadSource: "prometheus"}, "", `want auto, getloads, http or off`},
		{"deprecated endpoint", RelayConfig{EngineMetricsURL: "http://127.0.0.1:30000/get_load"}, "", "deprecated"},
		{"not a URL", RelayConfig{EngineMetricsURL: "127.0.0.1:8000"}, "", "want http(s)://"},
		{"bad interval", RelayConfig{Upstream: "127.0.0.1:1", LoadInterval: "0s"}, "", "load-interval"},
		{"bad age", RelayConfig{Upstream: "127.0.0.1:1", LoadMaxAge: "soon"}, "", "load-max-age"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			tc.cfg.Engine, tc.cfg.Listen = "vllm", "127.0.0.1:0"
			tc.cfg.KVEventsConfig = json.RawMessage(`{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557"}`)
			rs, err := Resolve([]RelayConfig{tc.cfg})
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("err = %v, want it to say %q", err, tc.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if rs[0].Load.Kind != tc.wantKind {
				t.Fatalf("load source %q, want %q", rs[0].Load.Kind, tc.wantKind)
			}
		})
	}
	rs, err := Resolve([]RelayConfig{{Engine: "vllm", Listen: "127.0.0.1:0", Upstream: "127.0.0.1:1",
		KVEventsConfig: json.RawMessage(`{"enable_kv_cache_events": true}`), LoadInterval: "100ms", LoadMaxAge: "2s"}})
	if err != nil {
		t.Fatal(err)
	}
	if rs[0].Load.Interval != 100*time.Millisecond || rs[0].Load.MaxAge != 2*time.Second {
		t.Fatalf("settings %+v", rs[0].Load)
	}
}
