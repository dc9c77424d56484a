package index

import (
	"context"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

type lockedClock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *lockedClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *lockedClock) Add(d time.Duration) {
	c.mu.Lock()
	c.t = c.t.Add(d)
	c.mu.Unlock()
}

// Run prunes on its own schedule and returns when its context ends.
func TestRunPrunesAndStops(t *testing.T) {
	clk := &lockedClock{t: time.Unix(5_000_000, 0)}
	ix := New(Options{BlockSize: 4, TTL: time.Minute, PruneEvery: time.Millisecond, Now: clk.Now})
	ix.Apply("a", batch(0, stored(chainBlocks(1, seq(1, 8)))))
	clk.Add(2 * time.Minute)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { ix.Run(ctx); close(done) }()
	deadline := time.Now().Add(10 * time.Second)
	for ix.Stats().Entries != 0 {
		if time.Now().After(deadline) {
			t.Fatal("Run never pruned the expired entries")
		}
		time.Sleep(time.Millisecond)
	}
	cancel()
	<-done

	// Without a bound, Run has nothing to do and returns at once.
	New(Options{}).Run(context.Background())
}
