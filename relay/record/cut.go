package record

import (
	"math"
	"slices"
	"sync/atomic"

	"google.golang.org/protobuf/proto"

	"github.com/kvrelay/kvrelay/proto/kvpb"
)

// ChunkBlocks is the number of units (physical copies) a snapshot chunk holds before a rank's
// chunk size has to grow to fit its stamps.
const ChunkBlocks = 2048

// Cut is the record's state at one instant, readable off the lock until Release.
type Cut struct {
	rec      *Record
	ranks    []cutRank
	tails    []*tailKey
	extras   [][]byte // extraTable's wire forms
	blocks   uint64
	first    int32 // the rank an empty snapshot is attributed to
	hasFirst bool
	released atomic.Bool
}

type cutRank struct {
	rank    int32
	segs    []*segment
	used    uint32
	entries uint64
	blocks  uint64
	tiers   int // tiers holding entries
}

func (cr *cutRank) entry(slot uint32) *entry {
	return &cr.segs[slot>>segShift].entries[slot&segMask]
}

// Cut takes the state of the given ranks (all ranks when ranks is empty). It copies segment
// pointers only; the segments become copy-on-write until the Cut is released.
func (r *Record) Cut(ranks []int32) *Cut {
	r.epoch++
	r.liveCuts.Add(1)
	c := &Cut{rec: r, tails: r.tails.keys, extras: r.extras.keys}
	if len(ranks) > 0 {
		c.first, c.hasFirst = ranks[0], true
		ranks = slices.Clone(ranks)
	} else {
		for rank := range r.ranks {
			ranks = append(ranks, rank)
		}
	}
	slices.Sort(ranks)
	ranks = slices.Compact(ranks)
	for _, rank := range ranks {
		rs := r.ranks[rank]
		if rs == nil || rs.entries == 0 {
			continue
		}
		nsegs := (rs.used + segMask) >> segShift
		tiers := 0
		for _, n := range rs.tiers {
			if n > 0 {
				tiers++
			}
		}
		c.ranks = append(c.ranks, cutRank{
			rank: rank, segs: slices.Clone(rs.segs[:nsegs]), used: rs.used,
			entries: rs.entries, blocks: rs.blocks, tiers: tiers,
		})
		c.blocks += rs.blocks
	}
	return c
}

// Release lets the record write the Cut's segments in place again. Chunks must not be called
// after Release (it then returns nil). Release is idempotent.
func (c *Cut) Release() {
	if c.released.CompareAndSwap(false, true) {
		c.rec.liveCuts.Add(-1)
	}
}

// Blocks is the number of physical copies in the Cut.
func (c *Cut) Blocks() uint64 { return c.blocks }

// Entries is the number of (rank, tier, hash) entries in the Cut.
func (c *Cut) Entries() uint64 {
	var n uint64
	for _, cr := range c.ranks {
		n += cr.entries
	}
	return n
}

// Ranks lists the ranks the Cut holds blocks of, ascending.
func (c *Cut) Ranks() []int32 {
	ranks := make([]int32, len(c.ranks))
	for i, cr := range c.ranks {
		ranks[i] = cr.rank
	}
	return ranks
}

// MaxChunkBytes bounds the encoded size of a snapshot chunk: under gRPC's default 4 MiB receive
// limit (tonic's too), with room for framing, so that any gateway can take every chunk.
const MaxChunkBytes = 4<<20 - 64<<10

