// Package membership keeps a gateway's workers in step with its sources:
// the static --worker list, the admin API, a file of workers, a DNS name
// and the relays' NATS announcements, in any combination. Each source
// states the whole list it knows now (Replace) or one change (the admin
// API); the Set works out what changed and applies it to the gateway while
// it routes.
//
// A worker is a member while any source lists it. A source that stops
// listing a worker drains it: no new route goes to it, its subscription
// and index stay until its tracked requests end or DrainTimeout passes,
// then it is removed (its index entries and placements go, and the other
// replicas hear of it over NATS). A source that lists a draining worker
// again calls the drain off.
//
// An update that does not hold together (a line that does not parse, one
// worker twice, more workers than MaxWorkers) is refused whole with an
// error naming the problem: the source's last good list stays in force,
// and the other sources are not touched.
package membership

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrelay/kvrelay/gateway"
)

// Target is what the Set changes: a *gateway.Gateway.
type Target interface {
	AddWorker(w gateway.Worker) error
	DrainWorker(id string) (<-chan struct{}, error)
	UndrainWorker(id string) error
	RemoveWorker(id string) error
}

// Source names, the label of kvrelay_gateway_membership_changes_total.
const (
	SourceStatic = "static"
	SourceAdmin  = "admin"
	SourceFile   = "file"
	SourceDNS    = "dns"
	SourceNATS   = "nats"
)

// DefaultMaxWorkers is the cap on the workers of one gateway, all sources
// together. Routing costs O(candidates + log workers) and the index was
// measured at 10,000 workers (BENCHMARKS.md, fleet scale); 10,000 engines
// is past any single deployment we know of, and a source answering more
// (a DNS name gone wrong) is refused rather than followed.
const DefaultMaxWorkers = 10000

// DefaultDrainTimeout bounds a drain: a tracked request not completed by
// then no longer keeps its worker (the gateway's in-flight timeout ends
// it too).
const DefaultDrainTimeout = 2 * time.Minute

// Options configures a Set.
type Options struct {
	// MaxWorkers caps the members, all sources together; 0 =
	// DefaultMaxWorkers.
	MaxWorkers int
	// DrainTimeout: a worker its sources dropped is removed when its
	// tracked requests end or after this; 0 = DefaultDrainTimeout.
	DrainTimeout time.Duration
	// Prepare, if set, completes a worker before it is added (its TLS
	// credentials for grpcs://); an error refuses the worker.
	Prepare func(*gateway.Worker) error
	// Registerer receives kvrelay_gateway_membership_changes_total and
	// kvrelay_gateway_membership_rejected_total; nil = unregistered.
	Registerer prometheus.Registerer
	Logger     *slog.Logger
}

// Errors the Set returns.
var (
	ErrDuplicate = errors.New("worker listed twice")
	ErrTooMany   = errors.New("over the cap on workers")
	ErrConflict  = errors.New("worker already a member with another model or service")
	ErrNotMember = errors.New("not a member")
	ErrHeld      = errors.New("listed by another source")
)

// member is one worker and the sources that list it.
type member struct {
	w       gateway.Worker
	sources map[string]bool
	// draining: no route goes to it; cancel ends the wait for its drain.
	draining bool
	cancel   context.CancelFunc
	// adminDrain: an operator drained it; it stays drained (not routed
	// to) while other sources list it, until the admin API adds it again.
	adminDrain bool
}

// Set is a gateway's membership. Safe for concurrent use.
type Set struct {
	opts     Options
	target   Target
	log      *slog.Logger
	changes  *prometheus.CounterVec // source, op
	rejected *prometheus.CounterVec // source
	regd     []prometheus.Collector

	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup

	mu      sync.Mutex
	members map[string]*member
	lists   map[string]map[string]gateway.Worker // source → its last good list, by ID
}

