package wire

import (
	"bytes"
	"encoding/json"
	"log/slog"
	"strings"

	"github.com/kvrelay/kvrelay/proto/kvpb"
)

// DropReason says why an event was not forwarded. The names are the metrics
// contract shared with smg's relays.
type DropReason uint8

const (
	DropUnknownType DropReason = iota
	DropUnsupportedOwnership
	DropNonLocalLocality
	DropUnknownMedium
	DropNonMainAttentionGroup
	DropUnalignedBlocks
	DropSelfReferencingHashes
	DropPlaceholder
	DropMalformed
	numDropReasons
)

var dropNames = [numDropReasons]string{
	"unknown_type",
	"unsupported_ownership",
	"non_local_locality",
	"unknown_medium",
	"non_main_attention_group",
	"unaligned_blocks",
	"self_referencing_hashes",
	"placeholder",
	"malformed",
}

func (r DropReason) String() string {
	if r < numDropReasons {
		return dropNames[r]
	}
	return "invalid"
}

// DropReasons lists every reason, in a stable order (for metrics).
func DropReasons() []DropReason {
	out := make([]DropReason, numDropReasons)
	for i := range out {
		out[i] = DropReason(i)
	}
	return out
}

// Drops counts dropped events by reason. It is a fixed array so counting
// drops never allocates.
type Drops [numDropReasons]uint64

// Total is the number of dropped events.
func (d Drops) Total() uint64 {
	var n uint64
	for _, v := range d {
		n += v
	}
	return n
}

// Map returns the non-zero counts keyed by reason name.
func (d Drops) Map() map[string]uint64 {
	m := make(map[string]uint64)
	for i, v := range d {
		if v != 0 {
			m[dropNames[i]] = v
		}
	}
	return m
}

// MarshalJSON prints {"<reason>": n} for the non-zero reasons, in reason order.
func (d Drops) MarshalJSON() ([]byte, error) {
	var b bytes.Buffer
	b.WriteByte('{')
	first := true
	for i, v := range d {
		if v == 0 {
			continue
		}
		if !first {
			b.WriteByte(',')
		}
		first = false
		name, _ := json.Marshal(dropNames[i])
		b.Write(name)
		b.WriteByte(':')
		b.Write([]byte(jsonUint(v)))
	}
	b.WriteByte('}')
	return b.Bytes(), nil
}

func (d Drops) String() string {
	b, _ := d.MarshalJSON()
	return string(b)
}

func jsonUint(v uint64) string {
	b, _ := json.Marshal(v)
	return string(b)
}

// Counts are a Normalizer's cumulative counters.
type Counts struct {
	ForwardedStored  uint64 `json:"forwarded_stored"`
	ForwardedRemoved uint64 `json:"forwarded_removed"`
	ForwardedCleared uint64 `json:"forwarded_cleared"`
	// BigramStores are forwarded stores whose tokens came as bigram pairs.
	BigramStores uint64 `json:"bigram_stores"`
	// WindowOnlyStores are sliding-window stores forwarded because their
	// rank has shown no main-attention group.
	WindowOnlyStores uint64 `json:"window_only_stores"`
	// TailAlignedStores named fewer blocks than their tokens spanned and
	// took the tail of the tokens.
	TailAlignedStores uint64 `json:"tail_aligned_stores"`
	// UndecodableBatches are payloads Normalize returned an error for.
	UndecodableBatches uint64 `json:"undecodable_batches"`
	Dropped            Drops  `json:"dropped"`
}

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

// batchOut holds a batch and its rank in one allocation.
type batchOut struct {
	batch kvpb.KvEventBatch
	rank  int32
}

// storedOut holds everything one forwarded store points at, so building it
// costs one allocation whatever its optional fields.
type storedOut struct {
	event      kvpb.KvCacheEvent
	wrap       kvpb.KvCacheEvent_Stored
	msg        kvpb.KvBlocksStored
	parent     int64
	tier       kvpb.KvCacheTier
	locality   kvpb.KvCacheLocality
	group      uint32
	window     uint32
	loraID     int64
	cacheLevel int32
	medium     string
	kind       string
	ownership  string
	session    string
	lora       string
	salt       string
}

