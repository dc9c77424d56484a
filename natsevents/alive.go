package natsevents

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
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

	mu    sync.Mutex
	sinks map[string]*sinkState
	// peerLog is log throttled, for what announcements (anyone's who can
	// publish on the alive subjects) drive.
	peerLog *slog.Logger
}

func newAliveTracker(silentAfter time.Duration, log *slog.Logger) *aliveTracker {
	return &aliveTracker{
		silentAfter: silentAfter, now: time.Now, log: log, peerLog: logthrottle.Wrap(log), sinks: map[string]*sinkState{},
		silences: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvrelay_gateway_events_sink_silent_total",
			Help: "Times a worker's JetStream sink stopped announcing itself while this replica's NATS connection was up; the worker then follows its gRPC stream until the sink is back with a newer snapshot."},
			[]string{"worker"}),
	}
}

// handle takes one announcement from subject <prefix>-alive.<token>.
func (t *aliveTracker) handle(m *nats.Msg) {
	token := m.Subject[strings.LastIndexByte(m.Subject, '.')+1:]
	a, err := decodeAnnouncement(m.Data)
	if err != nil {
		t.peerLog.Warn("undecodable sink announcement; ignored", "subject", m.Subject, "err", err)
		return
	}
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
// is publishing (between passes, and while NATS is down, it says nothing:
// a pass that cannot start for longer than the gateways' bound is a
// silent sink). Core NATS, at most once: a lost announcement is covered
// by the next ones.
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
		if pass == 0 || !s.nc.IsConnected() {
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
