package record

import (
	"encoding/binary"
	"math"
	"slices"

	"google.golang.org/protobuf/encoding/protowire"

	"github.com/kvrelay/kvrelay/internal/livedigest"
)

const (
	// 64 entries of 32 bytes: a segment's entries are one 2 KiB allocation, so copying one on
	// write (a Cut outstanding) moves 2 KiB, and a removal batch touching 64 segments 128 KiB
	// (BenchmarkApplyDuringCut). A Cut copies a pointer per 64 entries.
	segShift = 6
	segSize  = 1 << segShift
	segMask  = segSize - 1

	flagLive   = 1 << 0
	flagParent = 1 << 1
	// flagExtra: the entry's arena record ends with an extraTable id. Kept when the entry is
	// freed, with flagRecord, because together they size the record its slot may reuse.
	flagExtra = 1 << 2
	// flagRecord: tokOff points at a record of this slot in the segment's arena.
	flagRecord = 1 << 3
	// flagsKept are the flags a freed entry keeps.
	flagsKept = flagExtra | flagRecord

	maxOrder = math.MaxUint32

	// arenaSlack is the garbage (bytes) a segment's arena may hold before it is compacted, when
	// that is also more than an eighth of the arena (arenaGarbageShare). Packed records vary in
	// size, so a refilled slot often cannot take its old place: compacting at an eighth keeps a
	// churned record within a few bytes a block of a fresh one, and costs the copy of the arena
	// once per eighth of it turned over.
	arenaSlack        = 4 * segSize
	arenaGarbageShare = 8
	// extraIDBytes is the size of the extraTable id at the end of a record with flagExtra.
	extraIDBytes = 4
)

// entry is one live (tier, hash) of a rank: 32 bytes. Its tokens and extra keys' id sit in the
// segment's arena (see segment). A freed entry keeps tokOff and flagsKept so that the next entry
// placed in its slot can reuse the space.
type entry struct {
	hash   int64
	parent int64
	order  uint32 // store order within the rank
	tokOff uint32 // the entry's record in the segment's arena, when flagRecord
	tail   uint32 // interned store tail (tailTable id)
	copies uint8
	tier   uint8
	flags  uint8
}

// segment holds segSize entries and their records. Once a Cut has seen it, it is read-only: the
// record copies it before the next write (Record.writableSeg). The copy shares the arena: a live
// entry's record is never rewritten, new records are appended past what any Cut reads, and the
// space of freed entries is reused only once no Cut is live (sharedArena).
//
// An entry's record in the arena is its token ids exactly as the wire packs them (protobuf
// varints: 2-3 bytes a token at a 152k vocabulary instead of 4), preceded by their byte length
// as a varint and followed, for an entry with extra keys, by its extraTable id (4 bytes, little
// endian). The snapshot encoder copies the packed tokens as they are.
type segment struct {
	entries     *[segSize]entry // a separate allocation of exactly 2 KiB, a size class
	tokens      []byte          // the arena of records
	garbage     int             // arena bytes no live entry uses
	records     int             // records appended since the arena was last (re)built
	epoch       uint64          // the record epoch the segment was last made private in
	sharedArena bool            // records may be read by a Cut through an older copy of this segment
}

// record returns the packed tokens of the entry's record and the record's end.
func (s *segment) record(e *entry) (toks []byte, end int) {
	off := int(e.tokOff)
	n, w := uvarint(s.tokens[off:])
	start := off + w
	end = start + int(n)
	toks = s.tokens[start:end:end]
	if e.flags&flagExtra != 0 {
		end += extraIDBytes
	}
	return toks, end
}

// tokensOf is the entry's token ids, packed as on the wire.
func (s *segment) tokensOf(e *entry) []byte {
	toks, _ := s.record(e)
	return toks
}

// extraOf is the extraTable id of a live entry with flagExtra.
func (s *segment) extraOf(e *entry) uint32 {
	_, end := s.record(e)
	return binary.LittleEndian.Uint32(s.tokens[end-extraIDBytes : end])
}

// uvarint reads a varint the record itself wrote.
func uvarint(b []byte) (uint64, int) {
	var v uint64
	for i, c := range b {
		v |= uint64(c&0x7f) << (7 * i)
		if c < 0x80 {
			return v, i + 1
		}
	}
	panic("record: truncated arena record") // the arena holds only records written by putRecord
}

