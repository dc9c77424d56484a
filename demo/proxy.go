package demo

import (
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"time"
)

// proxy is a loopback TCP forwarder between the gateway and one relay. It
// exists so the demo can drop the gateway's streams the way a network does
// (connections reset under an open stream, the gateway keeping its cursors),
// which neither the relay nor the gateway can be asked to do to itself.
type proxy struct {
	ln     net.Listener
	target string

	mu     sync.Mutex
	conns  map[net.Conn]struct{}
	closed bool
	wg     sync.WaitGroup
}

func startProxy(target string) (*proxy, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, fmt.Errorf("proxy for %s: %w", target, err)
	}
	p := &proxy{ln: ln, target: target, conns: map[net.Conn]struct{}{}}
	p.wg.Add(1)
	go p.accept()
	return p, nil
}

func (p *proxy) addr() string { return p.ln.Addr().String() }

func (p *proxy) accept() {
	defer p.wg.Done()
	for {
		c, err := p.ln.Accept()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			// Transient accept errors (fd exhaustion) pass; the gateway
			// retries the connection.
			time.Sleep(10 * time.Millisecond)
			continue
		}
		p.wg.Add(1)
		go p.forward(c)
	}
}

// track registers both ends of a forwarded connection; false means the proxy
// is closing and the caller must drop them.
func (p *proxy) track(cs ...net.Conn) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return false
	}
	for _, c := range cs {
		p.conns[c] = struct{}{}
	}
	return true
}

func (p *proxy) untrack(cs ...net.Conn) {
	p.mu.Lock()
	for _, c := range cs {
		delete(p.conns, c)
	}
	p.mu.Unlock()
}

func (p *proxy) forward(client net.Conn) {
	defer p.wg.Done()
	// The relay may be down (a relay restart); the gateway then sees the
	// connection close and backs off, as it would facing the relay itself.
	upstream, err := net.DialTimeout("tcp", p.target, time.Second)
	if err != nil {
		client.Close()
		return
	}
	if !p.track(client, upstream) {
		client.Close()
		upstream.Close()
		return
	}
	var both sync.WaitGroup
	pipe := func(dst, src net.Conn) {
		defer both.Done()
		_, _ = io.Copy(dst, src)
		// Either direction ending ends the connection, as a reset would.
		dst.Close()
		src.Close()
	}
	both.Add(2)
	go pipe(upstream, client)
	go pipe(client, upstream)
	both.Wait()
	p.untrack(client, upstream)
}

// cut closes every forwarded connection and returns how many client
// connections it dropped.
func (p *proxy) cut() int {
	p.mu.Lock()
	n := len(p.conns) / 2
	for c := range p.conns {
		c.Close()
	}
	p.mu.Unlock()
	return n
}

func (p *proxy) close() {
	p.mu.Lock()
	p.closed = true
	p.mu.Unlock()
	p.ln.Close()
	p.cut()
	p.wg.Wait()
}
