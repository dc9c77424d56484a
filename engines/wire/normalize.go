package wire

import (
	"log/slog"
	"strings"

	"github.com/kvrelay/kvrelay/proto/kvpb"
)

// mainAttentionKinds are the cache-group kinds that hold a whole prefix.
func isMainKind(kind string) bool {
	switch kind {
	case "full_attention", "mla_attention", "sink_full_attention":
		return true
	}
	return false
}

// copiesCap is the most physical copies of one block a record counts: the
// gateway's cap.
const copiesCap = 8

// tierOf maps a medium to its tier (N12); ok is false for an unknown medium.
func tierOf(medium optString) (kvpb.KvCacheTier, bool) {
	if !medium.ok {
		return kvpb.KvCacheTier_KV_CACHE_TIER_DEVICE, true
	}
	switch strings.ToUpper(medium.s) {
	case "GPU", "DEVICE":
		return kvpb.KvCacheTier_KV_CACHE_TIER_DEVICE, true
	case "CPU", "CPU_PINNED", "CPU_TIER1":
		return kvpb.KvCacheTier_KV_CACHE_TIER_HOST, true
	case "CPU_TIER2", "DISK", "NVME", "STORAGE":
		return kvpb.KvCacheTier_KV_CACHE_TIER_DISK, true
	case "EXTERNAL", "NETWORK", "REMOTE", "SHARED":
		return kvpb.KvCacheTier_KV_CACHE_TIER_EXTERNAL, true
	}
	return 0, false
}

// cacheLevelOf is KvBlock.cache_level for a tier; the device has none
// (older consumers read an absent level as the device).
func cacheLevelOf(t kvpb.KvCacheTier) (int32, bool) {
	switch t {
	case kvpb.KvCacheTier_KV_CACHE_TIER_HOST:
		return 1, true
	case kvpb.KvCacheTier_KV_CACHE_TIER_DISK:
		return 2, true
	case kvpb.KvCacheTier_KV_CACHE_TIER_EXTERNAL:
		return 3, true
	}
	return 0, false
}

func isResidencyAgent(ownership optString) bool {
	return ownership.ok && strings.EqualFold(ownership.s, "kvcr")
}

// blockRecord is what the normalizer remembers per (rank, tier, hash) of a
// block stored under a namespace (a LoRA name or a cache salt), for its
// children to inherit. Blocks without one are not remembered: a parent the
// normalizer does not know passes on nothing, which is what an empty
// namespace passes on, and most engines publish no namespace at all. The
// relay's live-block record keeps every block anyway; this table stays small.
type blockRecord struct {
	ns     uint32 // interned namespace id; 0 is the empty namespace
	copies uint8
}

type rankState struct {
	// tiers[t-1] holds tier t's records (DEVICE=1 … EXTERNAL=4).
	tiers [4]*recordTable
	// filters[t-1] is a superset of tiers[t-1]'s keys, cheap to ask.
	filters [4]recordFilter
	// groups maps a cache group to whether it is a main-attention group.
	groups map[uint32]bool
	// windowForwarded holds hashes forwarded from a sliding-window group
	// while the rank had no main group, so their removals still pass.
	windowForwarded map[int64]struct{}
}

func (s *rankState) mainSeen() bool {
	for _, main := range s.groups {
		if main {
			return true
		}
	}
	return false
}

func (s *rankState) tier(t kvpb.KvCacheTier, create bool) *recordTable {
	i := int(t) - 1
	if i < 0 || i >= len(s.tiers) {
		return nil
	}
	if s.tiers[i] == nil && create {
		s.tiers[i] = &recordTable{}
	}
	return s.tiers[i]
}

type namespace struct {
	lora, salt optString
}

