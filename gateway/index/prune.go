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
		n, _, _ := ix.shards[i].stats()
		entries += n
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
		t := sh.tab.Load()
		for j := range t.n {
			if st := t.getStamp(j); t.hold(j) != 0 && st <= graceEnd {
				stamps = append(stamps, st)
			}
		}
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

func (ix *Index) evictWhere(match func(uint32) bool, limit int) int {
	evicted := 0
	var keys []uint64
	for i := range ix.shards {
		sh := &ix.shards[i]
		t := sh.writeBegin()
		keys = keys[:0]
		for j := range t.n {
			if t.hold(j) != 0 && match(t.getStamp(j)) {
				keys = append(keys, t.key(j))
			}
		}
		// Delete by key: backward shifts move entries, so slot positions from
		// the scan do not survive the first deletion.
		for _, k := range keys {
			if limit >= 0 && evicted >= limit {
				break
			}
			j := t.find(k, ix.shardBits)
			if j < 0 {
				continue
			}
			sh.mem -= holderCount(t, t.hold(j))
			sh.delSlot(t, j, ix.shardBits)
			evicted++
		}
		sh.writeEnd()
		if limit >= 0 && evicted >= limit {
			break
		}
	}
	return evicted
}
