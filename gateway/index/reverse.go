package index

import "math/bits"

// copiesCap bounds a tier's copy count (SMG COPIES_CAP): vLLM's "full" report
// mode re-announces hit chains without removals and would otherwise grow a
// count without bound. It must fit a nibble (see revTable.cnt).
const copiesCap = 8

// revTable maps one (worker, rank)'s engine block hashes to the position the
// index filed the block at (a packed loc, see packLoc: its run and offset,
// which also give its prefix hash), with its physical copies per tier. It is
// the index's memory hog (one slot per block a worker holds), so it is an
// open-addressing table of 12-byte slots (key and 32-bit position side by
// side: one cache line when a probe hits, but for the one slot in sixteen
// that straddles two) plus 2 bytes of metadata per slot, 14 bytes in all.
// The metadata holds the copy counts, the entry's distance from its home
// slot (4 bits, 15 meaning 15 or more) and a 4-bit tag of the key, so a
// probe walks the dense metadata (32 slots a cache line) and reads a slot
// only when the tag matches (one in sixteen of the others): that keeps
// probes short at a high load. The distance spares a deletion's backward
// shift the key and its home: without it each shifted entry was re-hashed
// (two multiplies) from a key read out of the slot array.
// Occupancy is a non-zero count: an entry whose copies all went is deleted.
//
// The slot count is not a power of two: a hash maps to its home slot by a
// multiply-high (fastrange), and the table grows by a quarter, so its load
// stays between 0.65 and 0.81 instead of halving at each doubling. (Growing
// by an eighth saved 3 B a block but cost a tenth of the replay's time in
// rehashing while caches fill.)
type revTable struct {
	slots []rslot
	meta  []uint16 // tag<<12 | distance<<8 | counts; counts: device copies in the low nibble, host in the high
	n     int
	// resizes counts reallocations, which move every entry: a writer that
	// keeps slot numbers across upserts checks it to know they still hold.
	resizes uint32
	// The most entries the table had lately: peak in the current window of
	// changes (inserts and deletions, revPeakWindow times the slot count),
	// prevPeak in the one before. A shrink leaves room for them (see del).
	// windowLeft is the changes left in the window: revPeakWindow times the
	// slot count less the changes made in it (a reallocation adds or takes
	// the difference in slots, so a window's length follows the table's
	// size as it changes). Counting down saves a multiply and a compare
	// against the length at every change.
	windowLeft, peak, prevPeak int
	// shrinkFloor, when not 0: a shrink asked for this many slots and got
	// back a table not an eighth smaller, because the allocator rounds a
	// request up to its size class (whole 8 KiB pages past 32 KiB). A shrink
	// asking for as many or more is not tried again until the table is
	// reallocated; without it, a table settled in such a band was rehashed
	// into one of the same size at every removal.
	shrinkFloor int
	// shrinkBelow: a deletion leaving fewer entries than this looks at
	// shrinking (see del). It is the load threshold's entry count for the
	// table's size, or 1 while the recent peak forbids a shrink (that holds
	// until the peak window ends or the table is reallocated: the peak only
	// rises meanwhile), so a deletion usually pays one comparison for it.
	shrinkBelow int
	// growAt: an insert into a table of this many entries grows it first
	// (the load would pass revMaxLoad16).
	growAt int
	// pool, when not nil, gives and takes back the table's arrays.
	pool *arrayPool
}

// rslot is one entry. The key is kept as two 32-bit halves so that the slot
// is 12 bytes: a uint64 field would align the struct to 8 and pad it to 16.
type rslot struct {
	keyLo, keyHi uint32 // engine block hash (the proto int64, bit for bit)
	pos          uint32 // the block's position in the forward map (packLoc), or noPos
}

func (s *rslot) key() uint64 { return uint64(s.keyLo) | uint64(s.keyHi)<<32 }

func makeSlot(k uint64, p uint32) rslot {
	return rslot{keyLo: uint32(k), keyHi: uint32(k >> 32), pos: p}
}