type removedOut struct {
	event      kvpb.KvCacheEvent
	wrap       kvpb.KvCacheEvent_Removed
	msg        kvpb.KvBlocksRemoved
	tier       kvpb.KvCacheTier
	locality   kvpb.KvCacheLocality
	group      uint32
	cacheLevel int32
	medium     string
	ownership  string
}

type clearedOut struct {
	event     kvpb.KvCacheEvent
	wrap      kvpb.KvCacheEvent_Cleared
	msg       kvpb.KvCacheCleared
	ownership string
}

// fill sets everything of a cleared event but nothing it does not say.
func (o *clearedOut) fill(p *plan) {
	setString(&o.msg.Ownership, &o.ownership, p.ev.ownership)
	o.wrap.Cleared = &o.msg
	o.event.EventId, o.event.Data = p.eventID, &o.wrap
}

// fill sets a removal's fields, its hashes included.
func (o *removedOut) fill(p *plan, hashes []int64) {
	ev := p.ev
	o.tier, o.locality = p.tier, kvpb.KvCacheLocality_KV_CACHE_LOCALITY_LOCAL
	o.msg.BlockHashes = hashes
	if lvl, ok := cacheLevelOf(p.tier); ok {
		o.cacheLevel = lvl
		o.msg.CacheLevel = &o.cacheLevel
	}
	o.msg.Tier, o.msg.Locality = &o.tier, &o.locality
	setString(&o.msg.Medium, &o.medium, ev.medium)
	setString(&o.msg.Ownership, &o.ownership, ev.ownership)
	if ev.groupIdx.ok {
		o.group = ev.groupIdx.v
		o.msg.GroupIdx = &o.group
	}
	o.wrap.Removed = &o.msg
	o.event.EventId, o.event.Data = p.eventID, &o.wrap
}

// fill sets a store's own fields (not its blocks) and returns the lora_id
// and cache_level every one of its blocks carries.
func (o *storedOut) fill(p *plan) (loraID *int64, cacheLevel *int32) {
	ev := p.ev
	o.tier, o.locality = p.tier, kvpb.KvCacheLocality_KV_CACHE_LOCALITY_LOCAL
	m := &o.msg
	m.Tier, m.Locality = &o.tier, &o.locality
	if ev.parent.ok {
		o.parent = ev.parent.v
		m.ParentBlockHash = &o.parent
	}
	setString(&m.Medium, &o.medium, ev.medium)
	setString(&m.KvCacheSpecKind, &o.kind, ev.specKind)
	setString(&m.Ownership, &o.ownership, ev.ownership)
	setString(&m.SessionId, &o.session, ev.sessionID)
	setString(&m.LoraName, &o.lora, p.ns.lora)
	setString(&m.CacheSalt, &o.salt, p.ns.salt)
	if ev.groupIdx.ok {
		o.group = ev.groupIdx.v
		m.GroupIdx = &o.group
	}
	if ev.window.ok {
		o.window = ev.window.v
		m.KvCacheSpecSlidingWindow = &o.window
	}
	if ev.loraID.ok {
		o.loraID = ev.loraID.v
		loraID = &o.loraID
	}
	if lvl, ok := cacheLevelOf(p.tier); ok {
		o.cacheLevel = lvl
		cacheLevel = &o.cacheLevel
	}
	o.wrap.Stored = m
	o.event.EventId, o.event.Data = p.eventID, &o.wrap
	return loraID, cacheLevel
}

func setString(dst **string, field *string, v optString) {
	if v.ok {
		*field = v.s
		*dst = field
	}
}

