// Package procs sizes the Go runtime's processors (GOMAXPROCS) to the
// process's own load: one P while the process is mostly idle, all of them
// when it is busy.
//
// A relay at an engine's pacing (a few hundred batches a second for a whole
// GPU host) is idle nearly all the time, and nearly all of its CPU is the
// runtime waking up: each goroutine a batch readies on a process with an
// idle P wakes a second thread to look for work, which finds none and
// sleeps again. With one P those hand-offs stay on one thread
// (docs/bench/log/2026-12-05-relay-pacing-quiet.md). A relay carrying tens
// of thousands of batches a second needs every core. Adaptive watches the
// process's CPU time and moves between the two.
package procs

import (
	"context"
	"runtime"
	"runtime/metrics"
	"syscall"
	"time"
)

// Adaptive switches GOMAXPROCS between 1 and Max by the process's CPU use
// (user + system time of all its threads, from getrusage). At one P it is
// sampled every Watch, and a sample at or above Up CPU-seconds per second
// raises the count to Max; at Max it is sampled every Every, and DownAfter
// of samples below Down lower it to one. The zero value of each field takes
// its default.
//
// Why two intervals: a burst that arrives at one P queues until the next
// sample, and at tens of thousands of batches a second one P's tail latency
// is several times two Ps' (docs/bench/log/2026-12-06-relay-adaptive-default.md),
// so going up must be quick; going down must not be, and a sample is a
// wake-up of an otherwise idle process, so the slow interval is the
// long-lived one.
//
// CPU use alone sees a backlog late on a busy host: a process held to one P
// whose thread waits for a core uses less than Up while its goroutines
// queue. So at one P a sample also raises it when at least LateShare of the
// goroutines that became runnable waited Late or longer to run (the
// runtime's /sched/latencies:seconds).
type Adaptive struct {
	Max       int           // Ps when busy (default: GOMAXPROCS when Run starts)
	Up        float64       // default 0.3 of a core at one P
	Down      float64       // default 0.15
	Watch     time.Duration // sampling at one P; default 100 ms
	Every     time.Duration // sampling at Max; default 1 s
	DownAfter time.Duration // default 10 s
	Late      time.Duration // default 2 ms; negative: CPU use only
	LateShare float64       // default 0.05
	// OnChange, when set, is called after every change with the new count
	// and the CPU use that caused it.
	OnChange func(procs int, cpuPerSecond float64)
}

// Run sets one P, then adapts until ctx is done, when it restores Max.
// With Max 1 (a one-core machine or GOMAXPROCS=1) there is nothing to adapt
// and it only waits.
func (a Adaptive) Run(ctx context.Context) {
	if a.Max <= 0 {
		a.Max = runtime.GOMAXPROCS(0)
	}
	if a.Up <= 0 {
		a.Up = 0.3
	}
	if a.Down <= 0 {
		a.Down = 0.15
	}
	if a.Watch <= 0 {
		a.Watch = 100 * time.Millisecond
	}
	if a.Every <= 0 {
		a.Every = time.Second
	}
	if a.DownAfter <= 0 {
		a.DownAfter = 10 * time.Second
	}
	if a.Late == 0 {
		a.Late = 2 * time.Millisecond
	}
	if a.LateShare <= 0 {
		a.LateShare = 0.05
	}
	if a.Max == 1 {
		<-ctx.Done()
		return
	}
	set := func(n int, rate float64) {
		runtime.GOMAXPROCS(n)
		if a.OnChange != nil {
			a.OnChange(n, rate)
		}
	}
	set(1, 0)
	defer runtime.GOMAXPROCS(a.Max)
	t := time.NewTicker(a.Watch)
	defer t.Stop()
	procs, quiet := 1, time.Duration(0)
	lastCPU, lastAt := cpuTime(), time.Now()
	var sched schedLatency
	sched.late(a.Late)
	for {
		select {
		case <-ctx.Done():
			return
		case now := <-t.C:
			used := cpuTime()
			wall := now.Sub(lastAt)
			if wall <= 0 {
				continue
			}
			rate := (used - lastCPU).Seconds() / wall.Seconds()
			lastCPU, lastAt = used, now
			lateShare := sched.late(a.Late)
			switch {
			case procs == 1 && (rate >= a.Up || (a.Late > 0 && lateShare >= a.LateShare)):
				procs, quiet = a.Max, 0
				set(procs, rate)
				t.Reset(a.Every)
			case procs > 1 && rate < a.Down:
				if quiet += wall; quiet >= a.DownAfter {
					procs, quiet = 1, 0
					set(procs, rate)
					t.Reset(a.Watch)
				}
			default:
				quiet = 0
			}
		}
	}
}

// schedLatency reads the runtime's histogram of how long runnable
// goroutines waited to run.
type schedLatency struct {
	sample [1]metrics.Sample
	last   []uint64
}

// minLateSamples keeps a handful of scheduling events from deciding.
const minLateSamples = 20

// late returns the share of the goroutines scheduled since the last call
// that waited at least d (0 with fewer than minLateSamples of them).
func (s *schedLatency) late(d time.Duration) float64 {
	s.sample[0].Name = "/sched/latencies:seconds"
	metrics.Read(s.sample[:])
	if s.sample[0].Value.Kind() != metrics.KindFloat64Histogram {
		return 0
	}
	h := s.sample[0].Value.Float64Histogram()
	var total, late uint64
	for i, c := range h.Counts {
		var prev uint64
		if i < len(s.last) {
			prev = s.last[i]
		}
		n := c - prev
		total += n
		// Bucket i holds [Buckets[i], Buckets[i+1]).
		if h.Buckets[i] >= d.Seconds() {
			late += n
		}
	}
	s.last = append(s.last[:0], h.Counts...)
	if total < minLateSamples {
		return 0
	}
	return float64(late) / float64(total)
}

// cpuTime is the process's user + system CPU time so far.
func cpuTime() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