const (
	revMinSlots = 16
	// revMaxLoad16 (in 1/16) is the highest load before growing. The table
	// is private to one writer and tags keep its lookups cheap, but removals
	// shift whole clusters back, and clusters lengthen fast above 0.8.
	revMaxLoad16 = 13 // 0.8125
	// Below revMinLoad100 (in 1/100) a removal shrinks the table to
	// revShrunkLoad100. A worker's table grows while its cache overshoots
	// (a store lands before the engine evicts to make room) and the
	// evictions then left it two fifths empty for good: at block size 128
	// that was half the index's bytes a block.
	// The gap between the thresholds is the hysteresis: after a shrink
	// (load 0.72) the table takes an eighth more entries before growing,
	// and after a growth (load 0.65) it loses a twentieth before
	// shrinking, so a resize, O(table), is paid for by many cheap changes,
	// and a cache's usual overshoot (a store's worth) moves between them.
	// Shrinking at 0.58 changed nothing in the bs128 replay (its tables
	// sit at 0.60, just after a growth); 0.62 takes them to 0.67 (a table's
	// size is rounded up to the allocator's size class).
	revMinLoad100    = 62
	revShrunkLoad100 = 72
	// A shrink sizes the table for its recent peak at this load, and is
	// skipped when that saves less than an eighth. In the Mooncake replay
	// (512-block caches, stores of up to a request's missing blocks landing
	// before the evictions) a worker's entries swing by a quarter and more
	// every request, more than the gap between the thresholds above can
	// absorb: sized for the entries left, its table shrank on the eviction
	// and grew again on the next store, and those rehashes were a quarter of
	// the whole replay's instructions.
	revPeakLoad100 = 78
	// revPeakWindow is a peak window's length in changes, in multiples of
	// the slot count: a table forgets a peak after eight to sixteen times
	// its size in changes, and its bytes are bounded by the most entries it
	// had in that span. Half a table forgot too soon (a worker's big request
	// comes back after several small ones) and left 8 % of the replay's
	// instructions in resizes; two tables, 4.6 % (the growth while caches
	// fill included). Counted in CPU time rather than instructions, two
	// tables still paid for 4,740 resizes in the Mooncake corpus replay
	// (each a fresh allocation, its page faults and a rehash); eight bring
	// that to 2,296 and the replay's CPU time down by 11 %, for 16 % more
	// index bytes there (59.4 to 68.6 B a block). A cache whose table does
	// not swing (the synthetic bs128 replay's) does not change. Sixteen and
	// 32 saved 3-5 % more, inside the spread, for 3-6 % more bytes. See
	// docs/bench/log/2026-12-05-index-write-path.md.
	revPeakWindow = 8
)

func newRevTable(pool *arrayPool) *revTable {
	t := &revTable{pool: pool}
	t.alloc(revMinSlots, revMinSlots)
	return t
}

// alloc gives the table empty arrays of at least slots and, when they come
// from the pool, at most most slots.
func (t *revTable) alloc(slots, most int) {
	old := len(t.slots)
	if t.pool != nil {
		t.slots, t.meta = t.pool.getRev(slots, max(slots, most))
	} else {
		t.slots = fullAlloc[rslot](slots)
		t.meta = make([]uint16, len(t.slots))
	}
	t.windowLeft += revPeakWindow * (len(t.slots) - old)
	t.n = 0
	t.resizes++
	t.shrinkFloor = 0
	t.shrinkBelow = t.loadShrinkBelow()
	t.growAt = len(t.slots) * revMaxLoad16 / 16 // (n+1)*16 > slots*revMaxLoad16
}

// loadShrinkBelow is the entry count below which the table's load is under
// revMinLoad100 (n*100 < slots*revMinLoad100).
func (t *revTable) loadShrinkBelow() int {
	if len(t.slots) <= revMinSlots {
		return 0
	}
	return (len(t.slots)*revMinLoad100 + 99) / 100
}

// The metadata's fields.
const (
	metaCounts = 0x00ff
	metaDist   = 0x0f00
	metaTag    = 0xf000
	distShift  = 8
	distMax    = 15 // a distance of 15 or more
)

// distBits is the metadata's distance field for distance d (d >= 0).
func distBits(d int) uint16 { return uint16(min(d, distMax)) << distShift }

