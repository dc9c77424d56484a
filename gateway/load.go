package gateway

import (
	"context"
	"fmt"
	"sort"
	"time"

	"github.com/kvrelay/kvrelay/gateway/picker"
	"github.com/kvrelay/kvrelay/proto/kvpb"
)

// Load the picker sees comes from three places:
//
//   - the engines' own load records (EngineLoad, one per DP rank), pushed
//     on the event stream or, where a worker pushes none, polled with
//     GetLoads (loadpoll.go): waiting-prefill backlog for overlap decay, KV
//     token usage for the pressure thresholds, the cache hit rate as a
//     gauge;
//   - the requests the gateway routed with RouteRequest.Track and that have
//     not completed (Decision.Done, POST /v1/done), as SMG counts its own;
//   - in-flight counts a client reports (ReportLoads, POST /v1/load),
//     each dropped when not reported again within Config.ReportedLoadTTL.
//
// A worker's in-flight count is the larger of the last two: a client that
// reports totals and also completes tracked requests is not counted twice,
// and one that only does either is counted fully.
//
// With several replicas sharing load (package placementsync), the tracked
// count is this replica's own plus the other replicas' latest tracked
// counts (SetPeerRouted): a client reporting totals reports them to one
// replica or all, so reported counts are never summed across replicas.

// DefaultInflightTimeout is how long a tracked request counts as in flight
// when nobody completes it (a client that crashed, a lost /v1/done).
const DefaultInflightTimeout = 10 * time.Minute

// DefaultReportedLoadTTL is how long a client-reported count lives without
// a new report: a client reporting totals reports them far more often
// than this, and one that stopped (or a forger's one-off MaxReportedLoad,
// issue 29) stops steering routing within it.
const DefaultReportedLoadTTL = time.Minute

// engineLoadMaxAge is how old a rank's load record may be and still steer
// the picker. Streams send one at least every 5 s while idle (SMG's
// heartbeat backoff), so an older one means the stream is down and the
// record says nothing about the engine now.
const engineLoadMaxAge = 15 * time.Second

// EngineLoad is the last load record of a worker's DP rank, pushed on its
// event stream or polled. Optional fields the engine did not report are nil.
type EngineLoad struct {
	Rank int32 `json:"rank"`
	// Source is LoadPushed or LoadPolled.
	Source          string  `json:"source"`
	RunningRequests uint32  `json:"running_requests"`
	WaitingRequests uint32  `json:"waiting_requests"`
	TokenUsage      float64 `json:"token_usage"`
	// WaitingUncachedTokens is the prompt tokens queued for prefill that the
	// cache does not hold (SGLang reports it).
	WaitingUncachedTokens *uint32 `json:"waiting_uncached_tokens,omitempty"`
	// PrefillPendingTokens is the prompt tokens handed to the engine with no
	// output yet (SMG's SGLang servicer reports it instead).
	PrefillPendingTokens *uint32 `json:"prefill_pending_tokens,omitempty"`
	// CacheHitRate is the engine's own prefix-cache hit rate. Streams carry
	// it only in their first record and in load-only ones, so the last value
	// seen is kept.
	CacheHitRate *float64 `json:"cache_hit_rate,omitempty"`
	// At is when the engine sampled it: arrival less the age the record
	// declared (age_ms), so a record that waited is not taken as fresh.
	At time.Time `json:"at"`
	// AgeMs is the record's age when reported (Workers fills it).
	AgeMs int64 `json:"age_ms"`
}

// tracked is a routed request not yet completed.
type tracked struct {
	worker  string
	expires time.Time
}

func optionalU32(p *uint32) *uint32 {
	if p == nil {
		return nil
	}
	v := *p
	return &v
}

