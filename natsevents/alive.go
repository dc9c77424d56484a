package natsevents

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrelay/kvrelay/internal/logthrottle"
)

// Sink liveness. A sink that goes silent while the gateway's own NATS
// connection stays up (its relay killed, its connection partitioned)
// leaves a JetStream stream that simply stops moving; without
// a signal a replica would keep following it and its index for that
// worker would go stale unnoticed. So each sink announces itself on core
// NATS every AliveEvery while a pass is publishing, and a source that has
// heard a worker's sink and then hears nothing for longer than the bound
// ends that worker's JetStream subscription and serves it from its gRPC
// stream (see Source). The announcements are not stored: they go to
// <prefix>-alive.<token>, which the stream's <prefix>.> does not capture
// (the prefix's last token differs: "events-alive" is not "events").

// DefaultAliveEvery is how often a sink announces itself.
const DefaultAliveEvery = time.Second

// DefaultSilentIntervals is how many of a sink's announced intervals a
// source lets pass without an announcement before it calls the sink silent.
const DefaultSilentIntervals = 3

// aliveSubject is where a worker's sink announces itself.
func aliveSubject(prefix, token string) string { return prefix + "-alive." + token }

// aliveFilter matches every worker's announcements.
func aliveFilter(prefix string) string { return prefix + "-alive.*" }

// announcement is one "I am alive" of a sink.
type announcement struct {
	// Incarnation is random per sink process: a new value is a restarted
	// relay (or sink).
	Incarnation uint64
	// Pass counts the sink's passes (resyncs) in this incarnation.
	Pass uint64
	// LastSeq is the stream sequence of the newest message the sink had
	// stored (0: none yet). A sink that announces while its engine works
	// but whose LastSeq does not move is alive but not publishing.
	LastSeq uint64
	// Every is the sink's announcement interval, so a source's bound
	// follows the sink's setting.
	Every time.Duration
}

// The message: a 4-byte magic with the format version, then the four
// numbers as big-endian uint64 (Every in milliseconds). Fixed size, so the
// decoder checks one length and allocates nothing.
const (
	aliveMagic = "KVA1"
	aliveSize  = len(aliveMagic) + 4*8
	// maxAliveEvery bounds a peer-declared interval, so that a bogus one
	// cannot make a silent sink look alive for days.
	maxAliveEvery = time.Minute
)

func encodeAnnouncement(a announcement) []byte {
	b := make([]byte, 0, aliveSize)
	b = append(b, aliveMagic...)
	b = binary.BigEndian.AppendUint64(b, a.Incarnation)
	b = binary.BigEndian.AppendUint64(b, a.Pass)
	b = binary.BigEndian.AppendUint64(b, a.LastSeq)
	b = binary.BigEndian.AppendUint64(b, uint64(a.Every/time.Millisecond))
	return b
}

func decodeAnnouncement(b []byte) (announcement, error) {
	if len(b) != aliveSize {
		return announcement{}, fmt.Errorf("sink announcement: %d bytes, want %d", len(b), aliveSize)
	}
	if string(b[:4]) != aliveMagic {
		return announcement{}, fmt.Errorf("sink announcement: magic %q, want %q", b[:4], aliveMagic)
	}
	b = b[4:]
	a := announcement{
		Incarnation: binary.BigEndian.Uint64(b[0:]),
		Pass:        binary.BigEndian.Uint64(b[8:]),
		LastSeq:     binary.BigEndian.Uint64(b[16:]),
	}
	ms := binary.BigEndian.Uint64(b[24:])
	if ms == 0 || ms > uint64(maxAliveEvery/time.Millisecond) {
		return announcement{}, fmt.Errorf("sink announcement: interval %d ms, want 1 to %d", ms, maxAliveEvery/time.Millisecond)
	}
	a.Every = time.Duration(ms) * time.Millisecond
	return a, nil
}

// sinkState is what a source knows of one worker's sink.
type sinkState struct {
	heard  time.Time // the last announcement (or the reconnect after it)
	last   announcement
	silent bool // reported silent, not heard since
	// silenced: found silent since the source last took it (takeSilence):
	// the snapshot object of then predates the silence and is not served.
	silenced bool
}

