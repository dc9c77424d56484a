package procs

import (
	"context"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// TestAdaptiveFollowsLoad runs the controller on this process: one P while
// idle, Max once a goroutine burns CPU, one again after it stops, and Max
// restored when the controller ends.
func TestAdaptiveFollowsLoad(t *testing.T) {
	before := runtime.GOMAXPROCS(0)
	defer runtime.GOMAXPROCS(before)

	ctx, cancel := context.WithCancel(context.Background())
	var changes []int
	var mu sync.Mutex
	a := Adaptive{
		Max: 2,
		// A spinning goroutine gets well over a tenth of a core even on a
		// loaded 2-core host; the idle test process uses far less.
		Up: 0.1, Down: 0.05,
		Every: 20 * time.Millisecond, DownAfter: 100 * time.Millisecond,
		OnChange: func(n int, _ float64) {
			mu.Lock()
			changes = append(changes, n)
			mu.Unlock()
		},
	}
	var wg sync.WaitGroup
	wg.Go(func() { a.Run(ctx) })
	defer func() {
		cancel()
		wg.Wait()
		if got := runtime.GOMAXPROCS(0); got != 2 {
			t.Errorf("GOMAXPROCS after Run = %d, want Max 2 restored", got)
		}
	}()

	waitProcs(t, 1, "at start, idle")

	var stop atomic.Bool
	var burner sync.WaitGroup
	burner.Go(func() { burn(&stop) })
	waitProcs(t, 2, "while a goroutine burns CPU")
	stop.Store(true)
	burner.Wait()
	waitProcs(t, 1, "after the burner stopped")

	mu.Lock()
	defer mu.Unlock()
	if len(changes) < 3 || changes[0] != 1 || changes[1] != 2 || changes[len(changes)-1] != 1 {
		t.Errorf("OnChange saw %v, want 1, 2, …, 1", changes)
	}
}

// burn spins on the CPU until stop is set.
func burn(stop *atomic.Bool) {
	x := 0
	for !stop.Load() {
		for i := 0; i < 1000; i++ {
			x += i
		}
	}
	_ = x
}

func waitProcs(t *testing.T, want int, when string) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for runtime.GOMAXPROCS(0) != want {
		if time.Now().After(deadline) {
			t.Fatalf("%s: GOMAXPROCS = %d, want %d", when, runtime.GOMAXPROCS(0), want)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func TestAdaptiveOneProcWaits(t *testing.T) {
	before := runtime.GOMAXPROCS(0)
	defer runtime.GOMAXPROCS(before)
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	called := false
	Adaptive{Max: 1, Every: time.Millisecond, OnChange: func(int, float64) { called = true }}.Run(ctx)
	if called || runtime.GOMAXPROCS(0) != before {
		t.Errorf("Max 1: OnChange called %v, GOMAXPROCS %d (was %d); want nothing changed", called, runtime.GOMAXPROCS(0), before)
	}
}

// TestAdaptiveLateGoroutinesRaise: at one P, goroutines that wait to run
// raise the count even when the CPU threshold is out of reach (a process
// whose one thread does not get the CPU its backlog needs).
func TestAdaptiveLateGoroutinesRaise(t *testing.T) {
	before := runtime.GOMAXPROCS(0)
	defer runtime.GOMAXPROCS(before)

	ctx, cancel := context.WithCancel(context.Background())
	a := Adaptive{Max: 2, Up: 1000, Every: 100 * time.Millisecond, DownAfter: time.Hour,
		Late: time.Millisecond, LateShare: 0.05}
	var wg sync.WaitGroup
	wg.Go(func() { a.Run(ctx) })
	done := make(chan struct{})
	var work sync.WaitGroup
	defer func() {
		close(done)
		work.Wait()
		cancel()
		wg.Wait()
	}()
	waitProcs(t, 1, "at start")
	// A backlog at one P: each round readies 32 goroutines at once (a
	// broadcast), each working about 100 µs, so at one P most of them wait
	// behind the others' work for a millisecond or more. (A ring passing
	// tokens on did not: a goroutine readied by a send runs next, ahead of
	// the queue, so few waited, and on a loaded host too few to decide.)
	const n = 32
	var mu sync.Mutex
	cond := sync.NewCond(&mu)
	round, finished, stopped := 0, 0, false
	roundDone := make(chan struct{}, 1)
	for range n {
		work.Go(func() {
			seen := 0
			for {
				mu.Lock()
				for round == seen && !stopped {
					cond.Wait()
				}
				if stopped {
					mu.Unlock()
					return
				}
				seen = round
				mu.Unlock()
				for start := time.Now(); time.Since(start) < 100*time.Microsecond; {
				}
				mu.Lock()
				if finished++; finished == n {
					roundDone <- struct{}{}
				}
				mu.Unlock()
			}
		})
	}
	work.Go(func() {
		for {
			mu.Lock()
			round++
			finished = 0
			cond.Broadcast()
			mu.Unlock()
			select {
			case <-done:
				mu.Lock()
				stopped = true
				cond.Broadcast()
				mu.Unlock()
				return
			case <-roundDone:
			}
		}
	})
	waitProcs(t, 2, "with goroutines waiting to run")
}

// TestAdaptiveRaisesAtTheWatchInterval: at one P the controller samples every
// Watch, not every Every, so a burst is met within a Watch or two even when
// Every is long.
func TestAdaptiveRaisesAtTheWatchInterval(t *testing.T) {
	before := runtime.GOMAXPROCS(0)
	defer runtime.GOMAXPROCS(before)

	ctx, cancel := context.WithCancel(context.Background())
	a := Adaptive{Max: 2, Up: 0.1, Down: 0.05, Watch: 10 * time.Millisecond,
		Every: time.Hour, DownAfter: time.Hour, Late: -1}
	var wg sync.WaitGroup
	wg.Go(func() { a.Run(ctx) })
	var stop atomic.Bool
	var burner sync.WaitGroup
	defer func() {
		stop.Store(true)
		burner.Wait()
		cancel()
		wg.Wait()
	}()
	waitProcs(t, 1, "at start, idle")
	burner.Go(func() { burn(&stop) })
	waitProcs(t, 2, "while a goroutine burns CPU, Every an hour")
}
