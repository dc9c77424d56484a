package natsevents

import (
	"strings"
	"testing"
)

// TestConnectErrorsHideTheURLsCredentials: a URL nats.go cannot parse (a
// mistyped port) fails the connect with url.Parse's error, which quotes
// the whole URL; the sink's, the source's and the members watcher's
// errors must not carry its password (they reach the start's log line).
func TestConnectErrorsHideTheURLsCredentials(t *testing.T) {
	const secret = "s3cret-pw"
	for _, url := range []string{
		"nats://alice:" + secret + "@127.0.0.1:42x2",
		"alice:" + secret + "@127.0.0.1:42x2", // no scheme: nats.go adds nats://
	} {
		errs := map[string]error{}
		_, errs["sink"] = NewSink(nil, SinkOptions{URL: url, Worker: "w"})
		_, errs["source"] = NewSource(SourceOptions{URL: url})
		_, errs["members"] = WatchMembers(MemberOptions{URL: url, OnChange: func([]string) {}})
		for what, err := range errs {
			if err == nil {
				t.Errorf("%s: %q accepted", what, url)
				continue
			}
			if strings.Contains(err.Error(), secret) {
				t.Errorf("%s: the error for %q shows the password: %v", what, url, err)
			}
		}
	}
}
