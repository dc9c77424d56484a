package gateway

import (
	"errors"
	"fmt"
	"hash/fnv"
	"slices"
	"strings"

	"github.com/kvrelay/kvrelay/gateway/index"
	"github.com/kvrelay/kvrelay/gateway/monitor"
	"github.com/kvrelay/kvrelay/gateway/picker"
)

// The partitioned tier (issue 31.3, docs/partitioned-tier.md): with
// Config.Partitions = P > 1, the tier's replicas split the fleet's events
// instead of each applying all of them. Every replica still knows every
// worker (membership, the picker's fleet and in-flight counts are as
// before), but it subscribes only to the workers PartitionOf assigns to
// its own partition, so its index holds 1/P of the fleet. A route hashes
// the request once, asks the other partitions for their workers' overlaps
// (a Scatterer: package partitionsync, over NATS), looks its own index up
// meanwhile, merges, and runs the picker as a full replica would. The
// merge is the full index's answer because a worker's overlap with a
// request depends on that worker's blocks only, and each worker lives in
// one partition.
//
// What else a full replica learns from a worker's stream travels in the
// answers too, so the picker sees what a full replica would: the engine
// load signals of the partition's workers (when a picker knob reads them),
// which of its workers are unreachable (a full replica leaves those out of
// the fleet), and the model's block size as its workers' events revealed
// it. A partition that does not answer within the scatter's deadline
// leaves its workers at zero overlap, without engine signals, and with
// the reachability it last reported.

// MaxPartitions bounds Config.Partitions: a route scatters to every
// partition, so more would cost more per route than they save.
const MaxPartitions = 256

// PartitionOf is the partition of parts that owns worker's events:
// rendezvous hashing, the partition whose hash with the worker's name is
// highest. Every replica computes it alone; changing parts moves only the
// workers the added or removed partitions gain or lose, and a worker's
// partition does not depend on the other workers. parts ≤ 1 is 0.
func PartitionOf(worker string, parts int) int {
	if parts <= 1 {
		return 0
	}
	h := fnv.New64a()
	h.Write([]byte(worker))
	name := h.Sum64()
	best, bestScore := 0, uint64(0)
	for p := range parts {
		if s := mix64(name ^ mix64(uint64(p)+0x9e3779b97f4a7c15)); p == 0 || s > bestScore {
			best, bestScore = p, s
		}
	}
	return best
}

// mix64 is a 64-bit finalizer (splitmix64's): every input bit moves every
// output bit, so the scores of one name under different partitions are
// independent.
func mix64(x uint64) uint64 {
	x ^= x >> 30
	x *= 0xbf58476d1ce4e5b9
	x ^= x >> 27
	x *= 0x94d049bb133111eb
	x ^= x >> 31
	return x
}

// PartitionQuery is what a route asks every other partition.
type PartitionQuery struct {
	Model string
	// Prefix is the request's prefix hashes (index.PrefixHashes).
	Prefix []uint64
	// Loads asks for the partition's workers' engine load signals (the
	// picker reads them: overlap decay or a KV-pressure threshold).
	Loads bool
}

// WorkerSignal is one worker's engine load signal, as the picker reads it.
type WorkerSignal struct {
	Worker string
	picker.EngineSignal
}

// PartitionAnswer is one partition's answer to a PartitionQuery.
type PartitionAnswer struct {
	Partition int
	// BlockSize is the block size the partition's workers' events revealed
	// for the model; 0 when none has.
	BlockSize int
	// Matches are the partition's workers' overlaps with the request,
	// deepest first, then by name (index.Matches' order).
	Matches []index.Match
	// Unreachable are the partition's workers of the model whose last
	// subscribe attempt failed.
	Unreachable []string
	// Signals are the partition's workers' fresh engine signals, when the
	// query asked for them.
	Signals []WorkerSignal
}

// Reset empties a, keeping its slices' room.
func (a *PartitionAnswer) Reset() {
	clear(a.Matches)
	clear(a.Unreachable)
	clear(a.Signals)
	*a = PartitionAnswer{Matches: a.Matches[:0], Unreachable: a.Unreachable[:0], Signals: a.Signals[:0]}
}

