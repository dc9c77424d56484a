package main

import (
	"bytes"
	"log/slog"
	"strings"
	"testing"

	"github.com/kvrelay/kvrelay/internal/natsconn"
)

// TestNATSURLCredentialWarningHidesIt: a --nats URL carrying a password
// is warned about, and the warning must not print the password, with a
// scheme or without one (nats.go takes "alice:pw@h:4222" as nats://).
func TestNATSURLCredentialWarningHidesIt(t *testing.T) {
	const secret = "s3cret-pw"
	for _, url := range []string{"nats://alice:" + secret + "@127.0.0.1:4222", "alice:" + secret + "@127.0.0.1:4222", "nats://127.0.0.1:4223, tok-" + secret + "@127.0.0.1:4222"} {
		var buf bytes.Buffer
		if _, err := natsAuthOptions(url, &natsconn.Config{}, slog.New(slog.NewTextHandler(&buf, nil))); err != nil {
			t.Fatal(err)
		}
		if !strings.Contains(buf.String(), "a credential in the --nats URL") {
			t.Errorf("%q: no warning: %s", url, buf.String())
		}
		if strings.Contains(buf.String(), secret) {
			t.Errorf("%q: the warning shows the password: %s", url, buf.String())
		}
	}
}
