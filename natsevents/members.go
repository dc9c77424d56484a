package natsevents

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrelay/kvrelay/internal/logthrottle"
	"github.com/kvrelay/kvrelay/internal/natsconn"
)

// Members: a relay started with a member (SinkOptions.Member, kvrelay serve
// --nats-member) says in every announcement how gateways should route to
// its engine, so an engine joins the fleet by starting its sidecar. The
// member rides in a header of the announcement, so the announcement's
// payload, and every gateway that reads only it, is unchanged. A gateway
// (kvrelay gateway --workers-from-nats) follows them with a MemberWatcher:
// a sink heard with a member is a member until it is silent for
// LeaveAfter.

// MemberHeader is the announcement header holding the member.
const MemberHeader = "Kvrelay-Member"

// maxMemberSpec bounds a member's text (an address and two options).
const maxMemberSpec = 1024

// DefaultLeaveIntervals is how many of a sink's announced intervals a
// member may be silent before it leaves: longer than the sink's silence
// bound (DefaultSilentIntervals), so a relay's resync or restart, which
// pauses its announcements for a few seconds, does not drop its worker's
// index.
const DefaultLeaveIntervals = 10

// Members tied to the stream (issue 29). Anyone who can publish on
// <prefix>-alive.<token> could otherwise add a worker pointing anywhere,
// or re-point a real one. So a MemberWatcher takes a member only once the
// worker's stream bears its announcement out, as a Source checks a sink's
// (streamCheck.verify): the stream's newest message under the worker's
// token is of the announced incarnation and names the announced member
// (the sink stamps both on every message it stores, and stores a marker
// before it announces, sink.go), and the announced sequence is one of the
// worker's messages. That is checked when a worker joins and when its
// announced member changes; until it holds, nothing changes (a known
// member keeps its member, and its clock runs on). Announcements that
// repeat a member's member keep it a member without asking the stream
// again (one JetStream look-up per join, not one per announcement). A
// refused announcement is counted in
// kvrelay_gateway_members_refused_total{reason} and logged at a limited
// rate. While the stream cannot be asked (JetStream unreachable), nobody
// joins or changes member, and the members stay as long as their relays
// announce: a JetStream outage, or a relay's restart during one, drops
// no worker. Not stopped: announcements repeating a member's member (a
// replay, or a made-up incarnation) keep it a member after its relay
// stopped, pointing where it did; NATS's permissions stop that.

// MemberOptions configures a MemberWatcher.
type MemberOptions struct {
	// URL is the NATS server list; Stream (DefaultStream) and
	// SubjectPrefix (DefaultSubjectPrefix) the relays' events stream, the
	// same as the relays'.
	URL           string
	Stream        string
	SubjectPrefix string
	// LeaveAfter is how long a member may be silent; 0 =
	// DefaultLeaveIntervals of its announced interval.
	LeaveAfter time.Duration
	// MaxMembers bounds the members kept; announcements of more are
	// ignored (and logged) until some leave. 0 = 10,000.
	MaxMembers int
	// OnChange receives the members' specs, sorted, whenever they change.
	// It is called from one goroutine at a time.
	OnChange    func(specs []string)
	NATSOptions []nats.Option
	Registerer  prometheus.Registerer
	Logger      *slog.Logger
}

type heardMember struct {
	spec  string
	heard time.Time
	every time.Duration
}

// memberClaim is an announcement waiting to be checked against the stream.
type memberClaim struct {
	spec string
	a    announcement
}

// Reasons of kvrelay_gateway_members_refused_total besides the
// verifier's (mismatchIncarnation, mismatchMember, mismatchSequence,
// mismatchNoMessage, mismatchUnverifiable, mismatchOverflow).
const (
	refusedUndecodable = "undecodable"
	refusedTooLong     = "too_long"
	refusedFull        = "full"
)

var memberRefusals = []string{mismatchIncarnation, mismatchMember, mismatchSequence, mismatchNoMessage,
	mismatchUnverifiable, mismatchOverflow, refusedUndecodable, refusedTooLong, refusedFull}

// MemberWatcher follows the relays' member announcements.
type MemberWatcher struct {
	opts    MemberOptions
	nc      *nats.Conn
	sub     *nats.Subscription
	log     *slog.Logger
	peerLog *slog.Logger // log throttled, for what announcements drive
	now     func() time.Time
	check   *streamCheck
	refused *prometheus.CounterVec // by reason: no sink label, forged tokens make no series
	claims  *claimQueue[memberClaim]

	mu      sync.Mutex
	members map[string]heardMember // by worker token
	full    bool                   // MaxMembers reached, logged
	changed chan struct{}
	last    []string // what OnChange was last given
	// reconnects is the connection's reconnect count at the last look.
	reconnects uint64
}

