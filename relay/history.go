package relay

import (
	"sort"
)

// entryOverhead is what one history entry costs on top of its batch's
// encoded size (a hole costs this alone), as in the Rust relay.
const entryOverhead = 96

// entry is one slot of the interleaved history log: a relayed batch of one
// rank, or a hole (a run of that rank's sequences that passed without a
// batch). pos is the entry's place in the log; positions are never reused,
// not even across a publisher restart, so a subscriber can name "everything
// after this point" with one number.
type entry struct {
	pos   uint64
	rank  int32
	first uint64 // the batch's sequence, or the hole's first sequence
	last  uint64 // == first for a batch, the hole's last sequence
	// enc is the batch's protobuf encoding, made once when it was relayed:
	// every subscriber is sent these bytes, and they take about a third of
	// the memory the message would. nil for a hole.
	enc  []byte
	size int64
	// digest is the rank's live digest right after this batch (see
	// KvEventBatch.live_digest), sent to subscribers that ask for it.
	digest liveDigest
}

// liveDigest is a rank's anti-entropy digest and the copies it covers.
type liveDigest struct {
	sum, blocks uint64
	set         bool
}

func (e *entry) hole() bool { return e.enc == nil }

// rankSlot is where one of a rank's entries sits: its log position and the
// sequences it covers, so a rank's cursor resolves to a log position with a
// binary search.
type rankSlot struct {
	pos         uint64
	first, last uint64
}

type rankWindow struct {
	slots    []rankSlot
	head     int
	holes    int    // hole entries of this rank in the window
	holeSeqs uint64 // sequences those holes cover
}

func (w *rankWindow) live() []rankSlot { return w.slots[w.head:] }

// history is one log for every rank, bounded by entries and by bytes,
// evicted from the front. A hole run counts as one entry whatever its
// length: unlike the Rust relay's per-sequence hole slots, a long loss of one
// rank then cannot evict every other rank's history.
type history struct {
	maxEntries int
	maxBytes   int64

	entries []entry
	head    int
	nextPos uint64 // the position the next entry gets
	bytes   int64
	holes   int
	ranks   map[int32]*rankWindow
}

func newHistory(maxEntries int, maxBytes int64) *history {
	if maxEntries < 1 {
		maxEntries = 1
	}
	return &history{maxEntries: maxEntries, maxBytes: maxBytes, nextPos: 1, ranks: map[int32]*rankWindow{}}
}

func (h *history) len() int { return len(h.entries) - h.head }

// tip is the position of the newest entry, or of the last entry the log ever
// held (0 before the first one).
func (h *history) tip() uint64 { return h.nextPos - 1 }

// firstPos is the oldest position still held; with an empty log it is
// tip()+1.
func (h *history) firstPos() uint64 {
	if h.len() == 0 {
		return h.nextPos
	}
	return h.entries[h.head].pos
}

func (h *history) rank(r int32) *rankWindow {
	w := h.ranks[r]
	if w == nil {
		w = &rankWindow{}
		h.ranks[r] = w
	}
	return w
}

// pushBatch appends a relayed batch and returns its position.
// size is what it is charged, its encoded size.
func (h *history) pushBatch(rank int32, seq uint64, enc []byte, size int64, digest liveDigest) uint64 {
	if enc == nil {
		enc = []byte{} // an empty encoding is still a batch, not a hole
	}
	return h.push(entry{rank: rank, first: seq, last: seq, enc: enc, size: size + entryOverhead, digest: digest})
}

// pushHole records that rank's sequences from..to passed without a batch.
func (h *history) pushHole(rank int32, from, to uint64) uint64 {
	if to < from {
		return 0
	}
	return h.push(entry{rank: rank, first: from, last: to, size: entryOverhead})
}

func (h *history) push(e entry) uint64 {
	e.pos = h.nextPos
	h.nextPos++
	h.entries = append(h.entries, e)
	h.bytes += e.size
	w := h.rank(e.rank)
	w.slots = append(w.slots, rankSlot{pos: e.pos, first: e.first, last: e.last})
	if e.hole() {
		h.holes++
		w.holes++
		w.holeSeqs += e.last - e.first + 1
	}
	h.evict()
	return e.pos
}

