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

// MemberOptions configures a MemberWatcher.
type MemberOptions struct {
	// URL is the NATS server list; SubjectPrefix the events' prefix
	// (DefaultSubjectPrefix), the same as the relays'.
	URL           string
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
	Logger      *slog.Logger
}

type heardMember struct {
	spec  string
	heard time.Time
	every time.Duration
}

// MemberWatcher follows the relays' member announcements.
type MemberWatcher struct {
	opts MemberOptions
	nc   *nats.Conn
	sub  *nats.Subscription
	log  *slog.Logger
	now  func() time.Time

	mu      sync.Mutex
	members map[string]heardMember // by worker token
	full    bool                   // MaxMembers reached, logged
	changed chan struct{}
	last    []string // what OnChange was last given
}

// WatchMembers connects and subscribes to the announcements; Run delivers
// the changes. It does not wait for the server.
func WatchMembers(opts MemberOptions) (*MemberWatcher, error) {
	if opts.OnChange == nil {
		return nil, errors.New("natsevents: WatchMembers needs OnChange")
	}
	if opts.SubjectPrefix == "" {
		opts.SubjectPrefix = DefaultSubjectPrefix
	}
	if err := checkSubjectPrefix(opts.SubjectPrefix); err != nil {
		return nil, fmt.Errorf("natsevents: %w", err)
	}
	if opts.MaxMembers <= 0 {
		opts.MaxMembers = 10000
	}
	if opts.Logger == nil {
		opts.Logger = slog.New(slog.DiscardHandler)
	}
	w := &MemberWatcher{opts: opts, log: opts.Logger, now: time.Now, members: map[string]heardMember{}, changed: make(chan struct{}, 1)}
	nopts := append([]nats.Option{
		nats.ReconnectHandler(func(*nats.Conn) { w.reconnected() }),
	}, opts.NATSOptions...)
	nc, err := natsconn.Connect(opts.URL, "kvrelay-gateway-members", time.Second, w.log, nopts...)
	if err != nil {
		return nil, fmt.Errorf("natsevents: %w", err)
	}
	w.nc = nc
	if w.sub, err = nc.Subscribe(aliveFilter(opts.SubjectPrefix), w.handle); err != nil {
		nc.Close()
		return nil, fmt.Errorf("natsevents: subscribe: %w", err)
	}
	return w, nil
}

// Close ends the subscription and the connection.
func (w *MemberWatcher) Close() { w.nc.Close() }

// handle takes one announcement; one without a member (a relay not
// announcing one, or from before members) is not a member.
func (w *MemberWatcher) handle(m *nats.Msg) {
	spec := m.Header.Get(MemberHeader)
	if spec == "" {
		return
	}
	a, err := decodeAnnouncement(m.Data)
	if err != nil {
		w.log.Warn("undecodable member announcement; ignored", "subject", m.Subject, "err", err)
		return
	}
	if len(spec) > maxMemberSpec {
		w.log.Warn("member announcement over the size bound; ignored", "subject", m.Subject, "bytes", len(spec))
		return
	}
	token := m.Subject[strings.LastIndexByte(m.Subject, '.')+1:]
	w.mu.Lock()
	defer w.mu.Unlock()
	old, known := w.members[token]
	if !known && len(w.members) >= w.opts.MaxMembers {
		if !w.full {
			w.full = true
			w.log.Error("more relays announce members than the cap; the others are ignored until some leave", "cap", w.opts.MaxMembers)
		}
		return
	}
	w.members[token] = heardMember{spec: spec, heard: w.now(), every: a.Every}
	if !known || old.spec != spec {
		w.signal()
	}
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

// Run delivers the members to OnChange until ctx ends: at each change, and
// when a member falls silent (checked every quarter second).
func (w *MemberWatcher) Run(ctx context.Context) {
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

// MemberAnnouncement is the announcement a sink of worker with member sends
// every interval (one of its first pass): for a program that stands in for
// a relay, such as a benchmark of the gateway's membership or a demo.
func MemberAnnouncement(subjectPrefix, worker, member string, every time.Duration) *nats.Msg {
	if subjectPrefix == "" {
		subjectPrefix = DefaultSubjectPrefix
	}
	return &nats.Msg{
		Subject: aliveSubject(subjectPrefix, WorkerToken(worker)),
		Data:    encodeAnnouncement(announcement{Incarnation: 1, Pass: 1, Every: every}),
		Header:  nats.Header{MemberHeader: []string{member}},
	}
}
