package sglang

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
	zmq := func(c *engines.Config) { c.Enabled, c.Publisher = true, "zmq" }
	cases := []struct {
		name string
		text string
		want engines.Config
		err  string
	}{
		{"no config", "", defaults(func(*engines.Config) {}), ""},
		{"no publisher means null", `{"endpoint": "tcp://*:6000"}`,
			defaults(func(c *engines.Config) { c.Endpoint = "tcp://*:6000" }), ""},
		{"an enable flag is not SGLang's", `{"enable_kv_cache_events": true}`, defaults(func(*engines.Config) {}), ""},
		{"zmq enables", `{"publisher": "zmq"}`, defaults(zmq), ""},
		{"zmq with fields", `{"publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5600", "topic": "t", "hwm": 5}`,
			defaults(func(c *engines.Config) { zmq(c); c.ReplayEndpoint, c.Topic, c.HWM = "tcp://*:5600", "t", 5 }), ""},
		{"null publisher string", `{"publisher": "null"}`, defaults(func(*engines.Config) {}), ""},
		{"publisher JSON null", `{"publisher": null}`, engines.Config{}, "publisher"},
		{"unknown publisher", `{"publisher": "nats"}`, engines.Config{}, "publisher"},
		{"endpoint not text", `{"publisher": "zmq", "endpoint": 1}`, engines.Config{}, "endpoint"},
		{"bad JSON", `{publisher: zmq}`, engines.Config{}, "JSON"},
		{"not an object", `"zmq"`, engines.Config{}, "object"},
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
	if Engine.Name != "sglang" || Engine.ServiceName != "sglang.grpc.scheduler.SglangScheduler" || Engine.Dialect != wire.SGLang ||
		Engine.ReplayTopicFrame || !Engine.StartupClear || !strings.Contains(Engine.DisabledMessage, "Start SGLang with --kv-events-config") {
		t.Errorf("engine %+v", Engine)
	}
}

func FuzzParseConfig(f *testing.F) {
	for _, s := range []string{"", `{"publisher": "zmq"}`, `{"publisher": null}`, `{"publisher": "zmq", "hwm": "7"}`, `1`} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, text string) {
		cfg, err := ParseConfig(text)
		if err == nil && cfg.Enabled != (cfg.Publisher == "zmq") {
			t.Fatalf("enabled %v with publisher %q", cfg.Enabled, cfg.Publisher)
		}
	})
}