// Scatterer asks the other partitions (package partitionsync does it over
// NATS).
type Scatterer interface {
	// Scatter sends q to every partition but this replica's own, calls
	// local while the answers are on their way, and returns the answers
	// that came within its deadline (at most one per partition). It counts
	// and logs the partitions that did not answer.
	Scatter(q PartitionQuery, local func()) []PartitionAnswer
}

// ErrNotPartitioned: the gateway was asked a partition's question but
// runs unpartitioned (Config.Partitions ≤ 1).
var ErrNotPartitioned = errors.New("gateway: not partitioned")

func checkPartitions(parts, own int) error {
	switch {
	case parts < 0 || parts > MaxPartitions:
		return fmt.Errorf("gateway: partitions must be 0..%d, got %d", MaxPartitions, parts)
	case own < 0 || (parts > 1 && own >= parts) || (parts <= 1 && own != 0):
		return fmt.Errorf("gateway: partition must be in 0..%d (partitions %d), got %d", max(parts, 1)-1, parts, own)
	}
	return nil
}

// Partition reports this replica's partition and the tier's count (0 and
// 1 when unpartitioned).
func (g *Gateway) Partition() (own, count int) {
	return g.cfg.Partition, max(g.cfg.Partitions, 1)
}

// partitioned reports whether routes scatter.
func (g *Gateway) partitioned() bool { return g.cfg.Partitions > 1 }

// owns reports whether this replica applies worker id's events; for a
// worker of the gateway, g.mu is held.
func (g *Gateway) owns(id string) bool {
	if !g.partitioned() {
		return true
	}
	if p, ok := g.partOf[id]; ok {
		return p == g.cfg.Partition
	}
	return PartitionOf(id, g.cfg.Partitions) == g.cfg.Partition
}

// SetScatterer makes routes ask s for the other partitions' overlaps; nil
// (or never set) leaves every other partition missing. Only for a
// partitioned gateway.
func (g *Gateway) SetScatterer(s Scatterer) {
	if s == nil {
		g.scatter.Store(nil)
		return
	}
	g.scatter.Store(&s)
}

// CatchingUp lists, sorted, this replica's workers (on a partitioned
// replica: its own partition's) whose index is not whole yet: their
// stream has not delivered their state once (monitor's
// WorkerStatus.CaughtUp) and they are not known to be out of reach
// (unreachable: their last subscribe attempt failed, a mark the retries
// keep until one streams; disabled: their events are off) or removed. A
// replica answering from such an index would leave those workers' blocks
// out (partitionsync holds a restarted replica's answers back until this
// is empty).
func (g *Gateway) CatchingUp() []string {
	var out []string
	sts := g.mon.Workers()
	g.reachMu.Lock()
	defer g.reachMu.Unlock()
	for _, st := range sts {
		switch {
		case st.CaughtUp, g.unreachable[st.ID]:
		case st.State == monitor.StateBackoff, st.State == monitor.StateDisabled, st.State == monitor.StateStopped:
		default:
			out = append(out, st.ID)
		}
	}
	return out
}

// PartitionAnswerer is a Scatterer that also answers this replica's
// partition's lookups (partitionsync.Tier), and says whether it does yet.
type PartitionAnswerer interface {
	Answering() bool
}

// AnsweringPartition reports whether this replica answers its partition's
// lookups: false while its Scatterer (a PartitionAnswerer) holds them
// back until the replica's own workers' indexes are whole. True when
// unpartitioned, or when the Scatterer does not say.
func (g *Gateway) AnsweringPartition() bool {
	if !g.partitioned() {
		return true
	}
	s := g.scatter.Load()
	if s == nil {
		return true
	}
	a, ok := (*s).(PartitionAnswerer)
	return !ok || a.Answering()
}

