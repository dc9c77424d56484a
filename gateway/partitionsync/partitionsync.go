// Package partitionsync connects the replicas of a partitioned gateway
// tier over NATS (`kvrelay gateway --nats URL --partitions P --partition
// p`; issue 31.3, docs/partitioned-tier.md).
//
// Each replica of partition p of a P-partition tier answers lookups on
// <prefix>.lookup.<P>.<p> (default prefix kvrelay.tier) in the queue group
// kvrelay-tier-<P>-<p>, so the k replicas of one partition share the
// questions and one answers each, and replicas of another P (a tier being
// replaced) never take them. Queries and answers carry P as well; a
// mismatch is refused and counted. A route on any replica scatters the request's prefix hashes to
// every other partition with a reply subject of its own, looks its own
// partition up meanwhile, and waits for the answers until its deadline
// (Options.Deadline); what it merges is gateway.Gateway's business
// (package gateway, partition.go). A partition that does not answer in
// time, or that NATS reports has no responder, is counted in
// kvrelay_gateway_scatter_missing_total{partition} and logged (a few
// lines a minute), and the route goes on without it.
//
// A replica joins its partition's queue group only once its own workers'
// indexes are whole (gateway.Gateway.CatchingUp is empty: each worker's
// stream delivered its state once, or the worker is out of reach), or
// Options.JoinWait has passed, whichever comes first: with k replicas of a
// partition, a restarted one would otherwise answer some of the
// partition's lookups from a partial index while it catches up, and those
// answers are not counted missing. It holds back only while another
// replica answers the partition (a request to <prefix>.present.<P>.<p>
// has a responder): alone, it joins at once, as a partial answer leaves
// out fewer workers than none. kvrelay_gateway_partition_answering says
// whether it answers; kvrelay_gateway_partition_joins_total{how} counts
// how it came to (caught_up; alone; timed_out, with the workers still
// catching up logged by name).
//
// The wire form is versioned and bounded (wire.go); a query or answer that
// breaks a bound is refused with a clear error and counted, never
// allocated from.
package partitionsync

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrelay/kvrelay/gateway"
	"github.com/kvrelay/kvrelay/internal/logthrottle"
	"github.com/kvrelay/kvrelay/internal/natsconn"
	"github.com/kvrelay/kvrelay/internal/natslog"
)

// Defaults.
const (
	DefaultSubjectPrefix = "kvrelay.tier"
	// DefaultDeadline is how long a route waits for the other partitions.
	// On a quiet host a scatter to 16 partitions takes under a millisecond
	// at p99 (docs/partitioned-tier.md); the deadline bounds the tail when a
	// partition's replicas are slow or gone.
	DefaultDeadline = 50 * time.Millisecond
	// DefaultResponders is how many lookups one replica answers at once.
	DefaultResponders = 2
	// DefaultJoinWait bounds how long a started replica holds back its
	// answers while its own workers' indexes fill. A worker whose relay
	// cannot be reached stops the wait within its subscribe deadline (2 s
	// by default); one that is reached but sends its state slowly (a
	// snapshot of millions of blocks takes seconds) is waited for up to
	// this, and the partition is answered anyway after it.
	DefaultJoinWait = 30 * time.Second
	// joinPoll is how often a replica holding back checks its workers;
	// probeEvery how often it asks whether another replica answers the
	// partition meanwhile.
	joinPoll   = 20 * time.Millisecond
	probeEvery = 250 * time.Millisecond
	// PendingMsgs and PendingBytes bound the queries a responder holds
	// unread; past them NATS drops them (the asker counts them missing).
	PendingMsgs  = 4096
	PendingBytes = 64 << 20
)

// Target answers this replica's partition's lookups (a *gateway.Gateway).
type Target interface {
	AnswerPartition(q gateway.PartitionQuery, dst *gateway.PartitionAnswer) error
	Partition() (own, count int)
}