// mix spreads engine hashes (engines' hashes are not all uniform: small
// integers are legal); its top bits choose the home slot, bits 32–35 the tag.
func mix(k uint64) uint64 { return k * 0x9E3779B97F4A7C15 }

func (t *revTable) homeOf(m uint64) int {
	hi, _ := bits.Mul64(m, uint64(len(t.slots)))
	return int(hi)
}

func tagOf(m uint64) uint16 { return uint16(m>>32) << 12 }

// find returns the slot holding k, or -1.
func (t *revTable) find(k uint64) int {
	// The loops work on local copies of the slices: a store through one
	// could alias the table's fields for all the compiler knows, which
	// reloaded them at every step.
	slots := t.slots
	meta := t.meta[:len(slots)]
	m := mix(k)
	tag := tagOf(m)
	n := len(slots)
	for i := t.homeOf(m); ; {
		md := meta[i]
		if md&metaCounts == 0 {
			return -1
		}
		if md&metaTag == tag && slots[i].key() == k {
			return i
		}
		if i++; i == n {
			i = 0
		}
	}
}

// upsert returns k's slot and whether it was there; if not, k now occupies
// the returned slot with position p and counts cnt. One probe sequence serves both.
func (t *revTable) upsert(k uint64, p uint32, cnt uint8) (int, bool) {
	if t.n >= t.growAt {
		t.grow()
	}
	slots := t.slots
	meta := t.meta[:len(slots)]
	m := mix(k)
	tag := tagOf(m)
	n := len(slots)
	h := t.homeOf(m)
	i := h
	for {
		md := meta[i]
		if md&metaCounts == 0 {
			break
		}
		if md&metaTag == tag && slots[i].key() == k {
			return i, true
		}
		if i++; i == n {
			i = 0
		}
	}
	d := i - h
	if d < 0 {
		d += n
	}
	slots[i] = makeSlot(k, p)
	meta[i] = tag | distBits(d) | uint16(cnt)
	t.n++
	t.peak = max(t.peak, t.n)
	t.changed()
	return i, false
}

// changed counts one insert or deletion, and starts a new peak window every
// revPeakWindow tables of them.
func (t *revTable) changed() {
	if t.windowLeft--; t.windowLeft <= 0 {
		t.prevPeak, t.peak, t.windowLeft = t.peak, t.n, revPeakWindow*len(t.slots)
		t.shrinkBelow = t.loadShrinkBelow()
	}
}

// counts returns slot i's copy counts.
func (t *revTable) counts(i int) uint8 { return uint8(t.meta[i]) }

// setCounts sets slot i's non-zero copy counts.
func (t *revTable) setCounts(i int, c uint8) { t.meta[i] = t.meta[i]&^metaCounts | uint16(c) }

func (t *revTable) grow() {
	size := len(t.slots) + len(t.slots)/4
	t.resize(size, size+size/8)
}

// resize rehashes the table into size slots, or up to most when arrays of
// that size are at hand in the pool (size at least its entries).
func (t *revTable) resize(size, most int) {
	slots, meta := t.slots, t.meta
	t.alloc(size, most)
	n := len(t.slots)
	for j, md := range meta {
		if md&metaCounts == 0 {
			continue
		}
		h := t.homeOf(mix(slots[j].key()))
		i := h
		for t.meta[i]&metaCounts != 0 {
			if i++; i == n {
				i = 0
			}
		}
		d := i - h
		if d < 0 {
			d += n
		}
		t.slots[i], t.meta[i] = slots[j], md&^metaDist|distBits(d)
		t.n++
	}
	t.giveBack(slots, meta)
}

// giveBack returns arrays the table no longer uses to its pool.
func (t *revTable) giveBack(slots []rslot, meta []uint16) {
	if t.pool != nil {
		t.pool.putRev(slots, meta)
	}
}

// release gives the table's arrays back; the table is not used again.
func (t *revTable) release() {
	t.giveBack(t.slots, t.meta)
	t.slots, t.meta, t.n = nil, nil, 0
}

// fillsHole reports whether the entry at slot j, whose home is slot h, moves
// back into the hole at slot i during a backward-shift deletion: it does
// unless its home lies cyclically in (i, j]. Both tables use it.
func fillsHole(i, j, h int) bool {
	return (j > i && (h <= i || h > j)) || (j < i && (h <= i && h > j))
}