// Normalizer turns one publisher stream's payloads into the proto batches a
// gateway indexes, applying smg's gates (N10-N15) and keeping the per-rank
// record behind namespace inheritance, copy counting and group policy
// (N13, N16-N18). It is not safe for concurrent use; use one per stream.
type Normalizer struct {
	dec    *decoder
	ranks  map[int32]*rankState
	counts Counts
	// eventID is the last event id handed out; ids advance once per input
	// event, forwarded or not, and survive Reset so they stay monotonic.
	eventID uint64

	nsIDs     map[namespace]uint32
	nsList    []namespace // index = id; nsList[0] is the empty namespace
	nsCompact int         // table size that triggers the next compaction

	plans   []plan
	removed []int64
	seen    hashSet

	enc encodeScratch // AppendNormalized's reused messages and slabs
}

// plan is an admitted event, waiting for its proto.
type plan struct {
	ev          *wireEvent
	tier        kvpb.KvCacheTier
	tokOff      int // first token of the first block (after tail alignment)
	ns          namespace
	removedOff  int // removals: range in Normalizer.removed
	removedN    int
	eventID     uint64
	isWindowRem bool
}

// NewNormalizer returns a Normalizer for one engine dialect.
func NewNormalizer(d Dialect) *Normalizer {
	n := &Normalizer{dec: newDecoder(d)}
	n.enc.n = n
	n.Reset()
	return n
}

// Reset forgets every rank's record, as after a publisher restart. Counters
// and event ids carry on.
func (n *Normalizer) Reset() {
	n.ranks = make(map[int32]*rankState)
	n.nsIDs = map[namespace]uint32{{}: 0}
	n.nsList = []namespace{{}}
	n.nsCompact = 1024
}

// Counts returns the cumulative counters.
func (n *Normalizer) Counts() Counts { return n.counts }

func (n *Normalizer) rank(r int32) *rankState {
	s := n.ranks[r]
	if s == nil {
		s = &rankState{groups: make(map[uint32]bool)}
		n.ranks[r] = s
	}
	return s
}

// addDrops counts the unknown or malformed events beyond those already
// counted one by one from the decoder's skipped list.
func (n *Normalizer) addDrops(d *Drops, reason DropReason, total int) {
	if extra := uint64(total) - d[reason]; extra > 0 {
		d[reason] += extra
		n.counts.Dropped[reason] += extra
	}
}

func (n *Normalizer) drop(d *Drops, reason DropReason, eventID uint64) {
	d[reason]++
	n.counts.Dropped[reason]++
	if n.counts.Dropped[reason] <= 3 {
		slog.Debug("KV event not forwarded", "event_id", eventID, "reason", reason.String())
	}
}

// Normalize decodes one payload and normalizes its events. rank is the DP
// rank of the socket the payload came from; it wins over the payload's own
// rank, as in smg's Python relay (a publisher that stamps the wrong rank
// cannot corrupt another rank's record). A negative rank means the socket's
// rank is unknown: the payload's is used, and with none the batch has no
// dp_rank and its state keys as rank -1.
//
// The error (wrapping ErrUndecodable, with the byte offset) is returned only
// when the envelope is not a batch or the msgpack is truncated or invalid;
// then no event id is consumed. A bad event costs only itself and is
// counted in the returned Drops.
//
// The batch is the caller's, but read-only in one respect: blocks whose
// extra-key lists are equal (and hold no blob) share one list of key
// messages, so changing one block's keys changes its neighbours'.
func (n *Normalizer) Normalize(payload []byte, seq uint64, rank int32) (*kvpb.KvEventBatch, Drops, error) {
	h, drops, err := n.plan(payload, rank)
	if err != nil {
		return nil, drops, err
	}
	out := &batchOut{}
	batch := &out.batch
	batch.SequenceNumber = seq
	batch.Timestamp = h.ts
	if h.hasRank {
		out.rank = h.rank
		batch.DpRank = &out.rank
	}
	n.build(out, h.blocks, h.tokens)
	return batch, drops, nil
}

// batchHead is what a planned batch says besides its events.
type batchHead struct {
	ts             float64
	rank           int32
	hasRank        bool
	blocks, tokens int // in the admitted stores
}