// recordLoad keeps rank's record from source (LoadPushed, LoadPolled).
func (g *Gateway) recordLoad(worker string, rank int32, l *kvpb.EngineLoad, source string) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if _, ok := g.workerOf[worker]; !ok {
		return
	}
	now := g.now()
	if source == LoadPushed {
		g.lastPush[worker] = now
	}
	ranks := g.engine[worker]
	if ranks == nil {
		ranks = map[int32]EngineLoad{}
		g.engine[worker] = ranks
	}
	rec := EngineLoad{
		Rank:                  rank,
		Source:                source,
		RunningRequests:       l.GetRunningRequests(),
		WaitingRequests:       l.GetWaitingRequests(),
		TokenUsage:            l.GetTokenUsage(),
		WaitingUncachedTokens: optionalU32(l.WaitingUncachedTokens),
		PrefillPendingTokens:  optionalU32(l.PrefillPendingTokens),
		CacheHitRate:          ranks[rank].CacheHitRate,
		At:                    now.Add(-time.Duration(l.GetAgeMs()) * time.Millisecond),
	}
	if l.CacheHitRate != nil {
		v := l.GetCacheHitRate()
		rec.CacheHitRate = &v
	}
	ranks[rank] = rec
	g.lastRank[worker] = rank
}

// engineSignalsLocked sums each eligible worker's fresh rank records into
// what the picker reads; g.mu is held. nil when no worker has one.
func (g *Gateway) engineSignalsLocked(eligible []string, now time.Time) map[string]picker.EngineSignal {
	var out map[string]picker.EngineSignal
	for _, w := range eligible {
		s, ok := g.engineSignalLocked(w, now)
		if !ok {
			continue
		}
		if out == nil {
			out = make(map[string]picker.EngineSignal)
		}
		out[w] = s
	}
	return out
}

// engineSignalLocked sums w's fresh rank records into what the picker
// reads; false when it has none. g.mu is held.
func (g *Gateway) engineSignalLocked(w string, now time.Time) (picker.EngineSignal, bool) {
	ranks := g.engine[w]
	if len(ranks) == 0 {
		return picker.EngineSignal{}, false
	}
	var s picker.EngineSignal
	uncached, pending, hasPending := 0, 0, false
	fresh := false
	for _, r := range ranks {
		if now.Sub(r.At) > engineLoadMaxAge {
			continue
		}
		fresh = true
		if !s.HasTokenUsage || r.TokenUsage > s.TokenUsage {
			s.TokenUsage, s.HasTokenUsage = r.TokenUsage, true
		}
		if r.WaitingUncachedTokens != nil {
			uncached += int(*r.WaitingUncachedTokens)
			s.HasBacklog = true
		}
		if r.PrefillPendingTokens != nil {
			pending += int(*r.PrefillPendingTokens)
			hasPending = true
		}
	}
	if !fresh {
		return picker.EngineSignal{}, false
	}
	// SMG decays by waiting uncached tokens; an engine that reports only
	// the prompt tokens awaiting prefill gives an upper bound of the same
	// backlog (cached tokens included), better than none.
	switch {
	case s.HasBacklog:
		s.Backlog = uncached
	case hasPending:
		s.Backlog, s.HasBacklog = pending, true
	}
	return s, true
}

// inflightLocked is the worker's in-flight count as the picker sees it.
func (g *Gateway) inflightLocked(w string) int {
	return max(g.inflight[w], g.routed[w]+g.peerRouted[w])
}

// RoutedCounts returns this replica's own tracked, not completed requests
// per worker (only non-zero counts), and a version that changes whenever
// one of them does, so a sharer can skip unchanged snapshots.
func (g *Gateway) RoutedCounts() (counts map[string]int, version uint64) {
	g.mu.Lock()
	defer g.mu.Unlock()
	counts = make(map[string]int, len(g.routed))
	for w, n := range g.routed {
		counts[w] = n
	}
	return counts, g.routedVersion
}

// routedChangedLocked bumps the version and wakes RoutedChanged's reader
// without blocking; g.mu is held.
func (g *Gateway) routedChangedLocked() {
	g.routedVersion++
	select {
	case g.routedSignal <- struct{}{}:
	default: // a wake-up is pending already
	}
}

// RoutedChanged receives a value after this replica's tracked counts
// change (several changes may share one); for one reader, the load sharer.
func (g *Gateway) RoutedChanged() <-chan struct{} { return g.routedSignal }

// RoutedVersion is RoutedCounts' version without the copy.
func (g *Gateway) RoutedVersion() uint64 {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.routedVersion
}

