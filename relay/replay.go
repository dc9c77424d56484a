package relay

import (
	"cmp"
	"context"
	"math"
	"slices"

	"github.com/zeebo/xxh3"
)

// The replay ROUTER: priming a rank from 0 before its first live batch,
// filling gaps, catching up after a restart, and taking the replies in
// order within their bounds.

// replayStats is what one fill obtained.
type replayStats struct {
	recovered uint64
	first     uint64 // the first recovered sequence, if recovered > 0
	answered  bool   // some replay answered (end marker or batches)
}

// fill recovers rk's sequences from..to from the replay before anything
// later is relayed. Replies below what is expected are dropped; replies past
// to are relayed too (the live copies then read as duplicates); a replay
// that stops early is asked again from the next missing sequence; whatever
// no replay gives becomes a hole.
func (r *Relay) fill(ctx context.Context, rk *rankState, from, to uint64) replayStats {
	if rk.replay == nil {
		r.lose(rk, from, to)
		return replayStats{}
	}
	msgs, complete, err := r.askReplay(ctx, rk, from)
	st, next := r.takeReplies(ctx, rk, from, to, true, msgs, complete, err)
	if next <= to && ctx.Err() == nil {
		r.lose(rk, next, to)
	}
	r.log.Info("gap filled", "rank", rk.rank, "from", from, "to", to, "recovered", st.recovered)
	return st
}

func (r *Relay) askReplay(ctx context.Context, rk *rankState, from uint64) ([]Message, bool, error) {
	msgs, complete, err := rk.replay.Replay(ctx, from)
	r.noteReplay(ctx, rk, from, complete, err)
	return msgs, complete, err
}

// askReplayHead asks for the first batch the engine holds from from on,
// and for the whole ring from a replayer that cannot stop early.
func (r *Relay) askReplayHead(ctx context.Context, rk *rankState, from uint64) ([]Message, bool, error) {
	h, ok := rk.replay.(headReplayer)
	if !ok {
		return r.askReplay(ctx, rk, from)
	}
	msgs, complete, err := h.ReplayUpTo(ctx, from, 1)
	r.noteReplay(ctx, rk, from, complete, err)
	return msgs, complete, err
}

// noteReplay logs a replay's failure once per outage and counts the request
// by result.
func (r *Relay) noteReplay(ctx context.Context, rk *rankState, from uint64, complete bool, err error) {
	result := "complete"
	switch {
	case err != nil:
		result = "error"
		if ctx.Err() == nil {
			// Once per outage: an absent engine is retried with backoff,
			// and every retry would say the same.
			rk.replayFailures++
			if rk.replayFailures == 1 {
				r.log.Warn("replay failed; retrying quietly until it answers", "rank", rk.rank, "endpoint", rk.replayEndpoint, "from", from, "err", err)
			} else {
				r.log.Debug("replay failed again", "rank", rk.rank, "endpoint", rk.replayEndpoint, "from", from, "failures", rk.replayFailures, "err", err)
			}
		}
	case !complete:
		result = "truncated"
	}
	if err == nil && rk.replayFailures > 0 {
		r.log.Info("replay answering again", "rank", rk.rank, "endpoint", rk.replayEndpoint, "failures", rk.replayFailures)
		rk.replayFailures = 0
	}
	r.metrics.replays.WithLabelValues(rk.label, result).Inc()
}

