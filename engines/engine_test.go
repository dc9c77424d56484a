package engines_test

import (
	"slices"
	"strings"
	"testing"

	"github.com/kvrelay/kvrelay/engines"
)

func TestOffsetAndConnectEndpoints(t *testing.T) {
	cases := []struct {
		endpoint string
		rank     int
		offset   string // "" with errWant: error
		connect  string
		err      bool
	}{
		// relay-semantics §2.3 (smg's endpoint_for_rank table).
		{"tcp://*:5557", 0, "tcp://*:5557", "tcp://127.0.0.1:5557", false},
		{"tcp://0.0.0.0:5557", 0, "tcp://0.0.0.0:5557", "tcp://127.0.0.1:5557", false},
		{"tcp://*:5557", 2, "tcp://*:5559", "tcp://127.0.0.1:5559", false},
		{"tcp://10.0.0.1:5557", 1, "tcp://10.0.0.1:5558", "tcp://10.0.0.1:5558", false},
		// The engines raise where smg passes these through unchanged.
		{"tcp://host:port", 1, "", "", true},
		{"ipc:///tmp/kv", 1, "", "", true},
		{"tcp://*", 1, "", "", true},
		// Rank 0 and empty endpoints are never touched.
		{"ipc:///tmp/kv", 0, "ipc:///tmp/kv", "ipc:///tmp/kv", false},
		{"tcp://host:port", 0, "tcp://host:port", "tcp://host:port", false},
		{"", 3, "", "", false},
		// inproc gets the engines' _dp<rank> suffix.
		{"inproc://kv", 1, "inproc://kv_dp1", "inproc://kv_dp1", false},
		{"inproc://kv", 0, "inproc://kv", "inproc://kv", false},
		{"tcp://[::1]:5557", 3, "tcp://[::1]:5560", "tcp://[::1]:5560", false},
		{"tcp://*:5557", -1, "", "", true},
	}
	for _, c := range cases {
		got, err := engines.OffsetEndpointPort(c.endpoint, c.rank)
		if (err != nil) != c.err || got != c.offset {
			t.Errorf("OffsetEndpointPort(%q, %d) = %q, %v", c.endpoint, c.rank, got, err)
		}
		got, err = engines.ConnectEndpoint(c.endpoint, c.rank)
		if (err != nil) != c.err || got != c.connect {
			t.Errorf("ConnectEndpoint(%q, %d) = %q, %v", c.endpoint, c.rank, got, err)
		}
	}
}

// vLLM 0.33 binds tcp://*:0 to an OS-assigned port at every rank (#55844):
// the offset leaves port 0 alone, and a subscriber refuses to dial it
// (it used to dial ports 0 and 1 forever, logging refused connections).
func TestConnectEndpointRefusesOSAssignedPorts(t *testing.T) {
	for rank := 0; rank < 3; rank++ {
		if got, err := engines.OffsetEndpointPort("tcp://*:0", rank); err != nil || got != "tcp://*:0" {
			t.Errorf("OffsetEndpointPort(tcp://*:0, %d) = %q, %v; want it unchanged", rank, got, err)
		}
		if got, err := engines.ConnectEndpoint("tcp://*:0", rank); err == nil || !strings.Contains(err.Error(), "explicit ports") {
			t.Errorf("ConnectEndpoint(tcp://*:0, %d) = %q, %v; want an error asking for explicit ports", rank, got, err)
		}
	}
	cfg := engines.DefaultConfig()
	cfg.Endpoint, cfg.ReplayEndpoint = "tcp://*:5557", "tcp://*:0"
	if _, err := engines.PublisherEndpoints(cfg, 2); err == nil || !strings.Contains(err.Error(), "rank 0 replay endpoint") {
		t.Errorf("replay on port 0: %v", err)
	}
}

func TestPublisherEndpoints(t *testing.T) {
	cfg := engines.DefaultConfig()
	cfg.ReplayEndpoint = "tcp://*:5600"
	got, err := engines.PublisherEndpoints(cfg, 3)
	want := []engines.RankEndpoints{
		{0, "tcp://127.0.0.1:5557", "tcp://127.0.0.1:5600"},
		{1, "tcp://127.0.0.1:5558", "tcp://127.0.0.1:5601"},
		{2, "tcp://127.0.0.1:5559", "tcp://127.0.0.1:5602"},
	}
	if err != nil || !slices.Equal(got, want) {
		t.Fatalf("got %v %v", got, err)
	}
	cfg.ReplayEndpoint = ""
	got, err = engines.PublisherEndpoints(cfg, 0)
	if err != nil || !slices.Equal(got, []engines.RankEndpoints{{0, "tcp://127.0.0.1:5557", ""}}) {
		t.Errorf("dp 0: %v %v", got, err)
	}
	cfg.Endpoint = "ipc:///tmp/kv"
	if _, err := engines.PublisherEndpoints(cfg, 1); err != nil {
		t.Errorf("ipc at one rank: %v", err)
	}
	if _, err := engines.PublisherEndpoints(cfg, 2); err == nil || !strings.Contains(err.Error(), "rank 1") {
		t.Errorf("ipc at rank 1: %v", err)
	}
	cfg.Endpoint, cfg.ReplayEndpoint = "tcp://*:5557", "ipc:///tmp/replay"
	if _, err := engines.PublisherEndpoints(cfg, 2); err == nil || !strings.Contains(err.Error(), "replay") {
		t.Errorf("ipc replay at rank 1: %v", err)
	}
}

func TestConfigObjectCoercions(t *testing.T) {
	obj, empty, err := engines.ParseConfigObject(`{"a": true, "b": "yes", "c": 0, "d": "10", "e": 10.0, "f": 1.5, "g": null, "h": [1]}`)
	if err != nil || empty {
		t.Fatalf("%v %v", err, empty)
	}
	for name, want := range map[string]bool{"a": true, "b": true, "c": false} {
		if got, err := obj.Bool(name, !want); err != nil || got != want {
			t.Errorf("Bool(%s) = %v, %v", name, got, err)
		}
	}
	if got, err := obj.Bool("g", true); err != nil || !got {
		t.Errorf("null bool takes the default: %v %v", got, err)
	}
	if _, err := obj.Bool("h", false); err == nil || !strings.Contains(err.Error(), "h") {
		t.Errorf("array bool: %v", err)
	}
	for name, want := range map[string]int{"d": 10, "e": 10, "g": 7, "missing": 7} {
		if got, err := obj.Int(name, 7); err != nil || got != want {
			t.Errorf("Int(%s) = %v, %v", name, got, err)
		}
	}
	if _, err := obj.Int("f", 0); err == nil || !strings.Contains(err.Error(), "f:") {
		t.Errorf("fractional int: %v", err)
	}
	for _, bad := range []string{`[1]`, `"x"`, `{`, `{"a":1} {}`, `null`} {
		if _, _, err := engines.ParseConfigObject(bad); err == nil {
			t.Errorf("ParseConfigObject(%s) accepted", bad)
		}
	}
	if _, empty, err := engines.ParseConfigObject("  \n"); !empty || err != nil {
		t.Errorf("blank: %v %v", empty, err)
	}
}
