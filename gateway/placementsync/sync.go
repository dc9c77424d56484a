// Package placementsync shares a gateway's placements with its other
// replicas over NATS (`kvrelay gateway --nats URL`).
//
// Every replica publishes each placement it makes (a routing decision's
// blocks on the chosen worker, package placement) to its model's subject,
// kvrelay.placements.<model>, and subscribes to kvrelay.placements.>,
// applying what the others publish into its own placements; the connection
// is made with NoEcho, so a replica never hears itself. With N replicas
// behind a load balancer, a prefix routed by one is then where all of them
// send it, before the engine has reported a block.
//
// NATS is optional and never in the routing path: a placement is published
// after the decision, without waiting, and while NATS is unreachable
// (at start or later) each replica routes on its own placements; what it
// places meanwhile is dropped, not queued (a placement replayed late would
// live a TTL from its late arrival). The client reconnects on its own, and
// kvrelay_gateway_nats_connected says which mode a replica is in.
//
// With Options.Load, replicas also share their in-flight counts (load.go),
// so a prefix's holder does not look idle to the replicas that did not
// route to it; a peer that goes silent ages out after a few seconds.
package placementsync

import (
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvrelay/kvrelay/internal/logthrottle"
	"github.com/kvrelay/kvrelay/internal/natsconn"
	"github.com/kvrelay/kvrelay/internal/natslog"
	"github.com/prometheus/client_golang/prometheus"
)

// Target is where received placements go (a *gateway.Gateway); peer is
// the sending replica's id (its ReplicaHeader, "" when it sent none).
type Target interface {
	ApplyPlacement(model, peer, worker string, hashes []uint64) error
}

// Options configures a Sync.
type Options struct {
	// URL is the NATS server list (nats://host:4222, comma-separated).
	URL string
	// Name names the connection on the server (e.g. the replica's host).
	Name string
	// SubjectPrefix replaces DefaultSubjectPrefix, to keep fleets that share
	// a NATS server apart.
	SubjectPrefix string
	// ReconnectWait is the pause between reconnect attempts; 0 = 1 s.
	ReconnectWait time.Duration
	// Registerer receives kvrelay_gateway_nats_connected,
	// kvrelay_gateway_placements_shared_total and, sharing load,
	// kvrelay_gateway_nats_peers, kvrelay_gateway_load_shared_total and
	// kvrelay_gateway_load_workers_cut_total;
	// nil = unregistered.
	Registerer prometheus.Registerer
	Logger     *slog.Logger
	// Load, when set, shares the gateway's own tracked in-flight counts
	// with the other replicas and adds theirs to its own (load.go); nil
	// shares placements only.
	Load LoadSource
	// LoadSubject is where the counts go; "" = SubjectPrefix + "-load"
	// (outside the placements' wildcard).
	LoadSubject string
	// LoadInterval is the least time between two snapshots, Heartbeat the
	// most, PeerTimeout how long a silent peer's counts still count; 0 =
	// DefaultLoadInterval, DefaultHeartbeat, DefaultPeerTimeout.
	LoadInterval, Heartbeat, PeerTimeout time.Duration
	// NATSOptions are added to the connection's options (TLS, credentials).
	NATSOptions []nats.Option
	// Limits bound what each peer replica's placements and load can cost
	// this one (bounds.go); zero fields take the defaults.
	Limits Limits
}

// Sync publishes a gateway's placements and applies the other replicas'.
// Safe for concurrent use.
type Sync struct {
	opts   Options
	target Target
	nc     *nats.Conn
	sub    *nats.Subscription
	log    *slog.Logger
	shared *prometheus.CounterVec // direction: published, received, dropped, rejected
	// removals counts worker removals shared (removal.go), by direction.
	removals *prometheus.CounterVec
	remSub   *nats.Subscription
	regd     []prometheus.Collector
	load     *loadShare // nil unless Options.Load

	id      string      // this replica's, in ReplicaHeader and its load snapshots
	hdr     nats.Header // ReplicaHeader: id, on every placement
	places  *peerLimiter
	limited *prometheus.CounterVec // kind, reason
	peerLog *slog.Logger           // throttled: lines peers drive

	bufs sync.Pool
}

