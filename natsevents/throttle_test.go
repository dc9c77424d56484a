package natsevents

import (
	"bytes"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
)

// TestForgedAnnouncementsLogAFewLines: a flood of undecodable alive
// announcements, and of a silent sink flapping back, logs a few lines a
// minute each (logthrottle), not one per message (issue 29: 20,010 lines
// in 0.27 s).
func TestForgedAnnouncementsLogAFewLines(t *testing.T) {
	var buf bytes.Buffer
	tr := newAliveTracker(0, slog.New(slog.NewTextHandler(&buf, nil)))
	t0 := time.Unix(1000, 0)
	now := t0
	tr.now = func() time.Time { return now }
	good := &nats.Msg{Subject: aliveSubject(DefaultSubjectPrefix, "a"), Data: encodeAnnouncement(announcement{Incarnation: 7, Pass: 1, LastSeq: 3, Every: 100 * time.Millisecond})}
	for i := range 20_000 {
		tr.handle(&nats.Msg{Subject: aliveSubject(DefaultSubjectPrefix, "a"), Data: []byte("forged")})
		// Silent, then back: the "announces itself again" line each time.
		now = t0.Add(time.Duration(i) * time.Second)
		_ = tr.check("a", "w-a")
		tr.handle(good)
	}
	for _, msg := range []string{"undecodable sink announcement", "announces itself again"} {
		if n := strings.Count(buf.String(), msg); n == 0 || n > 5 {
			t.Errorf("%d lines of %q for 20,000 messages, want 1 to 5", n, msg)
		}
	}
}