// CatchingUp is a Target that tells which of its workers' indexes are not
// whole yet (gateway.Gateway.CatchingUp); a Tier answers for it only once
// none is, or Options.JoinWait has passed. A Target without it is
// answered for at once.
type CatchingUp interface {
	CatchingUp() []string
}

// Options configures a Tier.
type Options struct {
	// URL is the NATS server list (nats://host:4222, comma-separated).
	URL string
	// Name names the connection on the server.
	Name string
	// SubjectPrefix replaces DefaultSubjectPrefix, to keep tiers that share
	// a NATS server apart.
	SubjectPrefix string
	// Deadline is how long Scatter waits for the answers (0: DefaultDeadline).
	Deadline time.Duration
	// Responders is how many lookups this replica answers at once (0:
	// DefaultResponders).
	Responders int
	// ReconnectWait is the pause between reconnect attempts; 0 = 1 s.
	ReconnectWait time.Duration
	// JoinWait bounds how long this replica holds its partition's answers
	// back while its own workers' indexes fill and another replica
	// answers the partition (0: DefaultJoinWait; negative: it answers at
	// once).
	JoinWait time.Duration
	// Registerer receives kvrelay_gateway_scatter_seconds,
	// kvrelay_gateway_scatter_missing_total,
	// kvrelay_gateway_partition_lookups_total,
	// kvrelay_gateway_partition_answers_refused_total,
	// kvrelay_gateway_partition_answering and
	// kvrelay_gateway_partition_joins_total; nil = unregistered.
	Registerer prometheus.Registerer
	Logger     *slog.Logger
	// NATSOptions are added to the connection's options (TLS, credentials).
	NATSOptions []nats.Option
}

// Tier is one replica's side of the tier: its partition's responder and
// the scatter its routes use (gateway.Scatterer). Safe for concurrent use.
type Tier struct {
	opts       Options
	target     Target
	own, parts int
	nc         *nats.Conn
	subs       []*nats.Subscription
	replySub   *nats.Subscription
	inbox      string
	log, peer  *slog.Logger
	subjects   []string // per partition
	seconds    prometheus.Histogram
	missing    *prometheus.CounterVec // partition
	missingBy  []prometheus.Counter   // per partition
	lookups    *prometheus.CounterVec // result
	refused    *prometheus.CounterVec // reason
	answering  prometheus.Gauge
	joins      *prometheus.CounterVec // how
	regd       []prometheus.Collector
	joined     atomic.Bool     // the responders are subscribed
	ctx        context.Context // ended by Close: the join gives up
	cancel     context.CancelFunc
	joinDone   chan struct{} // closed when the join has subscribed or given up
	next       atomic.Uint64
	mu         sync.Mutex
	calls      map[uint64]chan reply
	queryBufs  sync.Pool
	closeOnce  sync.Once
}

