package membership

import (
	"bufio"
	"bytes"
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	"github.com/kvrelay/kvrelay/gateway"
)

// A worker file (--worker-file) lists one worker a line in Syntax; blank
// lines and everything after a '#' are ignored. It is the convention of
// Prometheus's file_sd: a ConfigMap, consul-template or any orchestrator
// writes it, the gateway follows it. The file is polled (its modification
// time and size, then a hash of its bytes) rather than watched with
// inotify: a Kubernetes ConfigMap is replaced through a symlink swap that
// inotify watchers of the file miss, and a poll every few seconds costs a
// stat.

// DefaultFileInterval is how often the file is checked for a change.
const DefaultFileInterval = 5 * time.Second

// maxFileBytes bounds a worker file: DefaultMaxWorkers lines of the
// longest worker fit several times over.
const maxFileBytes = 16 << 20

// ParseWorkerFile reads a worker file's bytes. Every line that does not
// parse is named in the error, by line number.
func ParseWorkerFile(b []byte) ([]gateway.Worker, error) {
	var out []gateway.Worker
	var errs []error
	sc := bufio.NewScanner(bytes.NewReader(b))
	sc.Buffer(make([]byte, 0, 4096), maxSpec+2)
	for n := 1; sc.Scan(); n++ {
		line, _, _ := strings.Cut(sc.Text(), "#")
		line = strings.TrimSpace(line)
		if line == "" {
			continue
		}
		w, err := ParseWorker(line)
		if err != nil {
			errs = append(errs, fmt.Errorf("line %d: %w", n, err))
			if len(errs) == 10 {
				errs = append(errs, errors.New("more lines not read"))
				break
			}
			continue
		}
		out = append(out, w)
	}
	if err := sc.Err(); err != nil {
		errs = append(errs, fmt.Errorf("a line over %d bytes: %w", maxSpec, err))
	}
	return out, errors.Join(errs...)
}

// FileWatcher follows a worker file into a Set as SourceFile.
type FileWatcher struct {
	set      *Set
	path     string
	every    time.Duration
	modTime  time.Time
	size     int64
	sum      [sha256.Size]byte
	haveSum  bool
	badSum   [sha256.Size]byte // the last content refused, logged once
	reloaded func()            // tests: after each check that read the file
}

// WatchFile reads path into set now, failing if it cannot be read or does
// not parse (a gateway should not start on a file it cannot read); Run
// then follows its changes every interval (0 = DefaultFileInterval).
func WatchFile(set *Set, path string, interval time.Duration) (*FileWatcher, error) {
	if interval <= 0 {
		interval = DefaultFileInterval
	}
	f := &FileWatcher{set: set, path: path, every: interval}
	if _, err := f.check(); err != nil {
		return nil, err
	}
	return f, nil
}

// Run checks the file every interval until ctx ends. A file that cannot be
// read or does not parse is logged and counted; the last good list stays.
func (f *FileWatcher) Run(ctx context.Context) {
	t := time.NewTicker(f.every)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		if reported, err := f.check(); err != nil && !reported {
			f.set.Reject(SourceFile, err)
		}
	}
}

// check reloads the file if it changed; reported says the Set counted and
// logged the refusal already.
func (f *FileWatcher) check() (reported bool, err error) {
	st, err := os.Stat(f.path)
	if err != nil {
		return false, fmt.Errorf("worker file: %w", err)
	}
	if f.haveSum && st.ModTime().Equal(f.modTime) && st.Size() == f.size {
		return false, nil
	}
	fh, err := os.Open(f.path)
	if err != nil {
		return false, fmt.Errorf("worker file: %w", err)
	}
	b, err := io.ReadAll(io.LimitReader(fh, maxFileBytes+1))
	fh.Close()
	if err != nil {
		return false, fmt.Errorf("worker file %s: %w", f.path, err)
	}
	if len(b) > maxFileBytes {
		return false, fmt.Errorf("worker file %s: over %d bytes", f.path, maxFileBytes)
	}
	sum := sha256.Sum256(b)
	if f.haveSum && sum == f.sum {
		f.modTime, f.size = st.ModTime(), st.Size()
		return false, nil
	}
	if sum == f.badSum {
		return false, nil // refused and logged already
	}
	ws, err := ParseWorkerFile(b)
	if err != nil {
		f.badSum = sum
		return false, fmt.Errorf("worker file %s: %w", f.path, err)
	}
	if err := f.set.Replace(SourceFile, ws); err != nil {
		f.badSum = sum
		return true, fmt.Errorf("worker file %s: %w", f.path, err)
	}
	// Only a file that was applied is remembered as in force; one that
	// does not parse is remembered as refused, so it is logged once.
	f.modTime, f.size, f.sum, f.haveSum = st.ModTime(), st.Size(), sum, true
	if f.reloaded != nil {
		f.reloaded()
	}
	return false, nil
}