// build turns the plans into protos. Blocks, block pointers and tokens of
// the whole batch come from one slab each, so the allocations per batch do
// not grow with its block count.
func (n *Normalizer) build(out *batchOut, blocks, tokens int) {
	if len(n.plans) == 0 {
		return
	}
	events := make([]*kvpb.KvCacheEvent, len(n.plans))
	var blockSlab []kvpb.KvBlock
	var blockPtrs []*kvpb.KvBlock
	var tokenSlab []uint32
	if blocks > 0 {
		blockSlab = make([]kvpb.KvBlock, blocks)
		blockPtrs = make([]*kvpb.KvBlock, blocks)
		tokenSlab = make([]uint32, tokens)
	}
	// Extra keys (vLLM's per-block LoRA names, salts, multimodal ids) come
	// from one slab too: a message, its oneof wrapper and its pointer each
	// were an allocation per key.
	var keySlab []extraKeyOut
	var keyPtrs []*kvpb.KvBlockExtraKey
	if n := n.countExtraKeys(); n > 0 {
		keySlab = make([]extraKeyOut, n)
		keyPtrs = make([]*kvpb.KvBlockExtraKey, n)
	}
	var removedSlab []int64
	if len(n.removed) > 0 {
		removedSlab = make([]int64, len(n.removed))
		copy(removedSlab, n.removed)
	}
	for i := range n.plans {
		p := &n.plans[i]
		ev := p.ev
		switch ev.kind {
		case kindCleared:
			o := &clearedOut{}
			o.fill(p)
			events[i] = &o.event
		case kindRemoved:
			o := &removedOut{}
			o.fill(p, removedSlab[p.removedOff:p.removedOff+p.removedN:p.removedOff+p.removedN])
			events[i] = &o.event
		case kindStored:
			o := &storedOut{}
			loraID, cacheLevel := o.fill(p)
			m := &o.msg
			width := int(ev.blockSize)
			nb := ev.hashN
			m.Blocks = blockPtrs[:nb:nb]
			blockPtrs = blockPtrs[nb:]
			toks := tokenSlab[:nb*width]
			tokenSlab = tokenSlab[nb*width:]
			copy(toks, n.dec.tokens[p.tokOff:p.tokOff+nb*width])
			hashes := n.dec.hashes[ev.hashOff : ev.hashOff+nb]
			for j := 0; j < nb; j++ {
				b := &blockSlab[j]
				b.BlockHash = hashes[j]
				b.TokenIds = toks[j*width : (j+1)*width : (j+1)*width]
				b.BlockSize = int32(width)
				b.LoraId = loraID
				b.CacheLevel = cacheLevel
				if j < len(ev.extraKeys) && len(ev.extraKeys[j]) > 0 {
					k := len(ev.extraKeys[j])
					b.ExtraKeys = keyPtrs[:k:k]
					extraKeysProto(ev.extraKeys[j], keySlab[:k], b.ExtraKeys)
					keyPtrs, keySlab = keyPtrs[k:], keySlab[k:]
				}
				m.Blocks[j] = b
			}
			blockSlab = blockSlab[nb:]
			events[i] = &o.event
		}
	}
	out.batch.Events = events
}

// extraKeyOut holds one extra key's message with every form its oneof can
// take, so that a key costs no allocation of its own.
type extraKeyOut struct {
	key   kvpb.KvBlockExtraKey
	text  kvpb.KvBlockExtraKey_Text
	num   kvpb.KvBlockExtraKey_Number
	blob  kvpb.KvBlockExtraKey_Blob
	mm    kvpb.KvBlockExtraKey_Multimodal
	mmKey kvpb.KvMultimodalKey
}

// countExtraKeys is the number of extra keys the planned stores' blocks
// carry.
func (n *Normalizer) countExtraKeys() int {
	total := 0
	for i := range n.plans {
		ev := n.plans[i].ev
		if ev.kind != kindStored {
			continue
		}
		for j := 0; j < ev.hashN && j < len(ev.extraKeys); j++ {
			total += len(ev.extraKeys[j])
		}
	}
	return total
}

// extraKeysProto fills out[i] with keys[i]'s message, built in slab[i].
func extraKeysProto(keys []extraKey, slab []extraKeyOut, out []*kvpb.KvBlockExtraKey) {
	for i, k := range keys {
		o := &slab[i]
		switch k.kind {
		case extraText:
			o.text.Text = k.text
			o.key.Key = &o.text
		case extraNumber:
			o.num.Number = k.num
			o.key.Key = &o.num
		case extraBlob:
			o.blob.Blob = k.blob
			o.key.Key = &o.blob
		case extraMultimodal:
			o.mmKey.Identifier, o.mmKey.Offset = k.text, k.num
			o.mm.Multimodal = &o.mmKey
			o.key.Key = &o.mm
		default:
			out[i] = nil // the decoder keeps no other kind
			continue
		}
		out[i] = &o.key
	}
}