// Chunks orders and encodes the Cut as snapshot batches, ranks in ascending order. Exactly one
// chunk (the first) starts with AllBlocksCleared, since the gateway clears the whole worker on
// chunk index 0; index and count span all ranks. A rank's chunks carry its dp_rank (none for
// NoRank) and consecutive sequences ending at cursors[rank] (0 when absent); its chunk size
// doubles from ChunkBlocks until the chunks fit in cursor+1 sequences, but never past what keeps
// a chunk under MaxChunkBytes: where that leaves more chunks than sequences, the first ones are
// stamped 0 (a gateway sets its cursor from every chunk's stamp; only one that ignores the
// snapshot marker would drop those as stale). A rank without live blocks gets no chunk: the
// gateway then holds no cursor for it and applies its next batch as the first. An empty Cut
// yields one chunk holding only the clear, attributed to the first rank passed to Cut, else to
// the lowest rank in cursors, else to no rank at sequence 0.
func (c *Cut) Chunks(cursors map[int32]uint64, unknownBefore map[int32]uint64, timestamp float64) []*kvpb.KvEventBatch {
	st := c.Stream(cursors, unknownBefore, timestamp)
	if st == nil {
		return nil
	}
	out := make([]*kvpb.KvEventBatch, 0, st.Count())
	for b := st.Next(); b != nil; b = st.Next() {
		out = append(out, b)
	}
	return out
}

// ChunkStream hands out a Cut's snapshot chunks (as Chunks describes them) one at a time, each
// encoded only when asked for, so a subscriber that reads slowly holds one chunk, not the whole
// snapshot. It reads the Cut: Release the Cut only after the last Next.
type ChunkStream struct {
	c              *Cut
	plans          []chunkPlan
	cursors        map[int32]uint64
	unknownBefore  map[int32]uint64
	timestamp      float64
	total, emitted uint64
	// Where the next chunk starts: the plan, its chunk, the position in the plan's order, the
	// copy of that slot and the units done.
	plan           int
	chunk          uint64
	pos            int
	slotCopy, done uint64
	// NextEncoded's encoder and the previous chunk's size, to size the next buffer.
	enc     *chunkEncoder
	lastLen int
}

type chunkPlan struct {
	cr     *cutRank
	order  []uint32
	size   uint64 // units per chunk
	chunks uint64
}

// Stream plans the Cut's chunks (ordering every rank) and returns a stream of them; nil after
// Release.
func (c *Cut) Stream(cursors map[int32]uint64, unknownBefore map[int32]uint64, timestamp float64) *ChunkStream {
	if c.released.Load() {
		return nil
	}
	st := &ChunkStream{c: c, cursors: cursors, unknownBefore: unknownBefore, timestamp: timestamp}
	st.plans = make([]chunkPlan, 0, len(c.ranks))
	for i := range c.ranks {
		cr := &c.ranks[i]
		order, unitBytes := c.orderRankSized(cr)
		p := chunkPlan{cr: cr, order: order, size: ChunkBlocks}
		limit := uint64(max(1, MaxChunkBytes/unitBytes))
		cursor := cursors[cr.rank]
		p.chunks = ceilDiv(cr.blocks, p.size)
		for cursor != math.MaxUint64 && p.chunks > cursor+1 && p.size < cr.blocks && p.size*2 <= limit {
			p.size *= 2
			p.chunks = ceilDiv(cr.blocks, p.size)
		}
		if p.size > limit {
			p.size = limit
			p.chunks = ceilDiv(cr.blocks, p.size)
		}
		st.total += p.chunks
		st.plans = append(st.plans, p)
	}
	return st
}

// Count is the number of chunks the stream hands out.
func (st *ChunkStream) Count() uint64 { return max(st.total, 1) }

// Left is the number of chunks Next has yet to hand out.
func (st *ChunkStream) Left() uint64 { return st.Count() - st.emitted }

