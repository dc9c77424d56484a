package record

import (
	"math"
	"slices"

	"github.com/kvrelay/kvrelay/internal/livedigest"
)

const (
	segShift = 8
	segSize  = 1 << segShift
	segMask  = segSize - 1

	flagLive   = 1 << 0
	flagParent = 1 << 1

	maxOrder = math.MaxUint32

	// arenaSlack is the garbage a segment's token arena may hold before it is compacted.
	arenaSlack = 4 * segSize
)

// entry is one live (tier, hash) of a rank: 40 bytes. The tokens sit in the segment's arena. A
// freed entry keeps tokOff/tokLen so that the next entry placed in its slot can reuse the space.
type entry struct {
	hash   int64
	parent int64
	order  uint32 // store order within the rank
	tokOff uint32
	tokLen uint32
	tail   uint32 // interned store tail (tailTable id)
	extra  uint32 // extraTable id + 1, 0 for none
	copies uint8
	tier   uint8
	flags  uint8
}

// segment holds segSize entries and their tokens. Once a Cut has seen it, it is read-only: the
// record copies it before the next write (Record.writableSeg). The copy shares the token arena:
// a live entry's tokens are never rewritten, new tokens are appended past what any Cut reads, and
// the space of freed entries is reused only once no Cut is live (sharedArena).
type segment struct {
	entries     *[segSize]entry // a separate allocation of exactly 10 KiB, a size class
	tokens      []uint32
	garbage     int    // arena words no live entry uses
	epoch       uint64 // the record epoch the segment was last made private in
	sharedArena bool   // tokens may be read by a Cut through an older copy of this segment
}

func (s *segment) tokensOf(e *entry) []uint32 {
	return s.tokens[e.tokOff : e.tokOff+e.tokLen : e.tokOff+e.tokLen]
}

// putTokens places the tokens of a new entry, reusing the slot's old space when it is big enough
// and no Cut may read it.
func (s *segment) putTokens(e *entry, toks []uint32, cutsLive bool) {
	if s.sharedArena && !cutsLive {
		s.sharedArena = false
	}
	n := uint32(len(toks))
	if s.tokens == nil {
		// A segment's blocks nearly always share one size: size the arena for all of them at once.
		s.tokens = make([]uint32, 0, segSize*max(int(n), 1))
	}
	if !s.sharedArena && e.tokLen >= n && int(e.tokOff+e.tokLen) <= len(s.tokens) && e.tokLen > 0 {
		s.garbage += int(e.tokLen - n)
		copy(s.tokens[e.tokOff:], toks)
		e.tokLen = n
		return
	}
	s.garbage += int(e.tokLen)
	if s.garbage > arenaSlack && s.garbage > len(s.tokens)/2 {
		s.compact(e)
	}
	e.tokOff = uint32(len(s.tokens))
	e.tokLen = n
	s.tokens = append(s.tokens, toks...)
}

// compact rewrites the arena with only the live entries' tokens; skip is the entry being filled.
func (s *segment) compact(skip *entry) {
	live, count := 0, 0
	for i := range s.entries {
		if e := &s.entries[i]; e.flags&flagLive != 0 && e != skip {
			live += int(e.tokLen)
			count++
		}
	}
	// Room for a full segment of blocks of the average size, so refilling it does not regrow.
	room := live
	if count > 0 {
		room = segSize * ((live + count - 1) / count)
	}
	arena := make([]uint32, 0, room)
	for i := range s.entries {
		e := &s.entries[i]
		if e.flags&flagLive == 0 || e == skip {
			e.tokOff, e.tokLen = 0, 0
			continue
		}
		off := uint32(len(arena))
		arena = append(arena, s.tokens[e.tokOff:e.tokOff+e.tokLen]...)
		e.tokOff = off
	}
	s.tokens = arena
	s.garbage = 0
	s.sharedArena = false
}

// clone returns a copy of a shared segment with private entries and a shared token arena.
func (s *segment) clone(epoch uint64) *segment {
	c := &segment{entries: new([segSize]entry), epoch: epoch, tokens: s.tokens, garbage: s.garbage, sharedArena: true}
	*c.entries = *s.entries
	return c
}

// rankState is one rank's part of the record.
type rankState struct {
	segs      []*segment
	used      uint32   // slots ever handed out (the high-water mark)
	free      []uint32 // freed slots, reused first
	index     slotIndex
	entries   uint64
	blocks    uint64
	tiers     [8]uint64 // entries per tier
	nextOrder uint32
	// digest and digestBlocks: the rank's live digest (internal/livedigest)
	// and the copies it covers, kept at every copy stored or removed.
	digest, digestBlocks uint64
	evicted              uint64 // entries dropped at the cap
}

// count adds (n = 1) or takes (n = -1) one copy of hash on tier to the
// rank's digest.
func (rs *rankState) count(hash int64, tier uint8, n int) {
	if !livedigest.Covered(tier) {
		return
	}
	d := livedigest.Block(uint64(hash), tier)
	if n > 0 {
		rs.digest += d
		rs.digestBlocks++
	} else {
		rs.digest -= d
		rs.digestBlocks--
	}
}

func (rs *rankState) entry(slot uint32) *entry {
	return &rs.segs[slot>>segShift].entries[slot&segMask]
}

