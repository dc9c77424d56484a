package tlsconfig

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"sync"
	"time"
)

// stamp is what a cheap stat says about a file: a rewrite or a rename over it
// changes one of these.
type stamp struct {
	mod  time.Time
	size int64
}

func stat(path string) (stamp, error) {
	fi, err := os.Stat(path)
	if err != nil {
		return stamp{}, err
	}
	return stamp{mod: fi.ModTime(), size: fi.Size()}, nil
}

// reloadable is something loaded from files that is re-read when one of them
// changes (checked at each handshake) or on demand (SIGHUP). A load that fails
// keeps the previous value in service.
type reloadable[T any] struct {
	paths  []string
	load   func() (T, error)
	log    *slog.Logger
	failed func() // counts a changed file that did not load

	mu     sync.Mutex
	stamps []stamp
	value  T
}

func newReloadable[T any](log *slog.Logger, failed func(), load func() (T, error), paths ...string) (*reloadable[T], error) {
	r := &reloadable[T]{paths: paths, load: load, log: log, failed: failed}
	if err := r.reload(); err != nil {
		return nil, err
	}
	return r, nil
}

// current re-reads the files if a stat says one changed, then returns the
// value in service.
func (r *reloadable[T]) current() T {
	r.mu.Lock()
	defer r.mu.Unlock()
	stamps, err := r.stat()
	if err == nil && equalStamps(stamps, r.stamps) {
		return r.value
	}
	if err := r.reloadLocked(); err != nil {
		// Remember what failed so each handshake does not retry (and log)
		// until the files change again; a half-written rotation that is
		// completed later changes a stamp and is picked up then.
		if stamps != nil {
			r.stamps = stamps
		}
		r.failed()
		r.log.Error("TLS files changed but do not load; the previous ones stay in service", "err", err)
	}
	return r.value
}

// reload re-reads the files whether or not they changed.
func (r *reloadable[T]) reload() error {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.reloadLocked()
}

func (r *reloadable[T]) reloadLocked() error {
	// Stat before reading: a change between the two is seen at the next
	// handshake instead of being missed.
	stamps, err := r.stat()
	if err != nil {
		return err
	}
	v, err := r.load()
	if err != nil {
		return err
	}
	r.value, r.stamps = v, stamps
	return nil
}

func (r *reloadable[T]) stat() ([]stamp, error) {
	out := make([]stamp, len(r.paths))
	for i, p := range r.paths {
		s, err := stat(p)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", p, err)
		}
		out[i] = s
	}
	return out, nil
}

func equalStamps(a, b []stamp) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if !a[i].mod.Equal(b[i].mod) || a[i].size != b[i].size {
			return false
		}
	}
	return true
}

// loadKeyPair reads a certificate and its key, naming the file at fault.
func loadKeyPair(certFile, keyFile string) (*tls.Certificate, error) {
	certPEM, err := os.ReadFile(certFile)
	if err != nil {
		return nil, fmt.Errorf("certificate: %w", err)
	}
	keyPEM, err := os.ReadFile(keyFile)
	if err != nil {
		return nil, fmt.Errorf("key: %w", err)
	}
	pair, err := tls.X509KeyPair(certPEM, keyPEM)
	if err != nil {
		return nil, fmt.Errorf("certificate %s with key %s: %w", certFile, keyFile, err)
	}
	// Swapping a live certificate for an expired one would only break the
	// next handshakes; refuse it like any other bad file.
	if pair.Leaf != nil && time.Now().After(pair.Leaf.NotAfter) {
		return nil, fmt.Errorf("certificate %s expired at %s", certFile, pair.Leaf.NotAfter.Format(time.RFC3339))
	}
	return &pair, nil
}

// loadPool reads a PEM bundle of CA certificates.
func loadPool(path string) (*x509.CertPool, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("CA bundle: %w", err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(data) {
		return nil, fmt.Errorf("CA bundle %s: no PEM certificate in it", path)
	}
	return pool, nil
}

var errNoKey = errors.New("a certificate needs its key (and a key its certificate)")
