package natsevents

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/protobuf/proto"

	"github.com/kvrelay/kvrelay/engines/load"
	"github.com/kvrelay/kvrelay/proto/kvpb"
)

// Engine load over NATS. On gRPC a relay stamps every batch with its rank's
// EngineLoad (field 8) and sends load_only batches while quiet; those
// records are added per subscriber by the gRPC server, so the batches the
// sink publishes carry none, and they must not: a stored record would be
// replayed to a late replica as if it were current, and a load_only batch
// repeats its rank's last sequence, so the stream's duplicate window (by
// worker, rank, sequence and timestamp) would drop it, and one published
// without an id would sit between the batches that the snapshot argument
// counts.
//
// So loads go beside the stream, on core NATS like the announcements: the
// sink publishes each rank's record to <prefix>-load.<token>.<rank> on a
// change (SMG's thresholds, engines/load's Changed) or on silence (1 s, 5 s after two unchanged),
// checked every 100 ms, while a pass is publishing, for the ranks the pass
// has relayed a batch of (so never before the rank's first real batch).
// The record's age_ms is its sample's age when sent. The source keeps the
// newest record per worker and rank and hands it to each JetStream-served
// subscription of that worker as a load_only batch (the rank's last
// delivered sequence repeated), after the snapshot's chunks: the monitor
// takes it exactly as it takes one from a gRPC stream. A record handed on
// later is aged by the time it waited, and one older than loadMaxAge is
// not handed on at all. Lost messages cost nothing: the next heartbeat
// replaces them.

// LoadSource is what the sink needs of its relay's load sources (the ones
// that stamp its gRPC stream): rank's newest record, with age_ms saying how
// old its sample is, or nil while unknown. The sink keeps what it gets.
type LoadSource interface {
	Load(rank int32) *kvpb.EngineLoad
}

// PollerLoads is the LoadSource of a relay's load poller (the one its gRPC
// server stamps batches from): a rank's newest fresh record, copied, with
// its age.
func PollerLoads(p *load.Poller) LoadSource { return pollerLoads{p} }

type pollerLoads struct{ p *load.Poller }

func (s pollerLoads) Load(rank int32) *kvpb.EngineLoad {
	r, ok := s.p.Latest(rank)
	if !ok {
		return nil
	}
	l := proto.Clone(r.Load).(*kvpb.EngineLoad)
	l.AgeMs = uint32(max(s.p.Now().Sub(r.At), 0) / time.Millisecond)
	return l
}

// Load record timing, SMG's servicer's (relay-semantics.md §3.9).
const (
	loadTick             = 100 * time.Millisecond
	loadHeartbeat        = time.Second
	loadHeartbeatBackoff = 5 * time.Second
	// loadMaxAge is the oldest record a source hands on: the gateway
	// stops trusting one at 15 s too (heartbeats come every 5 s at most).
	loadMaxAge = 15 * time.Second
	// loadMaxBytes bounds a record's message; a real one is a few hundred
	// bytes with every telemetry section.
	loadMaxBytes = 16 << 10
	// loadMaxRanks bounds the ranks a source keeps per worker, so that
	// messages naming ever new ranks cannot grow it without end.
	loadMaxRanks = 1024
)

func loadSubject(prefix, token string, rank int32) string {
	return prefix + "-load." + token + "." + strconv.Itoa(int(rank))
}

// loadFilter matches every worker's load subjects; like the announcements'
// it is outside the stream's <prefix>.>.
func loadFilter(prefix string) string { return prefix + "-load.*.*" }

// parseLoadSubject returns the worker token and rank of a load subject.
func parseLoadSubject(subject string) (string, int32, error) {
	i := strings.LastIndexByte(subject, '.')
	if i < 0 {
		return "", 0, fmt.Errorf("load subject %q: no rank", subject)
	}
	rank, err := strconv.ParseUint(subject[i+1:], 10, 31)
	if err != nil || rank >= loadMaxRanks {
		return "", 0, fmt.Errorf("load subject %q: rank is not a number below %d", subject, loadMaxRanks)
	}
	j := strings.LastIndexByte(subject[:i], '.')
	if j <= 0 || j+1 == i {
		return "", 0, fmt.Errorf("load subject %q: no worker token", subject)
	}
	return subject[j+1 : i], int32(rank), nil
}

