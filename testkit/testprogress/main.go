// Command testprogress turns `go test -json` on stdin into a readable log
// that shows progress: the race tests run for many minutes per package, and
// plain `go test` prints nothing until a package is done.
//
// It prints, as they happen: each top-level test that fails (with all its
// output) or took at least -slow; every package's summary line exactly as
// go test prints it ("ok  \tpkg\t12.3s", "FAIL\tpkg …", which CI parses);
// a package's whole output when it fails outside a test (panic, timeout,
// build error); and every -every a line naming the packages still running.
// It exits 1 when anything failed.
//
//	go test -race -json ./... | go run ./internal/testprogress
package main

import (
	"bufio"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"os"
	"sort"
	"strings"
	"sync"
	"time"
)

// event is one line of `go test -json` (cmd/test2json).
type event struct {
	Action      string
	Package     string
	Test        string
	Elapsed     float64
	Output      string
	ImportPath  string // build-output events
	FailedBuild string
}

func main() {
	slow := flag.Duration("slow", 5*time.Second, "print passing top-level tests that took at least this long")
	every := flag.Duration("every", 30*time.Second, "how often to name the packages still running")
	flag.Parse()
	p := newPrinter(os.Stdout, *slow)
	stop := make(chan struct{})
	go func() {
		t := time.NewTicker(*every)
		defer t.Stop()
		for {
			select {
			case <-stop:
				return
			case <-t.C:
				p.heartbeat(time.Now())
			}
		}
	}()
	err := p.consume(os.Stdin)
	close(stop)
	if err != nil {
		fmt.Fprintln(os.Stderr, "testprogress:", err)
		os.Exit(1)
	}
	if p.failed {
		os.Exit(1)
	}
}

type printer struct {
	mu      sync.Mutex
	out     io.Writer
	slow    time.Duration
	started map[string]time.Time // running packages
	output  map[string][]string  // buffered output by package+"\x00"+test
	failed  bool
}

func newPrinter(out io.Writer, slow time.Duration) *printer {
	return &printer{out: out, slow: slow, started: map[string]time.Time{}, output: map[string][]string{}}
}

func (p *printer) consume(r io.Reader) error {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64*1024), 16*1024*1024)
	for sc.Scan() {
		line := sc.Bytes()
		var ev event
		if err := json.Unmarshal(line, &ev); err != nil || ev.Action == "" {
			// Not an event (go vet or build messages): pass it through.
			p.mu.Lock()
			fmt.Fprintf(p.out, "%s\n", line)
			p.mu.Unlock()
			continue
		}
		p.handle(ev, time.Now())
	}
	if err := sc.Err(); err != nil {
		return fmt.Errorf("reading go test -json: %w", err)
	}
	return nil
}

func (p *printer) handle(ev event, now time.Time) {
	p.mu.Lock()
	defer p.mu.Unlock()
	key := ev.Package + "\x00" + ev.Test
	topLevel := ev.Test != "" && !strings.Contains(ev.Test, "/")
	switch ev.Action {
	case "build-output":
		fmt.Fprint(p.out, ev.Output)
	case "build-fail":
		p.failed = true
	case "start":
		p.started[ev.Package] = now
	case "output":
		if ev.Test == "" {
			p.output[key] = append(p.output[key], ev.Output)
			return
		}
		// Subtests' output is kept with their top-level test.
		top, _, _ := strings.Cut(ev.Test, "/")
		k := ev.Package + "\x00" + top
		p.output[k] = append(p.output[k], ev.Output)
	case "pass", "skip":
		if ev.Test == "" {
			p.endPackage(ev, key, false)
			return
		}
		if topLevel {
			if time.Duration(ev.Elapsed*float64(time.Second)) >= p.slow {
				fmt.Fprintf(p.out, "    --- PASS: %s (%.1fs) %s\n", ev.Test, ev.Elapsed, ev.Package)
			}
			delete(p.output, key)
		}
	case "fail":
		p.failed = true
		if ev.Test == "" {
			p.endPackage(ev, key, true)
			return
		}
		if topLevel {
			fmt.Fprintf(p.out, "    --- FAIL: %s (%.1fs) %s\n", ev.Test, ev.Elapsed, ev.Package)
			for _, l := range p.output[key] {
				fmt.Fprint(p.out, "        ", l)
			}
			delete(p.output, key)
		}
	}
}

// endPackage prints the package's summary line, or all its own output when
// it failed (a panic or timeout is reported there, not in a test).
func (p *printer) endPackage(ev event, key string, failed bool) {
	delete(p.started, ev.Package)
	lines := p.output[key]
	delete(p.output, key)
	for _, l := range lines {
		summary := strings.HasPrefix(l, "ok ") || strings.HasPrefix(l, "FAIL\t") || strings.HasPrefix(l, "?   ")
		if failed || summary {
			fmt.Fprint(p.out, l)
		}
	}
}

func (p *printer) heartbeat(now time.Time) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if len(p.started) == 0 {
		return
	}
	names := make([]string, 0, len(p.started))
	for pkg, t := range p.started {
		names = append(names, fmt.Sprintf("%s (%s)", pkg, now.Sub(t).Round(time.Second)))
	}
	sort.Strings(names)
	fmt.Fprintf(p.out, "... running: %s\n", strings.Join(names, ", "))
}
