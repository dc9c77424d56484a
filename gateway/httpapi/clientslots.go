package httpapi

import (
	"net"
	"net/http"
	"sync"
)

// perClient is MaxInFlightPerClient or its default.
func (l Limits) perClient() int {
	if l.MaxInFlightPerClient > 0 {
		return l.MaxInFlightPerClient
	}
	return max(1, l.MaxInFlight/8)
}

// clientKey is the address a request's connection comes from, without its
// port: one client's connections share its slots.
func clientKey(r *http.Request) string {
	host, _, err := net.SplitHostPort(r.RemoteAddr)
	if err != nil {
		return r.RemoteAddr
	}
	return host
}

// clientSlots counts the requests in flight per client. An entry lives
// only while its client has one in flight, so the map holds at most
// MaxInFlight entries (the global bound is taken after this one, but a
// refused request gives its slot back at once).
type clientSlots struct {
	max int
	mu  sync.Mutex
	n   map[string]int
}

func newClientSlots(max int) *clientSlots { return &clientSlots{max: max, n: map[string]int{}} }

func (c *clientSlots) take(client string) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.n[client] >= c.max {
		return false
	}
	c.n[client]++
	return true
}

func (c *clientSlots) give(client string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.n[client] <= 1 {
		delete(c.n, client)
		return
	}
	c.n[client]--
}
