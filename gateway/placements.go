package gateway

import (
	"context"
	"time"

	"github.com/kvrelay/kvrelay/gateway/placement"
)

// runPlacementSweep drops expired placements until ctx ends. Lookups drop
// the expired entries they walk over; the sweep bounds the memory of those
// nobody looks up again, a few times per TTL.
func (g *Gateway) runPlacementSweep(ctx context.Context) {
	every := min(max(g.placementTTL()/4, 10*time.Millisecond), 30*time.Second)
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			g.sweepPlacements()
		}
	}
}

func (g *Gateway) placementTTL() time.Duration {
	o := g.cfg.Placements
	if o.TTL > 0 {
		return o.TTL
	}
	return placement.DefaultTTL
}

// sweepPlacements drops every model's expired placements.
func (g *Gateway) sweepPlacements() {
	g.mu.Lock()
	stores := make([]*placement.Store, 0, len(g.models))
	for _, m := range g.models {
		if m.places != nil {
			stores = append(stores, m.places)
		}
	}
	now := g.now()
	g.mu.Unlock()
	for _, s := range stores {
		s.Sweep(now)
	}
}