// New builds a Set that changes target. Workers already in target (its
// Config.Workers) are not known to the Set: give them as SourceStatic.
// Close stops its drains.
func New(target Target, opts Options) (*Set, error) {
	if target == nil {
		return nil, errors.New("membership: nil target")
	}
	if opts.MaxWorkers < 0 || opts.DrainTimeout < 0 {
		return nil, fmt.Errorf("membership: max workers %d and drain timeout %v must be ≥ 0", opts.MaxWorkers, opts.DrainTimeout)
	}
	if opts.MaxWorkers == 0 {
		opts.MaxWorkers = DefaultMaxWorkers
	}
	if opts.DrainTimeout == 0 {
		opts.DrainTimeout = DefaultDrainTimeout
	}
	if opts.Logger == nil {
		opts.Logger = slog.New(slog.DiscardHandler)
	}
	s := &Set{
		opts: opts, target: target, log: opts.Logger,
		members: map[string]*member{}, lists: map[string]map[string]gateway.Worker{},
		changes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvrelay_gateway_membership_changes_total",
			Help: "Membership changes applied, by the source that caused them (static, admin, file, dns, nats) and op (add, drain, undrain, remove).",
		}, []string{"source", "op"}),
		rejected: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvrelay_gateway_membership_rejected_total",
			Help: "Membership updates refused whole (a line that does not parse, a duplicate, over the cap), by source; the source's last good list stays in force.",
		}, []string{"source"}),
	}
	s.ctx, s.cancel = context.WithCancel(context.Background())
	if opts.Registerer != nil {
		for _, c := range []prometheus.Collector{s.changes, s.rejected} {
			if err := opts.Registerer.Register(c); err != nil {
				s.Close()
				return nil, fmt.Errorf("membership metrics: %w", err)
			}
			s.regd = append(s.regd, c)
		}
	}
	return s, nil
}

// Close ends the drains in progress (their workers stay, drained) and
// unregisters the metrics.
func (s *Set) Close() {
	s.cancel()
	s.wg.Wait()
	for _, c := range s.regd {
		s.opts.Registerer.Unregister(c)
	}
	s.regd = nil
}

// Member is one worker as Members reports it.
type Member struct {
	Worker   gateway.Worker
	Sources  []string
	Draining bool
}

// Members lists the members, sorted by ID.
func (s *Set) Members() []Member {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]Member, 0, len(s.members))
	for _, m := range s.members {
		mm := Member{Worker: m.w, Draining: m.draining}
		for src := range m.sources {
			mm.Sources = append(mm.Sources, src)
		}
		sort.Strings(mm.Sources)
		out = append(out, mm)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Worker.ID < out[j].Worker.ID })
	return out
}

// Routable lists the IDs of the members not draining, sorted.
func (s *Set) Routable() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []string
	for id, m := range s.members {
		if !m.draining {
			out = append(out, id)
		}
	}
	sort.Strings(out)
	return out
}

// normalize fills a worker's defaults as the gateway does, so IDs compare.
func normalize(w gateway.Worker) gateway.Worker {
	if w.Model == "" {
		w.Model = gateway.DefaultModel
	}
	if w.ID == "" {
		w.ID = w.Addr
	}
	return w
}

// same reports whether two descriptions of one ID are the same worker.
func same(a, b gateway.Worker) bool {
	return a.Addr == b.Addr && a.Model == b.Model && a.Service == b.Service
}

// Replace makes source's list ws: workers new to the Set are added, those
// the source no longer lists and no other source lists are drained, then
// removed. The whole update is refused, changing nothing, when it lists an
// ID twice, would take the Set over MaxWorkers, or names a member of
// another source with another model or service; the refusal is counted and
// logged here.
func (s *Set) Replace(source string, ws []gateway.Worker) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.replaceLocked(source, ws); err != nil {
		s.rejected.WithLabelValues(source).Inc()
		s.log.Warn("membership update refused; the source's last good list stays in force", "source", source, "err", err)
		return err
	}
	return nil
}

