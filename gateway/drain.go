package gateway

import (
	"fmt"
)

// Draining: a worker about to leave (an upgrade, a scale-down) gets no new
// requests, but its subscription and its index stay while the requests
// already routed to it run, so the other workers' answers are unchanged
// and a drain that is called off costs nothing. The caller (package
// membership) removes the worker once Drained's channel closes or its own
// timeout passes.

// DrainWorker stops routing new requests to the worker. The returned
// channel closes when none of its tracked requests (RouteRequest.Track) is
// in flight any more: at once if none is. Draining a draining worker
// returns the same channel.
func (g *Gateway) DrainWorker(id string) (<-chan struct{}, error) {
	g.mu.Lock()
	defer g.mu.Unlock()
	name, ok := g.workerOf[id]
	if !ok {
		return nil, fmt.Errorf("gateway: %s: %w", id, ErrUnknownWorker)
	}
	if ch, ok := g.draining[id]; ok {
		return ch, nil
	}
	ch := make(chan struct{})
	g.draining[id] = ch
	if g.routed[id] == 0 {
		close(ch)
	}
	g.models[name].fleet.Remove(id)
	// Drained of one worker, the rule "all unreachable: route to all"
	// is decided anew at the next route.
	g.reachDirty.Store(true)
	return ch, nil
}

// UndrainWorker routes to a draining worker again; a worker that is not
// draining is left as it is.
func (g *Gateway) UndrainWorker(id string) error {
	g.mu.Lock()
	defer g.mu.Unlock()
	if _, ok := g.workerOf[id]; !ok {
		return fmt.Errorf("gateway: %s: %w", id, ErrUnknownWorker)
	}
	if _, ok := g.draining[id]; !ok {
		return nil
	}
	g.endDrainLocked(id)
	g.reachDirty.Store(true) // syncFleetsLocked puts it back with its load
	return nil
}

// Draining reports whether the worker is draining.
func (g *Gateway) Draining(id string) bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	_, ok := g.draining[id]
	return ok
}

// endDrainLocked forgets the worker's drain, closing its channel if
// requests were still in flight; g.mu is held.
func (g *Gateway) endDrainLocked(id string) {
	ch, ok := g.draining[id]
	if !ok {
		return
	}
	delete(g.draining, id)
	select {
	case <-ch:
	default:
		close(ch)
	}
}

// drainProgressLocked closes a draining worker's channel once its last
// tracked request ends; g.mu is held.
func (g *Gateway) drainProgressLocked(id string) {
	ch, ok := g.draining[id]
	if !ok || g.routed[id] > 0 {
		return
	}
	select {
	case <-ch:
	default:
		close(ch)
	}
}

// RemovalPublisher is a PlacementPublisher that also tells the other
// replicas when a worker leaves this one (package placementsync), so they
// drop the placements this replica shared for it.
type RemovalPublisher interface {
	PublishRemoval(model, worker string)
}

func (g *Gateway) publishRemoval(model, worker string) {
	if p := g.publisher.Load(); p != nil {
		if rp, ok := (*p).(RemovalPublisher); ok {
			rp.PublishRemoval(model, worker)
		}
	}
}

// ForgetPlacements drops every placement on worker in model: another
// replica removed the worker, so the affinity it shared for it points at
// an engine that is leaving. Workers this replica still routes to keep
// their index; an unknown model or worker is not an error (the replicas'
// fleets differ while a change spreads). It reports how many placements
// went.
func (g *Gateway) ForgetPlacements(model, worker string) int {
	g.mu.Lock()
	m := g.models[model]
	g.mu.Unlock()
	if m == nil || m.places == nil {
		return 0
	}
	return m.places.RemoveWorker(worker)
}