// Start connects to opts.URL and answers target's partition. It does not
// wait for the server: while NATS is unreachable every other partition is
// missing from the routes, and the client reconnects on its own. Close
// ends it.
func Start(target Target, opts Options) (*Tier, error) {
	if target == nil {
		return nil, errors.New("partitionsync: nil target")
	}
	own, parts := target.Partition()
	if parts < 2 {
		return nil, fmt.Errorf("partitionsync: the gateway is not partitioned (%d partition)", parts)
	}
	if strings.TrimSpace(opts.URL) == "" {
		return nil, errors.New("partitionsync: empty NATS URL")
	}
	if opts.SubjectPrefix == "" {
		opts.SubjectPrefix = DefaultSubjectPrefix
	}
	if strings.ContainsAny(opts.SubjectPrefix, " *>") || strings.HasPrefix(opts.SubjectPrefix, ".") || strings.HasSuffix(opts.SubjectPrefix, ".") {
		return nil, fmt.Errorf("partitionsync: subject prefix %q: want dot-separated tokens without wildcards", opts.SubjectPrefix)
	}
	if opts.Deadline < 0 {
		return nil, fmt.Errorf("partitionsync: deadline must be ≥ 0, got %v", opts.Deadline)
	}
	if opts.Deadline == 0 {
		opts.Deadline = DefaultDeadline
	}
	if opts.Responders <= 0 {
		opts.Responders = DefaultResponders
	}
	if opts.ReconnectWait <= 0 {
		opts.ReconnectWait = time.Second
	}
	if opts.JoinWait == 0 {
		opts.JoinWait = DefaultJoinWait
	}
	if opts.Logger == nil {
		opts.Logger = slog.New(slog.DiscardHandler)
	}
	t := &Tier{
		opts: opts, target: target, own: own, parts: parts,
		log: opts.Logger, peer: logthrottle.Wrap(opts.Logger),
		calls:    map[uint64]chan reply{},
		joinDone: make(chan struct{}),
		answering: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "kvrelay_gateway_partition_answering",
			Help: "1 when this replica answers its partition's lookups (it is in the partition's queue group), 0 while it holds them back until its own workers' indexes are whole (at most --partition-join-wait).",
		}),
		joins: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvrelay_gateway_partition_joins_total",
			Help: "Times this replica began answering its partition's lookups, by how: caught_up (every own worker's stream delivered its state once, or is out of reach), alone (workers still catching up, but no other replica answers the partition), timed_out (the join wait passed with workers still catching up; they are logged) or no_wait (the join wait is off: --partition-join-wait 0).",
		}, []string{"how"}),
		seconds: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "kvrelay_gateway_scatter_seconds",
			Help:    "Wall time of a partitioned route's scatter: from sending the query to the other partitions until the last answer (or the deadline), the replica's own lookup included.",
			Buckets: []float64{50e-6, 100e-6, 200e-6, 400e-6, 700e-6, 1e-3, 2e-3, 4e-3, 8e-3, 16e-3, 32e-3, 64e-3, 128e-3, 256e-3, 1},
		}),
		missing: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvrelay_gateway_scatter_missing_total",
			Help: "Partitions a route went on without, by partition: no answer within the deadline, no responder (its replicas are all gone), NATS unreachable, or an answer refused. Its workers were at zero overlap for that route.",
		}, []string{"partition"}),
		lookups: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvrelay_gateway_partition_lookups_total",
			Help: "Lookups this replica answered for the other partitions, by result: answered, unknown_model, refused (a malformed query), partition_count (asked by a tier of another partition count).",
		}, []string{"result"}),
		refused: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvrelay_gateway_partition_answers_refused_total",
			Help: "Answers to this replica's lookups it refused, by reason: malformed, partition_count (from a tier of another partition count), not_asked (to a partition not asked, or answered twice), reply_subject (claiming another partition than the one its reply subject asked). The partition is then missing from that route.",
		}, []string{"reason"}),
	}
	for p := range parts {
		t.subjects = append(t.subjects, LookupSubject(opts.SubjectPrefix, parts, p))
		t.missingBy = append(t.missingBy, t.missing.WithLabelValues(strconv.Itoa(p)))
	}
	for _, r := range []string{"answered", "unknown_model", "refused", "partition_count"} {
		t.lookups.WithLabelValues(r)
	}
	for _, r := range refusedReasons {
		t.refused.WithLabelValues(r)
	}
	for _, h := range []string{"caught_up", "alone", "timed_out", "no_wait"} {
		t.joins.WithLabelValues(h)
	}
	t.ctx, t.cancel = context.WithCancel(context.Background())
	t.queryBufs.New = func() any { return new([]byte) }
	nopts := []nats.Option{
		// No buffering while disconnected: a query that cannot go is a
		// missing partition now, not an answer later.
		nats.ReconnectBufSize(-1),
		nats.ConnectHandler(func(*nats.Conn) {
			t.log.Info("nats connected: scattering to the partitions", "partition", own, "partitions", parts)
		}),
		nats.ReconnectHandler(func(*nats.Conn) { t.log.Info("nats reconnected: scattering to the partitions again") }),
		nats.DisconnectErrHandler(func(_ *nats.Conn, err error) {
			t.log.Warn("nats disconnected: routes see only this partition's workers until it reconnects", "err", natslog.RedactError(err))
		}),
	}
	nc, err := natsconn.Connect(opts.URL, opts.Name, opts.ReconnectWait, t.log, append(nopts, opts.NATSOptions...)...)
	if err != nil {
		return nil, fmt.Errorf("partitionsync: %w", err)
	}
	t.nc = nc
	// Answers come to <inbox>.<route id>.<partition asked>.
	t.inbox = nc.NewInbox()
	if t.replySub, err = nc.Subscribe(t.inbox+".*.*", t.reply); err != nil {
		nc.Close()
		return nil, fmt.Errorf("partitionsync: subscribe %s: %w", t.inbox, err)
	}
	_ = t.replySub.SetPendingLimits(-1, PendingBytes)
	catching, _ := target.(CatchingUp)
	if catching == nil || opts.JoinWait < 0 {
		if err := t.subscribe(); err != nil {
			nc.Close()
			return nil, err
		}
		t.joins.WithLabelValues("no_wait").Inc()
		close(t.joinDone)
	} else {
		go t.join(catching, time.Now())
	}
	if opts.Registerer != nil {
		for _, c := range []prometheus.Collector{t.seconds, t.missing, t.lookups, t.refused, t.answering, t.joins} {
			if err := opts.Registerer.Register(c); err != nil {
				t.Close()
				return nil, fmt.Errorf("partitionsync: %w", err)
			}
			t.regd = append(t.regd, c)
		}
	}
	return t, nil
}

