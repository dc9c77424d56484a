// Package quietio reads and writes sockets without waking the Go runtime's
// monitor thread.
//
// A relay at an engine's pacing is idle between batches, and most of its CPU
// is waking up, not work (docs/bench/log/2026-12-05-relay-pacing-quiet.md).
// Half of those wake-ups are the runtime's monitor thread, sysmon. Once
// every P is idle, sysmon sleeps until the next timer; the first system
// call made through package syscall (a socket read, a socket write) wakes
// it, and it then polls every 20 µs until every P is idle again: four to
// five extra thread switches for each batch the relay handles.
//
// A read or write on a non-blocking socket never blocks, so it does not need
// the syscall state that lets sysmon hand the caller's P to another thread.
// Conn makes those calls with syscall.RawSyscall inside syscall.RawConn's
// Read and Write, which keep the runtime's network poller in charge of
// waiting for readiness, deadlines and Close; only the call itself is raw.
// This is how the runtime's own poller talks to epoll.
//
// On platforms other than Linux, and for connections that are not sockets,
// Wrap and Listener return what they were given.
package quietio

import (
	"net"
	"time"
)

// Listener returns l with every accepted connection wrapped by Wrap.
//
// userTimeout, when positive, is set as each accepted TCP connection's
// TCP_USER_TIMEOUT. gRPC sets it itself from its keepalive timeout, but only
// on a *net.TCPConn, which a wrapped connection no longer is: a server
// whose keepalive has a timeout passes the same value here.
func Listener(l net.Listener, userTimeout time.Duration) net.Listener {
	if !supported {
		return l
	}
	return listener{Listener: l, userTimeout: userTimeout}
}

type listener struct {
	net.Listener
	userTimeout time.Duration
}

func (l listener) Accept() (net.Conn, error) {
	for {
		c, err := l.Listener.Accept()
		if err != nil {
			return nil, err
		}
		if l.userTimeout > 0 {
			if err := setUserTimeout(c, l.userTimeout); err != nil {
				// gRPC drops a connection it cannot set the timeout on,
				// and goes on serving; an error from Accept would stop
				// the server instead.
				_ = c.Close()
				continue
			}
		}
		return Wrap(c), nil
	}
}

// tcpUserTimeout is TCP_USER_TIMEOUT from linux/tcp.h, which package syscall
// does not name.
const tcpUserTimeout = 0x12