func (r *Record) allocSlot(rs *rankState) uint32 {
	if n := len(rs.free); n > 0 {
		slot := rs.free[n-1]
		rs.free = rs.free[:n-1]
		return slot
	}
	slot := rs.used
	if int(slot>>segShift) == len(rs.segs) {
		rs.segs = append(rs.segs, &segment{entries: new([segSize]entry), epoch: r.epoch})
	}
	rs.used++
	return slot
}

// writableSeg returns segment i of the rank, copying it first when a Cut may be reading it.
func (r *Record) writableSeg(rs *rankState, i uint32) *segment {
	seg := rs.segs[i]
	if seg.epoch != r.epoch {
		if r.shared() {
			seg = seg.clone(r.epoch)
			rs.segs[i] = seg
		} else {
			seg.epoch = r.epoch
		}
	}
	return seg
}

func (r *Record) writable(rs *rankState, slot uint32) *entry {
	return &r.writableSeg(rs, slot>>segShift).entries[slot&segMask]
}

// renumber closes the gaps in a rank's store order when the 32-bit counter runs out, keeping the
// relative order.
func (r *Record) renumber(rs *rankState) {
	type live struct {
		order uint32
		slot  uint32
	}
	var all []live
	for slot := uint32(0); slot < rs.used; slot++ {
		if e := rs.entry(slot); e.flags&flagLive != 0 {
			all = append(all, live{e.order, slot})
		}
	}
	slices.SortFunc(all, func(a, b live) int {
		switch {
		case a.order < b.order:
			return -1
		case a.order > b.order:
			return 1
		}
		return 0
	})
	for i, l := range all {
		r.writable(rs, l.slot).order = uint32(i)
	}
	rs.nextOrder = uint32(len(all))
}

// slotIndex maps (tier, hash) to a slot of the rank with linear probing over 32-bit cells (slot+1,
// 0 empty) and a parallel byte of hash fingerprint per cell, so a probe reads an entry only when
// the fingerprint matches. The keys live in the entries: 5 bytes a cell against the 24-byte slots
// plus control bytes of a Go map (see BenchmarkGoMapIndexOverhead).
type slotIndex struct {
	cells []uint32
	fps   []uint8
	n     int
	shift uint8
}

func mix(h int64, tier uint8) uint64 {
	x := uint64(h) ^ uint64(tier)*0x9E3779B97F4A7C15
	x ^= x >> 32
	x *= 0xD6E8FEB86659FD93
	x ^= x >> 32
	return x
}

// place returns a key's home cell and fingerprint.
func (ix *slotIndex) place(h int64, tier uint8) (uint64, uint8) {
	x := mix(h, tier)
	return x >> ix.shift, uint8(x)
}

func (ix *slotIndex) find(rs *rankState, h int64, tier uint8) (uint32, bool) {
	if ix.n == 0 {
		return 0, false
	}
	mask := uint64(len(ix.cells) - 1)
	i, fp := ix.place(h, tier)
	for ; ; i = (i + 1) & mask {
		c := ix.cells[i]
		if c == 0 {
			return 0, false
		}
		if ix.fps[i] != fp {
			continue
		}
		if e := rs.entry(c - 1); e.hash == h && e.tier == tier {
			return c - 1, true
		}
	}
}

func (ix *slotIndex) insert(rs *rankState, slot uint32) {
	if (ix.n+1)*4 > len(ix.cells)*3 {
		ix.resize(rs, max(len(ix.cells)*2, 64))
	}
	e := rs.entry(slot)
	ix.put(slot+1, e.hash, e.tier)
	ix.n++
}

func (ix *slotIndex) put(c uint32, h int64, tier uint8) {
	mask := uint64(len(ix.cells) - 1)
	i, fp := ix.place(h, tier)
	for ix.cells[i] != 0 {
		i = (i + 1) & mask
	}
	ix.cells[i] = c
	ix.fps[i] = fp
}

// remove deletes the cell of (tier, hash), shifting later cells of the probe run back so that no
// tombstones are needed.
func (ix *slotIndex) remove(rs *rankState, h int64, tier uint8) {
	mask := uint64(len(ix.cells) - 1)
	i, fp := ix.place(h, tier)
	for {
		c := ix.cells[i]
		if c == 0 {
			return
		}
		if ix.fps[i] == fp {
			if e := rs.entry(c - 1); e.hash == h && e.tier == tier {
				break
			}
		}
		i = (i + 1) & mask
	}
	j := i
	for {
		j = (j + 1) & mask
		c := ix.cells[j]
		if c == 0 {
			break
		}
		e := rs.entry(c - 1)
		k, _ := ix.place(e.hash, e.tier)
		// The cell at j may move to i only if its home is not cyclically within (i, j].
		if i <= j {
			if i < k && k <= j {
				continue
			}
		} else if i < k || k <= j {
			continue
		}
		ix.cells[i], ix.fps[i] = c, ix.fps[j]
		i = j
	}
	ix.cells[i] = 0
	ix.n--
	if len(ix.cells) > 1024 && ix.n*16 < len(ix.cells) {
		ix.resize(rs, len(ix.cells)/4)
	}
}

func (ix *slotIndex) resize(rs *rankState, size int) {
	old := ix.cells
	ix.cells = make([]uint32, size)
	ix.fps = make([]uint8, size)
	ix.shift = uint8(64 - log2(size))
	for _, c := range old {
		if c != 0 {
			e := rs.entry(c - 1)
			ix.put(c, e.hash, e.tier)
		}
	}
}

func log2(n int) int {
	b := 0
	for 1<<b < n {
		b++
	}
	return b
}
