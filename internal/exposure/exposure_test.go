package exposure

import (
	"bytes"
	"log/slog"
	"strings"
	"testing"
)

func TestIsLoopback(t *testing.T) {
	for addr, want := range map[string]bool{
		"127.0.0.1:50051": true, "127.0.0.2:1": true, "[::1]:1": true, "localhost:1": true,
		"0.0.0.0:1": false, ":1": false, "[::]:1": false, "10.0.0.1:1": false, "relay.local:1": false, "nonsense": false,
	} {
		if got := IsLoopback(addr); got != want {
			t.Errorf("IsLoopback(%q) = %v, want %v", addr, got, want)
		}
	}
}

// A plaintext listener off loopback is named in a warning at start; one on
// loopback or with TLS is not.
func TestWarnIfExposed(t *testing.T) {
	tests := []struct {
		addr    string
		secured bool
		warn    bool
	}{
		{"0.0.0.0:50051", false, true},
		{":9464", false, true},
		{"0.0.0.0:50051", true, false},
		{"127.0.0.1:50051", false, false},
	}
	for _, tt := range tests {
		var buf bytes.Buffer
		WarnIfExposed(slog.New(slog.NewTextHandler(&buf, nil)), "grpc", tt.addr, tt.secured)
		if got := strings.Contains(buf.String(), "level=WARN") && strings.Contains(buf.String(), tt.addr); got != tt.warn {
			t.Errorf("%s secured=%v: warned %v (%q)", tt.addr, tt.secured, got, buf.String())
		}
	}
}