// Next builds the next chunk as a message; nil once all were handed out, or once the Cut was
// released. NextEncoded is the same chunk in its wire encoding, without the message.
func (st *ChunkStream) Next() *kvpb.KvEventBatch {
	if st.c.released.Load() {
		return nil
	}
	if st.total == 0 {
		if st.emitted > 0 {
			return nil
		}
		st.emitted++
		return st.c.emptyChunk(st.cursors, st.unknownBefore, st.timestamp)
	}
	p := st.nextPlan()
	if p == nil {
		return nil
	}
	h := st.head(p)
	w := chunkWriter{cut: st.c, cr: p.cr}
	w.reset(min(p.size, p.cr.blocks-st.done))
	if h.index == 0 {
		w.events = append(w.events, clearEvent())
	}
	st.fill(p, w.add)
	w.close()
	b := &kvpb.KvEventBatch{
		SequenceNumber: h.seq,
		Timestamp:      st.timestamp,
		Events:         w.events,
		Snapshot: &kvpb.KvSnapshotChunk{
			Index: h.index, Count: h.count, Blocks: h.blocks, UnknownBefore: h.unknownBefore,
		},
	}
	if h.rank != NoRank {
		b.DpRank = proto.Int32(h.rank)
	}
	st.finish(p)
	return b
}

// chunkHead is what a chunk's batch says besides its events.
type chunkHead struct {
	seq                   uint64
	rank                  int32
	index, count          uint32
	blocks, unknownBefore uint64
}

// nextPlan moves past the plans whose chunks are all out; nil when none is left.
func (st *ChunkStream) nextPlan() *chunkPlan {
	for st.plan < len(st.plans) && st.chunk == st.plans[st.plan].chunks {
		st.plan++
		st.chunk, st.pos, st.slotCopy, st.done = 0, 0, 0, 0
	}
	if st.plan == len(st.plans) {
		return nil
	}
	return &st.plans[st.plan]
}

// head stamps the plan's next chunk: chunk i of n ends at the cursor, cursor-(n-1-i), saturating
// at 0.
func (st *ChunkStream) head(p *chunkPlan) chunkHead {
	cursor := st.cursors[p.cr.rank]
	seq := uint64(0)
	if back := p.chunks - 1 - st.chunk; back <= cursor {
		seq = cursor - back
	}
	return chunkHead{
		seq: seq, rank: p.cr.rank, index: uint32(st.emitted), count: uint32(st.total),
		blocks: st.c.blocks, unknownBefore: st.unknownBefore[p.cr.rank],
	}
}

// fill hands the plan's next chunk of units, in order, to add.
func (st *ChunkStream) fill(p *chunkPlan, add func(slot uint32, copyIdx uint64)) {
	for n := uint64(0); n < p.size && st.pos < len(p.order); n++ {
		slot := p.order[st.pos]
		add(slot, st.slotCopy)
		st.done++
		st.slotCopy++
		if st.slotCopy == uint64(p.cr.entry(slot).copies) {
			st.pos++
			st.slotCopy = 0
		}
	}
}

// finish counts the chunk out.
func (st *ChunkStream) finish(p *chunkPlan) {
	st.chunk++
	st.emitted++
	if st.chunk == p.chunks {
		p.order = nil // done with this rank's order
	}
}

// unitSizer bounds the encoding of any one unit of a rank, as if it were an event of its own (a
// unit that chains onto the previous one costs less): the event and store framing with the
// tail's fields, the parent hash, and the block with its tokens, optionals and extra keys. The
// bound sizes a rank's chunks (Stream), so it is taken over every live entry.
type unitSizer struct {
	c         *Cut
	tailBytes map[uint32]int
	// Neighbours nearly always share a tail: the last one is remembered instead of a map
	// access per entry.
	lastTail uint32
	tb       int
	largest  int
}

func newUnitSizer(c *Cut) unitSizer {
	return unitSizer{c: c, tailBytes: map[uint32]int{}, lastTail: noTail, largest: 1}
}