// LookupSubject is partition p's lookup subject under prefix in a tier of
// parts partitions.
func LookupSubject(prefix string, parts, p int) string {
	return prefix + ".lookup." + strconv.Itoa(parts) + "." + strconv.Itoa(p)
}

// QueueGroup is partition p's queue group in a tier of parts partitions:
// its replicas share the lookups.
func QueueGroup(parts, p int) string {
	return "kvrelay-tier-" + strconv.Itoa(parts) + "-" + strconv.Itoa(p)
}

// The reasons of kvrelay_gateway_partition_answers_refused_total.
var refusedReasons = []string{"malformed", "partition_count", "not_asked", "reply_subject"}

// subscribe joins the partition's queue group with opts.Responders
// responders, and its presence subject, and waits (a second at most) for
// the server to know them before it says it answers.
func (t *Tier) subscribe() error {
	for range t.opts.Responders {
		sub, err := t.nc.QueueSubscribe(t.subjects[t.own], QueueGroup(t.parts, t.own), t.answerer())
		if err != nil {
			return fmt.Errorf("partitionsync: subscribe %s: %w", t.subjects[t.own], err)
		}
		_ = sub.SetPendingLimits(PendingMsgs, PendingBytes)
		t.subs = append(t.subs, sub)
	}
	present := PresenceSubject(t.opts.SubjectPrefix, t.parts, t.own)
	sub, err := t.nc.QueueSubscribe(present, QueueGroup(t.parts, t.own), func(m *nats.Msg) {
		if m.Reply != "" {
			_ = m.Respond(nil)
		}
	})
	if err != nil {
		return fmt.Errorf("partitionsync: subscribe %s: %w", present, err)
	}
	t.subs = append(t.subs, sub)
	// Disconnected, the subscriptions go out on reconnect: no need to wait.
	_ = t.nc.FlushTimeout(time.Second)
	t.joined.Store(true)
	t.answering.Set(1)
	return nil
}

// PresenceSubject is where the replicas answering partition p of a tier
// of parts partitions answer an empty request (in its queue group), so
// that a replica holding back learns whether another one answers the
// partition meanwhile.
func PresenceSubject(prefix string, parts, p int) string {
	return prefix + ".present." + strconv.Itoa(parts) + "." + strconv.Itoa(p)
}

