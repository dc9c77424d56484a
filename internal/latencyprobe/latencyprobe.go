// Package latencyprobe timestamps one relayed batch at each hand-off of
// kvrelay's path, from the rank's ZeroMQ feed to the subscriber's gRPC send,
// so that the latency kvrelay adds can be broken down stage by stage
// (the stage table in docs/bench/log/2026-12-03-relay-latency.md). It is a debug hook: the
// daemon never installs a probe, and then a mark costs one atomic load. The
// bench installs one around an in-process relay.
package latencyprobe

import "sync/atomic"

// Stage is a point on the relay's path. Marks of one batch come in this
// order.
type Stage uint8

const (
	// Received: the rank's reader took the batch off its feed (zmqsource's
	// queue), the point where the no-relay control hands it to the bench.
	Received Stage = iota
	// Decoded: the rank goroutine has it and the normalizer turned the
	// msgpack into a protobuf batch.
	Decoded
	// Queued: encoded, applied to the live-block record and the history,
	// and about to be appended to every subscriber's queue.
	Queued
	// Dequeued: a subscriber's gRPC pump took it from its queue.
	Dequeued
	// Written: the pump's SendMsg returned: gRPC has it queued for its
	// HTTP/2 writer goroutine.
	Written
	// NumStages counts the stages.
	NumStages
)

var names = [NumStages]string{"received", "decoded", "queued", "dequeued", "written"}

func (s Stage) String() string {
	if s < NumStages {
		return names[s]
	}
	return "unknown"
}

// Func receives a mark: the stage one rank's batch seq reached, now.
// It runs on the relay's goroutines and must be quick and safe for
// concurrent use.
type Func func(stage Stage, rank int32, seq uint64)

var current atomic.Pointer[Func]

// Install makes f receive every mark until the returned restore is called,
// which puts back the probe installed before (nil: none).
func Install(f Func) (restore func()) {
	prev := current.Swap(&f)
	return func() { current.Store(prev) }
}

// Mark reports that rank's batch seq reached stage.
func Mark(stage Stage, rank int32, seq uint64) {
	if f := current.Load(); f != nil {
		(*f)(stage, rank, seq)
	}
}