// add takes a live entry of seg into the bound.
func (u *unitSizer) add(seg *segment, e *entry) {
	if e.tail != u.lastTail {
		var ok bool
		if u.tb, ok = u.tailBytes[e.tail]; !ok {
			u.tb = proto.Size(u.c.tails[e.tail].storedEvent())
			u.tailBytes[e.tail] = u.tb
		}
		u.lastTail = e.tail
	}
	var xb int
	if e.flags&flagExtra != 0 {
		xb = len(u.c.extras[seg.extraOf(e)])
	}
	// 6 per length-delimited header, 11 per varint field with its tag; the tokens as packed.
	n := 3*6 + u.tb + 11 + // event, stored, block list framing; the parent hash
		6 + 11 + 6 + 11 + 6 + // block framing; hash, block size, lora id, cache level
		6 + len(packedTokens(seg, e)) + xb
	u.largest = max(u.largest, n)
}

func ceilDiv(a, b uint64) uint64 { return (a + b - 1) / b }

func clearEvent() *kvpb.KvCacheEvent {
	return &kvpb.KvCacheEvent{Data: &kvpb.KvCacheEvent_Cleared{Cleared: &kvpb.KvCacheCleared{}}}
}

func (c *Cut) emptyChunk(cursors, unknownBefore map[int32]uint64, timestamp float64) *kvpb.KvEventBatch {
	rank, ok := c.first, c.hasFirst
	if !ok && len(cursors) > 0 {
		for r := range cursors {
			if !ok || r < rank {
				rank, ok = r, true
			}
		}
	}
	b := &kvpb.KvEventBatch{
		Timestamp: timestamp,
		Events:    []*kvpb.KvCacheEvent{clearEvent()},
		Snapshot:  &kvpb.KvSnapshotChunk{Index: 0, Count: 1},
	}
	if ok {
		b.SequenceNumber = cursors[rank]
		b.Snapshot.UnknownBefore = unknownBefore[rank]
		if rank != NoRank {
			b.DpRank = proto.Int32(rank)
		}
	}
	return b
}

// chunkWriter turns units into Stored events: consecutive first copies that chain (each one's
// parent is the previous block, same tier and tail) share one event; every extra copy is a
// one-block event of its own.
type chunkWriter struct {
	cut    *Cut
	cr     *cutRank
	events []*kvpb.KvCacheEvent
	cur    *kvpb.KvBlocksStored
	last   *entry
	// The chunk's blocks and the events' block lists are carved out of per-chunk arrays.
	blocks []kvpb.KvBlock
	ptrs   []*kvpb.KvBlock
	start  int // where cur's blocks begin in ptrs
	// Per-event copies of the tail's per-block optionals, shared by the event's blocks.
	loraID     *int64
	cacheLevel *int32
	toks       []uint32
}

func (w *chunkWriter) reset(units uint64) {
	w.events = nil
	w.cur, w.last = nil, nil
	w.blocks = make([]kvpb.KvBlock, 0, units)
	w.ptrs = make([]*kvpb.KvBlock, 0, units)
	w.start = 0
}

// close ends the current event.
func (w *chunkWriter) close() {
	if w.cur != nil {
		w.cur.Blocks = w.ptrs[w.start:len(w.ptrs):len(w.ptrs)]
	}
	w.cur, w.last = nil, nil
	w.start = len(w.ptrs)
}

