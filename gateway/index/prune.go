package index

import (
	"slices"
	"time"
)

// PruneResult counts the entries one Prune evicted.
type PruneResult struct {
	TTL      int
	Capacity int
}

// Prune evicts entries by age and by count (SMG G1 semantics):
//
//   - TTL: entries neither stored nor read since now − TTL go; skipped while
//     the index itself is younger than the TTL.
//   - Capacity: above MaxEntries, the least recently touched entries go until
//     90 % of MaxEntries is left; entries touched in the last 2 s are spared,
//     so an all-fresh burst may exceed the bound until it ages.
//
// Eviction leaves the workers' reverse maps alone: a later removal of an
// evicted block is a no-op, and a later store of it re-files it.
func (ix *Index) Prune(now time.Time) PruneResult {
	var r PruneResult
	nowStamp := ix.stampAt(now)
	if ttl := ix.opts.TTL; ttl > 0 && now.Sub(ix.epoch) >= ttl {
		cutoff := ix.stampAt(now.Add(-ttl))
		r.TTL = ix.evictOlder(cutoff, -1)
	}
	maxEntries := ix.opts.MaxEntries
	if maxEntries <= 0 {
		return r
	}
	entries := 0
	for i := range ix.shards {
		entries += int(load(&ix.shards[i].entries))
	}
	if entries <= maxEntries {
		return r
	}
	excess := entries - (maxEntries - maxEntries/10)
	var graceEnd uint32
	if nowStamp >= capacityGrace {
		graceEnd = nowStamp - capacityGrace
	}
	// Snapshot the candidates' stamps to find the age threshold; stamps only
	// grow, so an entry touched after the snapshot is safely newer than it.
	var stamps []uint32
	for i := range ix.shards {
		sh := &ix.shards[i]
		sh.mu.Lock()
		sh.eachPos(func(_ *run, b *runBody, o int) {
			// Lookups refresh stamps without the lock: read them atomically.
			if st := b.loadStamp(o); b.hold(o) != 0 && st <= graceEnd {
				stamps = append(stamps, st)
			}
		})
		sh.mu.Unlock()
	}
	if len(stamps) == 0 {
		return r
	}
	slices.Sort(stamps)
	k := min(excess, len(stamps))
	threshold := stamps[k-1]
	// Entries strictly older than the threshold all go; of those at exactly
	// the threshold, only as many as the excess still needs.
	older := 0
	for _, s := range stamps[:k] {
		if s < threshold {
			older++
		}
	}
	r.Capacity = ix.evictOlder(threshold, -1)
	r.Capacity += ix.evictAt(threshold, k-older)
	return r
}

// evictOlder removes every entry with stamp < cutoff. limit < 0 = no limit.
func (ix *Index) evictOlder(cutoff uint32, limit int) int {
	return ix.evictWhere(func(s uint32) bool { return s < cutoff }, limit)
}

func (ix *Index) evictAt(stamp uint32, limit int) int {
	if limit <= 0 {
		return 0
	}
	return ix.evictWhere(func(s uint32) bool { return s == stamp }, limit)
}

// evictWhere clears the holders of positions whose stamp matches. Runs and
// reverse entries stay: a later removal is a no-op, a later store re-files
// the holder at the same position.
func (ix *Index) evictWhere(match func(uint32) bool, limit int) int {
	evicted := 0
	for i := range ix.shards {
		sh := &ix.shards[i]
		sh.mu.Lock()
		sh.eachPos(func(r *run, b *runBody, o int) {
			if limit >= 0 && evicted >= limit {
				return
			}
			if b.hold(o) != 0 && match(b.loadStamp(o)) {
				r.ver.Add(1)
				sh.clearPos(b, o)
				r.ver.Add(1)
				evicted++
			}
		})
		sh.mu.Unlock()
		if limit >= 0 && evicted >= limit {
			break
		}
	}
	return evicted
}

// eachPos calls f for every position of every run (mu held; stamps exist,
// as only a pruning index calls it).
func (s *shard) eachPos(f func(r *run, b *runBody, o int)) {
	d := s.dir.Load()
	for idx := range min(s.runsUsed, len(d.r)) {
		r := d.r[idx].Load()
		if r == nil {
			continue
		}
		b := r.body.Load()
		for o := range int(r.n) { // mu held
			f(r, b, o)
		}
	}
}