// takeReplies relays a replay's answer from expected on, and asks again
// while the answer was cut short but brought something new. With bounded,
// it stops once the range up to to is covered. It returns the next sequence
// still missing.
func (r *Relay) takeReplies(ctx context.Context, rk *rankState, expected, to uint64, bounded bool,
	msgs []Message, complete bool, err error) (replayStats, uint64) {
	var st replayStats
	// missingAt is where the previous answer lacked a sequence: a reply can
	// be missing because a send-HWM dropped it (SGLang), so a sequence is
	// declared lost only when two answers in a row lack it.
	var missingAt uint64
	haveMissing := false
	// unanswered counts attempts in a row that brought nothing: an error (no
	// connection within the timeout, a broken one) or no reply before the
	// timeout. Such an attempt says nothing about what the engine holds (a
	// busy host can miss one deadline), so it is made again before the rest
	// is written off: a replay that is down costs one more timeout per gap,
	// a hiccup no longer costs the batches.
	unanswered := 0
	// held keeps what an answer gave past the sequence it lacked. By the
	// time the engine is asked again its ring may have moved on; what only
	// the earlier answer still had was received, not lost.
	var held []Message
	// last is set when the replay is given up with held replies: they are
	// taken as the final answer, and whatever they lack is lost.
	last := false
	for round := 0; ; round++ {
		if err != nil || (len(msgs) == 0 && !complete) {
			unanswered++
			if unanswered >= maxUnansweredReplays || round+1 >= maxReplayRounds || ctx.Err() != nil {
				if held == nil || ctx.Err() != nil {
					return st, expected
				}
				// Giving up, but an earlier answer brought these: they were
				// received, so they are relayed, and only what precedes
				// them is lost.
				msgs, complete, err, held, last = held, true, nil, nil, true
			} else {
				r.log.Info("replay brought nothing; asking again", "rank", rk.rank, "from", expected, "err", err)
				msgs, complete, err = r.askReplay(ctx, rk, expected)
				continue
			}
		}
		unanswered = 0
		st.answered = true
		if held != nil {
			msgs, held = mergeReplies(msgs, held), nil
		}
		took, jumped := 0, false
		for i, m := range msgs {
			if m.Seq < expected {
				r.metrics.replayStale.WithLabelValues(rk.label).Inc()
				continue
			}
			if m.Seq > expected && m.Seq-expected > r.cfg.window() && (!bounded || m.Seq > to+1) {
				// Further ahead than the engine's ring reaches: no engine
				// answers so, and recording it as a hole would let one reply
				// put 2^63 lost batches in the counters. The answer ends
				// here; what it did not give stays missing. A gap being
				// filled may be up to twice the ring (admission lets the
				// ring fill its end), so there a reply within the gap is in
				// reach: only the head before it is lost, a bounded hole.
				r.log.Warn("replay reply beyond the engine's replay window; ignoring the rest of the answer",
					"rank", rk.rank, "expected", expected, "seq", m.Seq, "window", r.cfg.window())
				return st, expected
			}
			if m.Seq > expected {
				if !last && (!haveMissing || missingAt != expected) {
					missingAt, haveMissing, jumped = expected, true, true
					held = msgs[i:]
					break
				}
				// Asked again and still not there: the engine's ring no
				// longer holds it, or it was never buffered.
				r.lose(rk, expected, m.Seq-1)
				expected = m.Seq
			}
			r.relay(rk, m.Seq, m.Payload)
			r.metrics.recovered.WithLabelValues(rk.label).Inc()
			if st.recovered == 0 {
				st.first = m.Seq
			}
			st.recovered++
			took++
			expected = m.Seq + 1
			if m.Seq >= rk.replayedFrom {
				if rk.replayed == nil {
					rk.replayed, rk.replayedMax = map[uint64]uint64{}, 0
				}
				rk.replayed[m.Seq] = xxh3.Hash(m.Payload)
				rk.replayedMax = max(rk.replayedMax, m.Seq)
			}
		}
		switch {
		case jumped && round+1 < maxReplayRounds && ctx.Err() == nil:
		case last, took == 0, complete, bounded && expected > to,
			round+1 >= maxReplayRounds, ctx.Err() != nil:
			return st, expected
		}
		r.log.Info("replay cut short; resuming it", "rank", rk.rank, "from", expected)
		msgs, complete, err = r.askReplay(ctx, rk, expected)
	}
}

// mergeReplies joins two answers of one replay into one, in sequence
// order, each sequence once (newer's copy where both have it).
func mergeReplies(newer, older []Message) []Message {
	out := make([]Message, 0, len(newer)+len(older))
	out = append(append(out, newer...), older...)
	slices.SortStableFunc(out, func(a, b Message) int { return cmp.Compare(a.Seq, b.Seq) })
	return slices.CompactFunc(out, func(a, b Message) bool { return a.Seq == b.Seq })
}

// catchUp asks the replay for what the live stream missed with no later
// batch to reveal it: batches sent before this subscription reached the
// publisher (ZeroMQ's slow joiner), the tail of a burst the PUB dropped at
// its high-water mark, or the first batches of a publisher that restarted
// while the feed was reconnecting. It asks from the cursor itself, so the
// answer also tells whether the engine still holds the batch the relay
// relayed last: a different batch there, or nothing at or after the cursor
// in a complete answer, means a new incarnation. It reports whether it
// restarted the rank (the caller then primes it from 0).
func (r *Relay) catchUp(ctx context.Context, rk *rankState) bool {
	from := rk.cursor
	if from == math.MaxUint64 {
		return false // nothing follows; the next batch is a regression
	}
	msgs, complete, err := r.askReplay(ctx, rk, from)
	if err != nil || ctx.Err() != nil {
		return false
	}
	switch {
	case len(msgs) == 0:
		if !complete || !rk.hasLast || rk.lastSeq != from {
			return false
		}
		// The engine's ring always holds its newest batches; with none at
		// or after a batch it sent, its counter went back.
		r.restartRank(rk, replayMismatch, from)
		return true
	case msgs[0].Seq == from:
		if rk.hasLast && rk.lastSeq == from && xxh3.Hash(msgs[0].Payload) != rk.lastHash {
			r.restartRank(rk, replayMismatch, from)
			return true
		}
		msgs = msgs[1:]
	}
	if len(msgs) == 0 {
		return false
	}
	r.log.Info("catch-up replay found batches the live stream missed", "rank", rk.rank, "from", from+1, "first", msgs[0].Seq)
	cursorHash, haveCursorHash := rk.lastHash, rk.hasLast && rk.lastSeq == from
	rk.replayedFrom = from + 1
	r.takeReplies(ctx, rk, from+1, 0, false, msgs, complete, nil)
	// The catch-up ran between two live messages, so a redelivery of the
	// batch at the old cursor may still be on its way: it is now below the
	// cursor and must read as a duplicate, not as a sequence regression.
	if haveCursorHash && rk.replayed != nil {
		rk.replayed[from] = cursorHash
	}
	return false
}

