package wire

import (
	"github.com/kvrelay/kvrelay/proto/kvpb"
)

// Building the typed batch (Normalize's path; AppendNormalized writes the
// same plans straight to protobuf bytes in encode.go): each forwarded event's
// messages come from one allocation, whatever its optional fields.

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