// Start connects to opts.URL and subscribes for target. It does not wait
// for the server: an unreachable one is retried in the background, and the
// replica routes on its own meanwhile. Close ends it.
func Start(target Target, opts Options) (*Sync, error) {
	if target == nil {
		return nil, errors.New("placementsync: nil target")
	}
	if strings.TrimSpace(opts.URL) == "" {
		return nil, errors.New("placementsync: empty NATS URL")
	}
	if opts.SubjectPrefix == "" {
		opts.SubjectPrefix = DefaultSubjectPrefix
	}
	if opts.ReconnectWait <= 0 {
		opts.ReconnectWait = time.Second
	}
	if opts.Logger == nil {
		opts.Logger = slog.New(slog.DiscardHandler)
	}
	if opts.LoadSubject == "" {
		opts.LoadSubject = opts.SubjectPrefix + "-load"
	}
	if opts.LoadInterval <= 0 {
		opts.LoadInterval = DefaultLoadInterval
	}
	if opts.Heartbeat <= 0 {
		opts.Heartbeat = DefaultHeartbeat
	}
	if opts.PeerTimeout <= 0 {
		opts.PeerTimeout = DefaultPeerTimeout
	}
	opts.Limits = opts.Limits.withDefaults()
	s := &Sync{
		opts: opts, target: target, log: opts.Logger, peerLog: logthrottle.Wrap(opts.Logger),
		limited: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvrelay_gateway_nats_peer_limited_total",
			Help: "Messages from peer replicas dropped by a bound, by kind (placement, load) and reason: rate (the peer broke its rate bound; its backoff starts), backoff (the peer is being ignored), total (every peer together over the bound), peers (too many senders tracked).",
		}, []string{"kind", "reason"}),
		shared: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvrelay_gateway_placements_shared_total",
			Help: "Placements shared over NATS, by direction: published, received (applied), dropped (not published: NATS unreachable), rejected (received but undecodable or naming a model or worker this replica does not route).",
		}, []string{"direction"}),
	}
	s.removals = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "kvrelay_gateway_worker_removals_shared_total",
		Help: "Worker removals shared over NATS, by direction: published, received (that worker's placements dropped here), dropped (not published: NATS unreachable), rejected (undecodable).",
	}, []string{"direction"})
	for _, d := range []string{"published", "received", "dropped", "rejected"} {
		s.shared.WithLabelValues(d)
		s.removals.WithLabelValues(d)
	}
	s.bufs.New = func() any { return new([]byte) }
	lim := opts.Limits
	s.places = newPeerLimiter("placement", lim.PeerHashRate, lim.PeerHashBurst, lim.TotalHashRate, lim.TotalHashBurst, lim.Backoff, s.limited)
	s.id = newReplicaID()
	nopts := []nats.Option{
		nats.NoEcho(),
		// No buffering while disconnected: Publish fails and the
		// placement is dropped.
		nats.ReconnectBufSize(-1),
		nats.ConnectHandler(func(*nats.Conn) { s.log.Info("nats connected: sharing placements") }),
		nats.ReconnectHandler(func(*nats.Conn) { s.log.Info("nats reconnected: sharing placements again") }),
		nats.DisconnectErrHandler(func(_ *nats.Conn, err error) {
			s.log.Warn("nats disconnected: placements stay local until it reconnects", "err", natslog.RedactError(err))
		}),
	}
	s.hdr = nats.Header{ReplicaHeader: []string{s.id}}
	nc, err := natsconn.Connect(opts.URL, opts.Name, opts.ReconnectWait, s.log, append(nopts, opts.NATSOptions...)...)
	if err != nil {
		return nil, fmt.Errorf("placementsync: %w", err)
	}
	s.nc = nc
	if s.sub, err = nc.Subscribe(opts.SubjectPrefix+".>", s.receive); err != nil {
		nc.Close()
		return nil, fmt.Errorf("placementsync: subscribe: %w", err)
	}
	if s.remSub, err = nc.Subscribe(removalFilter(opts.SubjectPrefix), s.receiveRemoval); err != nil {
		nc.Close()
		return nil, fmt.Errorf("placementsync: subscribe: %w", err)
	}
	_ = s.sub.SetPendingLimits(PendingMsgs, PendingBytes) // never fails on a live async subscription
	if opts.Load != nil {
		s.load = newLoadShare(opts.Load, opts)
		s.load.id = s.id
		s.load.limit = newPeerLimiter("load", lim.PeerLoadRate, lim.PeerLoadBurst, lim.TotalLoadRate, lim.TotalLoadBurst, lim.Backoff, s.limited)
		s.load.peerLog = s.peerLog
		if s.load.sub, err = nc.Subscribe(opts.LoadSubject, s.load.receive); err != nil {
			nc.Close()
			return nil, fmt.Errorf("placementsync: subscribe %s: %w", opts.LoadSubject, err)
		}
		_ = s.load.sub.SetPendingLimits(PendingMsgs, LoadPendingBytes)
		s.load.done.Add(1)
		go s.load.run(nc)
	}
	if opts.Registerer != nil {
		connected := prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "kvrelay_gateway_nats_connected",
			Help: "1 while the gateway shares placements over NATS, 0 while it routes on its own placements only (NATS unreachable).",
		}, func() float64 {
			if s.Connected() {
				return 1
			}
			return 0
		})
		collectors := []prometheus.Collector{connected, s.shared, s.removals, s.limited}
		if s.load != nil {
			peers := prometheus.NewGaugeFunc(prometheus.GaugeOpts{
				Name: "kvrelay_gateway_nats_peers",
				Help: "Other gateway replicas whose in-flight counts this one adds to its own (heard from within the peer timeout).",
			}, func() float64 { return float64(s.load.livePeers()) })
			collectors = append(collectors, peers, s.load.shared, s.load.cut)
		}
		for _, c := range collectors {
			if err := opts.Registerer.Register(c); err != nil {
				s.Close()
				return nil, fmt.Errorf("placementsync metrics: %w", err)
			}
			s.regd = append(s.regd, c)
		}
	}
	return s, nil
}

