package monitor

import "math"

// The thresholds are SMG's (kv_event_recovery.rs): a sequence at least
// restartWindow below the cursor cannot be a late duplicate, so the publisher
// must have restarted; an unrecoverable gap wider than gapClearThreshold has
// lost too much to keep the worker's blocks.
const (
	restartWindow     = 1024
	gapClearThreshold = 1024
)

// verdict is what admission decided for one batch on one rank.
type verdict int

const (
	// verdictApply: the batch is next in order (or the rank had no cursor).
	verdictApply verdict = iota
	// verdictStale: a duplicate at or below the cursor; dropped.
	verdictStale
	// verdictRestart: the publisher restarted; the worker's state is cleared
	// and the batch applied on the fresh state.
	verdictRestart
	// verdictReplay: a gap seen for the first time; the batch is not applied
	// and the caller reconnects with the unchanged cursor to get the gap
	// replayed.
	verdictReplay
	// verdictUnrecoveredKept: the server skipped the gap again; the gap is
	// small, so the blocks are kept and the rank is marked degraded.
	verdictUnrecoveredKept
	// verdictUnrecoveredCleared: the server skipped the gap again and it is
	// too wide to keep anything; the worker's state is cleared.
	verdictUnrecoveredCleared
)

func (v verdict) String() string {
	switch v {
	case verdictApply:
		return "apply"
	case verdictStale:
		return "stale"
	case verdictRestart:
		return "restart"
	case verdictReplay:
		return "replay"
	case verdictUnrecoveredKept:
		return "unrecovered_kept"
	case verdictUnrecoveredCleared:
		return "unrecovered_cleared"
	}
	return "unknown"
}

// admission is a verdict plus the gap size for the gap verdicts.
type admission struct {
	verdict verdict
	missed  uint64
}

// rankCursor is the recovery state of one (worker, DP rank).
type rankCursor struct {
	live bool   // a batch has been applied since the last reset
	last uint64 // last applied sequence; meaningful when live

	replayPending bool   // one replay was asked for and not yet settled
	expected      uint64 // the first sequence the pending replay should deliver

	degraded bool // the index may lack blocks this rank holds
	fresh    bool // no batch seen yet on the current connection
}

// cursors holds every rank's cursor of one worker. It is owned by the
// worker's subscription goroutine; readers take a copy under the worker lock.
type cursors struct {
	ranks map[int32]*rankCursor
}

func newCursors() cursors { return cursors{ranks: map[int32]*rankCursor{}} }

func (c *cursors) rank(r int32) *rankCursor {
	rc, ok := c.ranks[r]
	if !ok {
		rc = &rankCursor{}
		c.ranks[r] = rc
	}
	return rc
}

// admit decides what to do with batch seq on rank r and updates the rank's
// state accordingly. clears says the batch carries an engine-wide cache clear
// (a Cleared event with no ownership), which only a restarted or reset
// engine sends, so a clear at or below the cursor is a restart, not a
// duplicate.
func (c *cursors) admit(r int32, seq uint64, clears bool) admission {
	rc := c.rank(r)
	fresh := rc.fresh
	rc.fresh = false
	if !rc.live {
		rc.live, rc.last = true, seq
		rc.replayPending = false
		return admission{verdict: verdictApply}
	}
	last := rc.last
	switch {
	case last < math.MaxUint64 && seq == last+1:
		rc.last = seq
		rc.replayPending = false
		return admission{verdict: verdictApply}
	case seq <= last:
		// Servers resume strictly after the cursor, so on a fresh connection
		// nothing legitimate sits below it; engines count from 0 (vLLM,
		// SGLang) or 1 (the SMG mock) per process. A repeat of the cursor is
		// always stale: load-only heartbeats repeat it.
		restart := clears ||
			(fresh && seq < last) ||
			(seq <= 1 && seq < last) ||
			last-seq >= restartWindow
		if !restart {
			return admission{verdict: verdictStale}
		}
		c.resetOthers(r)
		*rc = rankCursor{live: true, last: seq}
		return admission{verdict: verdictRestart}
	default: // seq > last+1
		if !rc.replayPending {
			rc.replayPending = true
			rc.expected = last + 1
			return admission{verdict: verdictReplay, missed: seq - rc.expected}
		}
		// The replay was asked for and the server skipped ahead again: it
		// has no history for the gap. Settle it once; the next gap gets its
		// own single attempt.
		missed := seq - rc.expected
		rc.replayPending = false
		rc.last = seq
		if missed > gapClearThreshold {
			c.resetOthers(r)
			*rc = rankCursor{live: true, last: seq}
			return admission{verdict: verdictUnrecoveredCleared, missed: missed}
		}
		rc.degraded = true
		return admission{verdict: verdictUnrecoveredKept, missed: missed}
	}
}

// resetOthers forgets every rank's cursor but r's. It follows a clear of the
// worker's shared index state: the other ranks must start over, and must not
// read their next batch as one more restart that clears the state again.
func (c *cursors) resetOthers(r int32) {
	for k := range c.ranks {
		if k != r {
			delete(c.ranks, k)
		}
	}
}

// resetAll forgets every cursor: the next subscription asks from zero.
func (c *cursors) resetAll() { clear(c.ranks) }

// resyncTo sets rank r's cursor to a snapshot chunk's sequence.
func (c *cursors) resyncTo(r int32, seq uint64, degraded bool) {
	*c.rank(r) = rankCursor{live: true, last: seq, degraded: degraded}
}

// markFresh flags every rank as having seen nothing on a new connection.
func (c *cursors) markFresh() {
	for _, rc := range c.ranks {
		rc.fresh = true
	}
}

// anyLive reports whether some rank holds a cursor.
func (c *cursors) anyLive() bool {
	for _, rc := range c.ranks {
		if rc.live {
			return true
		}
	}
	return false
}

// resume returns what a new subscription sends: rank 0's cursor as
// start_sequence_number (0 = none) and every rank's cursor for servers that
// resume per rank.
func (c *cursors) resume() (start uint64, perRank map[int32]uint64) {
	for r, rc := range c.ranks {
		if !rc.live {
			continue
		}
		if perRank == nil {
			perRank = make(map[int32]uint64, len(c.ranks))
		}
		perRank[r] = rc.last
		if r == 0 {
			start = rc.last
		}
	}
	return start, perRank
}

// degradedCount is the number of ranks whose index state may be partial.
func (c *cursors) degradedCount() int {
	n := 0
	for _, rc := range c.ranks {
		if rc.degraded {
			n++
		}
	}
	return n
}
