package placementsync

import (
	"cmp"
	"crypto/rand"
	"encoding/binary"
	"encoding/hex"
	"log/slog"
	"maps"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"
)

// Sharing in-flight counts. Placements alone send a prefix's requests to
// its holder from every replica, but each replica counts only the requests
// it routed, so the holder looks idle to the others and they pile onto it
// (BENCHMARKS.md, "Gateway replicas behind a round-robin front"). So each
// replica also publishes its own tracked, not completed requests per worker
// (never client-reported counts: a client reports those to one replica or
// all, and summing them would count them again), and adds the live peers'
// latest counts to its own.
//
// A replica publishes a snapshot of its non-zero counts when they changed,
// at most once per LoadInterval, and at least once per Heartbeat; a peer
// not heard from for PeerTimeout (it stopped, or NATS is down) is dropped,
// so counts never stay stale and a replica cut off from NATS routes on its
// own counts.
//
// A snapshot too large for one message (more than MaxLoadWorkers workers
// in flight, or past the server's payload limit) goes out in parts of one
// generation; a peer applies it only once every part is in, so a lost part
// (core NATS is at most once) never mixes two snapshots: the peer keeps
// the previous one until a later generation completes, and is heard from
// only by whole snapshots, so one whose parts keep getting lost ages out.

// LoadSource is the gateway whose in-flight counts are shared (a
// *gateway.Gateway).
type LoadSource interface {
	// RoutedCounts is the replica's own tracked requests per worker and a
	// version that changes with them; RoutedVersion the version alone.
	RoutedCounts() (map[string]int, uint64)
	RoutedVersion() uint64
	// RoutedChanged receives after the counts change (nil: never; the
	// version is polled every LoadInterval all the same).
	RoutedChanged() <-chan struct{}
	// SetPeerRouted sets the sum of the live peers' counts per worker;
	// the map is the caller's, to read during the call only.
	SetPeerRouted(map[string]int)
}

// Load-sharing defaults.
const (
	DefaultLoadInterval = 50 * time.Millisecond
	DefaultHeartbeat    = time.Second
	DefaultPeerTimeout  = 3 * time.Second
	// MaxPeers bounds the replicas whose counts are kept; more are
	// rejected until one ages out.
	MaxPeers = 256
)

// peer is another replica's latest whole snapshot, and the parts of the
// next one while they arrive.
type peer struct {
	counts  map[string]int
	heard   time.Time // when the last whole snapshot came
	gen     uint64    // the last split snapshot's generation applied
	dropped uint64    // the last generation dropped as inconsistent
	pending *partial
}

// partial is a snapshot whose parts are arriving.
type partial struct {
	gen    uint64
	got    []bool // by part index
	have   int
	counts map[string]int // the parts' entries so far
}

// loadShare is the load-sharing half of a Sync.
type loadShare struct {
	src                              LoadSource
	id                               string
	subject                          string
	interval, heartbeat, peerTimeout time.Duration
	shared                           *prometheus.CounterVec // direction: published, received, dropped, rejected, incomplete
	cut                              prometheus.Counter     // workers left out past MaxLoadParts
	sub                              *nats.Subscription
	stop                             chan struct{}
	closeOnce                        sync.Once
	done                             sync.WaitGroup
	mu                               sync.Mutex // peers, and the order of SetPeerRouted calls
	peers                            map[string]*peer
	// totals is the live peers' counts summed, kept as they change: a
	// snapshot costs its own workers, not every peer's.
	totals map[string]int
	// limit bounds each peer's messages (nil: unbounded, tests of the
	// protocol alone); peerLog is the throttled log of what peers drive.
	limit   *peerLimiter
	peerLog *slog.Logger
}

// WorkerRouter is what a LoadSource may also be: it tells which workers it
// routes, so a peer's counts for any other worker are dropped as they
// arrive and a peer's memory here is bounded by the workers this replica
// routes (MaxPeers × workers × an entry), not by what the peer sends.
type WorkerRouter interface {
	// KeepRoutedWorkers deletes from counts every worker it does not
	// route (one lock for a whole message, not one per entry).
	KeepRoutedWorkers(counts map[string]int)
}