// Peers is the number of other replicas whose in-flight counts are
// applied now (0 when load is not shared).
func (s *Sync) Peers() int {
	if s.load == nil {
		return 0
	}
	return s.load.livePeers()
}

// Connected reports whether placements are being shared now.
func (s *Sync) Connected() bool { return s.nc.IsConnected() }

// PublishPlacement publishes worker's placement of hashes under model;
// while NATS is unreachable it drops it. It never blocks on the network.
func (s *Sync) PublishPlacement(model, worker string, hashes []uint64) {
	if len(hashes) > MaxHashes {
		hashes = hashes[:MaxHashes] // the rest would be rejected whole by every receiver
	}
	bp := s.bufs.Get().(*[]byte)
	*bp = encode((*bp)[:0], worker, hashes)
	err := s.nc.PublishMsg(&nats.Msg{Subject: s.opts.SubjectPrefix + "." + subjectToken(model), Data: *bp, Header: s.hdr})
	s.bufs.Put(bp)
	if err != nil {
		s.shared.WithLabelValues("dropped").Inc()
		return
	}
	s.shared.WithLabelValues("published").Inc()
}

// receive applies another replica's placement.
func (s *Sync) receive(msg *nats.Msg) {
	model, err := modelOf(strings.TrimPrefix(msg.Subject, s.opts.SubjectPrefix+"."))
	if err == nil {
		var worker string
		var hashes []uint64
		if worker, hashes, err = decode(msg.Data); err == nil {
			peer := msg.Header.Get(ReplicaHeader)
			switch s.places.admit(peer, len(hashes), time.Now()) {
			case admitted:
			case brokeBound:
				s.peerLog.Warn("a peer replica broke its placement rate bound; ignoring its placements for the backoff",
					"peer", peer, "hashes", len(hashes), "rate", s.opts.Limits.PeerHashRate, "burst", s.opts.Limits.PeerHashBurst, "backoff", s.opts.Limits.Backoff)
				return
			default:
				return // counted in kvrelay_gateway_nats_peer_limited_total
			}
			err = s.target.ApplyPlacement(model, peer, worker, hashes)
		}
	}
	if err != nil {
		s.shared.WithLabelValues("rejected").Inc()
		s.log.Debug("placement from another replica rejected", "subject", msg.Subject, "err", err)
		return
	}
	s.shared.WithLabelValues("received").Inc()
}

// Flush waits until the server has every placement published so far (for
// tests and benchmarks).
func (s *Sync) Flush(timeout time.Duration) error {
	return s.nc.FlushTimeout(timeout)
}

// Close unsubscribes, closes the connection and unregisters the metrics.
func (s *Sync) Close() {
	s.nc.Close()
	if s.load != nil {
		s.load.close()
	}
	for _, c := range s.regd {
		s.opts.Registerer.Unregister(c)
	}
	s.regd = nil
}