func (w *chunkWriter) add(slot uint32, copyIdx uint64) {
	e := w.cr.entry(slot)
	tail := w.cut.tails[e.tail]
	if copyIdx > 0 || w.last == nil || e.flags&flagParent == 0 || e.parent != w.last.hash ||
		e.tier != w.last.tier || e.tail != w.last.tail {
		w.close()
		w.cur = tail.storedEvent()
		if e.flags&flagParent != 0 {
			w.cur.ParentBlockHash = proto.Int64(e.parent)
		}
		w.loraID, w.cacheLevel = nil, nil
		if tail.has&hasLoraID != 0 {
			w.loraID = proto.Int64(tail.loraID)
		}
		if tail.has&hasCacheLevel != 0 {
			w.cacheLevel = proto.Int32(tail.cacheLevel)
		}
		w.events = append(w.events, &kvpb.KvCacheEvent{Data: &kvpb.KvCacheEvent_Stored{Stored: w.cur}})
	}
	w.last = e
	if len(w.blocks) == cap(w.blocks) {
		w.blocks = make([]kvpb.KvBlock, 0, 64)
	}
	w.blocks = w.blocks[:len(w.blocks)+1]
	blk := &w.blocks[len(w.blocks)-1]
	blk.BlockHash = e.hash
	blk.BlockSize = tail.blockSize
	seg := w.cr.segs[slot>>segShift]
	blk.TokenIds = w.unpackTokens(seg.tokensOf(e))
	blk.LoraId, blk.CacheLevel = w.loraID, w.cacheLevel
	if e.flags&flagExtra != 0 {
		blk.ExtraKeys = decodeExtraKeys(w.cut.extras[seg.extraOf(e)])
	}
	w.ptrs = append(w.ptrs, blk)
	if copyIdx > 0 {
		w.close()
	}
}

// unpackTokens decodes packed token ids into a shared slab: the record may rewrite its arenas
// once the Cut is released, while the chunks live on in the history and the streams.
func (w *chunkWriter) unpackTokens(packed []byte) []uint32 {
	if len(packed) == 0 {
		return nil
	}
	// A token takes at least one byte: room for len(packed) of them is enough.
	if cap(w.toks)-len(w.toks) < len(packed) {
		w.toks = make([]uint32, 0, max(len(packed), 16*1024))
	}
	n := len(w.toks)
	for i := 0; i < len(packed); {
		var v uint32
		for shift := 0; ; shift += 7 {
			c := packed[i]
			i++
			v |= uint32(c&0x7f) << shift
			if c < 0x80 {
				break
			}
		}
		w.toks = append(w.toks, v)
	}
	return w.toks[n:len(w.toks):len(w.toks)]
}

// Marks of orderRank, per slot.
const (
	markWalk  = 1 // on the parent walk
	markDone  = 2 // emitted
	markState = markWalk | markDone
	markMulti = 4 // the hash has entries in several tiers
)

// orderRank lists the rank's live slots in emission order: store order, except that each entry's
// live ancestors not yet emitted come first, root first, and all tiers of a hash come together.
//
// Finding a parent by hash is the costly part (a random access per block into a table of the
// whole rank). When the rank holds a single tier, each hash has one entry, and most blocks sit in
// the slot next to their parent's (slots are handed out in store order, and freed slots come back
// in runs): then the index holds only the parents that no neighbour supplies.
func (c *Cut) orderRank(cr *cutRank) []uint32 {
	order, _ := c.orderRankSized(cr)
	return order
}

// parentNextTo finds the live parent of the entry at slot in a neighbouring slot (a rank of one
// tier: each hash has one entry).
func (cr *cutRank) parentNextTo(slot uint32, e *entry) (uint32, bool) {
	if e.flags&flagParent == 0 {
		return 0, false
	}
	if slot > 0 {
		if p := cr.entry(slot - 1); p.flags&flagLive != 0 && p.hash == e.parent {
			return slot - 1, true
		}
	}
	if slot+1 < cr.used {
		if p := cr.entry(slot + 1); p.flags&flagLive != 0 && p.hash == e.parent {
			return slot + 1, true
		}
	}
	return 0, false
}