// WatchMembers connects and subscribes to the announcements; Run checks
// them and delivers the changes. It does not wait for the server.
func WatchMembers(opts MemberOptions) (*MemberWatcher, error) {
	if opts.OnChange == nil {
		return nil, errors.New("natsevents: WatchMembers needs OnChange")
	}
	var err error
	if opts.Stream, opts.SubjectPrefix, err = streamDefaults(opts.Stream, opts.SubjectPrefix); err != nil {
		return nil, err
	}
	if opts.MaxMembers <= 0 {
		opts.MaxMembers = 10000
	}
	if opts.Logger == nil {
		opts.Logger = slog.New(slog.DiscardHandler)
	}
	w := &MemberWatcher{opts: opts, log: opts.Logger, peerLog: logthrottle.Wrap(opts.Logger), now: time.Now,
		members: map[string]heardMember{}, claims: newClaimQueue[memberClaim](), changed: make(chan struct{}, 1),
		refused: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvrelay_gateway_members_refused_total",
			Help: "Member announcements not taken (--workers-from-nats), by reason: incarnation, member, sequence, no_message (the worker's stream does not bear the announcement out: its newest message is of another incarnation or names another member, the announced sequence is not the worker's, the stream holds nothing of the worker), unverifiable (the stream could not be asked), overflow (too many waiting to be checked), undecodable, too_long (a member over 1024 bytes), full (--max-workers members already)."},
			[]string{"reason"})}
	for _, r := range memberRefusals {
		w.refused.WithLabelValues(r)
	}
	if opts.Registerer != nil {
		if err := opts.Registerer.Register(w.refused); err != nil {
			return nil, fmt.Errorf("natsevents: %w", err)
		}
	}
	nopts := append([]nats.Option{
		nats.ReconnectHandler(func(*nats.Conn) { w.reconnected() }),
	}, opts.NATSOptions...)
	nc, err := natsconn.Connect(opts.URL, "kvrelay-gateway-members", time.Second, w.log, nopts...)
	if err != nil {
		return nil, fmt.Errorf("natsevents: %w", err)
	}
	w.nc = nc
	js, err := jetstream.New(nc)
	if err != nil {
		nc.Close()
		return nil, fmt.Errorf("natsevents: %w", err)
	}
	w.check = newStreamCheck(js, opts.Stream, opts.SubjectPrefix)
	if w.sub, err = nc.Subscribe(aliveFilter(opts.SubjectPrefix), w.handle); err != nil {
		nc.Close()
		return nil, fmt.Errorf("natsevents: subscribe: %w", err)
	}
	return w, nil
}

// Close ends the subscription and the connection (after Run returned).
func (w *MemberWatcher) Close() { w.nc.Close() }

// handle takes one announcement; one without a member (a relay not
// announcing one, or from before members) is not a member. One repeating
// a member's checked incarnation and member restarts its clock; any other
// waits for the stream's check (verify).
func (w *MemberWatcher) handle(m *nats.Msg) {
	spec := m.Header.Get(MemberHeader)
	if spec == "" {
		return
	}
	a, err := decodeAnnouncement(m.Data)
	if err != nil {
		w.refuse(refusedUndecodable, "undecodable member announcement; ignored", "subject", m.Subject, "err", err)
		return
	}
	if len(spec) > maxMemberSpec {
		w.refuse(refusedTooLong, "member announcement over the size bound; ignored", "subject", m.Subject, "bytes", len(spec))
		return
	}
	token := m.Subject[strings.LastIndexByte(m.Subject, '.')+1:]
	w.mu.Lock()
	old, known := w.members[token]
	if known && old.spec == spec {
		old.heard, old.every = w.now(), a.Every
		w.members[token] = old
		w.mu.Unlock()
		return
	}
	if !known && len(w.members) >= w.opts.MaxMembers {
		first := !w.full
		w.full = true
		w.mu.Unlock()
		w.refused.WithLabelValues(refusedFull).Inc()
		if first {
			w.log.Error("more relays announce members than the cap; the others are ignored until some leave", "cap", w.opts.MaxMembers)
		}
		return
	}
	w.mu.Unlock()
	if !w.claims.offer(token, memberClaim{spec: spec, a: a}) {
		w.refuse(mismatchOverflow, "too many member announcements waiting to be checked; ignored", "max", maxPendingClaims)
	}
}

// refuse counts and logs (at a limited rate) an announcement not taken.
func (w *MemberWatcher) refuse(reason, msg string, args ...any) {
	w.refused.WithLabelValues(reason).Inc()
	w.peerLog.Warn(msg, append(args, "reason", reason)...)
}

// verify checks the waiting announcements against the stream until ctx
// ends, in rounds at most every verifyEvery (as a Source's).
func (w *MemberWatcher) verify(ctx context.Context) {
	w.claims.run(ctx, func(ctx context.Context, token string, c memberClaim) (string, error) {
		return w.check.verify(ctx, token, c.a, &c.spec)
	}, func(token string, c memberClaim, reason string, err error) bool {
		w.settle(token, c, reason, err)
		// The stream cannot be asked: one look-up per round while it
		// lasts, however many wait (their relays announce again).
		return reason != mismatchUnverifiable
	})
}

