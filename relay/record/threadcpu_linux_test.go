package record

import (
	"syscall"
	"time"
	"unsafe"
)

// threadCPU is the CPU time of the calling thread (lock the goroutine to it first), to the
// nanosecond: a writer's own cost, without a concurrent reader's or the GC's. (getrusage's
// RUSAGE_THREAD counts in scheduler ticks, 4 ms here.)
func threadCPU() time.Duration {
	const clockThreadCPUTime = 3 // CLOCK_THREAD_CPUTIME_ID
	var ts syscall.Timespec
	if _, _, errno := syscall.Syscall(syscall.SYS_CLOCK_GETTIME, clockThreadCPUTime, uintptr(unsafe.Pointer(&ts)), 0); errno != 0 {
		return 0
	}
	return time.Duration(ts.Nano())
}
