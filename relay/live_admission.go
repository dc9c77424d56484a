package relay

import (
	"context"
	"fmt"

	"github.com/zeebo/xxh3"
)

// A live batch's way in: admission against the rank's cursor (the verdicts
// are admission.go's), gaps filled from the replay, restarts of the
// publisher, and the losses the record and the metrics must own up to.

// admitLive applies the admission table to one live batch.
func (r *Relay) admitLive(ctx context.Context, rk *rankState, m Message) {
	if len(rk.replayed) > 0 {
		if h, ok := rk.replayed[m.Seq]; ok && h == xxh3.Hash(m.Payload) {
			r.metrics.duplicates.WithLabelValues(rk.label).Inc()
			if m.Seq >= rk.replayedMax {
				rk.replayed = nil // the live stream has caught up
			}
			return
		}
		if m.Seq >= rk.replayedMax {
			rk.replayed = nil // the live stream has caught up
		}
	}
	clear := startsWithClear(m.Payload)
	if clear && rk.hasLast && rk.hasCursor && m.Seq == rk.cursor && m.Seq == rk.lastSeq && xxh3.Hash(m.Payload) == rk.lastHash {
		r.metrics.duplicates.WithLabelValues(rk.label).Inc()
		return
	}
	maxGap := r.cfg.window()
	if rk.replay != nil {
		maxGap *= 2
	}
	v, reason := admit(rk.hasCursor, rk.cursor, m.Seq, clear, maxGap)
	if v == restart && r.staleLive(ctx, rk, m.Seq, reason) {
		return
	}
	if v == restart {
		r.restartRank(rk, reason, m.Seq)
		v = accept
	}
	if !rk.hasLiveFrom {
		r.mu.Lock()
		rk.liveFrom, rk.hasLiveFrom = m.Seq, true
		r.mu.Unlock()
	}
	switch v {
	case duplicate:
		r.metrics.duplicates.WithLabelValues(rk.label).Inc()
		return
	case gap:
		from, to := rk.cursor+1, m.Seq-1
		r.metrics.gaps.WithLabelValues(rk.label).Inc()
		r.log.Warn("publisher gap; filling it from the replay", "rank", rk.rank, "from", from, "to", to)
		rk.replayedFrom = m.Seq
		r.fill(ctx, rk, from, to)
	case accept:
		switch {
		case rk.hasCursor:
		case joinedLate(m.Seq, clear):
			r.recoverStart(ctx, rk, m.Seq)
		case m.Seq == 1 && !clear && rk.replay != nil:
			r.recoverZero(ctx, rk)
		}
	}
	if ctx.Err() != nil {
		return
	}
	// Re-admit: the replay may have run past this batch, which then has
	// been relayed already.
	if rk.hasCursor && m.Seq <= rk.cursor {
		r.metrics.duplicates.WithLabelValues(rk.label).Inc()
		return
	}
	r.relay(rk, m.Seq, m.Payload)
}