// decodeLoad reads one published record, refusing what a gateway could not
// use: too large, not an EngineLoad, a non-finite or negative number where
// a rate or share belongs, or a sample older than loadMaxAge.
func decodeLoad(b []byte) (*kvpb.EngineLoad, error) {
	if len(b) > loadMaxBytes {
		return nil, fmt.Errorf("load record: %d bytes, at most %d", len(b), loadMaxBytes)
	}
	l := &kvpb.EngineLoad{}
	if err := proto.Unmarshal(b, l); err != nil {
		return nil, fmt.Errorf("load record: %w", err)
	}
	for _, f := range []struct {
		name string
		v    float64
		set  bool
	}{
		{"token_usage", l.GetTokenUsage(), true},
		{"active_token_usage", l.GetActiveTokenUsage(), l.ActiveTokenUsage != nil},
		{"gen_throughput", l.GetGenThroughput(), true},
		{"cache_hit_rate", l.GetCacheHitRate(), l.CacheHitRate != nil},
	} {
		if f.set && (math.IsNaN(f.v) || math.IsInf(f.v, 0) || f.v < 0) {
			return nil, fmt.Errorf("load record: %s is %v", f.name, f.v)
		}
	}
	if age := time.Duration(l.GetAgeMs()) * time.Millisecond; age > loadMaxAge {
		return nil, fmt.Errorf("load record: sample %s old, more than %s", age, loadMaxAge)
	}
	return l, nil
}

// sentLoad is what the sink last published for one rank.
type sentLoad struct {
	last      *kvpb.EngineLoad
	at        time.Time
	unchanged int // heartbeats in a row without a change
	sample    uint64
}

// noteRank remembers that the current process relayed a batch of rank, so
// its load may be published from now on.
func (s *Sink) noteRank(rank int32) {
	s.ranksMu.Lock()
	if _, ok := s.ranks[rank]; !ok {
		s.ranks[rank] = struct{}{}
	}
	s.ranksMu.Unlock()
}

func (s *Sink) knownRanks(into []int32) []int32 {
	into = into[:0]
	s.ranksMu.Lock()
	for r := range s.ranks {
		into = append(into, r)
	}
	s.ranksMu.Unlock()
	return into
}

// publishLoads sends the ranks' records while a pass is publishing (see the
// top of this file). Core NATS, at most once.
func (s *Sink) publishLoads(ctx context.Context) {
	t := time.NewTicker(loadTick)
	defer t.Stop()
	sent := map[int32]*sentLoad{}
	var ranks []int32
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		if s.pass.Load() == 0 || !s.nc.IsConnected() {
			continue
		}
		ranks = s.knownRanks(ranks)
		now := time.Now()
		for _, r := range ranks {
			l := s.opts.Loads.Load(r)
			if l == nil {
				continue
			}
			st := sent[r]
			if st == nil {
				st = &sentLoad{}
				sent[r] = st
			}
			reason := "change"
			if st.last != nil && !load.Changed(st.last, l) {
				every := loadHeartbeat
				if st.unchanged >= 2 {
					every = loadHeartbeatBackoff
				}
				if now.Sub(st.at) < every {
					continue
				}
				reason = "heartbeat"
				st.unchanged++
			} else {
				st.unchanged = 0
			}
			st.sample++
			l.Sample, l.LoadOnly = st.sample, false
			data, err := proto.Marshal(l)
			if err != nil {
				s.log.Warn("load record not encodable; not sent", "rank", r, "err", err)
				continue
			}
			if err := s.nc.Publish(loadSubject(s.opts.SubjectPrefix, s.token, r), data); err != nil {
				s.log.Debug("load record not sent", "rank", r, "err", err)
				continue
			}
			st.last, st.at = l, now
			s.m.loads.WithLabelValues(reason).Inc()
		}
	}
}

// heldLoad is a record a source holds and when its sample was taken.
type heldLoad struct {
	load    *kvpb.EngineLoad
	sampled time.Time
}

// aged returns a copy of the record with age_ms as of now, and false when
// it is too old to hand on.
func (h heldLoad) aged(now time.Time) (*kvpb.EngineLoad, bool) {
	age := max(now.Sub(h.sampled), 0)
	if age > loadMaxAge {
		return nil, false
	}
	l := proto.Clone(h.load).(*kvpb.EngineLoad)
	l.AgeMs = uint32(age / time.Millisecond)
	return l, true
}

// loadTracker is a source's side: the newest record per worker token and
// rank, and the open JetStream subscriptions to hand them to. Only tokens
// a subscription was opened for are kept.
type loadTracker struct {
	now      func() time.Time
	log      *slog.Logger
	received *prometheus.CounterVec // by result
	sub      *nats.Subscription

	mu     sync.Mutex
	latest map[string]map[int32]heldLoad
	feeds  map[string]map[*loadFeed]struct{}
	// bad says which tokens' last message was refused, so a bad sink is
	// logged once per change between good and bad, not per message.
	bad map[string]bool
}