// alone reports whether the server says no replica answers this
// replica's partition (a request to its presence subject with no
// responder); false when it cannot tell (NATS unreachable, no answer in
// a second).
func (t *Tier) alone() bool {
	ctx, cancel := context.WithTimeout(t.ctx, time.Second)
	defer cancel()
	_, err := t.nc.RequestWithContext(ctx, PresenceSubject(t.opts.SubjectPrefix, t.parts, t.own), nil)
	return errors.Is(err, nats.ErrNoResponders)
}

// maxLoggedWorkers bounds the worker names a join's log line lists.
const maxLoggedWorkers = 10

// join holds the partition's answers back until target's workers are
// caught up or opts.JoinWait has passed since start, then subscribes. It
// holds back only while another replica answers the partition: when none
// does (the first replica of a new tier, or the other one down too) it
// joins at once, since an answer from a partial index leaves out fewer
// of the partition's workers than no answer does. It gives up when the
// Tier is closed.
func (t *Tier) join(target CatchingUp, start time.Time) {
	defer close(t.joinDone)
	tick := time.NewTicker(joinPoll)
	defer tick.Stop()
	bound := time.NewTimer(t.opts.JoinWait)
	defer bound.Stop()
	behind, expired, alone := target.CatchingUp(), false, false
	var probed time.Time
	for len(behind) > 0 && !expired && !alone {
		if time.Since(probed) >= probeEvery {
			if alone = t.alone(); alone {
				break
			}
			probed = time.Now()
		}
		select {
		case <-t.ctx.Done():
			return
		case <-tick.C:
			behind = target.CatchingUp()
		case <-bound.C:
			expired = true
		}
	}
	if t.ctx.Err() != nil {
		return
	}
	how := "caught_up"
	switch {
	case len(behind) == 0:
	case alone:
		how = "alone"
	default:
		how = "timed_out"
	}
	if err := t.subscribe(); err != nil {
		// Only a closed connection fails a subscription (the server's
		// permissions deny it asynchronously): the Tier is closing.
		t.log.Error("partition lookups not answered: cannot subscribe", "partition", t.own, "err", natslog.RedactError(err))
		return
	}
	t.joins.WithLabelValues(how).Inc()
	took := time.Since(start).Round(time.Millisecond)
	listed := behind[:min(len(behind), maxLoggedWorkers)]
	switch how {
	case "caught_up":
		t.log.Info("answering the partition's lookups: every own worker's index is whole", "partition", t.own, "waited", took)
	case "alone":
		t.log.Info("answering the partition's lookups before every own worker's index is whole: no other replica answers the partition, and a partial answer leaves out fewer workers than none",
			"partition", t.own, "waited", took, "catching_up", len(behind), "workers", listed)
	default:
		t.log.Warn("answering the partition's lookups although some own workers' indexes are not whole yet: their blocks are missing from this replica's answers until they catch up",
			"partition", t.own, "waited", took, "catching_up", len(behind), "workers", listed)
	}
}

// A Tier is the gateway's Scatterer and tells it whether it answers
// (/readyz reads it through gateway.Gateway.AnsweringPartition).
var (
	_ gateway.Scatterer         = (*Tier)(nil)
	_ gateway.PartitionAnswerer = (*Tier)(nil)
)

// Answering reports whether this replica answers its partition's lookups
// (gateway.PartitionAnswerer): false until its own workers' indexes are
// whole, no other replica answers the partition, or Options.JoinWait has
// passed.
func (t *Tier) Answering() bool { return t.joined.Load() }

// Close unsubscribes, closes the connection and unregisters the metrics.
func (t *Tier) Close() {
	t.closeOnce.Do(func() {
		t.cancel()
		<-t.joinDone
		t.nc.Close()
		for _, c := range t.regd {
			t.opts.Registerer.Unregister(c)
		}
	})
}

// Connected reports whether the NATS connection is up.
func (t *Tier) Connected() bool { return t.nc.IsConnected() }