// staleLive reports whether a live batch the admission table reads as a
// restart, because it went back below the cursor, is an old batch of the
// current incarnation; it is then counted and skipped.
//
// Live batches wait on the socket while the rank loop runs a replay (the
// start replay, a catch-up). A replay that runs past them relays later
// batches, and the live copies of those are recognised by their hashes
// (replayed); but what the engine's ring no longer held when it answered
// was written off as lost or unknown, and the live copies of those arrive
// below the cursor with nothing to recognise them by. A relay that took
// them for a restart would end every subscriber with DATA_LOSS for an
// engine that never restarted. Only a batch at or past the last live one
// (a second copy of a stale batch is at it) can be such a copy: one
// incarnation's live stream is in order. For it the engine's replay
// decides, as in catchUp: an engine whose ring still holds the batch the
// relay relayed last, byte for byte, has not restarted (a new incarnation
// stamps new times). Only that batch is asked for, so a run of stale
// batches costs the engine one reply each, not a ring each. Without that
// answer (no replay, an error, no batch at the cursor, a ring that rolled
// past it) the table's verdict stands. The check trusts that the replay
// endpoint is served by the process that publishes the live stream, as
// every engine binds both.
func (r *Relay) staleLive(ctx context.Context, rk *rankState, seq uint64, reason restartReason) bool {
	switch {
	case reason != counterRestarted && reason != sequenceRegression,
		rk.replay == nil, !rk.hasCursor, !rk.hasLast, rk.lastSeq != rk.cursor,
		rk.hasLastLive && seq < rk.lastLive:
		return false
	}
	msgs, _, err := r.askReplayHead(ctx, rk, rk.cursor)
	if err != nil || len(msgs) == 0 || msgs[0].Seq != rk.cursor || xxh3.Hash(msgs[0].Payload) != rk.lastHash {
		return false
	}
	r.metrics.stale.WithLabelValues(rk.label).Inc()
	if !rk.hasLastLive || seq != rk.lastLive+1 {
		// Once per run of such batches: the next ones follow in order.
		r.log.Info("live batch older than what a replay relayed; the engine still holds the cursor's batch, so it did not restart: skipping it",
			"rank", rk.rank, "seq", seq, "cursor", rk.cursor)
	}
	return true
}

// lose records rank's sequences from..to as a hole: nothing will ever
// deliver them, and the cursor moves past them.
func (r *Relay) lose(rk *rankState, from, to uint64) {
	if to < from {
		return
	}
	r.mu.Lock()
	r.hist.pushHole(rk.rank, from, to)
	rk.cursor, rk.hasCursor = to, true
	r.mu.Unlock()
	r.metrics.lost.WithLabelValues(rk.label).Add(float64(to - from + 1))
	r.log.Warn("publisher batches lost: no replay can give them", "rank", rk.rank, "from", from, "to", to)
}

// restartRank starts a new incarnation of rk's publisher. The history is one
// log for every rank, so it is cleared whole: every live subscriber is ended
// (gateways then reset every rank and come back from zero, when they get a
// snapshot), and no entry of the old incarnation can be served to a client
// whose cursor happens to fall inside the new one.
func (r *Relay) restartRank(rk *rankState, reason restartReason, seq uint64) {
	r.mu.Lock()
	old := rk.cursor
	r.generation++
	gen := r.generation
	r.hist.clear()
	r.rec.ClearRank(rk.rank)
	rk.hasCursor, rk.cursor = false, 0
	rk.hasStart, rk.startedAt = false, 0
	rk.hasLiveFrom, rk.liveFrom = false, 0
	rk.hasLastLive, rk.lastLive = false, 0
	rk.unknownBefore = 0
	rk.restarts++
	err := fmt.Errorf("%w: publisher of rank %d at %s restarted (%s, incarnation %d); resubscribe from zero",
		ErrDataLoss, rk.rank, rk.endpoint, reason, gen)
	for s := range r.subs {
		s.end(err, "publisher_restart")
	}
	r.mu.Unlock()
	rk.norm.reset()
	rk.replayed = nil
	rk.hasLast = false
	r.metrics.unknownBefore.WithLabelValues(rk.label).Set(0)
	r.metrics.restarts.WithLabelValues(rk.label, string(reason)).Inc()
	r.log.Warn("publisher restarted", "rank", rk.rank, "reason", string(reason), "cursor", old, "seq", seq, "generation", gen)
}

func (r *Relay) setUnknownBefore(rk *rankState, unknown uint64) {
	r.mu.Lock()
	rk.unknownBefore = unknown
	r.mu.Unlock()
	r.countUnknownBefore(rk, unknown)
}

func (r *Relay) countUnknownBefore(rk *rankState, unknown uint64) {
	r.metrics.unknownBefore.WithLabelValues(rk.label).Set(float64(unknown))
	// The total adds at most one replay window per incarnation: one batch
	// with a forged sequence must not add 2^63 (the gauge has the exact
	// value).
	r.metrics.unknownBeforeStart.WithLabelValues(rk.label).Add(float64(min(unknown, r.cfg.window())))
}
