//go:build !linux

package quietio

import (
	"net"
	"time"
)

const supported = false

// Wrap returns c: raw socket calls are used on Linux only.
func Wrap(c net.Conn) net.Conn { return c }

func setUserTimeout(net.Conn, time.Duration) error { return nil }