// AnswerPartition answers another replica's query for this replica's
// partition: its own workers' overlaps with q.Prefix, their reachability,
// the model's learned block size and, if asked, their engine signals.
// dst is reset first.
func (g *Gateway) AnswerPartition(q PartitionQuery, dst *PartitionAnswer) error {
	dst.Reset()
	if !g.partitioned() {
		return ErrNotPartitioned
	}
	dst.Partition = g.cfg.Partition
	g.mu.Lock()
	m := g.models[q.Model]
	g.mu.Unlock()
	if m == nil {
		return fmt.Errorf("%w: %q", ErrUnknownModel, q.Model)
	}
	dst.BlockSize = g.mon.BlockSize(q.Model)
	matches := getMatches()
	defer putMatches(matches)
	m.ix.FindMatchesHashesInto(matches, q.Prefix)
	dst.Matches = append(dst.Matches, matches.Workers...)
	g.mu.Lock()
	defer g.mu.Unlock()
	if q.Loads {
		// Only this partition's workers have load records here (their
		// streams and polls are this replica's): O(its workers), not the
		// model's.
		now := g.now()
		for w := range g.engine {
			if !m.workers[w] || !g.owns(w) {
				continue
			}
			if s, ok := g.engineSignalLocked(w, now); ok {
				dst.Signals = append(dst.Signals, WorkerSignal{Worker: w, EngineSignal: s})
			}
		}
	}
	g.reachMu.Lock()
	for w := range g.unreachable {
		if m.workers[w] {
			dst.Unreachable = append(dst.Unreachable, w)
		}
	}
	g.reachMu.Unlock()
	slices.Sort(dst.Unreachable)
	return nil
}

// scattered is what a partitioned route learned from the other
// partitions, applied under g.mu before the choice.
type scattered struct {
	answers []PartitionAnswer
}

// partitionLookup is a partitioned route's lookup: the other partitions'
// overlaps merged with this replica's own into dst (the full index's
// answer when every partition answered).
func (g *Gateway) partitionLookup(m *model, q PartitionQuery, dst *index.Matches) scattered {
	local := func() { m.ix.FindMatchesHashesInto(dst, q.Prefix) }
	var answers []PartitionAnswer
	if s := g.scatter.Load(); s != nil {
		answers = g.otherPartitions((*s).Scatter(q, local))
	} else {
		local()
	}
	g.mu.Lock()
	for _, a := range answers {
		for _, x := range a.Matches {
			// Only the answering partition's workers of this model, with an
			// overlap the request can have: a partition that is behind on
			// membership, or a forged answer, steers nothing else.
			if x.Blocks > 0 && x.Blocks <= len(q.Prefix) && m.workers[x.Worker] && g.partOf[x.Worker] == a.Partition {
				dst.Workers = append(dst.Workers, x)
			}
		}
	}
	g.mu.Unlock()
	// A worker listed twice (a partition answering twice, or one answer
	// naming it twice) keeps its deepest overlap, as a full index has one
	// per worker: sorted by name, deepest first, the first of each name is
	// the one kept; then back to index.Matches' order (deepest first, then
	// by name). Two sorts rather than a set, so a route allocates nothing.
	slices.SortFunc(dst.Workers, func(a, b index.Match) int {
		if c := strings.Compare(a.Worker, b.Worker); c != 0 {
			return c
		}
		return b.Blocks - a.Blocks
	})
	dst.Workers = slices.CompactFunc(dst.Workers, func(a, b index.Match) bool { return a.Worker == b.Worker })
	slices.SortFunc(dst.Workers, func(a, b index.Match) int {
		if a.Blocks != b.Blocks {
			return b.Blocks - a.Blocks
		}
		return strings.Compare(a.Worker, b.Worker)
	})
	return scattered{answers: answers}
}

