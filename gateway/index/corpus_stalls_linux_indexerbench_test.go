//go:build indexerbench && linux

package index

import (
	"bufio"
	"fmt"
	"os"
	"runtime"
	"time"

	"golang.org/x/sys/unix"
)

// processStart approximates the Go runtime's start, the origin of
// GODEBUG=gctrace=1's "@…s" times, so that stalls can be put on the GC's
// timeline (to within the few milliseconds package initialisation takes).
var processStart = time.Now()

// stallProbe is the lookup-stall diagnosis (KVRELAY_CORPUS_STALLS=path):
// around every lookup it reads the replay thread's CPU clock and its
// resource usage (minor page faults, voluntary and involuntary context
// switches), outside the lookup's timed window, and writes one line per
// lookup slower than threshold: when it started (seconds since process
// start), its wall and thread-CPU time, its blocks, and the deltas. A stall
// that is on-CPU (thread CPU ≈ wall) is work the thread did (a GC assist,
// a page fault's kernel time); one that is off-CPU with an involuntary
// switch is the OS running something else on our core.
type stallProbe struct {
	w         *bufio.Writer
	threshold time.Duration
	cpu0      int64
	ru0       unix.Rusage
	start     time.Time
	// totals over every lookup, to compare the slow ones with
	lookups, invol, faults int
}

func threadCPUNanos() int64 {
	var ts unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_THREAD_CPUTIME_ID, &ts); err != nil {
		return 0
	}
	return ts.Nano()
}

func (p *stallProbe) before() {
	_ = unix.Getrusage(unix.RUSAGE_THREAD, &p.ru0)
	p.start = time.Now()
	p.cpu0 = threadCPUNanos()
}

func (p *stallProbe) after(wall time.Duration, blocks int) {
	cpu := time.Duration(threadCPUNanos() - p.cpu0)
	var ru unix.Rusage
	_ = unix.Getrusage(unix.RUSAGE_THREAD, &ru)
	invol, faults := int(ru.Nivcsw-p.ru0.Nivcsw), int(ru.Minflt-p.ru0.Minflt)
	p.lookups++
	p.invol += min(invol, 1)
	p.faults += min(faults, 1)
	if wall < p.threshold {
		return
	}
	fmt.Fprintf(p.w, "%.6f %d %d %d %d %d %d\n", p.start.Sub(processStart).Seconds(), wall.Nanoseconds(), cpu.Nanoseconds(),
		blocks, faults, int(ru.Nvcsw-p.ru0.Nvcsw), invol)
}

// stallProbeFromEnv returns the probe KVRELAY_CORPUS_STALLS asks for (nil
// if unset) and the function that finishes its file. The replay then runs
// locked to its OS thread, so that the thread's clocks are the replay's.
func stallProbeFromEnv() (lookupProbe, func() error, error) {
	path := os.Getenv("KVRELAY_CORPUS_STALLS")
	if path == "" {
		return nil, func() error { return nil }, nil
	}
	f, err := os.Create(path)
	if err != nil {
		return nil, nil, fmt.Errorf("stall log: %w", err)
	}
	threshold := time.Duration(envInt("KVRELAY_CORPUS_STALL_NS", 5000))
	p := &stallProbe{w: bufio.NewWriterSize(f, 1<<20), threshold: threshold}
	fmt.Fprintf(p.w, "# start_s wall_ns thread_cpu_ns blocks minflt nvcsw nivcsw (lookups with wall >= %d ns)\n", threshold.Nanoseconds())
	runtime.LockOSThread()
	return p, func() error {
		runtime.UnlockOSThread()
		fmt.Fprintf(p.w, "# lookups %d, with an involuntary switch %d, with a minor fault %d\n", p.lookups, p.invol, p.faults)
		if err := p.w.Flush(); err != nil {
			f.Close()
			return fmt.Errorf("stall log: %w", err)
		}
		return f.Close()
	}, nil
}
