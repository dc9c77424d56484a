package placementsync

import (
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// Bounds on what one peer replica can make this one do (issue 29). NATS's
// permissions keep everything but gateways off the placement and load
// subjects (deploy/nats/kvrelay.conf); these bounds hold whatever gets
// through: a buggy replica, a stolen gateway credential, a server without
// permissions.
//
// A placement message names its sender (the ReplicaHeader header, the id
// the replica's load snapshots carry too); a load snapshot carries it in
// its payload. Each sender has a token bucket: placements in hashes, load
// in messages (parts). A sender whose message does not fit its bucket
// breaks the bound: the message is dropped, the sender is ignored for
// Backoff, counted in kvrelay_gateway_nats_peer_limited_total and logged
// a few lines a minute (logthrottle). All senders together share one more
// bucket per kind, which bounds the sum when a forger rotates its id; a
// message that does not fit it is dropped without a backoff (the sender
// may be honest and unlucky). Messages without a sender id (replicas
// before this header) share the sender "".
const (
	// ReplicaHeader names the replica a placement comes from.
	ReplicaHeader = "Kvrelay-Replica"

	// DefaultPeerHashRate and DefaultPeerHashBurst bound one peer's
	// placements: 20,000 hashes a second sustained (a replica routing
	// 300 requests a second of 64 new blocks each), 32,768 at once (a
	// 512 k-token prompt at block size 16). A flooder is then held to a
	// burst per Backoff: about 3 bursts, 98,304 hashes (17.3 MB of a
	// model's placements at placement.EntryBytes), alive within a TTL
	// of 180 s. The placements it gets through are its own source in the
	// store: once it holds the most, it evicts its own, not others'.
	DefaultPeerHashRate  = 20_000
	DefaultPeerHashBurst = 32_768
	// DefaultTotalHashRate and DefaultTotalHashBurst bound every peer's
	// placements together.
	DefaultTotalHashRate  = 100_000
	DefaultTotalHashBurst = 131_072
	// DefaultPeerLoadRate and DefaultPeerLoadBurst bound one peer's load
	// messages (a snapshot is 1 to MaxLoadParts parts): an honest
	// replica sends at most one snapshot each DefaultLoadInterval (20 a
	// second), of one part below 4,096 workers in flight.
	DefaultPeerLoadRate  = 100
	DefaultPeerLoadBurst = 2*MaxLoadParts + 64
	// DefaultTotalLoadRate and DefaultTotalLoadBurst bound every peer's
	// load messages together.
	DefaultTotalLoadRate  = 2_000
	DefaultTotalLoadBurst = 4 * DefaultPeerLoadBurst
	// DefaultBackoff is how long a peer that broke a bound is ignored.
	DefaultBackoff = time.Minute
	// PendingMsgs and PendingBytes bound the placements a subscription
	// holds before this replica reads them (nats.go's defaults are 512 k
	// messages and 64 MiB); past them NATS drops (slow consumer drops), so
	// a flood costs at most this much memory before the bounds above see
	// it. The load subscription keeps nats.go's 64 MiB: a replica with
	// 10,000 workers in flight sends snapshots of three 40 KB parts 20
	// times a second, and a peer slowed down must not drop parts.
	PendingMsgs  = 65_536
	PendingBytes = 16 << 20
	// LoadPendingBytes bounds the load subscription's queue.
	LoadPendingBytes = 64 << 20
	// MaxLimitedPeers bounds the senders tracked per kind (about 100
	// bytes each); past it, a new sender is dropped until an idle one is
	// forgotten.
	MaxLimitedPeers = 1024
)

// Limits are the bounds of Options.Limits; zero fields take the defaults.
type Limits struct {
	PeerHashRate, PeerHashBurst   float64
	TotalHashRate, TotalHashBurst float64
	PeerLoadRate, PeerLoadBurst   float64
	TotalLoadRate, TotalLoadBurst float64
	Backoff                       time.Duration
}

func (l Limits) withDefaults() Limits {
	def := func(v *float64, d float64) {
		if *v <= 0 {
			*v = d
		}
	}
	def(&l.PeerHashRate, DefaultPeerHashRate)
	def(&l.PeerHashBurst, DefaultPeerHashBurst)
	def(&l.TotalHashRate, DefaultTotalHashRate)
	def(&l.TotalHashBurst, DefaultTotalHashBurst)
	def(&l.PeerLoadRate, DefaultPeerLoadRate)
	def(&l.PeerLoadBurst, DefaultPeerLoadBurst)
	def(&l.TotalLoadRate, DefaultTotalLoadRate)
	def(&l.TotalLoadBurst, DefaultTotalLoadBurst)
	if l.Backoff <= 0 {
		l.Backoff = DefaultBackoff
	}
	return l
}

// bucket is a token bucket: rate tokens a second, at most burst.
type bucket struct {
	tokens float64
	last   time.Time
}

func (b *bucket) take(n, rate, burst float64, now time.Time) bool {
	if b.last.IsZero() {
		b.tokens = burst
	} else if dt := now.Sub(b.last).Seconds(); dt > 0 {
		b.tokens = min(burst, b.tokens+dt*rate)
	}
	b.last = now
	if n > b.tokens {
		return false
	}
	b.tokens -= n
	return true
}

// Verdicts of admit.
const (
	admitted    = ""
	brokeBound  = "rate"    // the peer's bucket: backoff starts
	inBackoff   = "backoff" // ignored until its backoff ends
	overTotal   = "total"   // every peer's bucket: dropped, no backoff
	tooManySrcs = "peers"   // MaxLimitedPeers senders tracked already
)

type sender struct {
	bucket
	until time.Time // ignored before this
}

// peerLimiter bounds one kind of message (placements or load) per sender
// and in total.
type peerLimiter struct {
	kind               string
	rate, burst        float64
	totalRate, totalBu float64
	backoff            time.Duration
	limited            *prometheus.CounterVec // kind, reason

	mu        sync.Mutex
	total     bucket
	senders   map[string]*sender
	lastSweep time.Time // of forgetIdleLocked: at most once a second
}

func newPeerLimiter(kind string, rate, burst, totalRate, totalBurst float64, backoff time.Duration, limited *prometheus.CounterVec) *peerLimiter {
	for _, r := range []string{brokeBound, inBackoff, overTotal, tooManySrcs} {
		limited.WithLabelValues(kind, r)
	}
	return &peerLimiter{
		kind: kind, rate: rate, burst: burst, totalRate: totalRate, totalBu: totalBurst, backoff: backoff,
		limited: limited, senders: map[string]*sender{},
	}
}

// admit reports whether a message of n tokens from peer is taken, and
// why not.
func (l *peerLimiter) admit(peer string, n int, now time.Time) string {
	v := l.admitLocked(peer, float64(n), now)
	if v != admitted {
		l.limited.WithLabelValues(l.kind, v).Inc()
	}
	return v
}

func (l *peerLimiter) admitLocked(peer string, n float64, now time.Time) string {
	l.mu.Lock()
	defer l.mu.Unlock()
	s := l.senders[peer]
	if s == nil {
		if len(l.senders) >= MaxLimitedPeers && now.Sub(l.lastSweep) >= time.Second {
			l.lastSweep = now
			l.forgetIdleLocked(now)
		}
		if len(l.senders) >= MaxLimitedPeers {
			return tooManySrcs
		}
		s = &sender{}
		l.senders[peer] = s
	}
	if now.Before(s.until) {
		return inBackoff
	}
	if !s.take(n, l.rate, l.burst, now) {
		s.until = now.Add(l.backoff)
		return brokeBound
	}
	if !l.total.take(n, l.totalRate, l.totalBu, now) {
		s.tokens += n // not this sender's fault: give its tokens back
		return overTotal
	}
	return admitted
}

// forgetIdleLocked drops the senders out of backoff whose buckets are full
// again: forgetting them changes nothing. It scans every sender, so a
// flood of new ids calls it at most once a second, not per message.
func (l *peerLimiter) forgetIdleLocked(now time.Time) {
	full := time.Duration(l.burst / l.rate * float64(time.Second))
	for id, s := range l.senders {
		if !now.Before(s.until) && now.Sub(s.last) >= full {
			delete(l.senders, id)
		}
	}
}