// newReplicaID is a replica's random id, in its load snapshots and in
// ReplicaHeader on its placements.
func newReplicaID() string {
	var b [8]byte
	_, _ = rand.Read(b[:]) // never fails (crypto/rand)
	return hex.EncodeToString(b[:])
}

func newLoadShare(src LoadSource, opts Options) *loadShare {
	l := &loadShare{
		src: src, id: newReplicaID(), subject: opts.LoadSubject, peerLog: slog.New(slog.DiscardHandler),
		interval: opts.LoadInterval, heartbeat: opts.Heartbeat, peerTimeout: opts.PeerTimeout,
		shared: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvrelay_gateway_load_shared_total",
			Help: "In-flight count snapshots shared over NATS, by direction: published, received (applied, all parts in), dropped (not published: NATS unreachable), rejected (received but undecodable, from a replica over the peer limit, or a part repeated or overlapping another), incomplete (a peer's snapshot split in parts dropped for a missing part).",
		}, []string{"direction"}),
		cut: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvrelay_gateway_load_workers_cut_total",
			Help: "Workers with requests in flight left out of a published snapshot, the least loaded past MaxLoadParts parts (256 × 4,096 workers or more).",
		}),
		stop:  make(chan struct{}),
		peers: map[string]*peer{}, totals: map[string]int{},
	}
	for _, d := range []string{"published", "received", "dropped", "rejected", "incomplete"} {
		l.shared.WithLabelValues(d)
	}
	return l
}

// livePeers is the number of peers whose counts are applied now: not
// those only part of whose first snapshot came.
func (l *loadShare) livePeers() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	n := 0
	for _, p := range l.peers {
		if p.counts != nil {
			n++
		}
	}
	return n
}

// run publishes snapshots and ages peers out until stop closes. A change
// is published at once when the last snapshot is at least LoadInterval
// old, else when it becomes so; the ticker catches changes the signal
// missed, sends heartbeats and ages peers out.
func (l *loadShare) run(nc *nats.Conn) {
	defer l.done.Done()
	t := time.NewTicker(l.interval)
	defer t.Stop()
	var sentVersion uint64
	var gen uint64           // the snapshots' generation, for their parts
	var sentAt time.Time     // the last attempt, sent or not
	sentOK := false          // whether it was sent
	var due <-chan time.Time // a change waiting for the rate limit
	publish := func(now time.Time) {
		counts, v := l.src.RoutedCounts()
		gen++
		msgs, cut := encodeSnapshot(l.id, gen, counts, partBytes(nc))
		if cut > 0 {
			l.cut.Add(float64(cut))
		}
		var err error
		for _, msg := range msgs {
			if err = nc.Publish(l.subject, msg); err != nil {
				break // the peers wait for the next generation
			}
		}
		if err != nil {
			l.shared.WithLabelValues("dropped").Inc()
		} else {
			l.shared.WithLabelValues("published").Inc()
			sentVersion = v
		}
		// A failed publish is retried at the next heartbeat, not every
		// tick: NATS is down and the peers age us out anyway.
		sentAt, sentOK = now, err == nil
	}
	for {
		select {
		case <-l.stop:
			return
		case <-l.src.RoutedChanged():
			now := time.Now()
			if wait := l.interval - now.Sub(sentAt); wait <= 0 {
				publish(now)
			} else if due == nil {
				due = time.After(wait)
			}
		case now := <-due:
			due = nil
			publish(now)
		case now := <-t.C:
			if v := l.src.RoutedVersion(); due == nil && (now.Sub(sentAt) >= l.heartbeat || sentOK && v != sentVersion) {
				publish(now)
			}
			l.ageOut(now)
		}
	}
}

// partBytes is the most a message may take: the server's payload limit
// (1 MiB by default), or that default before the first connection.
func partBytes(nc *nats.Conn) int {
	if n := nc.MaxPayload(); n > 0 {
		return int(n)
	}
	return 1 << 20
}

