package gateway

import (
	"errors"
	"testing"

	"github.com/kvrelay/kvrelay/gateway/monitor"
)

func closed(ch <-chan struct{}) bool {
	select {
	case <-ch:
		return true
	default:
		return false
	}
}

func TestDrainStopsNewRoutesAndWaitsForTrackedRequests(t *testing.T) {
	g, err := New(Config{Workers: []Worker{
		{Addr: "127.0.0.1:1", Service: monitor.ServiceVLLM},
		{Addr: "127.0.0.1:2", Service: monitor.ServiceVLLM},
	}})
	if err != nil {
		t.Fatal(err)
	}
	const a, b = "127.0.0.1:1", "127.0.0.1:2"
	// One tracked request on each worker (no overlap: least loaded, ties to
	// the first name, so a then b).
	var onA Decision
	for range 2 {
		d, err := g.Route(RouteRequest{TokenIDs: []uint32{1, 2, 3}, Track: true})
		if err != nil {
			t.Fatal(err)
		}
		if d.Worker == a {
			onA = d
		}
	}
	if onA.RequestID == 0 {
		t.Fatal("no tracked request went to a")
	}
	drained, err := g.DrainWorker(a)
	if err != nil {
		t.Fatal(err)
	}
	if closed(drained) {
		t.Fatal("drain finished with a request still in flight")
	}
	if again, _ := g.DrainWorker(a); again != drained {
		t.Fatal("draining twice gave another channel")
	}
	for i := range 50 {
		d, err := g.Route(RouteRequest{TokenIDs: []uint32{uint32(i), 9, 9, 9}})
		if err != nil {
			t.Fatal(err)
		}
		if d.Worker == a {
			t.Fatalf("route %d went to the draining worker", i)
		}
	}
	var st *WorkerStatus
	for _, ws := range g.Workers() {
		if ws.ID == a {
			st = &ws
		}
	}
	if st == nil || !st.Draining || st.Routed != 1 {
		t.Fatalf("status of the draining worker: %+v", st)
	}
	onA.Done()
	if !closed(drained) {
		t.Fatal("drain did not finish when its last request ended")
	}
	// Called off: routed to again.
	if err := g.UndrainWorker(a); err != nil {
		t.Fatal(err)
	}
	seen := false
	for i := range 10 {
		d, err := g.Route(RouteRequest{TokenIDs: []uint32{uint32(i), 7}, Track: true})
		if err != nil {
			t.Fatal(err)
		}
		seen = seen || d.Worker == a
	}
	if !seen {
		t.Fatal("an undrained worker got no route")
	}
	// All drained: no worker, and the error says so.
	for _, w := range []string{a, b} {
		if _, err := g.DrainWorker(w); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := g.Route(RouteRequest{TokenIDs: []uint32{1}}); !errors.Is(err, ErrNoWorkers) {
		t.Fatalf("every worker draining: got %v, want ErrNoWorkers", err)
	}
	// Removing a draining worker ends its drain.
	if err := g.RemoveWorker(b); err != nil {
		t.Fatal(err)
	}
	if g.Draining(b) {
		t.Fatal("a removed worker still drains")
	}
	if _, err := g.DrainWorker("nope"); !errors.Is(err, ErrUnknownWorker) {
		t.Fatalf("drain of an unknown worker: %v", err)
	}
}
