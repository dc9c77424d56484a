// Package zmtppeer is a raw ZMTP 3.0 peer for tests: a TCP server that
// completes the handshake as an engine's PUB or ROUTER socket would, then
// writes whatever bytes a test wants, including frame headers that lie about
// their size. Real engines (libzmq) never send such bytes, so the tests of
// kvrelay's limits need this peer rather than pyzmq.
package zmtppeer

import (
	"context"
	"encoding/binary"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"testing"
)

// Frame flags (ZMTP 3.0, RFC 23).
const (
	FlagMore    = 0x01
	FlagLong    = 0x02
	FlagCommand = 0x04
)

// GreetingBytes is the fixed size of a ZMTP 3.x greeting.
const GreetingBytes = 64

// Frame encodes one frame: its header and body. With body nil, the header
// declares size and no body follows (a header that lies).
func Frame(flags byte, body []byte, size uint64) []byte {
	if body != nil {
		size = uint64(len(body))
	}
	var b []byte
	if size > 255 || flags&FlagLong != 0 {
		b = append(b, flags|FlagLong)
		b = binary.BigEndian.AppendUint64(b, size)
	} else {
		b = append(b, flags, byte(size))
	}
	return append(b, body...)
}

// Message encodes frames as one message.
func Message(frames ...[]byte) []byte {
	var b []byte
	for i, f := range frames {
		flags := byte(FlagMore)
		if i == len(frames)-1 {
			flags = 0
		}
		b = append(b, Frame(flags, f, 0)...)
	}
	return b
}

// Greeting is a ZMTP 3.0 greeting with the NULL mechanism.
func Greeting() []byte {
	g := make([]byte, GreetingBytes)
	g[0], g[9], g[10], g[11] = 0xff, 0x7f, 3, 0
	copy(g[12:], "NULL")
	return g
}

// Ready is the READY command announcing socketType.
func Ready(socketType string) []byte {
	body := append([]byte{5}, "READY"...)
	body = append(body, byte(len("Socket-Type")))
	body = append(body, "Socket-Type"...)
	body = binary.BigEndian.AppendUint32(body, uint32(len(socketType)))
	body = append(body, socketType...)
	return Frame(FlagCommand, body, 0)
}

// Peer is a listening raw peer. It counts the connections it accepted and
// those that ended after the handshake.
type Peer struct {
	Endpoint string // tcp://host:port
	accepted atomic.Int32
	ended    atomic.Int32
}

// Accepted is how many connections the peer accepted.
func (p *Peer) Accepted() int { return int(p.accepted.Load()) }

// Ended is how many connections ended after the handshake: serve failed to
// write (the client hung up) or the client closed the stream.
func (p *Peer) Ended() int { return int(p.ended.Load()) }

// Start listens on a free loopback port; see StartOn.
func Start(t testing.TB, socketType string, serve func(c net.Conn) error) *Peer {
	t.Helper()
	return StartOn(t, "127.0.0.1:0", socketType, serve)
}

// StartOn listens on addr. Every connection gets the handshake as
// socketType, then serve; after serve the peer reads until the client hangs
// up. Everything stops at the test's cleanup.
func StartOn(t testing.TB, addr, socketType string, serve func(c net.Conn) error) *Peer {
	t.Helper()
	l, err := net.Listen("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	p := &Peer{Endpoint: "tcp://" + l.Addr().String()}
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	t.Cleanup(func() { cancel(); _ = l.Close(); wg.Wait() })
	wg.Go(func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			p.accepted.Add(1)
			wg.Go(func() {
				defer c.Close()
				stop := context.AfterFunc(ctx, func() { _ = c.Close() })
				defer stop()
				if err := Handshake(c, socketType); err != nil {
					return
				}
				if err := serve(c); err == nil {
					_, _ = io.Copy(io.Discard, c)
				}
				p.ended.Add(1)
			})
		}
	})
	return p
}

// Handshake exchanges greetings and READY commands as socketType.
func Handshake(c net.Conn, socketType string) error {
	if _, err := c.Write(Greeting()); err != nil {
		return err
	}
	if _, err := io.ReadFull(c, make([]byte, GreetingBytes)); err != nil {
		return err
	}
	if _, err := c.Write(Ready(socketType)); err != nil {
		return err
	}
	_, err := ReadFrame(c) // the client's READY
	return err
}

// ReadFrame reads one frame the client sent; bodies over 64 KiB are cut
// (tests read only requests and commands).
func ReadFrame(c net.Conn) ([]byte, error) {
	var hdr [9]byte
	if _, err := io.ReadFull(c, hdr[:1]); err != nil {
		return nil, err
	}
	var size uint64
	if hdr[0]&FlagLong != 0 {
		if _, err := io.ReadFull(c, hdr[1:9]); err != nil {
			return nil, err
		}
		size = binary.BigEndian.Uint64(hdr[1:9])
	} else {
		if _, err := io.ReadFull(c, hdr[1:2]); err != nil {
			return nil, err
		}
		size = uint64(hdr[1])
	}
	body := make([]byte, min(size, 1<<16))
	_, err := io.ReadFull(c, body)
	return body, err
}
