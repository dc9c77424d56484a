package tokenspeed

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

// The resolver cases of smg's test_tokenspeed_kv_events.py (relay-semantics §7.10).
func TestParseConfig(t *testing.T) {
	zmq := func(c *engines.Config) { c.Enabled, c.Publisher = true, "zmq" }
	cases := []struct {
		name string
		text string
		want engines.Config
		err  string
	}{
		{"missing", "", defaults(func(*engines.Config) {}), ""},
		{"empty object", "{}", defaults(func(c *engines.Config) { c.Publisher = "zmq" }), ""},
		{"disabled", `{"enable_kv_cache_events": false}`, defaults(func(c *engines.Config) { c.Publisher = "zmq" }), ""},
		{"default zmq", `{"enable_kv_cache_events": true}`, defaults(zmq), ""},
		{"publisher JSON null", `{"enable_kv_cache_events": true, "publisher": null}`, defaults(zmq), ""},
		{"publisher null string", `{"enable_kv_cache_events": true, "publisher": "null"}`, defaults(func(*engines.Config) {}), ""},
		{"other publisher disables", `{"enable_kv_cache_events": true, "publisher": "kafka"}`,
			defaults(func(c *engines.Config) { c.Publisher = "kafka" }), ""},
		{"non-string publisher disables", `{"enable_kv_cache_events": true, "publisher": 3}`, defaults(func(*engines.Config) {}), ""},
		{"endpoint and topic", `{"enable_kv_cache_events": true, "endpoint": "tcp://*:6000", "topic": "kv"}`,
			defaults(func(c *engines.Config) { zmq(c); c.Endpoint, c.Topic = "tcp://*:6000", "kv" }), ""},
		{"empty endpoint means default", `{"enable_kv_cache_events": true, "endpoint": ""}`, defaults(zmq), ""},
		{"null endpoint and topic", `{"enable_kv_cache_events": true, "endpoint": null, "topic": null}`, defaults(zmq), ""},
		{"replay endpoint carried", `{"enable_kv_cache_events": true, "replay_endpoint": "tcp://*:5600"}`,
			defaults(func(c *engines.Config) { zmq(c); c.ReplayEndpoint = "tcp://*:5600" }), ""},
		{"non-string replay endpoint ignored", `{"enable_kv_cache_events": true, "replay_endpoint": 5600}`, defaults(zmq), ""},
		{"non-string endpoint", `{"enable_kv_cache_events": true, "endpoint": 5557}`, engines.Config{}, "endpoint"},
		{"non-string topic", `{"enable_kv_cache_events": true, "topic": 1}`, engines.Config{}, "topic"},
		{"malformed JSON", `{"enable_kv_cache_events": true`, engines.Config{}, "JSON"},
		{"non-object", `[{"enable_kv_cache_events": true}]`, engines.Config{}, "object"},
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
	if Engine.Name != "tokenspeed" || Engine.ServiceName != "tokenspeed.grpc.scheduler.TokenSpeedScheduler" ||
		Engine.Dialect != wire.TokenSpeed || Engine.ReplayTopicFrame || Engine.StartupClear ||
		!strings.Contains(Engine.DisabledMessage, "Start TokenSpeed with --kv-events-config") {
		t.Errorf("engine %+v", Engine)
	}
}

func FuzzParseConfig(f *testing.F) {
	for _, s := range []string{"", "{}", `{"enable_kv_cache_events": true}`, `{"enable_kv_cache_events": true, "publisher": null, "replay_endpoint": 1}`,
		`{"enable_kv_cache_events": true, "endpoint": 5}`, `[]`} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, text string) {
		cfg, err := ParseConfig(text)
		if err == nil && cfg.Enabled && (cfg.Publisher != "zmq" || cfg.Endpoint == "") {
			t.Fatalf("enabled with publisher %q endpoint %q", cfg.Publisher, cfg.Endpoint)
		}
	})
}