// putRecord places a new entry's record (tokens, and the extra id when flagExtra is set in
// flags), reusing the slot's old record when it is big enough and no Cut may read it, then sets
// the entry's flags. oldFlags are the slot's flags before (flagsKept of the freed entry).
//
// The record is packed once, straight past the arena's end, into room for its worst case (5
// bytes a token), and sized by packing it: then it either stays there or is copied into the old
// slot. Sizing the tokens first and packing them second walked them twice, a quarter of the
// record's cost per block. When the arena lacks the worst case's room, the record is sized first
// so that the arena grows by what records really take (grow), not by the worst case.
//
// Tokens come as ids (toks) or, when packed is not nil, already packed (ApplyEncoded's, checked
// to be the bytes packing the ids writes): those are copied as they are, their size known.
func (s *segment) putRecord(e *entry, oldFlags, flags uint8, toks []uint32, packed []byte, extra uint32, cutsLive bool) {
	if s.sharedArena && !cutsLive {
		s.sharedArena = false
	}
	oldCap := 0
	if oldFlags&flagRecord != 0 {
		e.flags = oldFlags
		_, end := s.record(e)
		oldCap = end - int(e.tokOff)
	}
	e.flags = flags | flagRecord
	// Bytes past len(s.tokens) are read by no Cut: a Cut's copy of this segment, sharing the
	// arena, ends at or before len(s.tokens) (see segment).
	off := len(s.tokens)
	maxTok := 5 * len(toks)
	head := protowire.SizeVarint(uint64(maxTok))
	if room := cap(s.tokens) - off; packed == nil && room >= head+maxTok+extraIDBytes {
		b := s.tokens[off : off+head+maxTok+extraIDBytes]
		end := packTokens(b, head, toks)
		tokBytes := end - head
		if w := protowire.SizeVarint(uint64(tokBytes)); w != head {
			// More than 25 tokens, packed into fewer bytes than their worst case's length takes.
			end = w + copy(b[w:], b[head:end])
			head = w
		}
		putVarint(b, 0, uint64(tokBytes))
		if flags&flagExtra != 0 {
			binary.LittleEndian.PutUint32(b[end:], extra)
			end += extraIDBytes
		}
		if !s.sharedArena && oldCap >= end {
			s.garbage += oldCap - end
			copy(s.tokens[e.tokOff:], b[:end])
			return
		}
		s.garbage += oldCap
		if s.garbage > arenaSlack && s.garbage > len(s.tokens)/arenaGarbageShare {
			// Compacting moves the arena: pack the record again after it (rare, an eighth of
			// the arena turned over).
			s.compact(e)
			s.appendRecord(e, toks, nil, extra, flags)
			return
		}
		e.tokOff = uint32(off)
		s.tokens = s.tokens[:off+end]
		s.records++
		return
	}
	if tokBytes := tokensSize(toks, packed); !s.sharedArena && oldCap >= recordSize(tokBytes, flags) {
		s.garbage += oldCap - recordSize(tokBytes, flags)
		s.writeRecord(int(e.tokOff), tokBytes, toks, packed, extra, flags)
		return
	}
	s.garbage += oldCap
	if s.garbage > arenaSlack && s.garbage > len(s.tokens)/arenaGarbageShare {
		s.compact(e)
	}
	s.appendRecord(e, toks, packed, extra, flags)
}

// appendRecord places the entry's record at the arena's end, sized first, growing the arena if
// needed.
func (s *segment) appendRecord(e *entry, toks []uint32, packed []byte, extra uint32, flags uint8) {
	tokBytes := tokensSize(toks, packed)
	n := recordSize(tokBytes, flags)
	if cap(s.tokens)-len(s.tokens) < n {
		s.grow(n)
	}
	off := len(s.tokens)
	e.tokOff = uint32(off)
	s.tokens = s.tokens[:off+n]
	s.records++
	s.writeRecord(off, tokBytes, toks, packed, extra, flags)
}

// tokensSize is the bytes the tokens take packed.
func tokensSize(toks []uint32, packed []byte) int {
	if packed != nil {
		return len(packed)
	}
	n := 0
	for _, t := range toks {
		n += varintLen32(t)
	}
	return n
}

// recordSize is the bytes of a record of tokBytes packed tokens.
func recordSize(tokBytes int, flags uint8) int {
	n := protowire.SizeVarint(uint64(tokBytes)) + tokBytes
	if flags&flagExtra != 0 {
		n += extraIDBytes
	}
	return n
}

func (s *segment) writeRecord(off, tokBytes int, toks []uint32, packed []byte, extra uint32, flags uint8) {
	i := putVarint(s.tokens, off, uint64(tokBytes))
	if packed != nil {
		i += copy(s.tokens[i:], packed)
	} else {
		i = packTokens(s.tokens, i, toks)
	}
	if flags&flagExtra != 0 {
		binary.LittleEndian.PutUint32(s.tokens[i:], extra)
	}
}

