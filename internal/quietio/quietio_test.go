//go:build unix

package quietio

import (
	"bytes"
	"errors"
	"io"
	"net"
	"os"
	"runtime"
	"sync"
	"syscall"
	"testing"
	"time"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// pair returns the two ends of a loopback TCP connection, the accepted one
// through Listener (so wrapped) and the dialed one wrapped by Wrap.
func pair(t *testing.T, userTimeout time.Duration) (accepted, dialed net.Conn) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ql := Listener(ln, userTimeout)
	defer ql.Close()
	type result struct {
		c   net.Conn
		err error
	}
	got := make(chan result, 1)
	go func() {
		c, err := ql.Accept()
		got <- result{c, err}
	}()
	d, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	r := <-got
	if r.err != nil {
		d.Close()
		t.Fatal(r.err)
	}
	t.Cleanup(func() { r.c.Close(); d.Close() })
	return r.c, Wrap(d)
}

// TestCarriesBytesBothWays moves 8 MiB each way at once, more than the
// sockets' buffers hold, so writes meet a full buffer (EAGAIN, then the
// poller) and reads meet an empty one, and checks every byte.
func TestCarriesBytesBothWays(t *testing.T) {
	a, d := pair(t, 0)
	const size = 8 << 20
	payload := func(seed byte) []byte {
		b := make([]byte, size)
		for i := range b {
			b[i] = seed + byte(i*7)
		}
		return b
	}
	toA, toD := payload(1), payload(2)
	var wg sync.WaitGroup
	errs := make(chan error, 4)
	send := func(c net.Conn, b []byte) {
		defer wg.Done()
		// Odd-sized writes, so partial writes land mid-slice.
		for off := 0; off < len(b); {
			n := min(len(b)-off, 333_333)
			w, err := c.Write(b[off : off+n])
			if err != nil || w != n {
				errs <- errors.Join(err, io.ErrShortWrite)
				return
			}
			off += n
		}
	}
	recv := func(c net.Conn, want []byte) {
		defer wg.Done()
		got := make([]byte, len(want))
		if _, err := io.ReadFull(c, got); err != nil {
			errs <- err
			return
		}
		if !bytes.Equal(got, want) {
			errs <- errors.New("received bytes differ from those sent")
		}
	}
	wg.Add(4)
	go send(d, toA)
	go send(a, toD)
	go recv(a, toA)
	go recv(d, toD)
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
}

func TestReadErrorsAreNetConns(t *testing.T) {
	t.Run("EOF at the peer's close", func(t *testing.T) {
		a, d := pair(t, 0)
		if _, err := d.Write([]byte("last")); err != nil {
			t.Fatal(err)
		}
		d.Close()
		got, err := io.ReadAll(a)
		if err != nil || string(got) != "last" {
			t.Fatalf("ReadAll = %q, %v; want \"last\", nil (io.EOF ends it)", got, err)
		}
	})
	t.Run("deadline", func(t *testing.T) {
		a, _ := pair(t, 0)
		if err := a.SetReadDeadline(time.Now().Add(20 * time.Millisecond)); err != nil {
			t.Fatal(err)
		}
		_, err := a.Read(make([]byte, 8))
		var ne net.Error
		if !errors.Is(err, os.ErrDeadlineExceeded) || !errors.As(err, &ne) || !ne.Timeout() {
			t.Fatalf("Read past the deadline: %v; want a net.Error timeout wrapping os.ErrDeadlineExceeded", err)
		}
		var oe *net.OpError
		if !errors.As(err, &oe) || oe.Op != "read" {
			t.Fatalf("Read error %#v: want a *net.OpError with Op read", err)
		}
	})
	t.Run("closed while reading", func(t *testing.T) {
		a, _ := pair(t, 0)
		done := make(chan error, 1)
		go func() {
			_, err := a.Read(make([]byte, 8))
			done <- err
		}()
		// Whether Close lands while Read waits in the poller or before it
		// started, Read ends with net.ErrClosed.
		a.Close()
		if err := <-done; !errors.Is(err, net.ErrClosed) {
			t.Fatalf("Read on a closed conn: %v; want net.ErrClosed", err)
		}
	})
	t.Run("write after the peer reset", func(t *testing.T) {
		a, d := pair(t, 0)
		// SO_LINGER {on, 0}: the peer's close sends RST.
		rc, err := d.(syscall.Conn).SyscallConn()
		if err != nil {
			t.Fatal(err)
		}
		var serr error
		if err := rc.Control(func(fd uintptr) {
			serr = syscall.SetsockoptLinger(int(fd), syscall.SOL_SOCKET, syscall.SO_LINGER, &syscall.Linger{Onoff: 1, Linger: 0})
		}); err != nil || serr != nil {
			t.Fatal(err, serr)
		}
		d.Close()
		// The first writes may land before the RST does; one of the next
		// fails with the socket's error.
		var werr error
		for i := 0; i < 1000 && werr == nil; i++ {
			_, werr = a.Write([]byte("after"))
			if werr == nil {
				time.Sleep(time.Millisecond)
			}
		}
		var oe *net.OpError
		if !errors.As(werr, &oe) || oe.Op != "write" {
			t.Fatalf("Write to a reset peer: %v; want a *net.OpError with Op write", werr)
		}
		if !errors.Is(werr, syscall.ECONNRESET) && !errors.Is(werr, syscall.EPIPE) {
			t.Fatalf("Write to a reset peer: %v; want ECONNRESET or EPIPE", werr)
		}
	})
}

// TestListenerSetsUserTimeout: gRPC sets TCP_USER_TIMEOUT only on a
// *net.TCPConn, so the listener sets it on the connections it wraps.
func TestListenerSetsUserTimeout(t *testing.T) {
	if runtime.GOOS != "linux" {
		t.Skip("TCP_USER_TIMEOUT is set on Linux, where connections are wrapped")
	}
	for _, want := range []time.Duration{0, 5 * time.Second} {
		a, _ := pair(t, want)
		rc, err := a.(syscall.Conn).SyscallConn()
		if err != nil {
			t.Fatal(err)
		}
		var got int
		var gerr error
		if err := rc.Control(func(fd uintptr) {
			got, gerr = syscall.GetsockoptInt(int(fd), syscall.IPPROTO_TCP, tcpUserTimeout)
		}); err != nil || gerr != nil {
			t.Fatal(err, gerr)
		}
		if time.Duration(got)*time.Millisecond != want {
			t.Fatalf("TCP_USER_TIMEOUT = %d ms; want %v", got, want)
		}
	}
}
