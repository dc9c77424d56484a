package main

import (
	"context"
	"io"
	"log/slog"
	"runtime"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"
)

// The default is adaptive unless the operator set $GOMAXPROCS, which is then
// left to Go; "go", "adaptive" and a count are taken as written.
func TestProcsMode(t *testing.T) {
	cases := []struct {
		value, env string
		mode       string
		n          int
		err        string
	}{
		{value: "", mode: "adaptive"},
		{value: "", env: "3", mode: "go"},
		{value: "adaptive", env: "3", mode: "adaptive"},
		{value: "go", mode: "go"},
		{value: "4", env: "3", mode: "fixed", n: 4},
		{value: "0", err: `--gomaxprocs "0"`},
		{value: "-2", err: `--gomaxprocs "-2"`},
		{value: "auto", err: `--gomaxprocs "auto": want adaptive, go`},
	}
	for _, tc := range cases {
		t.Run(tc.value+"/"+tc.env, func(t *testing.T) {
			getenv := func(k string) string {
				if k == "GOMAXPROCS" {
					return tc.env
				}
				return ""
			}
			mode, n, err := procsMode(tc.value, getenv)
			if tc.err != "" {
				if err == nil || !strings.Contains(err.Error(), tc.err) {
					t.Fatalf("procsMode(%q) error %v, want one containing %q", tc.value, err, tc.err)
				}
				return
			}
			if err != nil || mode != tc.mode || n != tc.n {
				t.Fatalf("procsMode(%q, GOMAXPROCS=%q) = %q, %d, %v; want %q, %d", tc.value, tc.env, mode, n, err, tc.mode, tc.n)
			}
		})
	}
}

// With no flag and no $GOMAXPROCS, serve runs the adaptive controller: an idle
// process goes to one P, and gets its count back when the controller stops.
func TestStartProcsDefaultIsAdaptive(t *testing.T) {
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
	max := runtime.GOMAXPROCS(0)
	if max == 1 {
		t.Skip("one P: nothing to adapt")
	}
	t.Setenv("GOMAXPROCS", "")
	stop, err := startProcs(context.Background(), "", slog.New(slog.NewTextHandler(io.Discard, nil)))
	if err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for runtime.GOMAXPROCS(0) != 1 {
		if time.Now().After(deadline) {
			stop()
			t.Fatalf("GOMAXPROCS still %d 10 s after start, want 1 for an idle process", runtime.GOMAXPROCS(0))
		}
		time.Sleep(5 * time.Millisecond)
	}
	stop()
	if got := runtime.GOMAXPROCS(0); got != max {
		t.Fatalf("GOMAXPROCS %d after stop, want %d back", got, max)
	}
}