// otherPartitions returns answers without those that claim this
// replica's own partition or one outside the tier: the merge trusts an
// answer's partition to say whose workers it may speak for, and this
// replica's own workers are known here first-hand. Each dropped answer is
// counted and logged (throttled). answers is not modified; a copy is made
// only when one is dropped.
func (g *Gateway) otherPartitions(answers []PartitionAnswer) []PartitionAnswer {
	for i, a := range answers {
		if a.Partition != g.cfg.Partition && a.Partition >= 0 && a.Partition < g.cfg.Partitions {
			continue
		}
		kept := slices.Clone(answers[:i])
		for _, b := range answers[i:] {
			if b.Partition != g.cfg.Partition && b.Partition >= 0 && b.Partition < g.cfg.Partitions {
				kept = append(kept, b)
				continue
			}
			g.metrics.answersDropped.Inc()
			g.peerLog.Warn("gateway: dropped a partition answer that claims a partition not another's", "partition", b.Partition, "own", g.cfg.Partition, "partitions", g.cfg.Partitions)
		}
		return kept
	}
	return answers
}

// applyLocked records the answers' reachability and merges their engine
// signals into engine (returned, allocated if nil and needed); g.mu is
// held.
func (s scattered) applyLocked(g *Gateway, m *model, engine map[string]picker.EngineSignal, wantLoads bool) map[string]picker.EngineSignal {
	if len(s.answers) == 0 {
		return engine
	}
	g.reachMu.Lock()
	// The workers whose mark an answer changed, and how many more of the
	// model are reachable for it: the fleet follows them alone, not every
	// model's every worker. Two replicas of one partition that disagree
	// on a worker flip it at every other answer, and a walk of the whole
	// fleet under g.mu at each cost O(models × workers) a route
	// (BenchmarkRouteReachabilityFlap).
	var flipped []string
	delta := 0
	for _, a := range s.answers {
		var down map[string]bool
		for _, w := range a.Unreachable {
			if m.workers[w] && g.partOf[w] == a.Partition {
				if down == nil {
					down = make(map[string]bool, len(a.Unreachable))
				}
				down[w] = true
			}
		}
		key := remoteKey{partition: a.Partition, model: m.name}
		old := g.remoteDown[key]
		if sameSet(old, down) {
			continue
		}
		for w := range old {
			if !down[w] {
				flipped = append(flipped, w)
				delta += g.reachDeltaLocked(w)
			}
		}
		for w := range down {
			if !old[w] {
				flipped = append(flipped, w)
				delta -= g.reachDeltaLocked(w)
			}
		}
		if down == nil {
			delete(g.remoteDown, key)
		} else {
			g.remoteDown[key] = down
		}
	}
	if len(flipped) > 0 && !g.reachDirty.Load() {
		// Nothing else changed since the last sync, so m.reachable is
		// exact: a stream's state sets reachDirty under reachMu, a drain
		// or a membership change under g.mu, both held here, and every
		// swap of it back to false is followed by a sync under g.mu.
		g.flipLocked(m, flipped, delta)
	}
	g.reachMu.Unlock()
	// Anything else pending (a stream's state, a drain, membership): the
	// whole sync, which covers the flips too.
	if g.reachDirty.Swap(false) {
		g.syncFleetsLocked()
	}
	if !wantLoads {
		return engine
	}
	for _, a := range s.answers {
		for _, x := range a.Signals {
			if m.workers[x.Worker] && g.partOf[x.Worker] == a.Partition {
				if engine == nil {
					engine = make(map[string]picker.EngineSignal)
				}
				engine[x.Worker] = x.EngineSignal
			}
		}
	}
	return engine
}

// reachDeltaLocked is how much a model's reachable count moves when w's
// remote mark goes from down to up: 1 when that changes whether w counts
// as reachable (it is not draining, and this replica does not find it
// unreachable itself), 0 otherwise; the caller negates it for a mark
// going from up to down. g.mu and g.reachMu are held.
func (g *Gateway) reachDeltaLocked(w string) int {
	if _, drained := g.draining[w]; drained || g.unreachable[w] {
		return 0
	}
	return 1
}