// aliveTracker keeps the last announcement of each worker's sink, by
// worker token.
type aliveTracker struct {
	silentAfter time.Duration // 0: DefaultSilentIntervals of the sink's interval
	now         func() time.Time
	log         *slog.Logger
	silences    *prometheus.CounterVec // by worker token
	sub         *nats.Subscription
	// verify, if set, checks an announcement against the worker's stream
	// (streamCheck.verify): the reason label of a mismatch, ""
	// when it holds. Announcements then wait in claims for the verifier
	// (runVerifier); unset, they are taken as they come (the tracker's
	// unit tests).
	verify     func(ctx context.Context, token string, a announcement) (reason string, err error)
	claims     *claimQueue[announcement]
	mismatched *prometheus.CounterVec // by sink token, reason
	checked    *prometheus.CounterVec // by sink token: borne out

	mu    sync.Mutex
	sinks map[string]*sinkState
	// peerLog is log throttled, for what announcements (anyone's who can
	// publish on the alive subjects) drive.
	peerLog *slog.Logger
}

func newAliveTracker(silentAfter time.Duration, log *slog.Logger) *aliveTracker {
	return &aliveTracker{
		silentAfter: silentAfter, now: time.Now, log: log, peerLog: logthrottle.Wrap(log), sinks: map[string]*sinkState{},
		claims: newClaimQueue[announcement](),
		silences: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvrelay_gateway_events_sink_silent_total",
			Help: "Times a worker's JetStream sink stopped announcing itself while this replica's NATS connection was up; the worker then follows its gRPC stream until the sink is back with a newer snapshot."},
			[]string{"worker"}),
		mismatched: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvrelay_gateway_events_announcements_mismatched_total",
			Help: "Sink announcements not taken because the worker's stream does not bear them out (reason: incarnation, not the stream's newest message's; sequence, not one of the worker's messages in the stream; no_message, the stream holds nothing of the sink; unverifiable, the stream could not be asked; overflow, too many waiting). sink is the worker token, or \"other\" for a sink the stream holds nothing of or was not asked about."},
			[]string{"sink", "reason"}),
		checked: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvrelay_gateway_events_announcements_checked_total",
			Help: "Sink announcements the worker's stream bore out (its incarnation the stream's newest message's, its sequence the worker's), by sink token."},
			[]string{"sink"}),
	}
}

// Announcements tied to the stream (issue 29). Anyone who can publish on
// <prefix>-alive.<token> could keep a dead sink trusted; so with a
// verifier, an announcement counts only when the worker's stream bears it
// out: its incarnation is the one the sink stamped (IncarnationHeader) on
// the stream's newest message of the worker, and its LastSeq is a
// sequence of the stream holding one of the worker's messages, at or
// below that newest one. A forged announcement for a sink that stopped
// (a made-up incarnation, or a sequence the stream does not hold for the
// worker) is counted in kvrelay_gateway_events_announcements_mismatched_total
// and does not restart the sink's clock, so the worker falls back to its
// gRPC stream within the silence bound. Not stopped: a verbatim replay of
// a real announcement while the sink is idle (the stream's newest message
// is still its own); NATS's permissions stop that.

// maxPendingClaims bounds the announcements waiting for the verifier (one
// per sink token, the newest); verifyEvery paces its rounds, so a flood
// of announcements costs NATS at most 3 requests per waiting sink per
// round.
const (
	maxPendingClaims = 1024
	verifyEvery      = 100 * time.Millisecond
)

// Reasons of a mismatch.
const (
	mismatchIncarnation  = "incarnation"
	mismatchSequence     = "sequence"
	mismatchNoMessage    = "no_message"
	mismatchUnverifiable = "unverifiable"
	mismatchOverflow     = "overflow"
	// mismatchMember: the stream's newest message of the worker names
	// another member (MemberWatcher only).
	mismatchMember = "member"
	// mismatchNotYet: the incarnation matches, no sequence is announced
	// yet; neither taken nor counted.
	mismatchNotYet = "not_yet"
)

// otherSink is the sink label of a mismatch for a token the stream holds
// nothing of: forged tokens must not make metric series.
const otherSink = "other"

// runVerifier checks the waiting announcements until ctx ends.
func (t *aliveTracker) runVerifier(ctx context.Context) {
	t.claims.run(ctx, t.verify, func(token string, a announcement, reason string, err error) bool {
		switch reason {
		case "":
			t.checked.WithLabelValues(token).Inc()
			t.accept(token, a)
		case mismatchNotYet:
		default:
			sink := token
			if reason != mismatchIncarnation && reason != mismatchSequence {
				sink = otherSink // the stream holds nothing of it, or was not asked
			}
			t.mismatched.WithLabelValues(sink, reason).Inc()
			t.peerLog.Warn("a sink announcement the worker's stream does not bear out; ignored", "sink", token, "reason", reason, "incarnation", a.Incarnation, "last_stream_sequence", a.LastSeq, "err", err)
		}
		return true
	})
}

