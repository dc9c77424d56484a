package membership

import (
	"context"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"
)

func TestWorkerFileIsFollowed(t *testing.T) {
	s, g, _ := newSet(t, Options{})
	path := filepath.Join(t.TempDir(), "workers")
	write := func(body string) {
		t.Helper()
		// Written beside and renamed, as a ConfigMap's symlink swap or an
		// orchestrator's atomic write does: the watcher never reads half.
		tmp := path + ".tmp"
		if err := os.WriteFile(tmp, []byte(body), 0o644); err != nil {
			t.Fatal(err)
		}
		if err := os.Rename(tmp, path); err != nil {
			t.Fatal(err)
		}
	}
	write("# engines\ngrpc://127.0.0.1:1,model=llama\n\ngrpc://127.0.0.1:2,model=llama # the second\n")
	f, err := WatchFile(s, path, 10*time.Millisecond)
	if err != nil {
		t.Fatal(err)
	}
	reloads := make(chan struct{}, 16)
	f.reloaded = func() { reloads <- struct{}{} }
	if got := gatewayWorkers(g); !slices.Equal(got, []string{"grpc://127.0.0.1:1", "grpc://127.0.0.1:2"}) {
		t.Fatalf("at start: %v", got)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); f.Run(ctx) }()
	defer func() { cancel(); <-done }()

	write("grpc://127.0.0.1:2,model=llama\ngrpc://127.0.0.1:3,model=llama\n")
	eventually(t, "the file's new list", func() bool {
		return slices.Equal(gatewayWorkers(g), []string{"grpc://127.0.0.1:2", "grpc://127.0.0.1:3"})
	})

	// A file that does not parse: refused, logged once, the last good
	// list stays, and routing goes on.
	before := readCounter(s.rejected.WithLabelValues(SourceFile))
	write("grpc://127.0.0.1:2,model=llama\n127.0.0.1:4\ngrpc://127.0.0.1:5,service=nope\n")
	eventually(t, "the bad file is refused", func() bool { return readCounter(s.rejected.WithLabelValues(SourceFile)) == before+1 })
	if got := gatewayWorkers(g); !slices.Equal(got, []string{"grpc://127.0.0.1:2", "grpc://127.0.0.1:3"}) {
		t.Fatalf("after a bad file: %v", got)
	}
	if len(routesTo(t, g, "llama", 4)) != 2 {
		t.Fatal("routing changed after a bad file")
	}
	// A duplicate is refused too.
	write("grpc://127.0.0.1:2,model=llama\ngrpc://127.0.0.1:2,model=llama\n")
	eventually(t, "the duplicate is refused", func() bool { return readCounter(s.rejected.WithLabelValues(SourceFile)) == before+2 })
	// Fixed: followed again.
	write("grpc://127.0.0.1:6,model=llama\n")
	eventually(t, "the fixed file", func() bool { return slices.Equal(gatewayWorkers(g), []string{"grpc://127.0.0.1:6"}) })
	if got := readCounter(s.rejected.WithLabelValues(SourceFile)); got != before+2 {
		t.Fatalf("a refused file was counted %v times, want once each", got-before)
	}
}

func TestWorkerFileErrors(t *testing.T) {
	_, err := ParseWorkerFile([]byte("grpc://h:1\nnot a worker\n\ngrpc://h:2,model\n"))
	if err == nil || !strings.Contains(err.Error(), "line 2:") || !strings.Contains(err.Error(), "line 4:") {
		t.Fatalf("errors do not name the lines: %v", err)
	}
	s, _, _ := newSet(t, Options{})
	if _, err := WatchFile(s, filepath.Join(t.TempDir(), "missing"), 0); err == nil {
		t.Fatal("a missing file at start is not an error")
	}
	long := filepath.Join(t.TempDir(), "long")
	if err := os.WriteFile(long, []byte("grpc://h:1,model="+strings.Repeat("x", 5000)+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := WatchFile(s, long, 0); err == nil || !strings.Contains(err.Error(), "over 1024 bytes") {
		t.Fatalf("a 5,000-byte line: %v", err)
	}
}
