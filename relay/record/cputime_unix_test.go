//go:build unix

package record

import (
	"syscall"
	"time"
)

// processCPU is the CPU time the process has used, GC workers included: on a shared machine
// it says more about a benchmark's cost than the wall clock.
func processCPU() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
