package main

import (
	"bytes"
	"context"
	"io"
	"net"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/kvrelay/kvrelay/testkit/logbuf"
)

func TestHelpExitsZeroForEverySubcommand(t *testing.T) {
	for name := range commands {
		for _, flag := range []string{"-h", "--help"} {
			t.Run(name+" "+flag, func(t *testing.T) {
				var out, errOut bytes.Buffer
				code := dispatch(context.Background(), []string{name, flag}, strings.NewReader(""), &out, &errOut)
				if code != 0 {
					t.Fatalf("exit %d, want 0; stderr:\n%s", code, errOut.String())
				}
				// On stdout, so `kvrelay serve --help | grep tls` works.
				if out.Len() == 0 || errOut.Len() != 0 {
					t.Fatalf("usage on stdout: %d bytes, on stderr: %q", out.Len(), errOut.String())
				}
				if !strings.Contains(out.String(), "usage: kvrelay "+name) {
					t.Fatalf("usage does not name the command:\n%s", out.String())
				}
			})
		}
	}
}

// A mistyped flag gets its one-line reason and a pointer to --help, not the
// whole usage, and exit 2.
func TestMistypedFlagIsOneLineAndAPointer(t *testing.T) {
	for name := range commands {
		t.Run(name, func(t *testing.T) {
			var out, errOut bytes.Buffer
			code := dispatch(context.Background(), []string{name, "--no-such-flag"}, strings.NewReader(""), &out, &errOut)
			if code != 2 {
				t.Fatalf("exit %d, want 2", code)
			}
			want := "kvrelay " + name + ": flag provided but not defined: -no-such-flag\nrun 'kvrelay " + name + " --help' for usage\n"
			if errOut.String() != want || out.Len() != 0 {
				t.Fatalf("stderr %q (want %q), stdout %q", errOut.String(), want, out.String())
			}
		})
	}
}

func TestTopLevelHelp(t *testing.T) {
	var out, errOut bytes.Buffer
	if code := dispatch(context.Background(), []string{"--help"}, strings.NewReader(""), &out, &errOut); code != 0 || !strings.Contains(out.String(), "tail") {
		t.Fatalf("--help: exit %d, stdout %q", code, out.String())
	}
	out.Reset()
	if code := dispatch(context.Background(), nil, strings.NewReader(""), &out, &errOut); code != 2 || !strings.Contains(errOut.String(), "usage: kvrelay") {
		t.Fatalf("no subcommand: exit %d, stderr %q", code, errOut.String())
	}
}

func TestBenchHelpNamesNoStrayArgument(t *testing.T) {
	var errOut bytes.Buffer
	dispatch(context.Background(), []string{"bench", "--help"}, strings.NewReader(""), &errOut, io.Discard)
	// The flag package shows a back-quoted word in a usage string as the
	// flag's argument name.
	for _, line := range strings.Split(errOut.String(), "\n") {
		if strings.HasPrefix(strings.TrimSpace(line), "-in-process") && strings.TrimSpace(line) != "-in-process" {
			t.Fatalf("bench --help shows %q, want a bare boolean flag", line)
		}
	}
}

func TestServeHelpNamesHealthz(t *testing.T) {
	var errOut bytes.Buffer
	dispatch(context.Background(), []string{"serve", "--help"}, strings.NewReader(""), &errOut, io.Discard)
	if !strings.Contains(errOut.String(), "/healthz") {
		t.Fatalf("serve --help does not mention /healthz:\n%s", errOut.String())
	}
}

func TestVersion(t *testing.T) {
	want := regexp.MustCompile(`^kvrelay \S+( \([^)]*\))? go\S+\n$`)
	for _, args := range [][]string{{"version"}, {"--version"}, {"-version"}} {
		var out, errOut bytes.Buffer
		if code := dispatch(context.Background(), args, strings.NewReader(""), &out, &errOut); code != 0 {
			t.Fatalf("%v: exit %d; stderr: %s", args, code, errOut.String())
		}
		if !want.MatchString(out.String()) {
			t.Fatalf("%v printed %q, want %s", args, out.String(), want)
		}
	}
}

func TestTailPrintsTheStatusMessage(t *testing.T) {
	// A port nothing listens on: the stream fails at once with UNAVAILABLE.
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := lis.Addr().String()
	lis.Close()
	var errOut bytes.Buffer
	code := dispatch(context.Background(), []string{"tail", "--addr", addr}, strings.NewReader(""), &bytes.Buffer{}, &errOut)
	if code != 1 {
		t.Fatalf("exit %d, want 1; stderr: %s", code, errOut.String())
	}
	got := strings.TrimSpace(errOut.String())
	if !strings.HasPrefix(got, "stream ended: Unavailable: ") || len(got) <= len("stream ended: Unavailable: ") {
		t.Fatalf("stderr %q, want the code and the status message", got)
	}
}

// background is a kvrelay subcommand the test runs until it stops it.
type background struct {
	ctx    context.Context // ends when the command is stopped
	cancel context.CancelFunc
	stderr logbuf.Buffer
	done   chan int
}

// runInBackground starts `kvrelay args…`; the test's cleanup stops it if
// the test did not.
func runInBackground(t *testing.T, args ...string) *background {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	b := &background{ctx: ctx, cancel: cancel, done: make(chan int, 1)}
	go func() { b.done <- dispatch(ctx, args, strings.NewReader(""), io.Discard, &b.stderr) }()
	t.Cleanup(cancel)
	return b
}

// stop ends the command as SIGTERM would and fails t unless it exits 0
// within 20 s.
func (b *background) stop(t *testing.T) {
	t.Helper()
	b.cancel()
	select {
	case code := <-b.done:
		if code != 0 {
			t.Fatalf("exit %d after shutdown; stderr:\n%s", code, b.stderr.String())
		}
	case <-time.After(20 * time.Second):
		t.Fatal("the command did not shut down")
	}
}
