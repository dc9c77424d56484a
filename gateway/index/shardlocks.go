package index

import ()

// shardLocks holds the write locks of at most two shards, taken in shard
// order so that two writers never wait on each other in a cycle. A writer
// keeps a shard locked across the consecutive blocks it files there.
//
// A held shard's version is made odd at its first change and even again at
// release, so the changes a writer makes in one go cost one pair of atomic
// increments: a pair per change was the largest cost of filing a block.
// An event's forward changes are made in one go (its reverse-table work is
// done before, with no shard locked), so a lookup that meets a run the
// event is changing reads it again until the event's forward pass is over,
// or at most settleEvery blocks of it.
type shardLocks struct {
	ix      *Index
	held    [2]int // shard numbers, ascending; -1 = none
	writing [2]bool
	runs    [2][]*run // runs of each held shard whose version is odd by our hand
	// last is the run most recently marked changing (writeRunAt), run
	// number lastIdx of shard lastShard, while that shard stays held and the
	// run's version odd: an event's blocks are mostly consecutive positions
	// of one run, and the next block finds its run here instead of through
	// the lock bookkeeping, the run directory and the list of changing runs.
	last      *run
	lastShard int
	lastIdx   uint32
	// keep, when not nil, lends runs' arrays from one event to the next (the
	// worker's scratch, guarded by its lock): growing them anew for each
	// event was a steady allocation.
	keep *[2][]*run
}

// newShardLocks returns no locks held; keep (may be nil) is the scratch
// runs' arrays are taken from and given back to at release.
func newShardLocks(ix *Index, keep *[2][]*run) shardLocks {
	l := shardLocks{ix: ix, held: [2]int{-1, -1}, keep: keep}
	if keep != nil {
		l.runs = *keep
	}
	return l
}

// cached returns run idx of shard s if it is l.last: s is held and the
// run's version is odd by our hand; nil otherwise.
func (l *shardLocks) cached(s int, idx uint32) *run {
	if l.last != nil && l.lastShard == s && l.lastIdx == idx {
		return l.last
	}
	return nil
}

// writeRunAt is writeRun for run number idx, which becomes l.last.
func (l *shardLocks) writeRunAt(s int, idx uint32, r *run) {
	if l.cached(s, idx) == r {
		return
	}
	l.writeRun(s, r)
	l.last, l.lastShard, l.lastIdx = r, s, idx
}

// forget clears l.last if it is run idx of shard s (the run was freed).
func (l *shardLocks) forget(s int, idx uint32) {
	if l.cached(s, idx) != nil {
		l.last = nil
	}
}

func (l *shardLocks) has(s int) bool { return l.held[0] == s || l.held[1] == s }

// write marks held shard s as changing (its version odd) until release.
func (l *shardLocks) write(s int) {
	for i, h := range l.held {
		if h == s {
			if !l.writing[i] {
				l.ix.shards[s].begin()
				l.writing[i] = true
			}
			return
		}
	}
	panic("index: write to a shard not locked")
}

// writeRun marks run r of held shard s as changing until its shard is let go.
func (l *shardLocks) writeRun(s int, r *run) {
	for i, h := range l.held {
		if h == s {
			for _, x := range l.runs[i] {
				if x == r {
					return
				}
			}
			r.ver.Add(1)
			l.runs[i] = append(l.runs[i], r)
			return
		}
	}
	panic("index: write to a run whose shard is not locked")
}

// settleEvery bounds how long a lookup meeting a run that an event is
// changing waits for it: an event's forward pass ends its changes (settle)
// every settleEvery blocks, so a 2,000-block snapshot chunk does not keep
// a run's or shard's version odd, and its lookups retrying, for the whole
// chunk. One pair of atomic increments per settleEvery blocks.
const settleEvery = 64

// settle ends the changes made so far to runs and shards (their versions
// even again), keeping the locks, so lookups waiting on them go ahead.
func (l *shardLocks) settle() {
	l.last = nil
	for i := range l.runs {
		for j, r := range l.runs[i] {
			r.ver.Add(1)
			l.runs[i][j] = nil
		}
		l.runs[i] = l.runs[i][:0]
		if l.writing[i] {
			l.ix.shards[l.held[i]].end()
			l.writing[i] = false
		}
	}
}

func (l *shardLocks) release() {
	for i, s := range l.held {
		if s >= 0 {
			l.drop(i)
		}
	}
	if l.keep != nil {
		*l.keep = l.runs
	}
}

// drop lets go of held slot i.
func (l *shardLocks) drop(i int) {
	s := l.held[i]
	if l.last != nil && l.lastShard == s {
		l.last = nil
	}
	for j, r := range l.runs[i] {
		r.ver.Add(1)
		l.runs[i][j] = nil
	}
	l.runs[i] = l.runs[i][:0]
	if l.writing[i] {
		l.ix.shards[s].end()
		l.writing[i] = false
	}
	l.ix.shards[s].mu.Unlock()
	l.held[i] = -1
}

// need makes shards a and b (b < 0: only a) held. It returns false when it
// had to let go of a lock first, so what the caller read under it may be
// stale.
func (l *shardLocks) need(a, b int) bool {
	if b < 0 || b == a {
		b = -1
	}
	// Let go of the shards no longer needed: a shard's version stays odd
	// while it is held and written, and lookups reading it wait.
	for i, s := range l.held {
		if s >= 0 && s != a && s != b {
			l.drop(i)
		}
	}
	if l.held[0] < 0 && l.held[1] >= 0 {
		l.held[0], l.held[1] = l.held[1], -1
		l.writing[0], l.writing[1] = l.writing[1], false
		l.runs[0], l.runs[1] = l.runs[1], l.runs[0]
	}
	if l.has(a) && (b < 0 || l.has(b)) {
		return true
	}
	lo, hi := a, b
	if b >= 0 && b < a {
		lo, hi = b, a
	}
	// Extend without letting go when the new locks all come after those held.
	top := max(l.held[0], l.held[1])
	free := 0
	for _, s := range l.held {
		if s < 0 {
			free++
		}
	}
	var addBuf [2]int
	add := addBuf[:0]
	for _, s := range []int{lo, hi} {
		if s >= 0 && !l.has(s) {
			add = append(add, s)
		}
	}
	if len(add) <= free && add[0] > top {
		for _, s := range add {
			l.ix.shards[s].mu.Lock()
			l.put(s)
		}
		return true
	}
	l.release()
	for _, s := range []int{lo, hi} {
		if s >= 0 {
			l.ix.shards[s].mu.Lock()
			l.put(s)
		}
	}
	return false
}

func (l *shardLocks) put(s int) {
	if l.held[0] < 0 {
		l.held[0] = s
	} else {
		l.held[1] = s
	}
	if l.held[1] >= 0 && l.held[1] < l.held[0] {
		l.held[0], l.held[1] = l.held[1], l.held[0]
		l.writing[0], l.writing[1] = l.writing[1], l.writing[0]
		l.runs[0], l.runs[1] = l.runs[1], l.runs[0]
	}
}