func newLoadTracker(log *slog.Logger) *loadTracker {
	return &loadTracker{
		now: time.Now, log: log,
		latest: map[string]map[int32]heldLoad{}, feeds: map[string]map[*loadFeed]struct{}{}, bad: map[string]bool{},
		received: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvrelay_gateway_events_loads_total",
			Help: "Engine load records received from the workers' sinks over NATS, by result: accepted, malformed (refused), unfollowed (a worker this replica does not read from JetStream)."},
			[]string{"result"}),
	}
}

// handle takes one record from subject <prefix>-load.<token>.<rank>.
func (t *loadTracker) handle(m *nats.Msg) {
	token, rank, err := parseLoadSubject(m.Subject)
	var l *kvpb.EngineLoad
	if err == nil {
		l, err = decodeLoad(m.Data)
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if err != nil {
		t.received.WithLabelValues("malformed").Inc()
		if !t.bad[token] {
			t.bad[token] = true
			t.log.Warn("load record refused; further ones from this sink are counted, not logged, until a good one", "subject", m.Subject, "err", err)
		}
		return
	}
	ranks, followed := t.latest[token]
	if !followed {
		t.received.WithLabelValues("unfollowed").Inc()
		return
	}
	if t.bad[token] {
		delete(t.bad, token)
		t.log.Info("load records from a sink are good again", "subject", m.Subject)
	}
	t.received.WithLabelValues("accepted").Inc()
	h := heldLoad{load: l, sampled: t.now().Add(-time.Duration(l.GetAgeMs()) * time.Millisecond)}
	ranks[rank] = h
	for f := range t.feeds[token] {
		f.offer(rank, h)
	}
}

// attach returns a feed for a new subscription of token, holding the
// token's current records.
func (t *loadTracker) attach(token string) *loadFeed {
	f := &loadFeed{now: t.now, pending: map[int32]heldLoad{}, lastSeq: map[int32]uint64{}}
	f.wake, f.cancel = context.WithCancel(context.Background())
	t.mu.Lock()
	defer t.mu.Unlock()
	ranks := t.latest[token]
	if ranks == nil {
		ranks = map[int32]heldLoad{}
		t.latest[token] = ranks
	}
	for r, h := range ranks {
		f.pending[r] = h
	}
	if t.feeds[token] == nil {
		t.feeds[token] = map[*loadFeed]struct{}{}
	}
	t.feeds[token][f] = struct{}{}
	return f
}

func (t *loadTracker) detach(token string, f *loadFeed) {
	t.mu.Lock()
	delete(t.feeds[token], f)
	t.mu.Unlock()
	f.mu.Lock()
	f.cancel()
	f.mu.Unlock()
}

// loadFeed is one subscription's records not yet handed on: the newest per
// rank, and a context that is cancelled when one arrives, to wake a Recv
// waiting for the stream's next message.
type loadFeed struct {
	now func() time.Time

	mu      sync.Mutex
	pending map[int32]heldLoad
	wake    context.Context
	cancel  context.CancelFunc
	// lastSeq is the last sequence the subscription delivered per rank,
	// which a load_only batch repeats, as on gRPC.
	lastSeq map[int32]uint64
	sample  uint64
}

func (f *loadFeed) offer(rank int32, h heldLoad) {
	f.mu.Lock()
	f.pending[rank] = h
	f.cancel()
	f.mu.Unlock()
}

// delivered notes a batch the subscription handed to the monitor.
func (f *loadFeed) delivered(b *kvpb.KvEventBatch) {
	if b.GetSnapshot() != nil {
		return
	}
	f.mu.Lock()
	f.lastSeq[b.GetDpRank()] = b.GetSequenceNumber()
	f.mu.Unlock()
}

// next returns a load_only batch for the lowest rank with a pending
// record, or nil when none is pending (records too old are dropped).
func (f *loadFeed) next() *kvpb.KvEventBatch {
	f.mu.Lock()
	defer f.mu.Unlock()
	now := f.now()
	for len(f.pending) > 0 {
		rank := int32(math.MaxInt32)
		for r := range f.pending {
			rank = min(rank, r)
		}
		h := f.pending[rank]
		delete(f.pending, rank)
		l, ok := h.aged(now)
		if !ok {
			continue
		}
		f.sample++
		l.Sample, l.LoadOnly = f.sample, true
		return &kvpb.KvEventBatch{SequenceNumber: f.lastSeq[rank], Timestamp: float64(now.UnixNano()) / 1e9, DpRank: proto.Int32(rank), Load: l}
	}
	return nil
}

// waitCtx is a context cancelled when a record arrives (already cancelled
// if one is pending).
func (f *loadFeed) waitCtx() context.Context {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.wake.Err() != nil && len(f.pending) == 0 {
		f.wake, f.cancel = context.WithCancel(context.Background())
	}
	return f.wake
}

// woken says whether err ended a wait because a record arrived.
func (f *loadFeed) woken(err error) bool {
	return errors.Is(err, context.Canceled)
}