// orderRankSized is orderRank, and the unitSizer bound of the rank's units, taken in the same
// pass over the entries that collects the store order and the parents no neighbour supplies: at
// 1 M blocks each pass reads 32 MB of entries, and these were three (and the bound's a fourth,
// in emission order), all before the first chunk can go out.
func (c *Cut) orderRankSized(cr *cutRank) ([]uint32, int) {
	marks := make([]uint8, cr.used)
	single := cr.tiers <= 1
	var wanted *hashSet
	if single {
		wanted = newHashSet()
	}
	sizer := newUnitSizer(c)
	keys := make([]uint64, 0, cr.entries)
	sorted := true // a record that never reused a slot is in store order already
	for si, seg := range cr.segs {
		base := uint32(si) << segShift
		entries := seg.entries[:min(segSize, cr.used-base)]
		for j := range entries {
			e := &entries[j]
			if e.flags&flagLive == 0 {
				continue
			}
			slot := base + uint32(j)
			if single && e.flags&flagParent != 0 {
				if _, ok := cr.parentNextTo(slot, e); !ok {
					wanted.add(e.parent)
				}
			}
			sizer.add(seg, e)
			k := uint64(e.order)<<32 | uint64(slot)
			sorted = sorted && (len(keys) == 0 || keys[len(keys)-1] < k)
			keys = append(keys, k)
		}
	}
	neighbour := func(slot uint32) (uint32, bool) { return 0, false }
	if single {
		neighbour = func(slot uint32) (uint32, bool) { return cr.parentNextTo(slot, cr.entry(slot)) }
	}
	byHash := newHashIndex(cr, marks, wanted)
	if !sorted {
		sortByHigh32(keys)
	}
	out := make([]uint32, 0, len(keys))

	type frame struct {
		slots [8]uint32
		n     uint8
		next  uint8
	}
	// collect marks every unvisited tier of hash h as on the walk, in store order.
	collect := func(h int64) frame {
		var f frame
		byHash.each(h, func(slot uint32) {
			if marks[slot]&markState == 0 && int(f.n) < len(f.slots) {
				marks[slot] |= markWalk
				f.slots[f.n] = slot
				f.n++
			}
		})
		tiers := f.slots[:f.n]
		slices.SortFunc(tiers, func(a, b uint32) int { return cmpOrder(cr.entry(a).order, cr.entry(b).order) })
		return f
	}
	// open starts the frame of a slot's hash; an empty frame means it is already under way.
	open := func(slot uint32) frame {
		if marks[slot]&markMulti != 0 {
			return collect(cr.entry(slot).hash)
		}
		var f frame
		if marks[slot]&markState == 0 {
			marks[slot] |= markWalk
			f.slots[0], f.n = slot, 1
		}
		return f
	}
	var stack []frame
	var lastHash int64
	haveLast := false
	for _, k := range keys {
		slot := uint32(k)
		if marks[slot]&markState != 0 {
			continue
		}
		// An entry of one tier whose parent is none or the entry just emitted (a chain stored in
		// order: nearly every entry) goes out as the walk below would send it, without its frames.
		if marks[slot]&markMulti == 0 {
			if e := cr.entry(slot); e.flags&flagParent == 0 || (haveLast && e.parent == lastHash) {
				marks[slot] |= markDone
				out = append(out, slot)
				lastHash, haveLast = e.hash, true
				continue
			}
		}
		stack = append(stack[:0], open(slot))
		for len(stack) > 0 {
			f := &stack[len(stack)-1]
			pushed := false
			for f.next < f.n {
				e := cr.entry(f.slots[f.next])
				f.next++
				if e.flags&flagParent == 0 || (haveLast && e.parent == lastHash) {
					continue
				}
				var p frame
				if ps, ok := neighbour(f.slots[f.next-1]); ok {
					p = open(ps)
				} else {
					p = collect(e.parent)
				}
				if p.n > 0 {
					stack = append(stack, p)
					pushed = true
					break
				}
			}
			if pushed {
				continue
			}
			for _, s := range f.slots[:f.n] {
				marks[s] = marks[s]&^markState | markDone
				out = append(out, s)
			}
			lastHash, haveLast = cr.entry(f.slots[0]).hash, true
			stack = stack[:len(stack)-1]
		}
	}
	return out, sizer.largest
}

func cmpOrder(a, b uint32) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}

