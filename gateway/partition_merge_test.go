package gateway

import (
	"fmt"
	"sync"
	"testing"

	"github.com/kvrelay/kvrelay/gateway/index"
)

// fakeScatter answers a partitioned route's queries from answer, so the
// merge can be tested without NATS (package partitionsync tests the real
// scatter).
type fakeScatter struct {
	mu     sync.Mutex
	answer func(q PartitionQuery) []PartitionAnswer
	calls  int
	last   PartitionQuery
}

func (f *fakeScatter) Scatter(q PartitionQuery, local func()) []PartitionAnswer {
	f.mu.Lock()
	f.calls++
	f.last = q
	f.mu.Unlock()
	local()
	return f.answer(q)
}

func (f *fakeScatter) count() (int, PartitionQuery) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.calls, f.last
}

// idsIn returns n worker ids that PartitionOf puts in partition p of
// parts, named prefix000, prefix001, … so they sort in order.
func idsIn(t *testing.T, prefix string, p, parts, n int) []string {
	t.Helper()
	var ids []string
	for i := 0; len(ids) < n; i++ {
		if id := fmt.Sprintf("grpc://%s%03d:1", prefix, i); PartitionOf(id, parts) == p {
			ids = append(ids, id)
		}
	}
	return ids
}

func workersOf(model string, ids ...string) []Worker {
	var ws []Worker
	for _, id := range ids {
		ws = append(ws, Worker{ID: id, Addr: id[len("grpc://"):], Model: model})
	}
	return ws
}

// TestLearnBlockSizeConcurrent: learners racing with different sizes
// leave the index at the largest, the one recorded as learned. Before the
// fix (compare-and-swap, then set the index), a smaller learner's
// SetBlockSize could land after a larger one's.
func TestLearnBlockSizeConcurrent(t *testing.T) {
	g, err := New(Config{Workers: workersOf("", "grpc://x:1")})
	if err != nil {
		t.Fatal(err)
	}
	sizes := []int{16, 32, 64, 128}
	bad := 0
	rounds := 20000 // the old code failed about 1 round in 10,000
	if raceEnabled {
		rounds = 5000 // the detector slows each round several times
	}
	for range rounds {
		m := &model{ix: index.New(index.Options{})}
		start := make(chan struct{})
		var wg sync.WaitGroup
		for _, n := range sizes {
			wg.Go(func() { <-start; g.learnBlockSize(m, n) })
		}
		close(start)
		wg.Wait()
		if m.ix.BlockSize() != 128 || m.learnedBlock.Load() != 128 {
			bad++
		}
	}
	if bad > 0 {
		t.Errorf("%d of %d rounds: index block size not the largest learned", bad, rounds)
	}
}
