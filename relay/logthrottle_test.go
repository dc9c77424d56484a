package relay

import (
	"context"
	"log/slog"
	"strings"
	"sync"
	"testing"
)

// logRecorder keeps the level and message of every record.
type logRecorder struct {
	mu      sync.Mutex
	records []slog.Record
}

func (h *logRecorder) Enabled(context.Context, slog.Level) bool { return true }
func (h *logRecorder) Handle(_ context.Context, r slog.Record) error {
	h.mu.Lock()
	h.records = append(h.records, r.Clone())
	h.mu.Unlock()
	return nil
}
func (h *logRecorder) WithAttrs([]slog.Attr) slog.Handler { return h }
func (h *logRecorder) WithGroup(string) slog.Handler      { return h }

// count returns how many records at level have a message starting with
// prefix.
func (h *logRecorder) count(level slog.Level, prefix string) int {
	h.mu.Lock()
	defer h.mu.Unlock()
	n := 0
	for _, r := range h.records {
		if r.Level == level && strings.HasPrefix(r.Message, prefix) {
			n++
		}
	}
	return n
}

// Issue 15.4: an engine whose replay does not answer is warned about once
// per outage, retried with backoff, and its recovery is logged.
func TestAReplayThatDoesNotAnswerIsWarnedAboutOnce(t *testing.T) {
	rec := &logRecorder{}
	l := newLab(t, labOpts{skipPrimed: true, beforeRun: func(l *lab) {
		l.pubs[0].set(func(p *fakePub) { p.down = true })
		l.r.log = slog.New(rec)
	}})
	m := l.m()
	l.waitFor("five failed replays", func() bool { return counter(m.replays.WithLabelValues("0", "error")) >= 5 })
	if n := rec.count(slog.LevelWarn, "replay failed"); n != 1 {
		t.Fatalf("%d replay warnings for one outage, want 1", n)
	}
	l.pubs[0].set(func(p *fakePub) { p.down = false })
	l.waitFor("the recovery logged", func() bool { return rec.count(slog.LevelInfo, "replay answering again") == 1 })
}

// Issue 13.11: every undecodable batch is counted, but one engine sending
// garbage does not log a warning per batch.
func TestUndecodableBatchesAreCountedEachAndLoggedSparingly(t *testing.T) {
	rec := &logRecorder{}
	l := newLab(t, labOpts{noReplay: true, beforeRun: func(l *lab) { l.r.log = slog.New(rec) }})
	p := l.pubs[0]
	const n = 100
	for i := 0; i < n; i++ {
		p.publish([]byte{0xc1})
	}
	l.cursor(0, n-1)
	if got := counter(l.m().undecodable.WithLabelValues("0")); got != n {
		t.Fatalf("%v undecodable batches counted, want %d", got, n)
	}
	if got := rec.count(slog.LevelWarn, "undecodable batch"); got != 1 {
		t.Fatalf("%d warnings for %d undecodable batches within seconds, want 1", got, n)
	}
}
