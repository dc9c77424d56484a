package gateway

import "github.com/kvrelay/kvrelay/gateway/index"

// LiveSet is what the gateway's index holds for a worker, one row per (DP
// rank, tier, engine hash) with its copies, sorted. Exactness checks (the
// kvrelay demo, end-to-end tests) compare it with the engine's true live set;
// routing never needs it. ok is false for a worker the gateway does not know.
func (g *Gateway) LiveSet(worker string) (blocks []index.LiveBlock, ok bool) {
	g.mu.Lock()
	name, known := g.workerOf[worker]
	var m *model
	if known {
		m = g.models[name]
	}
	g.mu.Unlock()
	if m == nil {
		return nil, false
	}
	return m.ix.LiveSet(worker), true
}
