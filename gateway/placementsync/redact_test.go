package placementsync

import (
	"strings"
	"testing"

	"github.com/kvrelay/kvrelay/gateway"
)

// TestConnectErrorHidesTheURLsCredentials: a URL nats.go cannot parse (a
// mistyped port) fails with url.Parse's error, which quotes the whole
// URL; Start's error, which the gateway logs, must not carry its password.
func TestConnectErrorHidesTheURLsCredentials(t *testing.T) {
	g, err := gateway.New(gateway.Config{})
	if err != nil {
		t.Fatal(err)
	}
	const secret = "s3cret-pw"
	for _, url := range []string{"nats://alice:" + secret + "@127.0.0.1:42x2", "alice:" + secret + "@127.0.0.1:42x2"} {
		_, err := Start(g, Options{URL: url})
		if err == nil {
			t.Fatalf("%q accepted", url)
		}
		if strings.Contains(err.Error(), secret) {
			t.Errorf("the error for %q shows the password: %v", url, err)
		}
	}
}