// packTokens writes token ids as varints at b[i:], which has room, and returns the end. Ids of
// 3 bytes (16,384 to 2,097,151: nine in ten of a 152k vocabulary) are written with one range
// check and one bounds check, the rest a byte per loop turn. Under callgrind, 24.8 instructions
// a token against 31.6 for kvenc.PutVarints32's loop before that took its branch-free path (not
// measured against each other since). Only Apply's messages are packed here: the relay's path
// (ApplyEncoded) copies the packed bytes the wire already has.
func packTokens(b []byte, i int, toks []uint32) int {
	for _, v := range toks {
		if v-1<<14 < 1<<21-1<<14 {
			c := b[i : i+3 : i+3]
			c[0] = byte(v) | 0x80
			c[1] = byte(v>>7) | 0x80
			c[2] = byte(v >> 14)
			i += 3
			continue
		}
		for v >= 0x80 {
			b[i] = byte(v) | 0x80
			v >>= 7
			i++
		}
		b[i] = byte(v)
		i++
	}
	return i
}

// grow makes room for a record of n bytes and, at the average record size so far, for the rest
// of the segment: a segment's records nearly always have about one size, and growing by append's
// factor would leave up to a quarter of the arena unused. The first estimate, from one record,
// aims a little low: a second, smaller growth from a better average costs a copy of a few KiB,
// while room never used stays for the segment's life. Past a segment's worth of records (freed
// slots refilled), it makes room for an eighth of a segment more.
func (s *segment) grow(n int) {
	left := segSize - s.records - 1
	avg := (len(s.tokens) + n) / (s.records + 1)
	switch {
	case s.records == 0:
		avg -= avg / 16
	case left <= 0:
		left = segSize / 8
	}
	want := len(s.tokens) + n + left*avg
	arena := slices.Grow([]byte(nil), want) // rounds up to the size class: all of it is usable
	s.tokens = append(arena, s.tokens...)
}

// compact rewrites the arena with only the live entries' records; skip is the entry being filled.
func (s *segment) compact(skip *entry) {
	live, count := 0, 0
	for i := range s.entries {
		if e := &s.entries[i]; e.flags&flagLive != 0 && e != skip {
			_, end := s.record(e)
			live += end - int(e.tokOff)
			count++
		}
	}
	// Room for a full segment of records of the average size, so refilling it does not regrow.
	room := live
	if count > 0 {
		room = segSize * ((live + count - 1) / count)
	}
	arena := make([]byte, 0, room)
	for i := range s.entries {
		e := &s.entries[i]
		if e == skip {
			continue // its record is placed after the compaction
		}
		if e.flags&flagLive == 0 {
			e.flags &^= flagsKept
			continue
		}
		_, end := s.record(e)
		off := uint32(len(arena))
		arena = append(arena, s.tokens[e.tokOff:end]...)
		e.tokOff = off
	}
	s.tokens = arena
	s.records = count
	s.garbage = 0
	s.sharedArena = false
}