// encodeSnapshot encodes counts' non-zero entries as one version 1
// message when they fit in MaxLoadWorkers entries and maxBytes, else as
// generation gen's parts, each within both; past MaxLoadParts parts the
// least loaded are left out, and cut is how many.
func encodeSnapshot(id string, gen uint64, counts map[string]int, maxBytes int) (msgs [][]byte, cut int) {
	names := make([]string, 0, len(counts))
	vals := make([]int, 0, len(counts))
	for w, n := range counts {
		if n > 0 {
			names, vals = append(names, w), append(vals, min(n, MaxLoadCount))
		}
	}
	budget := max(maxBytes-loadHeaderBytes, minLoadPartBytes)
	bounds := splitLoad(names, vals, budget)
	if len(bounds) == 1 {
		return [][]byte{encodeLoad(nil, id, names, vals)}, 0
	}
	if len(bounds) > MaxLoadParts {
		// Rare (over a million workers, or names so long a part holds
		// few): sort only then, most loaded first, and cut the tail.
		order := make([]int, len(names))
		for i := range order {
			order[i] = i
		}
		slices.SortFunc(order, func(i, j int) int {
			if c := cmp.Compare(vals[j], vals[i]); c != 0 {
				return c
			}
			return strings.Compare(names[i], names[j])
		})
		sortedNames, sortedVals := make([]string, len(order)), make([]int, len(order))
		for k, i := range order {
			sortedNames[k], sortedVals[k] = names[i], vals[i]
		}
		names, vals = sortedNames, sortedVals
		bounds = splitLoad(names, vals, budget)
		// Sorted, the entries split again, and entries of other sizes can
		// make that fewer parts than before: keep what there is.
		bounds = bounds[:min(len(bounds), MaxLoadParts)]
		end := bounds[len(bounds)-1]
		cut = len(names) - end
		names, vals = names[:end], vals[:end]
	}
	start := 0
	for part, end := range bounds {
		msgs = append(msgs, encodeLoadPart(nil, id, gen, part, len(bounds), names[start:end], vals[start:end]))
		start = end
	}
	return msgs, cut
}

// splitLoad returns the end of each part in names: at most MaxLoadWorkers
// entries and budget bytes each.
func splitLoad(names []string, vals []int, budget int) (bounds []int) {
	start, size := 0, 0
	for i, w := range names {
		e := uvarintLen(uint64(len(w))) + len(w) + uvarintLen(uint64(vals[i]))
		if i > start && (i-start == MaxLoadWorkers || size+e > budget) {
			bounds = append(bounds, i)
			start, size = i, 0
		}
		size += e
	}
	return append(bounds, len(names))
}

// minLoadPartBytes is the least entry budget of a part, for a server
// whose payload limit is implausibly small: a longest worker name fits.
const minLoadPartBytes = MaxWorkerName + 2*binary.MaxVarintLen64

func uvarintLen(v uint64) int {
	n := 1
	for ; v >= 0x80; v >>= 7 {
		n++
	}
	return n
}

