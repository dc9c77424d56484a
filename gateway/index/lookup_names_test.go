package index

import (
	"fmt"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
)

// TestLookupNamesWhileWorkersComeAndGo: a lookup names its answer from
// the workers' name order published when workers come or go, without a
// lock, and redoes the walk when the order changed during it. Workers that
// take over one freed slot in turn hold different depths (p* 3 blocks, q*
// 5), so an answer named under a stale order (a p* name with 5 blocks, or
// a q* name with 3) shows; "keep" holds all 10 throughout, and the answer
// stays sorted by depth, then name.
func TestLookupNamesWhileWorkersComeAndGo(t *testing.T) {
	ix := New(Options{BlockSize: 4})
	toks := docTokens(7, 10)
	ix.Apply("keep", batch(0, stored(chainBlocks(100, toks))))
	const churn = 1000
	var stop atomic.Bool
	var done atomic.Int64 // lookups finished
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		defer stop.Store(true)
		for i := range churn {
			w, n := WorkerID(fmt.Sprintf("p%05d", i)), 3
			if i%2 == 1 {
				w, n = WorkerID(fmt.Sprintf("q%05d", i)), 5
			}
			ix.Apply(w, batch(0, stored(chainBlocks(1000, toks[:4*n]))))
			// Let lookups run while w is there (the window is otherwise a
			// sliver of an iteration), then overlap its going.
			for from := done.Load(); done.Load() < from+2; {
				runtime.Gosched()
			}
			ix.RemoveWorker(w)
		}
	}()
	lookups, seen := 0, 0
	var m Matches
	for !stop.Load() || lookups == 0 {
		ix.FindMatchesInto(&m, toks, Namespace{})
		lookups++
		done.Add(1)
		if len(m.Workers) == 0 || m.Workers[0] != (Match{Worker: "keep", Blocks: 10}) {
			t.Fatalf("lookup %d: %+v; want keep 10 first", lookups, m.Workers)
		}
		for _, x := range m.Workers[1:] {
			seen++
			want := map[byte]int{'p': 3, 'q': 5}[x.Worker[0]]
			if x.Blocks != want {
				t.Fatalf("lookup %d: %+v: %s named with %d blocks, holds %d", lookups, m.Workers, x.Worker, x.Blocks, want)
			}
		}
	}
	wg.Wait()
	t.Logf("%d lookups, %d churned workers seen in answers", lookups, seen)
	if seen < churn {
		t.Fatalf("the churned workers were seen %d times in %d lookups; want one a worker at least", seen, lookups)
	}
	if m := ix.FindMatches(toks, Namespace{}); len(m.Workers) != 1 {
		t.Fatalf("after the churn: %+v; want keep only", m.Workers)
	}
}

// TestLookupUnderAStaleOrderIsRedone: an attempt keyed under a name order
// that workers' coming and going has replaced would name a slot's new
// worker with its old worker's name; every change publishes a new order,
// which is what the lookup compares to redo it.
func TestLookupUnderAStaleOrderIsRedone(t *testing.T) {
	ix := New(Options{BlockSize: 4})
	toks := docTokens(8, 6)
	ix.Apply("a", batch(0, stored(chainBlocks(100, toks[:8]))))
	stale := ix.order.Load()
	ix.RemoveWorker("a")
	if ix.order.Load() == stale {
		t.Fatal("removing a worker kept the name order")
	}
	mid := ix.order.Load()
	ix.Apply("b", batch(0, stored(chainBlocks(200, toks))))
	if ix.order.Load() == mid {
		t.Fatal("adding a worker kept the name order")
	}
	if ix.workers["b"].id != 0 {
		t.Fatalf("b took slot %d; the test needs a's slot 0", ix.workers["b"].id)
	}
	ws := &walkState{hc: hashCursor{content: ContentHashes(toks, 4, Namespace{}.Seed()), n: 6}}
	if !ix.tryWalk(ws, 0, stale) || len(ws.done) != 1 || stale.names[uint32(ws.done[0])] != "a" {
		t.Fatalf("under the stale order: %x; want b's blocks named a (what the redo avoids)", ws.done)
	}
	if m := ix.FindMatches(toks, Namespace{}); len(m.Workers) != 1 || m.Workers[0] != (Match{Worker: "b", Blocks: 6}) {
		t.Fatalf("%+v; want b 6", m.Workers)
	}
}

// TestLookupAnswerSortedWhateverTheCoverageOrder: the answer is ordered by
// depth, then name, when the workers came (and so sit in a run's coverage)
// in another order; and it is unchanged when they came in that order
// already (the sort is skipped for keys in order).
func TestLookupAnswerSortedWhateverTheCoverageOrder(t *testing.T) {
	toks := docTokens(9, 8)
	depth := map[WorkerID]int{"a": 5, "b": 5, "c": 2, "d": 5, "e": 8, "f": 1}
	want := []Match{{"e", 8}, {"a", 5}, {"b", 5}, {"d", 5}, {"c", 2}, {"f", 1}}
	for _, order := range [][]WorkerID{
		{"c", "d", "f", "b", "e", "a"},
		{"f", "c", "d", "b", "a", "e"},
		{"e", "a", "b", "d", "c", "f"},
	} {
		ix := New(Options{BlockSize: 4})
		for i, w := range order {
			ix.Apply(w, batch(0, stored(chainBlocks(int64(100*(i+1)), toks[:4*depth[w]]))))
		}
		var m Matches
		for _, in := range [][]uint32{toks, toks[:4*6]} {
			ix.FindMatchesInto(&m, in, Namespace{})
			w := want
			if len(in) < len(toks) {
				w = []Match{{"e", 6}, {"a", 5}, {"b", 5}, {"d", 5}, {"c", 2}, {"f", 1}}
			}
			if !slices.Equal(m.Workers, w) || m.RequestBlocks != len(in)/4 {
				t.Fatalf("workers came in order %v: %+v (%d blocks); want %+v", order, m.Workers, m.RequestBlocks, w)
			}
		}
	}
}