// clone returns a copy of a shared segment with private entries and a shared arena.
func (s *segment) clone(epoch uint64) *segment {
	c := &segment{entries: new([segSize]entry), epoch: epoch, tokens: s.tokens, garbage: s.garbage,
		records: s.records, sharedArena: true}
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

// slotIndex maps (tier, hash) to a slot of the rank with linear probing over 32-bit cells (slot+1)
// and a parallel byte per cell, 0 for an empty cell, else 7 bits of hash fingerprint and a bit
// set when the cell is its key's home. A probe walks those bytes alone (64 cells a cache line)
// and reads a cell and its entry only when the fingerprint matches, so looking up a block the rank
// does not hold yet, every new block of a store, costs one cache miss, not two. A removal shifts
// the later cells of its run back, which needs each one's home: a cell marked at home stays
// without reading its entry (a cache miss each, most of a removal's cost before). The keys live in the entries: 5 bytes a cell against the
// 24-byte slots plus control bytes of a Go map (see BenchmarkGoMapIndexOverhead).
//
// The table's size is any multiple of 8 (a key's home is its hash scaled to the size, not masked)
// and grows by half at three quarters full, so at any size it is between half and three quarters
// full instead of doubling's three eighths to three quarters.
type slotIndex struct {
	cells []uint32
	fps   []uint8
	n     int
}

func mix(h int64, tier uint8) uint64 {
	x := uint64(h) ^ uint64(tier)*0x9E3779B97F4A7C15
	x ^= x >> 32
	x *= 0xD6E8FEB86659FD93
	x ^= x >> 32
	return x
}

// fpAtHome marks a cell that is its key's home; the byte's other 7 bits are the fingerprint.
const fpAtHome = 0x80

// place returns a key's home cell and fingerprint (7 bits, never 0: 0 marks an empty cell).
func (ix *slotIndex) place(h int64, tier uint8) (int, uint8) {
	x := mix(h, tier)
	fp := uint8(x) &^ fpAtHome
	if fp == 0 {
		fp = 1
	}
	return int((x >> 32) * uint64(len(ix.fps)) >> 32), fp
}

// fpAt is the byte of a key with fingerprint fp placed in cell i, its home being home.
func fpAt(fp uint8, i, home int) uint8 {
	if i == home {
		return fp | fpAtHome
	}
	return fp
}

func (ix *slotIndex) find(rs *rankState, h int64, tier uint8) (uint32, bool) {
	slot, _, ok := ix.lookup(rs, h, tier)
	return slot, ok
}

// probe is where a lookup ended: the key's cell when found, else the empty cell its probe run
// ended at, where an insert of the key puts it while the table is not changed in between.
type probe struct {
	cell, home int
	fp         uint8
}

// lookup is find that also returns where the probe ended, so that the insert or removal that
// follows does not hash the key and walk its run again (insertAt, removeAt).
func (ix *slotIndex) lookup(rs *rankState, h int64, tier uint8) (uint32, probe, bool) {
	if ix.n == 0 {
		return 0, probe{cell: -1}, false
	}
	home, fp := ix.place(h, tier)
	fps := ix.fps
	i := home
	for {
		f := fps[i]
		if f == 0 {
			return 0, probe{i, home, fp}, false
		}
		if f&^fpAtHome == fp {
			c := ix.cells[i]
			if e := rs.entry(c - 1); e.hash == h && e.tier == tier {
				return c - 1, probe{i, home, fp}, true
			}
		}
		if i++; i == len(fps) {
			i = 0
		}
	}
}

// touchHome reads the fingerprint and cell of a key's home, so that the find and insert that
// follow hit the cache. Called for every block of an event before any of them is applied, the
// reads do not depend on each other, and the processor overlaps their misses instead of waiting
// for one block's before it starts the next. The result only keeps the reads from being dropped.
func (ix *slotIndex) touchHome(h int64, tier uint8) uint32 {
	if ix.n == 0 {
		return 0
	}
	i, _ := ix.place(h, tier)
	return uint32(ix.fps[i]) + ix.cells[i]
}

// insertAt inserts slot's key, whose lookup ended at at (not found) with no change to the table
// since: unless the table grows first, the key goes straight into the empty cell found.
func (ix *slotIndex) insertAt(rs *rankState, slot uint32, at probe) {
	if (ix.n+1)*4 > len(ix.fps)*3 {
		ix.resize(rs, max((len(ix.fps)+len(ix.fps)/2+7)&^7, 64))
		at.cell = -1
	}
	if at.cell < 0 {
		e := rs.entry(slot)
		ix.put(slot+1, e.hash, e.tier)
	} else {
		ix.cells[at.cell] = slot + 1
		ix.fps[at.cell] = fpAt(at.fp, at.cell, at.home)
	}
	ix.n++
}

func (ix *slotIndex) put(c uint32, h int64, tier uint8) {
	home, fp := ix.place(h, tier)
	i := home
	for ix.fps[i] != 0 {
		if i++; i == len(ix.fps) {
			i = 0
		}
	}
	ix.cells[i] = c
	ix.fps[i] = fpAt(fp, i, home)
}

// remove deletes the cell of (tier, hash), shifting later cells of the probe run back so that no
// tombstones are needed.
func (ix *slotIndex) remove(rs *rankState, h int64, tier uint8) {
	if _, at, ok := ix.lookup(rs, h, tier); ok {
		ix.removeAt(rs, at.cell)
	}
}

// removeAt deletes cell i, where a lookup found its key with no change to the table since.
func (ix *slotIndex) removeAt(rs *rankState, i int) {
	size := len(ix.fps)
	j := i
	for {
		if j++; j == size {
			j = 0
		}
		f := ix.fps[j]
		if f == 0 {
			break
		}
		if f&fpAtHome != 0 {
			continue // its home is j itself, within (i, j]
		}
		c := ix.cells[j]
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
		ix.cells[i], ix.fps[i] = c, fpAt(f, i, k)
		i = j
	}
	ix.cells[i], ix.fps[i] = 0, 0
	ix.n--
	if len(ix.fps) > 1024 && ix.n*16 < len(ix.fps) {
		ix.resize(rs, (len(ix.fps)/4+7)&^7)
	}
}

func (ix *slotIndex) resize(rs *rankState, size int) {
	old, oldFps := ix.cells, ix.fps
	ix.cells = make([]uint32, size)
	ix.fps = make([]uint8, size)
	for i, c := range old {
		if oldFps[i] != 0 {
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
