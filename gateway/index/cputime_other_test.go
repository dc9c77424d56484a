//go:build !unix

package index

import "time"

// cpuTime is unavailable here; benchmarks then skip their per-CPU metrics.
func cpuTime() time.Duration { return 0 }

// minorFaults is unavailable here.
func minorFaults() uint64 { return 0 }
