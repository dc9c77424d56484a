package natslog

import (
	"errors"
	"strings"
	"testing"

	"github.com/nats-io/nats.go"
)

// redactCase is an input to a redaction and what it must give.
type redactCase struct{ in, want string }

// checkRedaction runs redact, called name in the messages, over cases:
// each in gives its want and keeps none of the credentials the cases
// carry.
func checkRedaction(t *testing.T, name string, redact func(string) string, cases []redactCase) {
	t.Helper()
	for _, tc := range cases {
		got := redact(tc.in)
		if got != tc.want {
			t.Errorf("%s(%q) = %q, want %q", name, tc.in, got, tc.want)
		}
		for _, secret := range []string{"s3cret", "tok3n", ":pw@", "p%40ss"} {
			if strings.Contains(got, secret) {
				t.Errorf("%s(%q) = %q keeps %q", name, tc.in, got, secret)
			}
		}
	}
}

func TestRedact(t *testing.T) {
	checkRedaction(t, "Redact", Redact, []redactCase{
		{"nats://127.0.0.1:4222", "nats://127.0.0.1:4222"},
		{"nats://alice:s3cret@127.0.0.1:4222", "nats://REDACTED@127.0.0.1:4222"},
		{"nats://tok3n@h:4222,tls://bob:pw@h2:4222", "nats://REDACTED@h:4222,tls://REDACTED@h2:4222"},
		{"natsevents: connect nats://a:p%40ss@h:4222: dial tcp: refused", "natsevents: connect nats://REDACTED@h:4222: dial tcp: refused"},
		{"no url here, user@example", "no url here, user@example"},
		{"nats://x@y:p@h:4222", "nats://REDACTED@h:4222"},
		{"nats://h:4222 and mail bob@example.com", "nats://h:4222 and mail bob@example.com"},
	})
}

func TestHasCredentials(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want bool
	}{
		{"nats://127.0.0.1:4222", false},
		{"127.0.0.1:4222", false},
		{"nats://h:1,nats://u:p@h:2", true},
		{"tok@h:4222", true},
	} {
		if got := HasCredentials(tc.in); got != tc.want {
			t.Errorf("HasCredentials(%q) = %v, want %v", tc.in, got, tc.want)
		}
	}
}

func FuzzRedact(f *testing.F) {
	for _, s := range []string{"nats://u:p@h:4222", "a://@", "nats://x@y@z", "://@@"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		got := Redact(s)
		if userinfo.MatchString(got) && strings.Contains(got, "://") {
			// Every remaining userinfo must be the redaction itself.
			for _, m := range userinfo.FindAllString(got, -1) {
				if !strings.HasSuffix(m, "://REDACTED@") {
					t.Fatalf("Redact(%q) = %q leaves %q", s, got, m)
				}
			}
		}
	})
}

func TestRedactURL(t *testing.T) {
	checkRedaction(t, "RedactURL", RedactURL, []redactCase{
		{"nats://127.0.0.1:4222", "nats://127.0.0.1:4222"},
		{"127.0.0.1:4222,h2:4222", "127.0.0.1:4222,h2:4222"},
		{"alice:s3cret@127.0.0.1:4222", "REDACTED@127.0.0.1:4222"},
		{"nats://h:1, tok3n@h:2,nats://bob:pw@h:3", "nats://h:1, REDACTED@h:2,nats://REDACTED@h:3"},
		{"x@y:p%40ss@h:4222/path@x", "REDACTED@h:4222/path@x"},
	})
}

// TestRedactError: nats.Connect's error for a URL it cannot parse quotes
// the URL whole (url.Parse's), with or without the scheme given.
func TestRedactError(t *testing.T) {
	for _, url := range []string{"nats://alice:s3cret@127.0.0.1:42x2", "alice:s3cret@127.0.0.1:42x2"} {
		_, err := nats.Connect(url)
		if err == nil {
			t.Fatalf("%q connected", url)
		}
		red := RedactError(err)
		if strings.Contains(red.Error(), "s3cret") || !strings.Contains(red.Error(), "REDACTED@127.0.0.1:42x2") {
			t.Errorf("RedactError(%v) = %v", err, red)
		}
		if !errors.Is(red, err) {
			t.Errorf("RedactError(%v) does not wrap it", err)
		}
	}
	if RedactError(nil) != nil {
		t.Error("RedactError(nil) is not nil")
	}
}