func (h *history) evict() {
	for h.len() > h.maxEntries || (h.bytes > h.maxBytes && h.len() > 1) {
		e := &h.entries[h.head]
		h.bytes -= e.size
		w := h.ranks[e.rank]
		w.head++
		if e.hole() {
			h.holes--
			w.holes--
			w.holeSeqs -= e.last - e.first + 1
		}
		*e = entry{} // let the batch be collected
		h.head++
	}
	// Compact once the dead prefix outweighs the live part, so appends stay
	// amortized O(1) and memory stays proportional to the window.
	if h.head > 1024 && h.head > h.len() {
		h.entries = append(h.entries[:0:0], h.entries[h.head:]...)
		h.head = 0
	}
	for _, w := range h.ranks {
		if w.head > 1024 && w.head > len(w.slots)-w.head {
			w.slots = append(w.slots[:0:0], w.slots[w.head:]...)
			w.head = 0
		}
	}
}

// clear empties the log; positions keep counting.
func (h *history) clear() {
	h.entries = nil
	h.head = 0
	h.bytes = 0
	h.holes = 0
	h.ranks = map[int32]*rankWindow{}
}

// at returns the entry at a position inside the window.
func (h *history) at(pos uint64) *entry {
	return &h.entries[h.head+int(pos-h.firstPos())]
}

// rankBounds is the span of rank's sequences the window covers.
func (h *history) rankBounds(rank int32) (first, last uint64, ok bool) {
	w := h.ranks[rank]
	if w == nil || len(w.live()) == 0 {
		return 0, 0, false
	}
	s := w.live()
	return s[0].first, s[len(s)-1].last, true
}

// rankEntriesAfter counts rank's entries at positions after pos.
func (h *history) rankEntriesAfter(rank int32, pos uint64) int {
	w := h.ranks[rank]
	if w == nil {
		return 0
	}
	s := w.live()
	return len(s) - sort.Search(len(s), func(i int) bool { return s[i].pos > pos })
}

// rankPos is the position of the entry of rank that covers seq, which must
// lie inside the rank's bounds.
func (h *history) rankPos(rank int32, seq uint64) uint64 {
	s := h.ranks[rank].live()
	i := sort.Search(len(s), func(i int) bool { return s[i].last >= seq })
	return s[i].pos
}

// completeFrom0 reports whether rank's window holds every batch of its
// incarnation: it starts at sequence 0 and has no holes.
func (h *history) completeFrom0(rank int32) bool {
	first, _, ok := h.rankBounds(rank)
	return ok && first == 0 && h.ranks[rank].holes == 0
}

// batchesAfter appends to out the batches (holes skipped) at positions after
// pos that keep says to keep, in log order, at most limit of them (limit ≤ 0:
// no limit). It returns the position of the last entry it looked at, so a
// caller can continue from there.
func (h *history) batchesAfter(out []posBatch, pos uint64, limit int, keep func(*entry) bool) ([]posBatch, uint64) {
	start := h.firstPos()
	if pos+1 > start {
		start = pos + 1
	}
	last := pos
	for p := start; p <= h.tip(); p++ {
		if limit > 0 && len(out) >= limit {
			break
		}
		e := h.at(p)
		last = p
		if e.hole() || (keep != nil && !keep(e)) {
			continue
		}
		out = append(out, posBatch{pos: p, enc: e.enc, digest: e.digest})
	}
	return out, last
}

// posBatch is a batch with its log position, as subscribers queue it: its
// encoding (no message: a caller that asks for one has it decoded).
type posBatch struct {
	pos    uint64
	enc    []byte
	digest liveDigest
	// live marks a batch queued as it was relayed (not refilled from the
	// history), with its rank and sequence, for the latency probe.
	live bool
	rank int32
	seq  uint64
}
