package quietio

import (
	"fmt"
	"io"
	"net"
	"os"
	"syscall"
	"time"
	"unsafe"
)

const supported = true

// Wrap returns c reading and writing with raw system calls, or c itself
// when it cannot (not a socket the runtime polls).
func Wrap(c net.Conn) net.Conn {
	sc, ok := c.(syscall.Conn)
	if !ok {
		return c
	}
	rc, err := sc.SyscallConn()
	if err != nil {
		return c
	}
	return &conn{Conn: c, raw: rc}
}

type conn struct {
	net.Conn
	raw syscall.RawConn
}

// SyscallConn gives the socket's raw connection, as the wrapped
// connection's would.
func (c *conn) SyscallConn() (syscall.RawConn, error) { return c.raw, nil }

// Read reads what the socket has, waiting in the poller while it has
// nothing. Errors are shaped as net.Conn's: io.EOF at the peer's end, a
// *net.OpError otherwise (errors.Is sees net.ErrClosed and
// os.ErrDeadlineExceeded through it).
func (c *conn) Read(p []byte) (int, error) {
	if len(p) == 0 {
		return 0, nil
	}
	var (
		n     uintptr
		errno syscall.Errno
	)
	err := c.raw.Read(func(fd uintptr) bool {
		for {
			n, _, errno = syscall.RawSyscall(syscall.SYS_READ, fd, uintptr(unsafe.Pointer(&p[0])), uintptr(len(p)))
			switch errno {
			case syscall.EINTR:
				continue
			case syscall.EAGAIN:
				return false // wait for readiness
			}
			return true
		}
	})
	if err != nil {
		return 0, c.opError("read", err)
	}
	if errno != 0 {
		return 0, c.opError("read", os.NewSyscallError("read", errno))
	}
	if n == 0 {
		return 0, io.EOF
	}
	return int(n), nil
}

// Write writes all of p, waiting in the poller while the socket's buffer is
// full, as net.Conn's Write does.
func (c *conn) Write(p []byte) (int, error) {
	written := 0
	var errno syscall.Errno
	for written < len(p) {
		err := c.raw.Write(func(fd uintptr) bool {
			for written < len(p) {
				rest := p[written:]
				n, _, e := syscall.RawSyscall(syscall.SYS_WRITE, fd, uintptr(unsafe.Pointer(&rest[0])), uintptr(len(rest)))
				switch e {
				case 0:
					if n == 0 {
						errno = syscall.EIO // a socket never takes nothing; do not spin
						return true
					}
					written += int(n)
					continue
				case syscall.EINTR:
					continue
				case syscall.EAGAIN:
					return false // wait until the socket can take more
				}
				errno = e
				return true
			}
			return true
		})
		if err != nil {
			return written, c.opError("write", err)
		}
		if errno != 0 {
			return written, c.opError("write", os.NewSyscallError("write", errno))
		}
	}
	return written, nil
}

func (c *conn) opError(op string, err error) error {
	if oe, ok := err.(*net.OpError); ok {
		// RawConn names its operation raw-read or raw-write; a caller
		// expects the operation it made.
		oe2 := *oe
		oe2.Op = op
		return &oe2
	}
	return &net.OpError{Op: op, Net: c.LocalAddr().Network(), Source: c.LocalAddr(), Addr: c.RemoteAddr(), Err: err}
}

// setUserTimeout sets TCP_USER_TIMEOUT on a TCP connection, as gRPC would
// have (milliseconds); other connections are left alone.
func setUserTimeout(c net.Conn, d time.Duration) error {
	tc, ok := c.(*net.TCPConn)
	if !ok {
		return nil
	}
	rc, err := tc.SyscallConn()
	if err != nil {
		return fmt.Errorf("TCP_USER_TIMEOUT: %w", err)
	}
	var serr error
	if err := rc.Control(func(fd uintptr) {
		serr = syscall.SetsockoptInt(int(fd), syscall.IPPROTO_TCP, tcpUserTimeout, int(d/time.Millisecond))
	}); err != nil {
		return fmt.Errorf("TCP_USER_TIMEOUT: %w", err)
	}
	if serr != nil {
		return fmt.Errorf("TCP_USER_TIMEOUT: %w", serr)
	}
	return nil
}