// receive applies a peer's snapshot, or collects its parts until its
// generation is complete.
func (l *loadShare) receive(msg *nats.Msg) {
	m, err := decodeLoad(msg.Data)
	if err != nil {
		l.shared.WithLabelValues("rejected").Inc()
		return
	}
	if m.id == l.id {
		return // our own (NoEcho should have kept it away)
	}
	if l.limit != nil {
		switch l.limit.admit(m.id, 1, time.Now()) {
		case admitted:
		case brokeBound:
			l.peerLog.Warn("a peer replica broke its load message rate bound; ignoring its load for the backoff",
				"peer", m.id, "rate", l.limit.rate, "burst", l.limit.burst, "backoff", l.limit.backoff)
			return
		default:
			return // counted in kvrelay_gateway_nats_peer_limited_total
		}
	}
	if r, ok := l.src.(WorkerRouter); ok {
		r.KeepRoutedWorkers(m.counts)
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	select {
	case <-l.stop:
		return // closed: the gateway's peer counts are cleared for good
	default:
	}
	p := l.peers[m.id]
	if p == nil {
		if len(l.peers) >= MaxPeers {
			l.shared.WithLabelValues("rejected").Inc()
			return
		}
		// heard now: a peer none of whose snapshots completes ages out.
		p = &peer{heard: time.Now()}
		l.peers[m.id] = p
	}
	counts := m.counts
	if m.parts > 1 {
		if counts = l.collectLocked(p, m); counts == nil {
			return
		}
	} else if p.pending != nil {
		l.shared.WithLabelValues("incomplete").Inc()
		p.pending = nil
	}
	// Only a whole snapshot is news of the peer: one whose parts keep
	// getting lost ages out rather than keeping its last counts forever.
	p.heard = time.Now()
	l.shared.WithLabelValues("received").Inc()
	changed := !maps.Equal(p.counts, counts)
	if changed {
		l.addLocked(p.counts, -1)
		l.addLocked(counts, 1)
	}
	p.counts = counts // non-nil even when empty: the peer is live
	if changed {
		l.applyLocked()
	}
}

// collectLocked adds part m to p's generation being collected and returns
// the whole snapshot once every part is in (else nil). A part of another
// generation drops the one being collected: core NATS delivers at most
// once and in order, so its missing parts will not come.
func (l *loadShare) collectLocked(p *peer, m loadMsg) map[string]int {
	if m.gen <= p.gen || m.gen <= p.dropped || p.pending != nil && m.gen < p.pending.gen {
		return nil // a part of a generation over or dropped already
	}
	if p.pending != nil && (p.pending.gen != m.gen || len(p.pending.got) != m.parts) {
		l.shared.WithLabelValues("incomplete").Inc()
		p.pending = nil
	}
	if p.pending == nil {
		p.pending = &partial{gen: m.gen, got: make([]bool, m.parts), counts: m.counts}
	} else {
		if p.pending.got[m.part] {
			l.shared.WithLabelValues("rejected").Inc()
			return nil // a repeat: keep collecting
		}
		for w, n := range m.counts {
			if _, dup := p.pending.counts[w]; dup {
				l.shared.WithLabelValues("rejected").Inc()
				p.dropped, p.pending = m.gen, nil // inconsistent: wait for the next generation
				return nil
			}
			p.pending.counts[w] = n
		}
	}
	p.pending.got[m.part] = true
	p.pending.have++
	if p.pending.have < len(p.pending.got) {
		return nil
	}
	counts := p.pending.counts
	p.gen, p.pending = p.pending.gen, nil
	return counts
}

// ageOut drops the peers not heard from for peerTimeout.
func (l *loadShare) ageOut(now time.Time) {
	l.mu.Lock()
	defer l.mu.Unlock()
	dropped := false
	for id, p := range l.peers {
		if now.Sub(p.heard) > l.peerTimeout {
			l.addLocked(p.counts, -1)
			delete(l.peers, id)
			dropped = true
		}
	}
	if dropped {
		l.applyLocked()
	}
}

// applyLocked hands the live peers' summed counts to the gateway; l.mu is
// held, so two calls never overtake each other.
func (l *loadShare) applyLocked() {
	l.src.SetPeerRouted(l.totals)
}

// addLocked adds sign × counts to the totals, dropping the zeros.
func (l *loadShare) addLocked(counts map[string]int, sign int) {
	for w, n := range counts {
		if t := l.totals[w] + sign*n; t != 0 {
			l.totals[w] = t
		} else {
			delete(l.totals, w)
		}
	}
}

// close stops publishing and clears the peers' counts from the gateway.
func (l *loadShare) close() {
	l.closeOnce.Do(func() {
		close(l.stop)
		l.done.Wait()
		l.mu.Lock()
		defer l.mu.Unlock()
		l.peers, l.totals = map[string]*peer{}, map[string]int{}
		l.src.SetPeerRouted(nil)
	})
}