// SetPeerRouted replaces the other replicas' tracked requests per worker
// (the sum over the live peers) that add to this replica's own in the
// picker's view. Workers this gateway does not route are ignored; nil
// clears them (every peer gone, or NATS down long enough).
func (g *Gateway) SetPeerRouted(totals map[string]int) {
	g.mu.Lock()
	defer g.mu.Unlock()
	old := g.peerRouted
	g.peerRouted = make(map[string]int, len(totals))
	for w, n := range totals {
		if _, ok := g.workerOf[w]; ok && n > 0 {
			g.peerRouted[w] = n
		}
	}
	for w := range old {
		if g.peerRouted[w] != old[w] {
			g.syncFleetLocked(w)
		}
	}
	for w, n := range g.peerRouted {
		if old[w] != n {
			g.syncFleetLocked(w)
		}
	}
}

// syncFleetLocked copies w's in-flight count into its model's Fleet after
// either source changed; a worker already removed has no Fleet entry. g.mu
// is held.
func (g *Gateway) syncFleetLocked(w string) {
	if name, ok := g.workerOf[w]; ok {
		g.models[name].fleet.Set(w, g.inflightLocked(w))
	}
}

// trackLocked counts a routed request until done or its timeout, returning
// its id; g.mu is held.
func (g *Gateway) trackLocked(worker string, now time.Time) uint64 {
	g.nextID++
	id := g.nextID
	g.pending[id] = tracked{worker: worker, expires: now.Add(g.cfg.InflightTimeout)}
	g.routed[worker]++
	g.routedChangedLocked()
	g.syncFleetLocked(worker)
	return id
}

// Complete ends a tracked request: its worker's in-flight count drops by
// one. It fails with ErrUnknownRequest for an id never issued, already
// completed or expired.
func (g *Gateway) Complete(id uint64) error {
	g.mu.Lock()
	defer g.mu.Unlock()
	if !g.untrackLocked(id) {
		return fmt.Errorf("%w: %d", ErrUnknownRequest, id)
	}
	return nil
}

func (g *Gateway) untrackLocked(id uint64) bool {
	t, ok := g.pending[id]
	if !ok {
		return false
	}
	delete(g.pending, id)
	if g.routed[t.worker]--; g.routed[t.worker] <= 0 {
		delete(g.routed, t.worker)
	}
	g.routedChangedLocked()
	g.syncFleetLocked(t.worker)
	g.drainProgressLocked(t.worker)
	return true
}

// expireTracked ends the tracked requests whose timeout passed.
func (g *Gateway) expireTracked() int {
	g.mu.Lock()
	defer g.mu.Unlock()
	now := g.now()
	var ids []uint64
	for id, t := range g.pending {
		if !now.Before(t.expires) {
			ids = append(ids, id)
		}
	}
	sort.Slice(ids, func(i, j int) bool { return ids[i] < ids[j] })
	for _, id := range ids {
		g.untrackLocked(id)
	}
	if len(ids) > 0 {
		g.metrics.inflightExpired.Add(float64(len(ids)))
		g.log.Warn("tracked requests expired without completion", "count", len(ids), "timeout", g.cfg.InflightTimeout)
	}
	return len(ids)
}

// expireReported drops the reported counts older than ReportedLoadTTL.
func (g *Gateway) expireReported() int {
	g.mu.Lock()
	defer g.mu.Unlock()
	now := g.now()
	n := 0
	for w, at := range g.reportedAt {
		if now.Sub(at) >= g.cfg.ReportedLoadTTL {
			delete(g.inflight, w)
			delete(g.reportedAt, w)
			g.syncFleetLocked(w)
			n++
		}
	}
	return n
}

// runExpiry expires tracked requests and reported counts until ctx ends,
// checking a few times per timeout so none outlives it by more than a
// quarter of it.
func (g *Gateway) runExpiry(ctx context.Context) {
	every := min(max(min(g.cfg.InflightTimeout, g.cfg.ReportedLoadTTL)/4, 10*time.Millisecond), 30*time.Second)
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			g.expireTracked()
			g.expireReported()
		}
	}
}
