package natsevents

import (
	"errors"
	"time"

	"github.com/nats-io/nats.go"
)

// Snapshot requests. A replica that cannot serve a worker from JetStream
// only because its snapshot object is too old (written before NATS came
// back or the sink went silent) or is the one its index diverged on would
// otherwise wait for the sink's next period (30 s) on the worker's gRPC
// stream. So it asks the sink for a new object, on core NATS at
// <prefix>-snapshot.<token> (outside the stream's <prefix>.>), with an
// empty message; the sink cuts one as soon as every rank is settled (see
// passAcks), at most once per snapshotRequestEvery however many ask, so
// a flood of requests costs a relay at most one cut a second.

// snapshotRequestEvery bounds how often requests make a sink cut.
const snapshotRequestEvery = time.Second

// snapshotRequestSubject is where worker token's sink takes requests.
func snapshotRequestSubject(prefix, token string) string { return prefix + "-snapshot." + token }

// errSnapshotRequested ends a sink's wait for the next batch when a
// request came in.
var errSnapshotRequested = errors.New("a snapshot was requested")

// takeRequest is the sink's handler of <prefix>-snapshot.<token>: it wakes
// the pass, which cuts a snapshot if the last one is old enough.
func (s *Sink) takeRequest(*nats.Msg) {
	s.requested.Store(true)
	s.mu.Lock()
	wake := s.wake
	s.mu.Unlock()
	if wake != nil {
		wake(errSnapshotRequested)
	}
}

// requestSnapshot asks worker token's sink for a new snapshot object (core
// NATS, at most once: a lost request is sent again at the next check).
func (s *Source) requestSnapshot(token string) {
	if err := s.nc.Publish(snapshotRequestSubject(s.opts.SubjectPrefix, token), nil); err != nil {
		s.log.Debug("snapshot request not sent", "sink", token, "err", err)
	}
}