// farDist is the distance of the entry at slot j from its home, told from
// its key: the metadata says only that it is 15 or more. It is kept out of
// line so that its multiply-high (fixed registers) does not cost del's loop
// a reload at every step.
//
//go:noinline
func farDist(slots []rslot, j int) int {
	hi, _ := bits.Mul64(mix(slots[j].key()), uint64(len(slots)))
	d := j - int(hi)
	if d < 0 {
		d += len(slots)
	}
	return d
}

// del removes slot i with backward-shift deletion, so lookups need no
// tombstones and the table never degrades under churn.
func (t *revTable) del(i int) {
	slots := t.slots
	meta := t.meta[:len(slots)]
	n := len(slots)
	j := i
	di := 0 // j's distance past the hole at i, cyclically
	for {
		if j++; j == n {
			j = 0
		}
		di++
		md := meta[j]
		if md&metaCounts == 0 {
			break
		}
		// The entry at j moves back into the hole at i unless its home
		// lies cyclically in (i, j], that is unless it is nearer its home
		// than the hole is (fillsHole, told by distances back from j: its
		// own distance is in the metadata, unless it is 15 or more, rare,
		// when the key's home gives it). It is copied into the hole either
		// way, its distance less the shift, and the hole moves to j only
		// if it moved: the hole's contents are dead until it is filled or
		// cleared below, so the copy is harmless, and the loop has no
		// branch on whether the entry moves. That branch follows the data
		// and was mispredicted about once a deletion (callgrind's branch
		// simulation: 1.9 mispredictions a deletion, a third of the whole
		// replay's).
		dh := int(md&metaDist) >> distShift
		// moved is the entry's metadata once moved: its distance less di
		// (garbage when it stays).
		moved := md - uint16(di)<<distShift
		if dh == distMax {
			dh = farDist(slots, j)
			moved = md&^metaDist | distBits(max(dh-di, 0))
		}
		slots[i], meta[i] = slots[j], moved
		if dh >= di {
			i, di = j, 0
		}
	}
	meta[i] = 0
	t.n--
	t.changed()
	if t.n < t.shrinkBelow {
		t.shrink()
	}
}

// shrink reallocates a table whose load fell below revMinLoad100 (or that
// has drained) when its recent peak and the allocator's size classes allow.
func (t *revTable) shrink() {
	switch {
	case t.n == 0 && len(t.slots) > 1<<16:
		slots, meta := t.slots, t.meta
		t.alloc(revMinSlots, revMinSlots) // give a drained rank's memory back
		t.giveBack(slots, meta)
	case len(t.slots) > revMinSlots && t.n*100 < len(t.slots)*revMinLoad100:
		old := len(t.slots)
		// A table below the load threshold usually stays as it is, kept
		// large for its recent peak: tell that without the divisions below
		// (they were a tenth of a deletion's instructions in the Mooncake
		// corpus replay, whose tables sit there). The test is the size
		// condition below for the peak's term alone: the size is at least
		// that term, so when it exceeds old-old/8 no shrink is made, and
		// none will be until the peak window ends (the peak only rises
		// until then), so deletions stop looking (shrinkBelow 1: only a
		// drained table is looked at again).
		if max(t.peak, t.prevPeak)*100 >= (old-old/8+1)*revPeakLoad100 {
			t.shrinkBelow = 1
			break
		}
		size := max(revMinSlots, t.n*100/revShrunkLoad100, max(t.peak, t.prevPeak)*100/revPeakLoad100)
		if size <= old-old/8 && (t.shrinkFloor == 0 || size < t.shrinkFloor) {
			t.resize(size, min(size+size/8, old-old/8))
			if len(t.slots) > old-old/8 {
				t.shrinkFloor = size
			}
		}
	}
}

func (t *revTable) bytes() int { return len(t.slots)*12 + len(t.meta)*2 }

func tierCount(c uint8, tier Tier) uint8 { return c >> (4 * uint(tier)) & 0xf }

func withTierCount(c uint8, tier Tier, v uint8) uint8 {
	s := 4 * uint(tier)
	return c&^(0xf<<s) | v<<s
}
