// Package sdnotify speaks systemd's notify protocol: readiness, stopping and
// watchdog pets. The protocol is a single datagram on a unix socket, small
// enough not to warrant a dependency.
package sdnotify

import (
	"context"
	"fmt"
	"net"
	"os"
	"strconv"
	"time"
)

// Notify sends one state line to systemd's notify socket. Outside systemd
// (no NOTIFY_SOCKET) it does nothing.
func Notify(state string) error {
	path := os.Getenv("NOTIFY_SOCKET")
	if path == "" {
		return nil
	}
	if path[0] == '@' {
		path = "\x00" + path[1:] // abstract namespace
	}
	conn, err := net.DialUnix("unixgram", nil, &net.UnixAddr{Name: path, Net: "unixgram"})
	if err != nil {
		return fmt.Errorf("sd_notify %q: %w", state, err)
	}
	defer conn.Close()
	if _, err := conn.Write([]byte(state)); err != nil {
		return fmt.Errorf("sd_notify %q: %w", state, err)
	}
	return nil
}

// watchdogInterval is half of systemd's WatchdogSec, the rhythm at which
// WATCHDOG=1 must be sent; zero when no watchdog is configured for us.
func watchdogInterval() time.Duration {
	usec, err := strconv.ParseInt(os.Getenv("WATCHDOG_USEC"), 10, 64)
	if err != nil || usec <= 0 {
		return 0
	}
	if pid := os.Getenv("WATCHDOG_PID"); pid != "" && pid != strconv.Itoa(os.Getpid()) {
		return 0
	}
	return time.Duration(usec) * time.Microsecond / 2
}

// RunWatchdog pets systemd's watchdog while healthy() holds, so a relay that
// hangs is restarted by systemd rather than silently serving nothing.
func RunWatchdog(ctx context.Context, healthy func() bool) {
	every := watchdogInterval()
	if every == 0 {
		return
	}
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			if healthy() {
				_ = Notify("WATCHDOG=1")
			}
		}
	}
}