// Adopt records ws, already workers of the gateway (its Config.Workers),
// as source's list, without adding them again: a gateway built with its
// static workers hands them to the Set this way.
func (s *Set) Adopt(source string, ws []gateway.Worker) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.members)+len(ws) > s.opts.MaxWorkers {
		return fmt.Errorf("membership: %s lists %d workers: %w of %d", source, len(ws), ErrTooMany, s.opts.MaxWorkers)
	}
	list := make(map[string]gateway.Worker, len(ws))
	for _, w := range ws {
		w = normalize(w)
		if _, dup := s.members[w.ID]; dup {
			return fmt.Errorf("membership: %s: %s: %w", source, w.ID, ErrDuplicate)
		}
		s.members[w.ID] = &member{w: w, sources: map[string]bool{source: true}}
		list[w.ID] = w
	}
	s.lists[source] = list
	return nil
}

// Reject counts and logs an update a source could not even read (a file
// that does not parse, a failed DNS lookup): its last good list stays.
func (s *Set) Reject(source string, err error) {
	s.rejected.WithLabelValues(source).Inc()
	s.log.Warn("membership update refused; the source's last good list stays in force", "source", source, "err", err)
}

func (s *Set) replaceLocked(source string, ws []gateway.Worker) error {
	next := make(map[string]gateway.Worker, len(ws))
	for _, w := range ws {
		w = normalize(w)
		if _, dup := next[w.ID]; dup {
			return fmt.Errorf("membership: %s: %s: %w", source, w.ID, ErrDuplicate)
		}
		next[w.ID] = w
	}
	prev := s.lists[source]
	// The members after the update, counted before anything changes.
	total := len(s.members)
	for id, w := range next {
		m, ok := s.members[id]
		if !ok {
			total++
			continue
		}
		if !same(m.w, w) {
			return fmt.Errorf("membership: %s: %s (model %s, service %s): %w: model %s, service %s", source, id, w.Model, w.Service, ErrConflict, m.w.Model, m.w.Service)
		}
	}
	if total > s.opts.MaxWorkers {
		return fmt.Errorf("membership: %s lists %d workers, which makes %d members: %w of %d", source, len(next), total, ErrTooMany, s.opts.MaxWorkers)
	}
	var errs []error
	// Additions first: a rolling replacement never leaves a model empty.
	ids := sortedKeys(next)
	for _, id := range ids {
		if err := s.listLocked(source, next[id]); err != nil {
			delete(next, id) // not in force: a later update tries again
			errs = append(errs, err)
		}
	}
	for _, id := range sortedKeys(prev) {
		if _, still := next[id]; !still {
			s.unlistLocked(source, id)
		}
	}
	s.lists[source] = next
	return errors.Join(errs...)
}

func sortedKeys[V any](m map[string]V) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}

// listLocked records that source lists w, adding it or calling its drain
// off as needed.
func (s *Set) listLocked(source string, w gateway.Worker) error {
	m, ok := s.members[w.ID]
	if !ok {
		if s.opts.Prepare != nil {
			if err := s.opts.Prepare(&w); err != nil {
				return fmt.Errorf("membership: %s: %s: %w", source, w.ID, err)
			}
		}
		if err := s.target.AddWorker(w); err != nil {
			return fmt.Errorf("membership: %s: %w", source, err)
		}
		s.members[w.ID] = &member{w: w, sources: map[string]bool{source: true}}
		s.count(source, "add", w)
		return nil
	}
	m.sources[source] = true
	if m.draining && (!m.adminDrain || source == SourceAdmin) {
		s.undrainLocked(source, m)
	}
	return nil
}

// unlistLocked records that source no longer lists id: with no source
// left, the worker drains, then leaves.
func (s *Set) unlistLocked(source, id string) {
	m, ok := s.members[id]
	if !ok {
		return
	}
	delete(m.sources, source)
	if len(m.sources) == 0 && !m.draining {
		s.drainLocked(source, m, true)
	}
	if len(m.sources) == 0 && m.draining && m.cancel == nil {
		// Drained before (by an operator) with nothing in flight left to
		// wait for: it leaves now.
		s.removeLocked(source, m)
	}
}