// sortByHigh32 sorts keys by their upper 32 bits (the store order), an LSD radix sort over bytes.
func sortByHigh32(keys []uint64) {
	if len(keys) < 256 {
		slices.Sort(keys)
		return
	}
	tmp := make([]uint64, len(keys))
	src, dst := keys, tmp
	for shift := uint(32); shift < 64; shift += 8 {
		var count [256]int
		for _, k := range src {
			count[byte(k>>shift)]++
		}
		if count[byte(src[0]>>shift)] == len(src) {
			continue
		}
		sum := 0
		for i := range count {
			count[i], sum = sum, sum+count[i]
		}
		for _, k := range src {
			b := byte(k >> shift)
			dst[count[b]] = k
			count[b]++
		}
		src, dst = dst, src
	}
	if &src[0] != &keys[0] {
		copy(keys, src)
	}
}

// hashIndex finds a Cut's live slots by hash alone (several tiers may share one) for the parent
// walk. The hashes sit in the cells, so probing reads no entries.
type hashIndex struct {
	hashes []int64
	cells  []uint32 // slot+1, 0 empty
	shift  uint8
}

// newHashIndex indexes the rank's live slots (only those whose hash is wanted, unless wanted is
// nil) and marks those whose hash is in several tiers.
func newHashIndex(cr *cutRank, marks []uint8, wanted *hashSet) *hashIndex {
	n := int(cr.entries)
	if wanted != nil {
		n = wanted.n
	}
	size := max(64, 1<<log2(2*n))
	ix := &hashIndex{hashes: make([]int64, size), cells: make([]uint32, size), shift: uint8(64 - log2(size))}
	if wanted != nil && wanted.n == 0 {
		// Every parent sits next to its child (chains stored in order): no slot to index.
		return ix
	}
	mask := uint64(size - 1)
	for slot := uint32(0); slot < cr.used; slot++ {
		e := cr.entry(slot)
		if e.flags&flagLive == 0 || (wanted != nil && !wanted.has(e.hash)) {
			continue
		}
		i := mix(e.hash, 0) >> ix.shift
		for ; ix.cells[i] != 0; i = (i + 1) & mask {
			if ix.hashes[i] == e.hash {
				marks[slot] |= markMulti
				marks[ix.cells[i]-1] |= markMulti
			}
		}
		ix.cells[i] = slot + 1
		ix.hashes[i] = e.hash
	}
	return ix
}

func (ix *hashIndex) each(h int64, fn func(slot uint32)) {
	mask := uint64(len(ix.cells) - 1)
	for i := mix(h, 0) >> ix.shift; ix.cells[i] != 0; i = (i + 1) & mask {
		if ix.hashes[i] == h {
			fn(ix.cells[i] - 1)
		}
	}
}

// hashSet is a set of hashes with open addressing, for the few parents the neighbours miss.
type hashSet struct {
	keys  []int64
	used  []bool
	n     int
	shift uint8
}

func newHashSet() *hashSet {
	return &hashSet{keys: make([]int64, 64), used: make([]bool, 64), shift: 64 - 6}
}

func (s *hashSet) add(h int64) {
	if (s.n+1)*2 > len(s.keys) {
		old, oldUsed := s.keys, s.used
		s.keys, s.used = make([]int64, 2*len(old)), make([]bool, 2*len(old))
		s.shift--
		s.n = 0
		for i, k := range old {
			if oldUsed[i] {
				s.add(k)
			}
		}
	}
	mask := uint64(len(s.keys) - 1)
	i := mix(h, 0) >> s.shift
	for ; s.used[i]; i = (i + 1) & mask {
		if s.keys[i] == h {
			return
		}
	}
	s.keys[i], s.used[i] = h, true
	s.n++
}

func (s *hashSet) has(h int64) bool {
	mask := uint64(len(s.keys) - 1)
	for i := mix(h, 0) >> s.shift; s.used[i]; i = (i + 1) & mask {
		if s.keys[i] == h {
			return true
		}
	}
	return false
}
