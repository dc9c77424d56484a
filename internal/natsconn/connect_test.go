package natsconn

import (
	"bytes"
	"log/slog"
	"strings"
	"testing"
	"time"
)

// TestConnectRedactsItsError: a server list that does not parse fails at
// once, and neither the error nor anything logged shows its password,
// though nats.go's own error quotes the URL.
func TestConnectRedactsItsError(t *testing.T) {
	var logs bytes.Buffer
	log := slog.New(slog.NewTextHandler(&logs, nil))
	for _, url := range []string{"nats://alice:s3cret@127.0.0.1:notaport", "nats://alice:s3cret@[::1"} {
		nc, err := Connect(url, "test", 10*time.Millisecond, log)
		if err == nil {
			nc.Close()
			t.Fatalf("%s connected", url)
		}
		if strings.Contains(err.Error(), "s3cret") || strings.Contains(logs.String(), "s3cret") {
			t.Errorf("the password shows: error %q, log %q", err, logs.String())
		}
		if !strings.Contains(err.Error(), "REDACTED@") {
			t.Errorf("error %q does not name the redacted URL", err)
		}
	}
}
