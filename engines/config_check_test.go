package engines

import (
	"strings"
	"testing"
)

func TestCheckKeys(t *testing.T) {
	known := append([]string{"enable_kv_cache_events"}, CommonConfigKeys...)
	cases := []struct {
		text string
		err  string // "" for none
	}{
		{`{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5657", "topic": "", "hwm": 1, "buffer_steps": 2, "max_queue_size": 3, "publisher": "zmq"}`, ""},
		{`{"endpont": "tcp://*:6000"}`, `unknown key "endpont" (did you mean "endpoint"?)`},
		{`{"replay_endpiont": "tcp://*:6000"}`, `unknown key "replay_endpiont" (did you mean "replay_endpoint"?)`},
		{`{"enable_kv_cache_event": true}`, `(did you mean "enable_kv_cache_events"?)`},
		{`{"zzz": 1, "aaa": 2}`, `unknown key "aaa" (known keys: enable_kv_cache_events, publisher, endpoint`},
	}
	for _, tc := range cases {
		obj, _, err := ParseConfigObject(tc.text)
		if err != nil {
			t.Fatal(err)
		}
		err = obj.CheckKeys(known)
		if tc.err == "" {
			if err != nil {
				t.Errorf("%s: %v", tc.text, err)
			}
			continue
		}
		if err == nil || !strings.Contains(err.Error(), tc.err) {
			t.Errorf("%s: error %v, want one containing %s", tc.text, err, tc.err)
		}
	}
}

func TestCheckEndpoints(t *testing.T) {
	cases := []struct {
		name             string
		endpoint, replay string
		dp               int
		err              string
	}{
		{"defaults", "tcp://*:5557", "", 1, ""},
		{"replay far enough", "tcp://*:5557", "tcp://*:5657", 8, ""},
		{"ipc single rank", "ipc:///run/vllm/kv", "", 1, ""},
		{"udp", "udp://*:5557", "", 1, `endpoint "udp://*:5557": ZeroMQ PUB/ROUTER sockets cannot use udp://`},
		{"inproc", "inproc://kv", "", 1, "inproc:// is reachable only inside the engine's own process"},
		{"no scheme", "127.0.0.1:5557", "", 1, "want tcp://HOST:PORT or ipc://PATH"},
		{"udp replay", "tcp://*:5557", "udp://*:5558", 1, `replay_endpoint "udp://*:5558"`},
		{"replay is rank 1's publisher", "tcp://*:5557", "tcp://*:5558", 2,
			"rank 1's endpoint tcp://127.0.0.1:5558 is also rank 0's replay_endpoint tcp://127.0.0.1:5558"},
		{"same port, host spelled differently", "tcp://*:5557", "tcp://127.0.0.1:5557", 1,
			"rank 0's replay_endpoint tcp://127.0.0.1:5557 is also rank 0's endpoint"},
		{"replay below the publishers", "tcp://*:5560", "tcp://*:5557", 4,
			"rank 3's replay_endpoint tcp://127.0.0.1:5560 is also rank 0's endpoint"},
		{"ipc beyond rank 0", "ipc:///run/kv", "", 2, "rank 1"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			err := CheckEndpoints(Config{Endpoint: tc.endpoint, ReplayEndpoint: tc.replay}, tc.dp)
			if tc.err == "" {
				if err != nil {
					t.Fatal(err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tc.err) {
				t.Fatalf("error %v, want one containing %s", err, tc.err)
			}
		})
	}
}

func TestPublisherBinds(t *testing.T) {
	cases := map[string]bool{
		"tcp://*:5557":         true,
		"tcp://[::]:5557":      true,
		"ipc:///run/vllm/kv":   true,
		"inproc://kv":          true,
		"tcp://127.0.0.1:5557": false,
		"tcp://0.0.0.0:5557":   false, // the engines connect here (engine-wire.md §1.2)
		"tcp://10.0.0.7:5557":  false,
	}
	for ep, want := range cases {
		if got := PublisherBinds(ep); got != want {
			t.Errorf("PublisherBinds(%q) = %v, want %v", ep, got, want)
		}
	}
}