// handle takes one announcement from subject <prefix>-alive.<token>.
func (t *aliveTracker) handle(m *nats.Msg) {
	token := m.Subject[strings.LastIndexByte(m.Subject, '.')+1:]
	a, err := decodeAnnouncement(m.Data)
	if err != nil {
		t.peerLog.Warn("undecodable sink announcement; ignored", "subject", m.Subject, "err", err)
		return
	}
	if t.verify == nil {
		t.accept(token, a)
		return
	}
	if !t.claims.offer(token, a) {
		t.mismatched.WithLabelValues(otherSink, mismatchOverflow).Inc()
		t.peerLog.Warn("too many sink announcements waiting to be checked; ignored", "max", maxPendingClaims)
	}
}

// accept takes an announcement of token's sink as heard now.
func (t *aliveTracker) accept(token string, a announcement) {
	t.mu.Lock()
	defer t.mu.Unlock()
	st := t.sinks[token]
	if st == nil {
		st = &sinkState{}
		t.sinks[token] = st
	}
	if st.silent {
		t.peerLog.Info("a silent sink announces itself again; its worker returns to JetStream once a snapshot newer than the silence is there", "sink", token, "incarnation", a.Incarnation, "pass", a.Pass, "last_stream_sequence", a.LastSeq)
		st.silent = false
	}
	st.heard, st.last = t.now(), a
}

// reconnected restarts every sink's clock: announcements sent while this
// replica was cut off were not lost by the sinks.
func (t *aliveTracker) reconnected() {
	t.mu.Lock()
	defer t.mu.Unlock()
	now := t.now()
	for _, st := range t.sinks {
		st.heard = now
	}
}

// check says why worker's sink (by token) cannot be trusted to carry its
// events now: nil if it announced itself within the bound, or never did
// (a relay from before announcements: today's behaviour, see the package
// doc). The first check that finds it silent counts and logs the silence
// under the worker's ID.
func (t *aliveTracker) check(token, workerID string) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	st := t.sinks[token]
	if st == nil {
		return nil
	}
	bound := t.silentAfter
	if bound <= 0 {
		bound = DefaultSilentIntervals * st.last.Every
	}
	quiet := t.now().Sub(st.heard)
	if quiet <= bound {
		return nil
	}
	if !st.silent {
		st.silent, st.silenced = true, true
		t.silences.WithLabelValues(workerID).Inc()
		t.log.Warn("a worker's JetStream sink is silent; the worker follows its gRPC stream", "worker", workerID, "sink", token, "silent_for", quiet.Round(time.Millisecond), "bound", bound, "incarnation", st.last.Incarnation, "pass", st.last.Pass, "last_stream_sequence", st.last.LastSeq)
	}
	return fmt.Errorf("%w: %s heard last %s ago (bound %s)", errSinkSilent, token, quiet.Round(time.Millisecond), bound)
}

var errSinkSilent = errors.New("the worker's JetStream sink is silent")

// takeSilence says whether token's sink was found silent since the last
// call.
func (t *aliveTracker) takeSilence(token string) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	st := t.sinks[token]
	if st == nil {
		return false
	}
	was := st.silenced
	st.silenced = false
	return was
}

// announce publishes the sink's announcement every AliveEvery while a pass
// is publishing, once the stream holds the sink's marker (between passes,
// and while NATS is down, it says nothing: a pass that cannot start for
// longer than the gateways' bound is a silent sink). Core NATS, at most
// once: a lost announcement is covered by the next ones.
func (s *Sink) announce(ctx context.Context) {
	t := time.NewTicker(s.opts.AliveEvery)
	defer t.Stop()
	subject := aliveSubject(s.opts.SubjectPrefix, s.token)
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		pass := s.pass.Load()
		// Nothing stored yet (the pass's marker not acknowledged): an
		// announcement the stream cannot bear out would be refused.
		if pass == 0 || s.lastSeq.Load() == 0 || !s.nc.IsConnected() {
			continue
		}
		msg := &nats.Msg{Subject: subject, Data: encodeAnnouncement(announcement{Incarnation: s.incarnation, Pass: pass, LastSeq: s.lastSeq.Load(), Every: s.opts.AliveEvery})}
		if s.opts.Member != "" {
			// A header, not the payload: gateways from before members
			// decode the announcement as they always did.
			msg.Header = nats.Header{MemberHeader: []string{s.opts.Member}}
		}
		if err := s.nc.PublishMsg(msg); err != nil {
			s.log.Debug("announcement not sent", "err", err)
		}
	}
}