// recoverStart fills 0..seq-1 for a publisher that was already counting when
// its first live batch arrived. What the replay cannot reach is unknown.
func (r *Relay) recoverStart(ctx context.Context, rk *rankState, seq uint64) {
	// No replay reaches further back than the engine's ring, so no hole
	// wider than it is recorded: a first batch at 2^63 (forged, or a
	// sequence jump) must not make 2^63 lost batches.
	var from uint64
	if w := r.cfg.window(); seq > w {
		from = seq - w
	}
	rk.replayedFrom = from
	rk.recoveringStart, rk.startOrigin = true, 0
	st := r.fill(ctx, rk, from, seq-1)
	rk.recoveringStart = false
	if st.recovered == 0 {
		// The live batch seq, relayed next, is the start: unknown_before is
		// set before the cursor reaches it.
		r.setUnknownBefore(rk, seq)
	}
	unknown := rk.unknownBefore
	if unknown == 0 {
		r.log.Info("late join recovered from the publisher's start", "rank", rk.rank, "first_live", seq, "recovered", st.recovered)
	} else {
		r.log.Warn("late join: sequences before the relay's start are unknown", "rank", rk.rank, "first_live", seq, "unknown_before", unknown)
	}
}

// recoverZero asks for sequence 0 when a publisher's first live batch is 1.
// The Rust relay takes 1 as a counter's start (smg's mock engine counts from
// 1), but the engines count from 0, and 0 is the batch a subscriber that
// joins late is likeliest to miss. A replay without 0 costs nothing: no hole
// is recorded, as for the mock.
func (r *Relay) recoverZero(ctx context.Context, rk *rankState) {
	rk.replayedFrom = 0
	for attempt := 0; attempt < 2; attempt++ {
		msgs, complete, err := r.askReplay(ctx, rk, 0)
		if err != nil || len(msgs) == 0 {
			return
		}
		if msgs[0].Seq == 0 {
			r.takeReplies(ctx, rk, 0, 0, true, msgs, complete, nil)
			return
		}
		if complete {
			return // the engine counts from 1
		}
		// An answer cut short may have lost 0 itself: ask once more.
	}
}

// prime asks the replay for everything from 0 before any live batch. It
// reports whether the engine answered (an empty but complete answer counts:
// the engine is up and has published nothing).
func (r *Relay) prime(ctx context.Context, rk *rankState) bool {
	if rk.hasCursor {
		return true
	}
	pctx, cancel := context.WithTimeout(ctx, 2*r.cfg.ReplayTimeout)
	defer cancel()
	msgs, complete, err := r.askReplay(pctx, rk, 0)
	if err != nil {
		return false
	}
	if len(msgs) == 0 {
		return complete
	}
	// An engine counting from 1 (smg's mock) lacks 0 without losing it.
	var start uint64
	if msgs[0].Seq == 1 && complete {
		start = 1
	}
	base := start
	if msgs[0].Seq-start > r.cfg.window() {
		// The ring starts further on than it could ever reach back (an
		// engine that has run for a while): what precedes it is unknown,
		// not a hole, and no hole wider than the window is recorded.
		start = msgs[0].Seq
	}
	rk.replayedFrom = 0
	rk.recoveringStart, rk.startOrigin = true, base
	st, _ := r.takeReplies(ctx, rk, start, 0, false, msgs, complete, nil)
	rk.recoveringStart = false
	if st.recovered == 0 {
		r.setUnknownBefore(rk, 0)
	}
	r.metrics.primed.WithLabelValues(rk.label).Add(float64(st.recovered))
	r.log.Info("primed from the publisher's replay", "rank", rk.rank, "batches", st.recovered, "unknown_before", rk.unknownBefore)
	return true
}

// triggerReprime asks every rank with nothing relayed to replay from 0
// again: a publisher that spoke only before the first start replay answered
// is otherwise invisible until its next batch.
func (r *Relay) triggerReprime() {
	for _, rk := range r.ranks {
		select {
		case rk.reprime <- struct{}{}:
		default:
		}
	}
}