// plan decodes a payload and runs every event through the gates and the
// per-rank record, leaving the admitted events in n.plans for build or
// encode. Both output paths share it, so they cannot disagree on what is
// forwarded.
func (n *Normalizer) plan(payload []byte, rank int32) (batchHead, Drops, error) {
	var drops Drops
	var h batchHead
	x := n.dec
	if err := x.decode(payload); err != nil {
		n.counts.UndecodableBatches++
		return h, drops, err
	}
	h.ts = x.ts
	key := int32(-1)
	switch {
	case rank >= 0:
		h.rank, h.hasRank, key = rank, true, rank
	case x.hasRank:
		h.rank, h.hasRank, key = x.rank, true, x.rank
	}
	base := n.eventID
	n.eventID += uint64(x.total)

	// Unknown and malformed events were counted, not kept, by the decoder;
	// the first few of them are logged like every other drop.
	for _, s := range x.skipped {
		reason := DropUnknownType
		if s.kind == kindMalformed {
			reason = DropMalformed
		}
		if n.counts.Dropped[reason] < 3 {
			slog.Debug("KV event not forwarded", "event_id", base+uint64(s.index)+1,
				"reason", reason.String(), "field", s.missing)
		}
		n.counts.Dropped[reason]++
		drops[reason]++
	}
	n.addDrops(&drops, DropUnknownType, x.unknown)
	n.addDrops(&drops, DropMalformed, x.malformed)

	// Learn the batch's groups before normalizing any event: an engine
	// lists a sliding-window group's store before the full-attention
	// group's in one step, and the window group's fate depends on whether
	// the rank has a main group at all.
	for i := range x.events {
		ev := &x.events[i]
		if ev.kind == kindStored && ev.groupIdx.ok && ev.specKind.ok {
			n.rank(key).groups[ev.groupIdx.v] = isMainKind(ev.specKind.s)
		}
	}

	n.plans = n.plans[:0]
	n.removed = n.removed[:0]
	blocks, tokens := 0, 0
	for i := range x.events {
		ev := &x.events[i]
		id := base + uint64(ev.index) + 1
		var p plan
		var ok bool
		switch ev.kind {
		case kindCleared:
			if isResidencyAgent(ev.ownership) {
				n.drop(&drops, DropUnsupportedOwnership, id)
				continue
			}
			delete(n.ranks, key)
			n.counts.ForwardedCleared++
			p, ok = plan{ev: ev}, true
		case kindStored:
			p, ok = n.stored(ev, key, id, &drops)
			if ok {
				blocks += ev.hashN
				tokens += ev.hashN * int(ev.blockSize)
			}
		case kindRemoved:
			p, ok = n.removedEvent(ev, key, id, &drops)
		}
		if ok {
			p.eventID = id
			n.plans = append(n.plans, p)
		}
	}
	h.blocks, h.tokens = blocks, tokens
	n.maybeCompactNamespaces()
	return h, drops, nil
}

type admitted struct {
	tier       kvpb.KvCacheTier
	windowOnly bool
}

// admit applies the gates stores and removals share (N10-N13).
func (n *Normalizer) admit(ev *wireEvent, key int32, id uint64, drops *Drops, learn bool) (admitted, bool) {
	if isResidencyAgent(ev.ownership) {
		n.drop(drops, DropUnsupportedOwnership, id)
		return admitted{}, false
	}
	if ev.locality.ok && !strings.EqualFold(ev.locality.s, "LOCAL") {
		n.drop(drops, DropNonLocalLocality, id)
		return admitted{}, false
	}
	tier, ok := tierOf(ev.medium)
	if !ok {
		n.drop(drops, DropUnknownMedium, id)
		return admitted{}, false
	}
	a := admitted{tier: tier}
	if ev.groupIdx.ok {
		state := n.rank(key)
		var main bool
		if ev.specKind.ok {
			main = isMainKind(ev.specKind.s)
			if learn {
				state.groups[ev.groupIdx.v] = main
			}
		} else {
			// A kind-less event follows its learned group; an unknown
			// group counts as main, as a single-group publisher's does.
			learned, known := state.groups[ev.groupIdx.v]
			main = learned || !known
		}
		if !main {
			forwardedBefore := false
			if !learn {
				for _, h := range n.dec.hashes[ev.hashOff : ev.hashOff+ev.hashN] {
					if _, ok := state.windowForwarded[h]; ok {
						forwardedBefore = true
						break
					}
				}
			}
			if state.mainSeen() && !forwardedBefore {
				n.drop(drops, DropNonMainAttentionGroup, id)
				return admitted{}, false
			}
			a.windowOnly = true
		}
	}
	return a, true
}

