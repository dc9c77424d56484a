package sim

import (
	"fmt"
	"time"

	"github.com/kvrelay/kvrelay/sim/prefixcache"
)

// FaultKind names a fault knob.
type FaultKind string

const (
	// FaultDropEvery drops every Nth batch (counted per rank from its
	// start) from the live stream while keeping it in the replay ring; N 0
	// turns dropping off.
	FaultDropEvery FaultKind = "drop_every"
	// FaultRestart restarts the publisher as an engine restart would: new
	// sockets on the same endpoints, sequence back to 0, an empty replay
	// ring and an empty cache (lost silently; SGLang then publishes its
	// startup clear).
	FaultRestart FaultKind = "restart"
	// FaultPause holds published batches back (the cache keeps changing);
	// FaultResume sends them, in order.
	FaultPause  FaultKind = "pause"
	FaultResume FaultKind = "resume"
	// FaultTruncateReplay cuts every replay reply stream after N messages,
	// the end marker counting as one, as a ROUTER at its high-water mark
	// does; a negative N restores full replays.
	FaultTruncateReplay FaultKind = "truncate_replay"
	// FaultResetCache resets the prefix cache as reset_prefix_cache does:
	// vLLM and SGLang publish AllBlocksCleared, TokenSpeed (which never
	// emits it) publishes a removal per block.
	FaultResetCache FaultKind = "reset_cache"
	// FaultReplayDelay makes every replay request wait N milliseconds
	// before it is answered (0 turns it off and releases the requests
	// waiting), as an engine busy in its scheduler answers late: ranks of
	// one engine then prime at different times.
	FaultReplayDelay FaultKind = "replay_delay"
)

// Fault is one fault injection. Rank nil means every rank.
type Fault struct {
	Kind FaultKind `json:"kind"`
	Rank *int      `json:"rank,omitempty"`
	N    int       `json:"n,omitempty"`
}

// Fault applies f.
func (e *Engine) Fault(f Fault) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closed {
		return fmt.Errorf("sim: fault %s: engine closed", f.Kind)
	}
	ranks, err := e.ranksFor(f.Rank)
	if err != nil {
		return fmt.Errorf("sim: fault %s: %w", f.Kind, err)
	}
	switch f.Kind {
	case FaultDropEvery, FaultReplayDelay:
		if f.N < 0 {
			return fmt.Errorf("sim: fault %s: n %d must not be negative", f.Kind, f.N)
		}
	case FaultRestart, FaultPause, FaultResume, FaultTruncateReplay, FaultResetCache:
	default:
		return fmt.Errorf("sim: unknown fault kind %q (want drop_every, restart, pause, resume, truncate_replay, reset_cache or replay_delay)", f.Kind)
	}
	for _, r := range ranks {
		if err := e.faultRankLocked(f, r); err != nil {
			return fmt.Errorf("sim: fault %s on rank %d: %w", f.Kind, r, err)
		}
	}
	e.log.Info("fault injected", "kind", f.Kind, "ranks", ranks, "n", f.N)
	return nil
}

func (e *Engine) faultRankLocked(f Fault, r int) error {
	p := e.ranks[r]
	switch f.Kind {
	case FaultDropEvery:
		p.mu.Lock()
		p.dropEvery = f.N
		p.mu.Unlock()
	case FaultTruncateReplay:
		p.mu.Lock()
		p.truncate = f.N
		p.mu.Unlock()
	case FaultReplayDelay:
		p.mu.Lock()
		p.replayDelay = time.Duration(f.N) * time.Millisecond
		p.mu.Unlock()
	case FaultPause:
		return p.setPaused(true)
	case FaultResume:
		return p.setPaused(false)
	case FaultRestart:
		p.close()
		e.caches[r].Reset()
		if err := p.open(); err != nil {
			return err
		}
		return e.startupLocked(r)
	case FaultResetCache:
		var evs []prefixcache.Event
		if e.prof.clearEvent {
			evs = e.caches[r].Clear()
		} else {
			evs = e.caches[r].EvictAll()
		}
		if len(evs) > 0 {
			return e.publishLocked(r, evs)
		}
	}
	return nil
}

// PublisherStats are a rank's publisher counters.
type PublisherStats struct {
	Rank int `json:"rank"`
	// NextSeq is the next sequence to be published.
	NextSeq uint64 `json:"next_seq"`
	// Dropped counts batches withheld from the live stream by the drop
	// knob since Start.
	Dropped uint64 `json:"dropped"`
	// Replays counts replay requests served since Start.
	Replays uint64 `json:"replays"`
	// Pending counts batches held back by a pause.
	Pending int `json:"pending"`
}

// PublisherStats reports every rank's publisher counters.
func (e *Engine) PublisherStats() []PublisherStats {
	out := make([]PublisherStats, len(e.ranks))
	for r, p := range e.ranks {
		p.mu.Lock()
		out[r] = PublisherStats{Rank: r, NextSeq: p.nextSeq, Dropped: p.dropped, Replays: p.replays, Pending: len(p.pending)}
		p.mu.Unlock()
	}
	return out
}
