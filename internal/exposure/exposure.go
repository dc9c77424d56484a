// Package exposure tells a listener reachable only from this host from one
// the network reaches, and warns about the latter when it is plaintext:
// anyone who reaches it reads the engines' block hashes and token ids.
package exposure

import (
	"log/slog"
	"net"
)

// IsLoopback reports whether a listen or dial address only reaches local
// peers. An empty host or a wildcard address listens on every interface.
func IsLoopback(addr string) bool {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return false
	}
	if host == "localhost" {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}

// WarnIfExposed logs a warning for a plaintext listener reachable from the
// network.
func WarnIfExposed(log *slog.Logger, what, addr string, secured bool) {
	if !secured && !IsLoopback(addr) {
		log.Warn("listener is not on loopback and has no TLS: any peer that reaches it can read and call it; set TLS (and client certificates) or bind to 127.0.0.1",
			"listener", what, "listen", addr)
	}
}