// flipLocked makes m's fleet follow the workers whose remote mark changed
// (flipped; m.reachable moves by delta): each alone, unless the model went
// from no reachable worker to some, or back, which moves every worker of
// it (the "none reachable: route to all" rule); g.mu and g.reachMu are
// held.
func (g *Gateway) flipLocked(m *model, flipped []string, delta int) {
	before := m.reachable
	m.reachable += delta
	if (before == 0) != (m.reachable == 0) {
		g.metrics.fleetSyncsModel.Inc()
		g.syncModelLocked(m)
		return
	}
	g.metrics.fleetSyncsWorkers.Inc()
	for _, w := range flipped {
		g.placeLocked(m, w)
	}
}

// remoteKey names one partition's unreachable workers of one model.
type remoteKey struct {
	partition int
	model     string
}

func sameSet(a, b map[string]bool) bool {
	if len(a) != len(b) {
		return false
	}
	for k := range a {
		if !b[k] {
			return false
		}
	}
	return true
}

// remoteUnreachableLocked reports whether another partition last said w is
// unreachable; g.mu and g.reachMu are held.
func (g *Gateway) remoteUnreachableLocked(model, w string) bool {
	if !g.partitioned() || len(g.remoteDown) == 0 {
		return false
	}
	return g.remoteDown[remoteKey{partition: g.partOf[w], model: model}][w]
}

// MaxAdoptedBlockSize bounds a block size taken from another partition's
// answer. Engines page KV at up to a few hundred tokens (vLLM raises its
// page to about a thousand for some hybrid models); a larger size from an
// answer is taken for a forged or broken one, since adopting it would
// hash every request shorter than it to no blocks, for good (sizes only
// grow). A size this replica's own workers reveal is not bounded.
const MaxAdoptedBlockSize = 4096

// adoptBlockSize takes the largest block size the answers report for the
// model, if larger than any learned here (the rule the monitor applies
// among its own workers), from an answer whose partition owns at least
// one of the model's workers in this replica's membership and at most
// MaxAdoptedBlockSize; each larger size offered is counted by outcome and
// logged (throttled: the answers are a peer's). It reports whether the
// model's block size changed.
func (g *Gateway) adoptBlockSize(m *model, s scattered) bool {
	cur := int(m.learnedBlock.Load())
	larger := false
	for _, a := range s.answers {
		larger = larger || a.BlockSize > cur
	}
	if !larger {
		return false // the common case: nothing to check under g.mu
	}
	n := 0
	g.mu.Lock()
	for _, a := range s.answers {
		switch {
		case a.BlockSize <= cur:
			continue
		case m.parts[a.Partition] == 0:
			g.metrics.blockSizes.WithLabelValues(m.name, "not_assigned").Inc()
			g.peerLog.Warn("gateway: refused a block size from a partition that owns no worker of the model", "model", m.name, "partition", a.Partition, "block_size", a.BlockSize)
		case a.BlockSize > MaxAdoptedBlockSize:
			g.metrics.blockSizes.WithLabelValues(m.name, "too_large").Inc()
			g.peerLog.Warn("gateway: refused a block size above the largest adopted", "model", m.name, "partition", a.Partition, "block_size", a.BlockSize, "max", MaxAdoptedBlockSize)
		default:
			n = max(n, a.BlockSize)
		}
	}
	g.mu.Unlock()
	if n == 0 {
		return false
	}
	before := m.ix.BlockSize()
	g.learnBlockSize(m, n)
	if m.ix.BlockSize() == before {
		return false
	}
	g.metrics.blockSizes.WithLabelValues(m.name, "adopted").Inc()
	g.peerLog.Info("gateway: adopted another partition's block size", "model", m.name, "block_size", n, "was", before)
	return true
}

// learnBlockSize sets the model's index block size to n if it is the
// largest learned so far. The comparison and both writes are one step
// under m.blockMu: with a compare-and-swap alone, a learner of 16 could
// set the index after a learner of 32 had, leaving it at 16.
func (g *Gateway) learnBlockSize(m *model, n int) {
	m.blockMu.Lock()
	defer m.blockMu.Unlock()
	if int64(n) <= m.learnedBlock.Load() {
		return
	}
	m.learnedBlock.Store(int64(n))
	m.ix.SetBlockSize(n)
}
