package placementsync

import (
	"strings"

	"github.com/nats-io/nats.go"
)

// Removals. When a worker leaves a replica (its membership sources dropped
// it, or an operator removed it), the replica tells the others on
// <prefix>-removed.<model>, in the placement message's encoding with no
// hashes: they drop the placements they hold on that worker, most of which
// that replica shared, so that no replica keeps sending a prefix's burst to
// an engine that is leaving while its own sources catch up. The subject is
// outside the placements' <prefix>.> wildcard, so a replica from before
// removals never sees one.

// Forgetter is a Target that can drop a worker's placements (a
// *gateway.Gateway).
type Forgetter interface {
	ForgetPlacements(model, worker string) int
}

func removalSubject(prefix, model string) string { return prefix + "-removed." + subjectToken(model) }

func removalFilter(prefix string) string { return prefix + "-removed.*" }

// PublishRemoval tells the other replicas that worker of model left this
// one. Like a placement, it is dropped while NATS is unreachable.
func (s *Sync) PublishRemoval(model, worker string) {
	if err := s.nc.Publish(removalSubject(s.opts.SubjectPrefix, model), encode(nil, worker, nil)); err != nil {
		s.removals.WithLabelValues("dropped").Inc()
		return
	}
	s.removals.WithLabelValues("published").Inc()
}

// receiveRemoval drops the placements another replica's removed worker
// holds here.
func (s *Sync) receiveRemoval(msg *nats.Msg) {
	f, ok := s.target.(Forgetter)
	model, err := modelOf(strings.TrimPrefix(msg.Subject, s.opts.SubjectPrefix+"-removed."))
	var worker string
	if err == nil {
		worker, _, err = decode(msg.Data)
	}
	if err != nil {
		s.removals.WithLabelValues("rejected").Inc()
		s.log.Debug("worker removal from another replica rejected", "subject", msg.Subject, "err", err)
		return
	}
	s.removals.WithLabelValues("received").Inc()
	if ok {
		n := f.ForgetPlacements(model, worker)
		s.log.Info("another replica removed a worker; its placements here are dropped", "model", model, "worker", worker, "placements", n)
	}
}
