package gateway

// KeepRoutedWorkers deletes from counts every worker the gateway does not
// route now: the NATS load share (placementsync.WorkerRouter) calls it on
// each peer snapshot as it arrives, so what a peer sends cannot grow this
// replica's memory past its own workers.
func (g *Gateway) KeepRoutedWorkers(counts map[string]int) {
	g.mu.Lock()
	defer g.mu.Unlock()
	for w := range counts {
		if _, ok := g.workerOf[w]; !ok {
			delete(counts, w)
		}
	}
}