// settle applies the check of token's claim c.
func (w *MemberWatcher) settle(token string, c memberClaim, reason string, err error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	old, known := w.members[token]
	switch reason {
	case "":
		if !known && len(w.members) >= w.opts.MaxMembers {
			w.refused.WithLabelValues(refusedFull).Inc()
			return
		}
		w.members[token] = heardMember{spec: c.spec, heard: w.now(), every: c.a.Every}
		if !known || old.spec != c.spec {
			w.log.Info("a relay's member announcement is borne out by its stream; the member joins", "sink", token, "member", c.spec, "incarnation", incarnationText(c.a.Incarnation))
			w.signal()
		}
		return
	case mismatchNotYet:
		return // its next announcement is checked
	}
	w.refused.WithLabelValues(reason).Inc()
	w.peerLog.Warn("a member announcement its worker's stream does not bear out; ignored", "sink", token, "member", c.spec, "reason", reason,
		"incarnation", incarnationText(c.a.Incarnation), "last_stream_sequence", c.a.LastSeq, "err", err)
}

func (w *MemberWatcher) signal() {
	select {
	case w.changed <- struct{}{}:
	default:
	}
}

// reconnected restarts every member's clock: announcements missed while
// this gateway was cut off say nothing about the relays.
func (w *MemberWatcher) reconnected() {
	w.mu.Lock()
	defer w.mu.Unlock()
	now := w.now()
	for t, m := range w.members {
		m.heard = now
		w.members[t] = m
	}
}

// Run checks the announcements and delivers the members to OnChange until
// ctx ends: at each change, and when a member falls silent (checked every
// quarter second).
func (w *MemberWatcher) Run(ctx context.Context) {
	vctx, stop := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() { defer close(done); w.verify(vctx) }()
	defer func() { stop(); <-done }()
	t := time.NewTicker(250 * time.Millisecond)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-w.changed:
		case <-t.C:
		}
		if specs, ok := w.current(); ok {
			w.opts.OnChange(specs)
		}
	}
}

// current expires silent members and returns the specs if they changed
// since the last call.
func (w *MemberWatcher) current() ([]string, bool) {
	w.mu.Lock()
	defer w.mu.Unlock()
	now := w.now()
	connected := w.nc.IsConnected()
	if r := w.nc.Stats().Reconnects; r != w.reconnects {
		// Reconnected since the last look, its handler perhaps not run
		// yet: silence from before is this gateway's, not the relays'.
		w.reconnects = r
		for t, m := range w.members {
			m.heard = now
			w.members[t] = m
		}
	}
	specs := make([]string, 0, len(w.members))
	for t, m := range w.members {
		bound := w.opts.LeaveAfter
		if bound <= 0 {
			bound = DefaultLeaveIntervals * m.every
		}
		// While this gateway is cut off from NATS, silence is its own.
		if connected && now.Sub(m.heard) > bound {
			w.log.Info("a member's relay stopped announcing; it leaves", "member", m.spec, "silent_for", now.Sub(m.heard).Round(time.Millisecond))
			delete(w.members, t)
			w.full = false
			continue
		}
		specs = append(specs, m.spec)
	}
	slices.Sort(specs)
	specs = slices.Compact(specs) // two sinks naming one worker: one member
	if slices.Equal(specs, w.last) && w.last != nil {
		return nil, false
	}
	w.last = specs
	return specs, true
}

// MemberMark is the marker a sink of worker with member (and incarnation)
// stores on the events stream before it announces (sink.go): for a program
// that stands in for a relay, such as a benchmark of the gateway's
// membership or a demo. Store it with JetStream, then announce with
// MemberAnnouncement and the stream sequence it was stored at.
func MemberMark(subjectPrefix, worker, member string, incarnation uint64) *nats.Msg {
	if subjectPrefix == "" {
		subjectPrefix = DefaultSubjectPrefix
	}
	msg := nats.NewMsg(sinkMarkSubject(subjectPrefix, WorkerToken(worker)))
	msg.Header.Set(IncarnationHeader, incarnationText(incarnation))
	msg.Header.Set(MemberHeader, member)
	return msg
}

// MemberAnnouncement is the announcement a sink of worker with member
// sends every interval (one of its first pass), its incarnation and the
// stream sequence of its newest stored message (see MemberMark).
func MemberAnnouncement(subjectPrefix, worker, member string, incarnation, lastSeq uint64, every time.Duration) *nats.Msg {
	if subjectPrefix == "" {
		subjectPrefix = DefaultSubjectPrefix
	}
	return &nats.Msg{
		Subject: aliveSubject(subjectPrefix, WorkerToken(worker)),
		Data:    encodeAnnouncement(announcement{Incarnation: incarnation, Pass: 1, LastSeq: lastSeq, Every: every}),
		Header:  nats.Header{MemberHeader: []string{member}},
	}
}