func (n *Normalizer) stored(ev *wireEvent, key int32, id uint64, drops *Drops) (plan, bool) {
	a, ok := n.admit(ev, key, id, drops, true)
	if !ok {
		return plan{}, false
	}
	if ev.hashN == 0 || ev.tokN == 0 {
		n.drop(drops, DropPlaceholder, id)
		return plan{}, false
	}
	width := ev.blockSize
	if width <= 0 || width >= 1<<31 {
		n.drop(drops, DropUnalignedBlocks, id)
		return plan{}, false
	}
	// The hashes name block_size tokens each, normally the whole span. A
	// sliding-window store spans the whole computed range while naming only
	// the window's newest blocks, so fewer hashes take the tail of the
	// tokens (the Rust relay's rule; the Python relay drops these).
	span := int64(ev.tokN)
	need := int64(ev.hashN) * width // both < 2^32, cannot overflow
	tokOff := ev.tokOff
	tailAligned := false
	switch {
	case need == span:
	case need < span && span%width == 0:
		tokOff += int(span - need)
		tailAligned = true
	default:
		n.drop(drops, DropUnalignedBlocks, id)
		return plan{}, false
	}
	hashes := n.dec.hashes[ev.hashOff : ev.hashOff+ev.hashN]
	if selfReferencing(hashes, ev.parent, &n.seen) {
		n.drop(drops, DropSelfReferencingHashes, id)
		return plan{}, false
	}

	// Namespace (N16): the event's, else vLLM's salt in block 0's extra
	// keys, else whatever the parent's record on this rank and tier holds.
	ns := namespace{lora: nonEmpty(ev.loraName), salt: nonEmpty(ev.cacheSalt)}
	if !ns.salt.ok {
		ns.salt = saltFromExtraKeys(ev.extraKeys, ns.lora)
	}
	state := n.rank(key)
	records := state.tier(a.tier, true)
	filter := &state.filters[a.tier-1]
	if (!ns.lora.ok || !ns.salt.ok) && ev.parent.ok {
		if rec, ok := records.get(ev.parent.v); ok && rec.ns != 0 {
			parent := n.nsList[rec.ns]
			if !ns.lora.ok {
				ns.lora = parent.lora
			}
			if !ns.salt.ok {
				ns.salt = parent.salt
			}
		}
	}
	nsID := n.namespaceID(ns)
	if nsID != 0 || records.len() > 0 {
		for _, h := range hashes {
			if nsID == 0 && !filter.mayHold(h) {
				continue // not recorded, and a block without a namespace is not recorded
			}
			i := records.find(h)
			if i < 0 {
				if nsID != 0 {
					records.insert(h, blockRecord{ns: nsID, copies: 1})
					filter.add(h, records)
				}
				continue
			}
			rec := &records.slots[i].rec
			if rec.copies < copiesCap {
				rec.copies++
			}
			rec.ns = nsID
		}
	}
	if ev.bigram {
		n.counts.BigramStores++
	}
	if tailAligned {
		n.counts.TailAlignedStores++
	}
	if a.windowOnly {
		n.counts.WindowOnlyStores++
		if state.windowForwarded == nil {
			state.windowForwarded = make(map[int64]struct{})
		}
		for _, h := range hashes {
			state.windowForwarded[h] = struct{}{}
		}
	}
	n.counts.ForwardedStored++
	return plan{ev: ev, tier: a.tier, tokOff: tokOff, ns: ns}, true
}