// Ready reports whether this replica's responders and reply inbox are
// known to the server (a round trip to it), so that it can answer and be
// answered.
func (t *Tier) Ready() bool { return t.nc.FlushTimeout(time.Second) == nil }

// answerer is one responder's handler, with its own buffers (a
// subscription's handler runs one message at a time).
func (t *Tier) answerer() nats.MsgHandler {
	var (
		q   gateway.PartitionQuery
		a   gateway.PartitionAnswer
		out []byte
	)
	return func(msg *nats.Msg) {
		if msg.Reply == "" {
			return
		}
		status := byte(statusAnswered)
		if parts, err := decodeQuery(msg.Data, &q); err != nil {
			status = statusRefused
			t.lookups.WithLabelValues("refused").Inc()
			t.peer.Warn("partition lookup refused", "err", err, "bytes", len(msg.Data))
			a.Reset()
			a.Partition = t.own
		} else if parts != t.parts {
			// Only a misconfigured server routes it here (the subject
			// carries P); the asker refuses the answer's count too.
			status = statusRefused
			t.lookups.WithLabelValues("partition_count").Inc()
			t.peer.Warn("partition lookup refused: asked by a tier of another partition count", "asker_partitions", parts, "partitions", t.parts)
			a.Reset()
			a.Partition = t.own
		} else if err := t.target.AnswerPartition(q, &a); err != nil {
			status = statusRefused
			result := "refused"
			if errors.Is(err, gateway.ErrUnknownModel) {
				status, result = statusUnknownModel, "unknown_model"
			}
			t.lookups.WithLabelValues(result).Inc()
			t.peer.Warn("partition lookup not answered", "err", err)
			a.Reset()
			a.Partition = t.own
		} else {
			t.lookups.WithLabelValues("answered").Inc()
		}
		out = appendAnswer(out[:0], t.parts, status, &a)
		if err := msg.Respond(out); err != nil {
			t.peer.Warn("partition lookup answer not sent", "err", natslog.RedactError(err))
		}
		// Names of this route's workers: not kept past the answer.
		clear(q.Prefix)
		a.Reset()
	}
}

// reply is an answer (or NATS's no-responder status) to the query sent to
// partition p.
type reply struct {
	p   int
	msg *nats.Msg
}

// reply hands an answer to the Scatter waiting for it.
func (t *Tier) reply(msg *nats.Msg) {
	// <inbox>.<route id, base 36>.<partition, base 10>
	rest, ps, ok := cutLast(msg.Subject)
	if !ok {
		return
	}
	_, ids, ok := cutLast(rest)
	if !ok {
		return
	}
	id, err := strconv.ParseUint(ids, 36, 64)
	if err != nil {
		return
	}
	p, err := strconv.Atoi(ps)
	if err != nil || p < 0 || p >= t.parts {
		t.refused.WithLabelValues("not_asked").Inc()
		return
	}
	t.mu.Lock()
	ch := t.calls[id]
	t.mu.Unlock()
	if ch == nil {
		return // late: its route went on without it
	}
	select {
	case ch <- reply{p, msg}:
	default: // more answers than partitions: forged or duplicated
		t.refused.WithLabelValues("not_asked").Inc()
	}
}

// cutLast splits s at its last dot.
func cutLast(s string) (before, after string, ok bool) {
	i := strings.LastIndexByte(s, '.')
	if i < 0 {
		return "", "", false
	}
	return s[:i], s[i+1:], true
}

// A partition's state in one Scatter.
const (
	notSent     = iota // the query could not be sent
	waiting            // asked, no answer yet
	answered           // answered, and the answer taken
	noResponder        // NATS said no replica of it is subscribed
	refusedAns         // its answer was refused (counted by reason)
	declined           // it answered that it could not look up
)

