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
// returns a NATS URL only through RedactURL, and nats.go's errors
// through RedactError: a password there would reach the logs of
// everything that starts (issue 29).
func Redact(s string) string {
	if !strings.Contains(s, "@") {
		return s
	}
	return userinfo.ReplaceAllString(s, "${1}REDACTED@")
}

// RedactURL returns a server list as an operator gave it, every URL's
// credentials replaced by "REDACTED@": besides what Redact finds, the
// URLs without a scheme ("alice:s3cret@h:4222"), which nats.go takes as
// nats:// and Redact cannot tell from text. Use it on a configured URL;
// Redact on a text that quotes one.
func RedactURL(servers string) string {
	if !strings.Contains(servers, "@") {
		return servers
	}
	parts := strings.Split(servers, ",")
	for i, p := range parts {
		if strings.Contains(p, "://") {
			parts[i] = Redact(p)
			continue
		}
		// As url.Parse reads it once nats.go adds the scheme: the
		// userinfo ends at the authority's last "@".
		authority := p
		if j := strings.IndexByte(p, '/'); j >= 0 {
			authority = p[:j]
		}
		if at := strings.LastIndexByte(authority, '@'); at >= 0 {
			lead := len(p) - len(strings.TrimLeft(p, " \t"))
			parts[i] = p[:lead] + "REDACTED@" + p[at+1:]
		}
	}
	return strings.Join(parts, ",")
}

// RedactError is err with its text passed through Redact (errors.Is and
// errors.As still see err): nats.Connect's error for a malformed URL is
// url.Parse's, which quotes the whole URL, credentials included.
func RedactError(err error) error {
	if err == nil {
		return nil
	}
	return redactedError{err}
}

type redactedError struct{ err error }

func (e redactedError) Error() string { return Redact(e.err.Error()) }
func (e redactedError) Unwrap() error { return e.err }

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