// drainLocked stops routing to m; with leave, it is removed once drained
// or at the timeout.
func (s *Set) drainLocked(source string, m *member, leave bool) {
	done, err := s.target.DrainWorker(m.w.ID)
	if err != nil {
		s.log.Error("drain failed", "worker", m.w.ID, "source", source, "err", err)
		return
	}
	m.draining = true
	s.count(source, "drain", m.w)
	ctx, cancel := context.WithCancel(s.ctx)
	m.cancel = cancel
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		t := time.NewTimer(s.opts.DrainTimeout)
		defer t.Stop()
		timedOut := false
		select {
		case <-done:
		case <-t.C:
			timedOut = true
		case <-ctx.Done():
			return
		}
		s.mu.Lock()
		defer s.mu.Unlock()
		if s.members[m.w.ID] != m || ctx.Err() != nil {
			return // called off or removed meanwhile
		}
		m.cancel = nil
		cancel()
		if timedOut {
			s.log.Warn("drain timed out with requests still in flight", "worker", m.w.ID, "timeout", s.opts.DrainTimeout)
		}
		if leave || len(m.sources) == 0 {
			s.removeLocked(source, m)
		}
	}()
}

func (s *Set) undrainLocked(source string, m *member) {
	if m.cancel != nil {
		m.cancel()
		m.cancel = nil
	}
	if err := s.target.UndrainWorker(m.w.ID); err != nil {
		s.log.Error("undrain failed", "worker", m.w.ID, "source", source, "err", err)
		return
	}
	m.draining, m.adminDrain = false, false
	s.count(source, "undrain", m.w)
}

func (s *Set) removeLocked(source string, m *member) {
	if m.cancel != nil {
		m.cancel()
		m.cancel = nil
	}
	delete(s.members, m.w.ID)
	for _, list := range s.lists {
		delete(list, m.w.ID)
	}
	if err := s.target.RemoveWorker(m.w.ID); err != nil {
		s.log.Error("remove failed", "worker", m.w.ID, "source", source, "err", err)
		return
	}
	s.count(source, "remove", m.w)
}

// count logs a change once and counts it.
func (s *Set) count(source, op string, w gateway.Worker) {
	s.changes.WithLabelValues(source, op).Inc()
	s.log.Info("membership change", "op", op, "source", source, "worker", w.ID, "model", w.Model, "service", string(w.Service))
}

// Add adds w for the admin API (or calls its drain off). A worker already
// listed by the admin API is ErrDuplicate.
func (s *Set) Add(w gateway.Worker) error {
	w = normalize(w)
	s.mu.Lock()
	defer s.mu.Unlock()
	list := s.lists[SourceAdmin]
	if _, dup := list[w.ID]; dup {
		m := s.members[w.ID]
		if m == nil || !m.draining {
			return fmt.Errorf("membership: %s: %w", w.ID, ErrDuplicate)
		}
	}
	next := make([]gateway.Worker, 0, len(list)+1)
	for id, lw := range list {
		if id != w.ID {
			next = append(next, lw)
		}
	}
	next = append(next, w)
	if err := s.replaceLocked(SourceAdmin, next); err != nil {
		s.rejected.WithLabelValues(SourceAdmin).Inc()
		return err
	}
	return nil
}

// Remove removes a worker the admin API added, at once (its tracked
// requests are dropped). A worker another source lists is ErrHeld: drain
// it instead, or remove it from that source.
func (s *Set) Remove(id string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	m, ok := s.members[id]
	if !ok {
		return fmt.Errorf("membership: %s: %w", id, ErrNotMember)
	}
	for src := range m.sources {
		if src != SourceAdmin {
			return fmt.Errorf("membership: %s: %w (%s); drain it, or remove it there", id, ErrHeld, strings.Join(sortedKeys(m.sources), ", "))
		}
	}
	s.removeLocked(SourceAdmin, m)
	return nil
}

// Drain drains a member for the admin API: no new route goes to it; once
// its tracked requests end (or DrainTimeout) it leaves, unless another
// source lists it: then it stays, drained, until that source drops it or
// the admin API adds it again.
func (s *Set) Drain(id string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	m, ok := s.members[id]
	if !ok {
		return fmt.Errorf("membership: %s: %w", id, ErrNotMember)
	}
	if m.draining {
		return nil
	}
	delete(m.sources, SourceAdmin)
	delete(s.lists[SourceAdmin], id)
	m.adminDrain = true
	s.drainLocked(SourceAdmin, m, false)
	return nil
}
