package quietio

import (
	"net"
	"testing"
)

func TestWrapsSocketsOnLinux(t *testing.T) {
	a, d := pair(t, 0)
	for _, c := range []net.Conn{a, d} {
		if _, wrapped := c.(*conn); !wrapped {
			t.Fatalf("%T: a TCP socket was not wrapped", c)
		}
	}
	// Not a socket: left as it is.
	p1, p2 := net.Pipe()
	defer p1.Close()
	defer p2.Close()
	if Wrap(p1) != p1 {
		t.Fatal("a net.Pipe end was wrapped; it has no socket")
	}
}
