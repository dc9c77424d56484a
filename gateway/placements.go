package gateway

import (
	"context"
	"fmt"
	"time"

	"github.com/kvrelay/kvrelay/gateway/index"

	"github.com/kvrelay/kvrelay/gateway/placement"
)

// TextBlockBytes is the size of a text request's pseudo-block: 64 bytes,
// about 16 tokens of English, the usual KV block.
const TextBlockBytes = 64

// textSalt keeps text pseudo-blocks apart from token blocks of the same
// namespace: the hashes are the index's, over another seed.
const textSalt = "kvrelay/text\x00"

// textPrefixHashes cuts text into TextBlockBytes blocks (a partial last
// block is left out, as with tokens) and chains their hashes as the index
// does, each block read as 16 little-endian u32 "tokens".
func textPrefixHashes(text string, ns index.Namespace) []uint64 {
	n := len(text) / TextBlockBytes
	words := make([]uint32, n*TextBlockBytes/4)
	for i := range words {
		j := 4 * i
		words[i] = uint32(text[j]) | uint32(text[j+1])<<8 | uint32(text[j+2])<<16 | uint32(text[j+3])<<24
	}
	ns.CacheSalt = textSalt + ns.CacheSalt
	return index.PrefixHashes(words, TextBlockBytes/4, ns)
}

// PlacementPublisher receives every placement the gateway makes, to share
// it with other replicas (package placementsync does it over NATS). Publish
// is called after the routing decision, outside the gateway's locks, and
// must not block: a replica that cannot share drops it.
type PlacementPublisher interface {
	PublishPlacement(model, worker string, hashes []uint64)
}

// SetPlacementPublisher makes p receive the gateway's placements from now
// on; nil stops it.
func (g *Gateway) SetPlacementPublisher(p PlacementPublisher) {
	if p == nil {
		g.publisher.Store(nil)
		return
	}
	g.publisher.Store(&p)
}

func (g *Gateway) publishPlacement(model, worker string, hashes []uint64) {
	if p := g.publisher.Load(); p != nil && len(hashes) > 0 {
		(*p).PublishPlacement(model, worker, hashes)
	}
}

// ApplyPlacement records a placement another replica, peer, made: hashes
// (prefix hashes, as package index computes them) placed on worker, which
// must serve model here too. The entries are peer's in the model's
// placements: a peer flooding them evicts its own (package placement).
func (g *Gateway) ApplyPlacement(model, peer, worker string, hashes []uint64) error {
	g.mu.Lock()
	m := g.models[model]
	ok := m != nil && m.workers[worker]
	g.mu.Unlock()
	switch {
	case m == nil:
		return fmt.Errorf("%w: %q", ErrUnknownModel, model)
	case !ok:
		return fmt.Errorf("%w: %q of model %q", ErrUnknownWorker, worker, model)
	case m.places == nil:
		return nil // placements are off here
	}
	m.places.RecordFrom(peer, worker, hashes, 0, g.now())
	return nil
}

// PlacementStats reports a model's placements; false when the model is
// unknown or placements are off.
func (g *Gateway) PlacementStats(model string) (placement.Stats, bool) {
	g.mu.Lock()
	m := g.models[model]
	g.mu.Unlock()
	if m == nil || m.places == nil {
		return placement.Stats{}, false
	}
	return m.places.Stats(), true
}

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
