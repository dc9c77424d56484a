package placementsync

import (
	"crypto/rand"
	"encoding/hex"
	"maps"
	"sort"
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
	// SetPeerRouted sets the sum of the live peers' counts per worker.
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

// peer is another replica's latest snapshot.
type peer struct {
	counts map[string]int
	heard  time.Time
}

// loadShare is the load-sharing half of a Sync.
type loadShare struct {
	src                              LoadSource
	id                               string
	subject                          string
	interval, heartbeat, peerTimeout time.Duration
	shared                           *prometheus.CounterVec // direction: published, received, dropped, rejected
	sub                              *nats.Subscription
	stop                             chan struct{}
	closeOnce                        sync.Once
	done                             sync.WaitGroup
	mu                               sync.Mutex // peers, and the order of SetPeerRouted calls
	peers                            map[string]*peer
}

func newLoadShare(src LoadSource, opts Options) *loadShare {
	var b [8]byte
	_, _ = rand.Read(b[:]) // never fails (crypto/rand)
	l := &loadShare{
		src: src, id: hex.EncodeToString(b[:]), subject: opts.LoadSubject,
		interval: opts.LoadInterval, heartbeat: opts.Heartbeat, peerTimeout: opts.PeerTimeout,
		shared: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvrelay_gateway_load_shared_total",
			Help: "In-flight count snapshots shared over NATS, by direction: published, received (applied), dropped (not published: NATS unreachable), rejected (received but undecodable, or from a replica over the peer limit).",
		}, []string{"direction"}),
		stop:  make(chan struct{}),
		peers: map[string]*peer{},
	}
	for _, d := range []string{"published", "received", "dropped", "rejected"} {
		l.shared.WithLabelValues(d)
	}
	return l
}

// livePeers is the number of peers whose counts are applied now.
func (l *loadShare) livePeers() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return len(l.peers)
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
	var sentAt time.Time     // the last attempt, sent or not
	sentOK := false          // whether it was sent
	var due <-chan time.Time // a change waiting for the rate limit
	publish := func(now time.Time) {
		counts, v := l.src.RoutedCounts()
		err := nc.Publish(l.subject, encodeSnapshot(l.id, counts))
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

// encodeSnapshot encodes counts' non-zero entries, the most loaded
// MaxLoadWorkers when there are more, in name order.
func encodeSnapshot(id string, counts map[string]int) []byte {
	names := make([]string, 0, len(counts))
	for w, n := range counts {
		if n > 0 {
			names = append(names, w)
		}
	}
	if len(names) > MaxLoadWorkers {
		sort.Slice(names, func(i, j int) bool { return counts[names[i]] > counts[names[j]] })
		names = names[:MaxLoadWorkers]
	}
	sort.Strings(names)
	vals := make([]int, len(names))
	for i, w := range names {
		vals[i] = min(counts[w], MaxLoadCount)
	}
	return encodeLoad(nil, id, names, vals)
}

// receive applies a peer's snapshot.
func (l *loadShare) receive(msg *nats.Msg) {
	id, counts, err := decodeLoad(msg.Data)
	if err != nil {
		l.shared.WithLabelValues("rejected").Inc()
		return
	}
	if id == l.id {
		return // our own (NoEcho should have kept it away)
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	select {
	case <-l.stop:
		return // closed: the gateway's peer counts are cleared for good
	default:
	}
	p := l.peers[id]
	if p == nil {
		if len(l.peers) >= MaxPeers {
			l.shared.WithLabelValues("rejected").Inc()
			return
		}
		p = &peer{}
		l.peers[id] = p
	}
	p.heard = time.Now()
	l.shared.WithLabelValues("received").Inc()
	if !maps.Equal(p.counts, counts) {
		p.counts = counts
		l.applyLocked()
	}
}

// ageOut drops the peers not heard from for peerTimeout.
func (l *loadShare) ageOut(now time.Time) {
	l.mu.Lock()
	defer l.mu.Unlock()
	dropped := false
	for id, p := range l.peers {
		if now.Sub(p.heard) > l.peerTimeout {
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
	totals := map[string]int{}
	for _, p := range l.peers {
		for w, n := range p.counts {
			totals[w] += n
		}
	}
	l.src.SetPeerRouted(totals)
}

// close stops publishing and clears the peers' counts from the gateway.
func (l *loadShare) close() {
	l.closeOnce.Do(func() {
		close(l.stop)
		l.done.Wait()
		l.mu.Lock()
		defer l.mu.Unlock()
		l.peers = map[string]*peer{}
		l.src.SetPeerRouted(nil)
	})
}
