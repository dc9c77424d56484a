// Package freeport finds ranges of free TCP ports. Engines put DP rank r on
// base port + r, so a simulated or peer engine needs n consecutive ports,
// which the kernel's port :0 cannot hand out.
package freeport

import (
	"errors"
	"fmt"
	"net"
)

// Range returns the first of n consecutive ports that are free right now on
// every interface (engines bind the wildcard address). Another process may
// still take one before the caller binds it; starting from a port the kernel
// chose makes that rare, and callers that can retry should.
func Range(n int) (int, error) {
	if n < 1 {
		return 0, fmt.Errorf("freeport: %d ports asked for", n)
	}
	for attempt := 0; attempt < 50; attempt++ {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return 0, fmt.Errorf("freeport: %w", err)
		}
		base := l.Addr().(*net.TCPAddr).Port
		l.Close()
		if base+n-1 > 65535 {
			continue
		}
		if holdAll(base, n) {
			return base, nil
		}
	}
	return 0, errors.New("freeport: no range of free ports found")
}

// holdAll binds base..base+n-1 and releases them, reporting whether all were
// free.
func holdAll(base, n int) bool {
	var held []net.Listener
	defer func() {
		for _, l := range held {
			l.Close()
		}
	}()
	for p := base; p < base+n; p++ {
		l, err := net.Listen("tcp", fmt.Sprintf("0.0.0.0:%d", p))
		if err != nil {
			return false
		}
		held = append(held, l)
	}
	return true
}

// fataler is the part of testing.TB that ForTest needs, so this package does
// not import testing into the binaries that use Range.
type fataler interface {
	Helper()
	Fatal(args ...any)
}

// ForTest is Range for tests: a failure to find ports fails the test.
func ForTest(t fataler, n int) int {
	t.Helper()
	base, err := Range(n)
	if err != nil {
		t.Fatal(err)
	}
	return base
}
