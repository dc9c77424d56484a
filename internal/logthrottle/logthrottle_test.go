package logthrottle

import (
	"bytes"
	"encoding/json"
	"fmt"
	"log/slog"
	"strings"
	"testing"
	"time"
)

type clock struct{ t time.Time }

func (c *clock) now() time.Time { return c.t }

func lines(t *testing.T, buf *bytes.Buffer) []map[string]any {
	t.Helper()
	var out []map[string]any
	for _, l := range strings.Split(strings.TrimSpace(buf.String()), "\n") {
		if l == "" {
			continue
		}
		var m map[string]any
		if err := json.Unmarshal([]byte(l), &m); err != nil {
			t.Fatalf("line %q: %v", l, err)
		}
		out = append(out, m)
	}
	return out
}

func TestFloodIsHeldToBurstPerWindow(t *testing.T) {
	for _, tc := range []struct {
		name          string
		burst, flood  int
		wantFirstRun  int
		wantSuppressd float64
	}{
		{"flood of a bad message", 5, 20010, 5, 20005},
		{"under the burst", 5, 3, 3, 0},
		{"burst of one", 1, 100, 1, 99},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var buf bytes.Buffer
			c := &clock{t: time.Unix(1000, 0)}
			h := NewHandler(slog.NewJSONHandler(&buf, nil), Options{Burst: tc.burst, Window: time.Minute, Now: c.now})
			log := slog.New(h).With("component", "natsevents")
			for i := range tc.flood {
				log.Warn("undecodable message on the stream; skipped", "seq", i)
			}
			if got := len(lines(t, &buf)); got != tc.wantFirstRun {
				t.Fatalf("%d lines in the first window, want %d", got, tc.wantFirstRun)
			}
			if got := h.Suppressed(); got != uint64(tc.wantSuppressd) {
				t.Fatalf("Suppressed() = %d, want %v", got, tc.wantSuppressd)
			}
			buf.Reset()
			c.t = c.t.Add(time.Minute)
			log.Warn("undecodable message on the stream; skipped", "seq", -1)
			got := lines(t, &buf)
			if len(got) != 1 {
				t.Fatalf("%d lines after the window, want 1", len(got))
			}
			s, has := got[0]["suppressed"]
			if tc.wantSuppressd == 0 {
				if has {
					t.Fatalf("suppressed=%v on a line none were held back before", s)
				}
				return
			}
			if s != tc.wantSuppressd {
				t.Fatalf("suppressed=%v, want %v", s, tc.wantSuppressd)
			}
			if got[0]["component"] != "natsevents" {
				t.Fatalf("attributes lost: %v", got[0])
			}
		})
	}
}

func TestMessagesHaveTheirOwnAllowance(t *testing.T) {
	var buf bytes.Buffer
	c := &clock{t: time.Unix(1000, 0)}
	log := slog.New(NewHandler(slog.NewJSONHandler(&buf, nil), Options{Burst: 2, Now: c.now}))
	for range 100 {
		log.Warn("a")
		log.With("worker", "w1").Warn("b") // derived: shares the allowances
	}
	counts := map[string]int{}
	for _, l := range lines(t, &buf) {
		counts[l["msg"].(string)]++
	}
	if counts["a"] != 2 || counts["b"] != 2 {
		t.Fatalf("lines per message %v, want 2 each", counts)
	}
}

func TestKeysAreBounded(t *testing.T) {
	var buf bytes.Buffer
	c := &clock{t: time.Unix(1000, 0)}
	h := NewHandler(slog.NewJSONHandler(&buf, nil), Options{Burst: 1, Now: c.now})
	log := slog.New(h)
	for i := range MaxKeys + 500 {
		log.Warn(fmt.Sprintf("formatted %d", i)) // a caller that formats its key
	}
	if n := len(h.lim.keys); n > MaxKeys+1 {
		t.Fatalf("%d keys tracked, want at most %d", n, MaxKeys+1)
	}
	if got := len(lines(t, &buf)); got != MaxKeys+1 {
		t.Fatalf("%d lines, want %d (one per key, one for the overflow)", got, MaxKeys+1)
	}
}

func TestWrapNil(t *testing.T) {
	Wrap(nil).Warn("nothing") // must not panic
}

// floodErrorLog prints n lines flood(0) … flood(n-1) and then other
// through ErrorLog at warn, and returns the lines it wrote, parsed and as
// written.
func floodErrorLog(t *testing.T, n int, flood func(i int) string, other string) ([]map[string]any, string) {
	t.Helper()
	var buf bytes.Buffer
	el := ErrorLog(slog.New(slog.NewJSONHandler(&buf, nil)), slog.LevelWarn)
	for i := range n {
		el.Print(flood(i))
	}
	el.Print(other)
	return lines(t, &buf), buf.String()
}

// TestErrorLogHoldsAFloodOfServerErrors: an http.Server's error lines,
// each naming another client, share their kind's allowance; another kind
// has its own.
func TestErrorLogHoldsAFloodOfServerErrors(t *testing.T) {
	got, _ := floodErrorLog(t, 10_000, func(i int) string {
		return fmt.Sprintf("http: TLS handshake error from 10.0.%d.%d:%d: remote error: tls: bad certificate", i/256%256, i%256, 40000+i)
	}, "http: URL query contains semicolon, which is no longer a supported separator; parts of the query may be stripped when parsed; see golang.org/issue/25192")
	if len(got) != DefaultBurst+1 {
		t.Fatalf("%d lines for 10,001 errors, want %d", len(got), DefaultBurst+1)
	}
	if got[0]["msg"] != "http: TLS handshake error" || got[0]["level"] != "WARN" || !strings.Contains(got[0]["detail"].(string), "10.0.0.0:40000") {
		t.Errorf("first line %v", got[0])
	}
	if got[DefaultBurst]["msg"] != "http: URL query contains semicolon, which is no longer a supported separator;" {
		t.Errorf("another kind: %v", got[DefaultBurst]["msg"])
	}
	for line, want := range map[string]string{
		"http: Accept error: accept tcp: too many open files; retrying in 5ms": "http: Accept error",
		"http: panic serving 1.2.3.4:5: boom":                                  "http: panic serving",
		"12345":                                                                "HTTP server error",
		"http: ":                                                               "HTTP server error",
	} {
		if got := lineKind(line); got != want {
			t.Errorf("lineKind(%q) = %q, want %q", line, got, want)
		}
	}
}

// TestErrorLogKindsOfHTTP2Lines: the HTTP/2 server's lines ("http2: …")
// are keyed by their kind too, so a client flooding malformed frames
// (one "server connection error" per connection) does not use up the
// allowance of a handler's panic on HTTP/2. (The digit of "http2" cut
// every such line's kind to "http": one allowance for all of them.)
func TestErrorLogKindsOfHTTP2Lines(t *testing.T) {
	got, out := floodErrorLog(t, 1000, func(i int) string {
		return fmt.Sprintf("http2: server connection error from 10.0.%d.%d:%d: connection error: PROTOCOL_ERROR", i/256%256, i%256, 40000+i)
	}, "http2: panic serving 10.0.0.1:40000: boom\ngoroutine 1 [running]:")
	if len(got) != DefaultBurst+1 {
		t.Fatalf("%d lines, want the flood's %d and the panic:\n%s", len(got), DefaultBurst, out)
	}
	if got[0]["msg"] != "http2: server connection error" || got[DefaultBurst]["msg"] != "http2: panic serving" {
		t.Errorf("kinds %q and %q, want the connection error's and the panic's", got[0]["msg"], got[DefaultBurst]["msg"])
	}
}
