package index

import (
	"math/bits"
	"slices"
	"sync/atomic"
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
		ix.fw.mu.Lock()
		r.TTL = ix.evictWhere(func(s uint32) bool { return s < cutoff }, -1)
		ix.fw.unlock()
	}
	maxEntries := ix.opts.MaxEntries
	if maxEntries <= 0 {
		return r
	}
	f := &ix.fw
	f.mu.Lock()
	defer f.unlock()
	entries := f.entries()
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
	f.eachHeld(func(_ uint32, r *run, o int) bool {
		// Lookups refresh stamps without the lock: read them atomically.
		if st := atomic.LoadUint32(f.stampOf(r, o)); st <= graceEnd {
			stamps = append(stamps, st)
		}
		return false
	})
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
	r.Capacity = ix.evictWhere(func(s uint32) bool { return s < threshold }, -1)
	if k-older > 0 {
		r.Capacity += ix.evictWhere(func(s uint32) bool { return s == threshold }, k-older)
	}
	return r
}

// evictWhere clears every holder of the held positions whose stamp matches,
// at most limit of them (limit < 0: no limit); the forward map's lock is
// held. Runs and reverse entries stay: a later removal is a no-op, a later
// store re-asserts the holder at the same position.
func (ix *Index) evictWhere(match func(uint32) bool, limit int) int {
	f := &ix.fw
	evicted := 0
	f.eachHeld(func(id uint32, r *run, o int) bool {
		if limit >= 0 && evicted >= limit {
			return true
		}
		if match(atomic.LoadUint32(f.stampOf(r, o))) {
			f.touch(id)
			for ci := int(r.ncov) - 1; ci >= 0; ci-- {
				if f.covers(&r.covs()[ci], uint32(o)) {
					f.uncover(r, ci, uint32(o))
				}
			}
			evicted++
		}
		return false
	})
	return evicted
}

// eachHeld calls fn for every position some worker holds, run by run (the
// forward map's lock held; fn may clear holders of the position it is
// given); fn returns true to stop.
func (f *forward) eachHeld(fn func(id uint32, r *run, o int) bool) {
	var m [maxRunLen / 64]uint64
	for id := uint32(1); id < f.nruns; id++ {
		r := f.run(id)
		if r.n == 0 || r.ncov == 0 {
			continue
		}
		clear(m[:])
		f.heldMask(r, m[:])
		for w, x := range m {
			for ; x != 0; x &= x - 1 {
				if fn(id, r, w<<6+bits.TrailingZeros64(x)) {
					return
				}
			}
		}
		if f.touched != nil && len(f.touched) >= settleEvery {
			f.settle()
		}
	}
}