// IncarnationHeader is the header of a sink's stream messages holding its
// incarnation (hexadecimal), which its announcements must match.
const IncarnationHeader = "Kvrelay-Incarnation"

func incarnationText(inc uint64) string { return strconv.FormatUint(inc, 16) }

// streamCheck checks sink announcements against the events stream: the
// Source's liveness tracker and the MemberWatcher (members.go) share it.
type streamCheck struct {
	js     jetstream.JetStream
	name   string // the stream
	prefix string // its subjects' prefix

	mu     sync.Mutex
	stream jetstream.Stream // looked up once
}

func newStreamCheck(js jetstream.JetStream, stream, prefix string) *streamCheck {
	return &streamCheck{js: js, name: stream, prefix: prefix}
}

// eventsStream is the events stream's handle, looked up once.
func (c *streamCheck) eventsStream(ctx context.Context) (jetstream.Stream, error) {
	c.mu.Lock()
	st := c.stream
	c.mu.Unlock()
	if st != nil {
		return st, nil
	}
	st, err := c.js.Stream(ctx, c.name)
	if err != nil {
		return nil, fmt.Errorf("stream %s: %w", c.name, err)
	}
	c.mu.Lock()
	c.stream = st
	c.mu.Unlock()
	return st, nil
}

// verify says whether the worker's stream bears the announcement out (see
// runVerifier's comment above): the reason label of a mismatch, "" when it
// holds. With member non-nil, the stream's newest message of the worker
// must also carry that member (MemberHeader): a member announcement is
// tied to the stream as its incarnation is, so that a replay of a real
// announcement cannot name another member.
func (c *streamCheck) verify(ctx context.Context, token string, a announcement, member *string) (string, error) {
	stream, err := c.eventsStream(ctx)
	if err != nil {
		return mismatchUnverifiable, err
	}
	// Every message the sink stores under the worker's token: its batches
	// and its markers (sinkMarkSubject).
	newest, err := stream.GetLastMsgForSubject(ctx, c.prefix+"."+token+".>")
	if errors.Is(err, jetstream.ErrMsgNotFound) {
		return mismatchNoMessage, errors.New("the stream holds no message of the sink's worker")
	}
	if err != nil {
		return mismatchUnverifiable, fmt.Errorf("the stream's newest message of the worker: %w", err)
	}
	if got, want := newest.Header.Get(IncarnationHeader), incarnationText(a.Incarnation); got != want {
		return mismatchIncarnation, fmt.Errorf("the stream's newest message of the worker (sequence %d) is of incarnation %q, the announcement %q", newest.Sequence, got, want)
	}
	if member != nil {
		if got := newest.Header.Get(MemberHeader); got != *member {
			return mismatchMember, fmt.Errorf("the stream's newest message of the worker (sequence %d) names member %q, the announcement %q", newest.Sequence, got, *member)
		}
	}
	if a.LastSeq == 0 {
		// A sink whose first message is stored but not yet acknowledged
		// to it: not taken, and not a mismatch (its next one will do).
		return mismatchNotYet, nil
	}
	if a.LastSeq > newest.Sequence {
		return mismatchSequence, fmt.Errorf("announced stream sequence %d, the worker's newest is %d", a.LastSeq, newest.Sequence)
	}
	if a.LastSeq == newest.Sequence {
		return "", nil
	}
	m, err := stream.GetMsg(ctx, a.LastSeq)
	if errors.Is(err, jetstream.ErrMsgNotFound) {
		return mismatchSequence, fmt.Errorf("the stream holds no message at the announced sequence %d", a.LastSeq)
	}
	if err != nil {
		return mismatchUnverifiable, fmt.Errorf("the stream's message at sequence %d: %w", a.LastSeq, err)
	}
	if !strings.HasPrefix(m.Subject, c.prefix+"."+token+".") {
		return mismatchSequence, fmt.Errorf("the stream's message at the announced sequence %d is not the worker's (%s)", a.LastSeq, m.Subject)
	}
	return "", nil
}