// selfReferencing reports a hash repeated within the store or equal to its
// parent (N15). seen is scratch, reused across stores.
func selfReferencing(hashes []int64, parent optI64, seen *hashSet) bool {
	if len(hashes) <= 16 {
		for i, h := range hashes {
			if parent.ok && h == parent.v {
				return true
			}
			for _, g := range hashes[:i] {
				if g == h {
					return true
				}
			}
		}
		return false
	}
	seen.reset(len(hashes) + 1)
	if parent.ok {
		seen.add(parent.v)
	}
	for _, h := range hashes {
		if seen.add(h) {
			return true
		}
	}
	return false
}

func nonEmpty(s optString) optString {
	if s.ok && s.s == "" {
		return optString{}
	}
	return s
}

// saltFromExtraKeys is vLLM's cache salt: the first non-empty text key of
// block 0 that is not the LoRA name.
func saltFromExtraKeys(keys [][]extraKey, lora optString) optString {
	if len(keys) == 0 {
		return optString{}
	}
	for _, k := range keys[0] {
		if k.kind == extraText && k.text != "" && (!lora.ok || k.text != lora.s) {
			return optString{s: k.text, ok: true}
		}
	}
	return optString{}
}

func (n *Normalizer) removedEvent(ev *wireEvent, key int32, id uint64, drops *Drops) (plan, bool) {
	a, ok := n.admit(ev, key, id, drops, false)
	if !ok {
		return plan{}, false
	}
	hashes := n.dec.hashes[ev.hashOff : ev.hashOff+ev.hashN]
	off := len(n.removed)
	state := n.ranks[key]
	if a.windowOnly && state != nil {
		// Once the rank has a main group, a window group's removal reaches
		// only the blocks forwarded while it had none.
		mainSeen := state.mainSeen()
		for _, h := range hashes {
			_, forwarded := state.windowForwarded[h]
			if mainSeen && !forwarded {
				continue
			}
			n.removed = append(n.removed, h)
			delete(state.windowForwarded, h)
		}
	} else {
		n.removed = append(n.removed, hashes...)
	}
	kept := n.removed[off:]
	if state != nil {
		// One physical copy goes; the record goes with the last.
		if records := state.tier(a.tier, false); records != nil {
			filter := &state.filters[a.tier-1]
			for _, h := range kept {
				if !filter.mayHold(h) {
					continue
				}
				i := records.find(h)
				if i < 0 {
					continue
				}
				if rec := &records.slots[i].rec; rec.copies > 1 {
					rec.copies--
				} else {
					records.deleteAt(i)
					filter.removed(records)
				}
			}
		}
	}
	n.counts.ForwardedRemoved++
	return plan{ev: ev, tier: a.tier, removedOff: off, removedN: len(kept), isWindowRem: a.windowOnly}, true
}

func (n *Normalizer) namespaceID(ns namespace) uint32 {
	if id, ok := n.nsIDs[ns]; ok {
		return id
	}
	id := uint32(len(n.nsList))
	n.nsList = append(n.nsList, ns)
	n.nsIDs[ns] = id
	return id
}

// maybeCompactNamespaces drops namespaces no record uses once the table has
// grown well past its last live size, so per-request salts cannot grow it
// without bound. The scan is amortized over the growth that triggered it.
func (n *Normalizer) maybeCompactNamespaces() {
	if len(n.nsList) < n.nsCompact {
		return
	}
	remap := make(map[uint32]uint32)
	nsList := []namespace{{}}
	nsIDs := map[namespace]uint32{{}: 0}
	for _, state := range n.ranks {
		for _, records := range state.tiers {
			if records == nil {
				continue
			}
			records.each(func(_ int64, rec *blockRecord) {
				if rec.ns == 0 {
					return
				}
				id, ok := remap[rec.ns]
				if !ok {
					id = uint32(len(nsList))
					ns := n.nsList[rec.ns]
					nsList = append(nsList, ns)
					nsIDs[ns] = id
					remap[rec.ns] = id
				}
				rec.ns = id
			})
		}
	}
	n.nsList, n.nsIDs = nsList, nsIDs
	n.nsCompact = max(1024, 2*len(nsList))
}
