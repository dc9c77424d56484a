//go:build unix

package index

import (
	"syscall"
	"time"
)

// cpuTime is the process's user + system CPU time so far. On a shared host
// a benchmark's wall time includes time its threads waited for a core;
// work per CPU-second does not (it still includes the GC's share).
func cpuTime() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// minorFaults is the process's minor page faults so far.
func minorFaults() uint64 {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return uint64(ru.Minflt)
}
