// Package logthrottle rate-limits the log lines a peer can drive.
//
// A peer that sends a bad message makes kvrelay log a line about it; a
// peer that sends a hundred thousand makes it log a hundred thousand (the
// probe of issue 29: 20,010 lines, 3.8 MB, in 0.27 s). Lines written
// through a Wrap-ped logger are limited per message: at most Burst lines
// of one message per Window, and the first line let through after some
// were held back says how many with a "suppressed" attribute. The metric
// or counter the caller keeps beside its log line still counts every
// event; the log only stops repeating it.
//
// The key is the message text, which kvrelay's call sites write as a
// constant, never the peer's data: so the number of keys is bounded by
// the code, and MaxKeys bounds it again should a caller format one.
package logthrottle

import (
	"context"
	stdlog "log"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// Defaults of Options.
const (
	DefaultBurst  = 5
	DefaultWindow = time.Minute
	// MaxKeys bounds the messages tracked; past it every new message
	// shares one allowance, so memory stays under MaxKeys small entries.
	MaxKeys = 1024
)

// overflowKey is the allowance the messages past MaxKeys share.
const overflowKey = "\x00logthrottle: other messages"

// Options configures Wrap.
type Options struct {
	// Burst is how many lines of one message pass per Window; 0 =
	// DefaultBurst.
	Burst int
	// Window is the period the Burst is counted over; 0 = DefaultWindow.
	Window time.Duration
	// Now replaces time.Now (tests).
	Now func() time.Time
}

// limiter is the state every handler derived from one Wrap shares.
type limiter struct {
	burst      int
	window     time.Duration
	now        func() time.Time
	mu         sync.Mutex
	keys       map[string]*allowance
	suppressed atomic.Uint64
}

type allowance struct {
	start      time.Time // the window's start
	passed     int       // lines let through in the window
	suppressed uint64    // lines held back since the last one let through
}

// allow reports whether a line of msg passes now and, if it does, how
// many of its lines were held back since the last that passed.
func (l *limiter) allow(msg string) (bool, uint64) {
	now := l.now()
	l.mu.Lock()
	defer l.mu.Unlock()
	a := l.keys[msg]
	if a == nil {
		if len(l.keys) >= MaxKeys {
			msg = overflowKey
			a = l.keys[msg]
		}
		if a == nil {
			a = &allowance{start: now}
			l.keys[msg] = a
		}
	}
	if now.Sub(a.start) >= l.window {
		a.start, a.passed = now, 0
	}
	if a.passed >= l.burst {
		a.suppressed++
		l.suppressed.Add(1)
		return false, 0
	}
	a.passed++
	held := a.suppressed
	a.suppressed = 0
	return true, held
}

// Handler is a slog.Handler that passes at most Burst records of one
// message per Window to the handler it wraps.
type Handler struct {
	next slog.Handler
	lim  *limiter
}

// NewHandler wraps next.
func NewHandler(next slog.Handler, opts Options) *Handler {
	if opts.Burst <= 0 {
		opts.Burst = DefaultBurst
	}
	if opts.Window <= 0 {
		opts.Window = DefaultWindow
	}
	if opts.Now == nil {
		opts.Now = time.Now
	}
	return &Handler{next: next, lim: &limiter{
		burst: opts.Burst, window: opts.Window, now: opts.Now, keys: map[string]*allowance{},
	}}
}

// Wrap returns a logger writing to log's handler, throttled with the
// defaults. A nil log gives a logger that discards.
func Wrap(log *slog.Logger) *slog.Logger {
	if log == nil {
		return slog.New(slog.DiscardHandler)
	}
	return slog.New(NewHandler(log.Handler(), Options{}))
}

// Enabled implements slog.Handler.
func (h *Handler) Enabled(ctx context.Context, l slog.Level) bool { return h.next.Enabled(ctx, l) }

// Handle implements slog.Handler: it drops the record when its message is
// over its allowance, and adds "suppressed" when lines were held back.
func (h *Handler) Handle(ctx context.Context, r slog.Record) error {
	ok, held := h.lim.allow(r.Message)
	if !ok {
		return nil
	}
	if held > 0 {
		r = r.Clone()
		r.AddAttrs(slog.Uint64("suppressed", held))
	}
	return h.next.Handle(ctx, r)
}

// WithAttrs implements slog.Handler; the derived handler shares the
// allowances.
func (h *Handler) WithAttrs(attrs []slog.Attr) slog.Handler {
	return &Handler{next: h.next.WithAttrs(attrs), lim: h.lim}
}

// WithGroup implements slog.Handler; the derived handler shares the
// allowances.
func (h *Handler) WithGroup(name string) slog.Handler {
	return &Handler{next: h.next.WithGroup(name), lim: h.lim}
}

// Suppressed is how many records were held back in all.
func (h *Handler) Suppressed() uint64 { return h.lim.suppressed.Load() }

// ErrorLog returns a *log.Logger for an http.Server's ErrorLog (or any
// library that logs through the standard logger) whose lines go to log at
// level, throttled: a flood of bad TLS handshakes or malformed requests,
// each line naming another client address, yields a few lines a minute.
// The throttle's key is the line's kind, its text up to the first
// " from ", ": " or digit ("http: TLS handshake error"), so lines that
// differ only in the client or the cause share one allowance; the whole
// line is the "detail" attribute.
func ErrorLog(log *slog.Logger, level slog.Level) *stdlog.Logger {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return stdlog.New(&errorWriter{log: Wrap(log), level: level}, "", 0)
}

type errorWriter struct {
	log   *slog.Logger
	level slog.Level
}

func (w *errorWriter) Write(p []byte) (int, error) {
	line := strings.TrimRight(string(p), "\n")
	w.log.Log(context.Background(), w.level, lineKind(line), "detail", line)
	return len(p), nil
}

// lineKind is a log line's constant part: its text up to the first
// " from " or ": " past a leading "http: " (or the HTTP/2 server's
// "http2: "), or the first digit, at most maxKind bytes (cut at a space).
func lineKind(line string) string {
	const maxKind = 80
	start := 0
	for _, prefix := range []string{"http: ", "http2: "} {
		if strings.HasPrefix(line, prefix) {
			start = len(prefix)
		}
	}
	end := len(line)
	for _, sep := range []string{" from ", ": "} {
		if i := strings.Index(line[start:], sep); i >= 0 && start+i < end {
			end = start + i
		}
	}
	if i := strings.IndexAny(line[start:end], "0123456789"); i >= 0 {
		end = start + i
	}
	if end > maxKind {
		end = maxKind
		if i := strings.LastIndexByte(line[:end], ' '); i > start {
			end = i
		}
	}
	kind := strings.TrimSpace(line[:end])
	if kind == "" || kind == "http:" || kind == "http2:" {
		return "HTTP server error"
	}
	return kind
}
