package main

import (
	"bytes"
	"strings"
	"testing"
	"time"
)

func TestPrinter(t *testing.T) {
	cases := []struct {
		name       string
		events     string
		want       []string // lines that must appear, in order
		wantAbsent []string
		failed     bool
	}{
		{
			name: "passing package prints its summary and slow tests only",
			events: `{"Action":"start","Package":"a"}
{"Action":"run","Package":"a","Test":"TestFast"}
{"Action":"output","Package":"a","Test":"TestFast","Output":"=== RUN   TestFast\n"}
{"Action":"pass","Package":"a","Test":"TestFast","Elapsed":0.1}
{"Action":"pass","Package":"a","Test":"TestSlow","Elapsed":7.5}
{"Action":"output","Package":"a","Output":"PASS\n"}
{"Action":"output","Package":"a","Output":"ok  \ta\t7.6s\n"}
{"Action":"pass","Package":"a","Elapsed":7.6}`,
			want:       []string{"--- PASS: TestSlow (7.5s) a", "ok  \ta\t7.6s"},
			wantAbsent: []string{"TestFast", "PASS\n"},
		},
		{
			name: "a failing test prints its output and its subtests'",
			events: `{"Action":"start","Package":"b"}
{"Action":"output","Package":"b","Test":"TestX","Output":"=== RUN   TestX\n"}
{"Action":"output","Package":"b","Test":"TestX/sub","Output":"    x_test.go:9: got 1, want 2\n"}
{"Action":"fail","Package":"b","Test":"TestX/sub","Elapsed":0}
{"Action":"fail","Package":"b","Test":"TestX","Elapsed":0.2}
{"Action":"output","Package":"b","Output":"FAIL\tb\t0.3s\n"}
{"Action":"fail","Package":"b","Elapsed":0.3}`,
			want:   []string{"--- FAIL: TestX (0.2s) b", "got 1, want 2", "FAIL\tb\t0.3s"},
			failed: true,
		},
		{
			name: "a package that dies outside a test prints all its output",
			events: `{"Action":"start","Package":"c"}
{"Action":"output","Package":"c","Output":"panic: test timed out after 20m0s\n"}
{"Action":"output","Package":"c","Output":"FAIL\tc\t1200.0s\n"}
{"Action":"fail","Package":"c","Elapsed":1200}`,
			want:   []string{"panic: test timed out", "FAIL\tc\t1200.0s"},
			failed: true,
		},
		{
			name: "a build failure fails the run",
			events: `{"ImportPath":"d","Action":"build-output","Output":"d/x.go:1: syntax error\n"}
{"ImportPath":"d","Action":"build-fail"}`,
			want:   []string{"syntax error"},
			failed: true,
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			var out bytes.Buffer
			p := newPrinter(&out, 5*time.Second)
			if err := p.consume(strings.NewReader(tc.events)); err != nil {
				t.Fatal(err)
			}
			got := out.String()
			rest := got
			for _, w := range tc.want {
				i := strings.Index(rest, w)
				if i < 0 {
					t.Fatalf("output lacks %q (in order); got:\n%s", w, got)
				}
				rest = rest[i+len(w):]
			}
			for _, a := range tc.wantAbsent {
				if strings.Contains(got, a) {
					t.Errorf("output has %q; got:\n%s", a, got)
				}
			}
			if p.failed != tc.failed {
				t.Errorf("failed = %v, want %v", p.failed, tc.failed)
			}
		})
	}
}

func TestHeartbeatNamesRunningPackages(t *testing.T) {
	var out bytes.Buffer
	p := newPrinter(&out, time.Second)
	t0 := time.Unix(1000, 0)
	p.handle(event{Action: "start", Package: "relay"}, t0)
	p.handle(event{Action: "start", Package: "bench"}, t0.Add(10*time.Second))
	p.heartbeat(t0.Add(70 * time.Second))
	if want := "... running: bench (1m0s), relay (1m10s)\n"; out.String() != want {
		t.Fatalf("got %q, want %q", out.String(), want)
	}
}
