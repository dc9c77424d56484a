package natslog

import (
	"net/url"
	"regexp"
	"strings"
)

// userinfo finds the credentials of a URL written inside a longer text
// (an error message, a server list): "scheme://user:pass@" or
// "scheme://token@".
var userinfo = regexp.MustCompile(`([A-Za-z][A-Za-z0-9+.-]*://)[^/\s,]*@`)

// Redact returns s with the credentials of every URL in it replaced by
// "REDACTED@": a NATS server list (nats://user:pass@h:4222,nats://…), a
// single URL, or an error's text that quotes one. kvrelay logs and
// returns a NATS URL only through Redact: a password there would reach
// the logs of everything that starts (issue 29).
func Redact(s string) string {
	if !strings.Contains(s, "@") {
		return s
	}
	return userinfo.ReplaceAllString(s, "${1}REDACTED@")
}

// HasCredentials reports whether a server list carries a user, password
// or token in one of its URLs (visible in ps and in the shell's history:
// kvrelay warns and points at the file flags).
func HasCredentials(servers string) bool {
	for _, s := range strings.Split(servers, ",") {
		s = strings.TrimSpace(s)
		if !strings.Contains(s, "://") {
			s = "nats://" + s
		}
		if u, err := url.Parse(s); err == nil && u.User != nil {
			return true
		}
		if userinfo.MatchString(s) {
			return true
		}
	}
	return false
}

// RedactErr is err with its text redacted (Redact), for an error that may
// quote a URL with its credentials (a URL that does not parse, a server
// list); it still unwraps to err. nil stays nil.
func RedactErr(err error) error {
	if err == nil {
		return nil
	}
	return redactedError{err}
}

type redactedError struct{ err error }

func (e redactedError) Error() string { return Redact(e.err.Error()) }
func (e redactedError) Unwrap() error { return e.err }