// Scatter sends q to every other partition, runs local, and returns the
// answers that came by the deadline (gateway.Scatterer). Each partition
// is asked with its own reply subject, <inbox>.<id>.<p>, and an answer
// must declare the partition its subject asked: a replica of partition q
// cannot pass its answer off as another partition's.
func (t *Tier) Scatter(q gateway.PartitionQuery, local func()) []gateway.PartitionAnswer {
	start := time.Now()
	if len(q.Prefix) > MaxHashes {
		q.Prefix = q.Prefix[:MaxHashes]
	}
	bp := t.queryBufs.Get().(*[]byte)
	*bp = appendQuery((*bp)[:0], t.parts, q)
	id := t.next.Add(1)
	ch := make(chan reply, t.parts)
	t.mu.Lock()
	t.calls[id] = ch
	t.mu.Unlock()
	replyPrefix := t.inbox + "." + strconv.FormatUint(id, 36) + "."
	state := make([]byte, t.parts)
	pending := 0
	var sendErr error
	for p := range t.parts {
		if p == t.own {
			continue
		}
		if err := t.nc.PublishRequest(t.subjects[p], replyPrefix+strconv.Itoa(p), *bp); err != nil {
			sendErr = err
			continue
		}
		state[p] = waiting
		pending++
	}
	t.queryBufs.Put(bp)
	local()
	answers := make([]gateway.PartitionAnswer, 0, pending)
	var timer *time.Timer
	for pending > 0 {
		var r reply
		select {
		case r = <-ch:
		default:
			if timer == nil {
				timer = time.NewTimer(t.opts.Deadline - time.Since(start))
				defer timer.Stop()
			}
			select {
			case r = <-ch:
			case <-timer.C:
			}
		}
		if r.msg == nil {
			break // the deadline
		}
		p, msg := r.p, r.msg
		if state[p] != waiting {
			t.refused.WithLabelValues("not_asked").Inc()
			t.peer.Warn("partition answer refused: to a partition not asked, or answered already", "partition", p)
			continue
		}
		pending--
		if len(msg.Data) == 0 && msg.Header.Get("Status") == "503" {
			state[p] = noResponder
			continue
		}
		var a gateway.PartitionAnswer
		status, parts, err := decodeAnswer(msg.Data, &a)
		state[p] = refusedAns
		switch {
		case err != nil:
			t.refused.WithLabelValues("malformed").Inc()
			t.peer.Warn("partition answer refused", "partition", p, "err", err, "bytes", len(msg.Data))
			continue
		case parts != t.parts:
			t.refused.WithLabelValues("partition_count").Inc()
			t.peer.Warn("partition answer refused: from a tier of another partition count", "partition", p, "answer_partitions", parts, "partitions", t.parts)
			continue
		case a.Partition != p:
			t.refused.WithLabelValues("reply_subject").Inc()
			t.peer.Warn("partition answer refused: it claims another partition than the one asked", "partition", p, "claimed", a.Partition)
			continue
		}
		if status != statusAnswered {
			state[p] = declined
			t.peer.Warn("partition did not answer the lookup", "partition", p, "status", statusName(status), "model", q.Model)
			continue
		}
		state[p] = answered
		answers = append(answers, a)
	}
	t.mu.Lock()
	delete(t.calls, id)
	t.mu.Unlock()
	t.seconds.Observe(time.Since(start).Seconds())
	for p, s := range state {
		if p == t.own || s == answered {
			continue
		}
		t.missingBy[p].Inc()
		switch s {
		case notSent:
			t.peer.Warn("partition missing from the route: the query was not sent", "partition", p, "err", natslog.RedactError(sendErr))
		case noResponder:
			t.peer.Warn("partition missing from the route: no replica of it subscribed", "partition", p)
		case waiting:
			t.peer.Warn("partition missing from the route: no answer within the deadline", "partition", p, "deadline", t.opts.Deadline)
		default: // refused or declined, logged above
		}
	}
	return answers
}

func statusName(s byte) string {
	switch s {
	case statusUnknownModel:
		return "unknown_model"
	case statusRefused:
		return "refused"
	}
	return "answered"
}
