package vllm

import (
	"strings"
	"testing"

	"github.com/kvrelay/kvrelay/engines"
	"github.com/kvrelay/kvrelay/engines/wire"
)

func defaults(mod func(*engines.Config)) engines.Config {
	c := engines.DefaultConfig()
	mod(&c)
	return c
}

func TestParseConfig(t *testing.T) {
	cases := []struct {
		name string
		text string
		want engines.Config
		err  string // substring of the error, "" for none
	}{
		{"no config", "", defaults(func(*engines.Config) {}), ""},
		{"empty object", "{}", defaults(func(*engines.Config) {}), ""},
		{"enabled resolves zmq", `{"enable_kv_cache_events": true}`,
			defaults(func(c *engines.Config) { c.Enabled, c.Publisher = true, "zmq" }), ""},
		{"null publisher resolves", `{"enable_kv_cache_events": true, "publisher": null}`,
			defaults(func(c *engines.Config) { c.Enabled, c.Publisher = true, "zmq" }), ""},
		{"disabled resolves null", `{"enable_kv_cache_events": false, "endpoint": "tcp://*:6000"}`,
			defaults(func(c *engines.Config) { c.Endpoint = "tcp://*:6000" }), ""},
		{"zmq without the flag publishes nothing", `{"publisher": "zmq"}`,
			defaults(func(c *engines.Config) { c.Publisher = "zmq" }), ""},
		{"explicit null publisher", `{"enable_kv_cache_events": true, "publisher": "null"}`,
			defaults(func(*engines.Config) {}), ""},
		{"every field", `{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://10.0.0.1:7000",
			"replay_endpoint": "tcp://*:7100", "buffer_steps": 5, "hwm": "6", "max_queue_size": 7.0, "topic": "kv", "future": 1}`,
			engines.Config{Enabled: true, Publisher: "zmq", Endpoint: "tcp://10.0.0.1:7000", ReplayEndpoint: "tcp://*:7100",
				BufferSteps: 5, HWM: 6, MaxQueueSize: 7, Topic: "kv"}, ""},
		{"null replay endpoint", `{"enable_kv_cache_events": true, "replay_endpoint": null}`,
			defaults(func(c *engines.Config) { c.Enabled, c.Publisher = true, "zmq" }), ""},
		{"unknown publisher", `{"enable_kv_cache_events": true, "publisher": "kafka"}`, engines.Config{}, "publisher"},
		{"publisher not text", `{"publisher": 1}`, engines.Config{}, "publisher"},
		{"flag not boolean", `{"enable_kv_cache_events": "maybe"}`, engines.Config{}, "enable_kv_cache_events"},
		{"endpoint not text", `{"endpoint": 5557}`, engines.Config{}, "endpoint"},
		{"endpoint null", `{"endpoint": null}`, engines.Config{}, "endpoint"},
		{"topic not text", `{"topic": []}`, engines.Config{}, "topic"},
		{"hwm not integer", `{"hwm": "lots"}`, engines.Config{}, "hwm"},
		{"bad JSON", `{"enable_kv_cache_events": tru}`, engines.Config{}, "JSON"},
		{"not an object", `[true]`, engines.Config{}, "object"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			got, err := Engine.ParseConfig(c.text)
			if c.err != "" {
				if err == nil || !strings.Contains(err.Error(), c.err) {
					t.Fatalf("err %v, want one naming %q", err, c.err)
				}
				return
			}
			if err != nil || got != c.want {
				t.Fatalf("got %+v, %v\nwant %+v", got, err, c.want)
			}
		})
	}
}

func TestEngine(t *testing.T) {
	if Engine.Name != "vllm" || Engine.ServiceName != "vllm.grpc.engine.VllmEngine" || Engine.Dialect != wire.VLLM ||
		!Engine.ReplayTopicFrame || Engine.StartupClear || !strings.Contains(Engine.DisabledMessage, "Start vLLM with --kv-events-config") {
		t.Errorf("engine %+v", Engine)
	}
}

func FuzzParseConfig(f *testing.F) {
	for _, s := range []string{"", "{}", `{"enable_kv_cache_events": true}`, `{"publisher": "zmq", "endpoint": "tcp://*:1"}`,
		`{"enable_kv_cache_events": "yes", "hwm": "10", "buffer_steps": 1e3}`, `[1]`, `{"topic": null}`} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, text string) {
		cfg, err := ParseConfig(text)
		if err == nil && cfg.Enabled && cfg.Publisher != "zmq" {
			t.Fatalf("enabled with publisher %q", cfg.Publisher)
		}
		if err == nil && cfg.Publisher != "zmq" && cfg.Publisher != "null" {
			t.Fatalf("publisher %q", cfg.Publisher)
		}
	})
}
