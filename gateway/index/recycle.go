package index

import "sync"

// arrayPool recycles the arrays the index discards: a run's arrays when the
// run grows into a larger size class or is freed, a reverse table's when it
// is resized. One pool serves the whole index (the forward map and every
// worker): an array given back by one run or worker is what another one
// asks for next (split per forward shard, as it once was, the lists were too small to keep even
// one large run array (the bound of 2 KiB plus a sixteenth of a shard's
// arrays was below one 256-position array, 3 KiB, at 128 workers × 512
// blocks), and most arrays were allocated anew). Allocating them anew costs
// the collector's work in a gateway and, in a replay whose heap goal the
// collector never reaches, a page fault per fresh page.
//
// What the pool holds is bounded (fits) and counted in Stats().MemoryBytes.
// Its lock is a leaf: taken under the forward map's or a worker's lock, it takes
// none.
type arrayPool struct {
	mu sync.Mutex
	// bodies by stamped (0 or 1) and size class; rev holds reverse-table
	// arrays, oldest first (a reverse table takes any length, so a request
	// takes the first one in its range).
	bodies [2][bodyClasses][][]uint64
	rev    []revArrays
	// held is the bytes of the arrays kept here, by kind (kindBody,
	// kindRev); live, those in use (handed out and not given back), which
	// set each kind's bound. Each kind has its own, so that run arrays (given
	// back 40 times as often) cannot crowd reverse tables out.
	held, live [2]int
	// off: keep nothing (tests compare with an index that does not recycle).
	off bool
	// Counted for tests and profiles.
	bodyGets, bodyHits, revGets, revHits, puts, kept int
}

type revArrays struct {
	slots []rslot
	meta  []uint16
}

const (
	// poolMinBytes and poolLiveDiv bound what the pool keeps of each kind:
	// 64 KiB plus a 32nd of that kind's arrays in use, so at most 128 KiB
	// plus a 32nd of the index's arrays (the per-shard lists it replaced
	// allowed 2 KiB a shard, 128 KiB at 64 shards, plus a sixteenth of the
	// run arrays).
	poolMinBytes = 64 << 10
	poolLiveDiv  = 32
	// poolMaxRev bounds the reverse-table list, which a request scans.
	poolMaxRev = 32
)

const (
	kindBody = iota
	kindRev
)

// fits reports whether sz more bytes of kind k stay within its bound:
// poolMinBytes plus a poolLiveDiv'th of that kind's arrays in use.
func (p *arrayPool) fits(k, sz int) bool {
	return p.held[k]+sz <= poolMinBytes+p.live[k]/poolLiveDiv
}

// getArrays returns a run's array of size class k, stamps (stamped) zero.
// A reused array may still be read by a lookup that started before it was
// given back; the run that gave it back moved its version since, so that
// lookup will read again, and the stores here are atomic for the race
// detector's sake.
func (p *arrayPool) getArrays(k int, stamped bool) []uint64 {
	st := 0
	if stamped {
		st = 1
	}
	size := bodySizes[k]
	n := arrLen(size, stamped)
	p.mu.Lock()
	p.bodyGets++
	l := p.bodies[st][k]
	if c := len(l); c > 0 {
		h := l[c-1]
		l[c-1] = nil
		p.bodies[st][k] = l[:c-1]
		p.held[kindBody] -= n * 8
		p.live[kindBody] += n * 8
		p.bodyHits++
		p.mu.Unlock()
		for i := size; i < n; i++ {
			store64(&h[i], 0)
		}
		return h
	}
	p.live[kindBody] += n * 8
	p.mu.Unlock()
	return make([]uint64, n)
}

// putArrays gives a run's array back (its version odd, so that lookups
// reading it will read again); it is kept if the bound allows.
func (p *arrayPool) putArrays(h []uint64, stamped bool) {
	st := 0
	if stamped {
		st = 1
	}
	k := bodyClass(hsize(h, stamped))
	sz := len(h) * 8
	p.mu.Lock()
	p.puts++
	p.live[kindBody] -= sz
	if !p.off && p.fits(kindBody, sz) && len(h) == arrLen(bodySizes[k], stamped) {
		p.bodies[st][k] = append(p.bodies[st][k], h)
		p.held[kindBody] += sz
		p.kept++
	}
	p.mu.Unlock()
}

// getRev returns reverse-table arrays of at least want and at most most
// slots (most ≥ want), meta cleared; slots' contents are left as they were
// (meta says which are in use).
func (p *arrayPool) getRev(want, most int) ([]rslot, []uint16) {
	p.mu.Lock()
	p.revGets++
	for i, a := range p.rev {
		if n := len(a.slots); n >= want && n <= most {
			last := len(p.rev) - 1
			p.rev[i] = p.rev[last]
			p.rev[last] = revArrays{}
			p.rev = p.rev[:last]
			sz := revBytes(n)
			p.held[kindRev] -= sz
			p.live[kindRev] += sz
			p.revHits++
			p.mu.Unlock()
			clear(a.meta)
			return a.slots, a.meta
		}
	}
	p.mu.Unlock()
	slots := fullAlloc[rslot](want)
	meta := make([]uint16, len(slots))
	p.mu.Lock()
	p.live[kindRev] += revBytes(len(slots))
	p.mu.Unlock()
	return slots, meta
}

// putRev gives a reverse table's arrays back; they are kept if the bound
// allows.
func (p *arrayPool) putRev(slots []rslot, meta []uint16) {
	sz := revBytes(len(slots))
	p.mu.Lock()
	p.puts++
	p.live[kindRev] -= sz
	// Room is made by dropping the oldest arrays: the tables' sizes drift
	// (they grow while caches fill), and arrays kept from long ago were
	// filling the list with sizes no table asked for any more.
	for !p.off && len(p.rev) > 0 && (len(p.rev) >= poolMaxRev || !p.fits(kindRev, sz)) {
		p.held[kindRev] -= revBytes(len(p.rev[0].slots))
		last := copy(p.rev, p.rev[1:])
		p.rev[last] = revArrays{}
		p.rev = p.rev[:last]
	}
	if !p.off && p.fits(kindRev, sz) {
		p.rev = append(p.rev, revArrays{slots, meta})
		p.held[kindRev] += sz
		p.kept++
	}
	p.mu.Unlock()
}

func revBytes(slots int) int { return slots * 14 }

// heldBytes is what the pool keeps.
func (p *arrayPool) heldBytes() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.held[kindBody] + p.held[kindRev]
}
