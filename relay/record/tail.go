package record

import (
	"encoding/binary"
	"hash/maphash"
	"strings"

	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	"github.com/kvrelay/kvrelay/proto/kvpb"
)

// Presence bits of tailKey's optional fields.
const (
	hasTier = 1 << iota
	hasMedium
	hasGroup
	hasKind
	hasWindow
	hasLocality
	hasOwnership
	hasSession
	hasLoraName
	hasSalt
	hasLoraID
	hasCacheLevel
)

const noTail = ^uint32(0)

// tailKey is everything a stored block shares with the rest of its store: the store's tail and
// namespace, plus the per-block fields that engines set alike on every block of a store (block
// size, lora_id, cache_level). Stores of one engine repeat a handful of these, so entries keep a
// 4-byte id instead.
type tailKey struct {
	has           uint16
	tier          kvpb.KvCacheTier // the store's own tier field, as sent
	locality      kvpb.KvCacheLocality
	groupIdx      uint32
	slidingWindow uint32
	blockSize     int32
	cacheLevel    int32
	loraID        int64
	medium        string
	kind          string
	ownership     string
	sessionID     string
	loraName      string
	cacheSalt     string
}

func storeTail(s *kvpb.KvBlocksStored) tailKey {
	var k tailKey
	if s.Tier != nil {
		k.has |= hasTier
		k.tier = *s.Tier
	}
	if s.Medium != nil {
		k.has |= hasMedium
		k.medium = *s.Medium
	}
	if s.GroupIdx != nil {
		k.has |= hasGroup
		k.groupIdx = *s.GroupIdx
	}
	if s.KvCacheSpecKind != nil {
		k.has |= hasKind
		k.kind = *s.KvCacheSpecKind
	}
	if s.KvCacheSpecSlidingWindow != nil {
		k.has |= hasWindow
		k.slidingWindow = *s.KvCacheSpecSlidingWindow
	}
	if s.Locality != nil {
		k.has |= hasLocality
		k.locality = *s.Locality
	}
	if s.Ownership != nil {
		k.has |= hasOwnership
		k.ownership = *s.Ownership
	}
	if s.SessionId != nil {
		k.has |= hasSession
		k.sessionID = *s.SessionId
	}
	if s.LoraName != nil {
		k.has |= hasLoraName
		k.loraName = *s.LoraName
	}
	if s.CacheSalt != nil {
		k.has |= hasSalt
		k.cacheSalt = *s.CacheSalt
	}
	return k
}

func (k *tailKey) setBlock(b *blockOp) {
	k.blockSize = b.blockSize
	k.has = k.has&^(hasLoraID|hasCacheLevel) | b.has
	k.loraID, k.cacheLevel = b.loraID, b.cacheLevel
}

// sameBlockFields reports whether two keys of one store have the same per-block fields (the only
// ones setBlock changes): comparing them is enough, and cheaper than the whole key with its strings.
func (k *tailKey) sameBlockFields(o *tailKey) bool {
	return k.blockSize == o.blockSize && k.has == o.has && k.loraID == o.loraID && k.cacheLevel == o.cacheLevel
}

// ownStrings replaces the key's strings by copies of their own.
func (k *tailKey) ownStrings() {
	for _, s := range [...]*string{&k.medium, &k.kind, &k.ownership, &k.sessionID, &k.loraName, &k.cacheSalt} {
		*s = strings.Clone(*s)
	}
}

// storedEvent returns a Stored event with the tail's store-level fields and no blocks.
func (k *tailKey) storedEvent() *kvpb.KvBlocksStored {
	s := &kvpb.KvBlocksStored{}
	if k.has&hasTier != 0 {
		s.Tier = k.tier.Enum()
	}
	if k.has&hasMedium != 0 {
		s.Medium = proto.String(k.medium)
	}
	if k.has&hasGroup != 0 {
		s.GroupIdx = proto.Uint32(k.groupIdx)
	}
	if k.has&hasKind != 0 {
		s.KvCacheSpecKind = proto.String(k.kind)
	}
	if k.has&hasWindow != 0 {
		s.KvCacheSpecSlidingWindow = proto.Uint32(k.slidingWindow)
	}
	if k.has&hasLocality != 0 {
		s.Locality = k.locality.Enum()
	}
	if k.has&hasOwnership != 0 {
		s.Ownership = proto.String(k.ownership)
	}
	if k.has&hasSession != 0 {
		s.SessionId = proto.String(k.sessionID)
	}
	if k.has&hasLoraName != 0 {
		s.LoraName = proto.String(k.loraName)
	}
	if k.has&hasSalt != 0 {
		s.CacheSalt = proto.String(k.cacheSalt)
	}
	return s
}

// tailTable interns tailKeys with reference counts (session ids may be unique per request, so
// unused tails must go). A Cut keeps the keys slice and reads the ids its entries hold; those are
// never rewritten while it is live, because an id freed during a Cut waits in limbo until no Cut
// is outstanding (ids freed before the Cut are referenced by none of its entries).
//
// The ids are found by a 64-bit hash of the key, not by the key itself: a Go map keyed by the
// 136-byte tailKey held a second copy of every key in its slots, 300 bytes a tail, which a salt
// per store (one tail each) made 5 B per live block. Keys of equal hash chain through next.
type tailTable struct {
	keys  []*tailKey // immutable once published; a Cut keeps the slice
	refs  []uint32
	next  []uint32          // the next id of the same hash, noTail at the end
	ids   map[uint64]uint32 // a key's hash to the first id of its chain
	seed  maphash.Seed
	free  []uint32
	limbo []uint32 // freed while a Cut was live; reusable once none is
}

func newTailTable() *tailTable { return &tailTable{ids: map[uint64]uint32{}, seed: maphash.MakeSeed()} }

func (t *tailTable) hash(k *tailKey) uint64 {
	var h maphash.Hash
	h.SetSeed(t.seed)
	var fixed [2 + 4*6 + 8]byte
	binary.LittleEndian.PutUint16(fixed[0:], k.has)
	binary.LittleEndian.PutUint32(fixed[2:], uint32(k.tier))
	binary.LittleEndian.PutUint32(fixed[6:], uint32(k.locality))
	binary.LittleEndian.PutUint32(fixed[10:], k.groupIdx)
	binary.LittleEndian.PutUint32(fixed[14:], k.slidingWindow)
	binary.LittleEndian.PutUint32(fixed[18:], uint32(k.blockSize))
	binary.LittleEndian.PutUint32(fixed[22:], uint32(k.cacheLevel))
	binary.LittleEndian.PutUint64(fixed[26:], uint64(k.loraID))
	h.Write(fixed[:])
	for _, s := range [...]string{k.medium, k.kind, k.ownership, k.sessionID, k.loraName, k.cacheSalt} {
		// The length first, so that no two lists of strings write the same bytes.
		var n [4]byte
		binary.LittleEndian.PutUint32(n[:], uint32(len(s)))
		h.Write(n[:])
		h.WriteString(s)
	}
	return h.Sum64()
}

// intern returns the id of k, counting one more reference. borrowed: k's strings alias bytes the
// caller reuses (ApplyEncoded's batch), so a new entry copies them.
func (t *tailTable) intern(k *tailKey, borrowed bool) uint32 {
	hk := t.hash(k)
	head, found := t.ids[hk]
	if found {
		for id := head; id != noTail; id = t.next[id] {
			if *t.keys[id] == *k {
				t.refs[id]++
				return id
			}
		}
	} else {
		head = noTail
	}
	c := *k
	if borrowed {
		c.ownStrings()
	}
	var id uint32
	if n := len(t.free); n > 0 {
		id = t.free[n-1]
		t.free = t.free[:n-1]
		t.keys[id] = &c
		t.refs[id] = 1
		t.next[id] = head
	} else {
		id = uint32(len(t.keys))
		t.keys = append(t.keys, &c)
		t.refs = append(t.refs, 1)
		t.next = append(t.next, head)
	}
	t.ids[hk] = id
	return id
}

func (t *tailTable) ref(id uint32) { t.refs[id]++ }

func (t *tailTable) unref(id uint32, shared bool) {
	t.refs[id]--
	if t.refs[id] > 0 {
		return
	}
	hk := t.hash(t.keys[id])
	if head := t.ids[hk]; head == id {
		if t.next[id] == noTail {
			delete(t.ids, hk)
		} else {
			t.ids[hk] = t.next[id]
		}
	} else {
		prev := head
		for t.next[prev] != id {
			prev = t.next[prev]
		}
		t.next[prev] = t.next[id]
	}
	t.next[id] = noTail
	if shared {
		t.limbo = append(t.limbo, id)
	} else {
		t.free = append(t.free, id)
	}
}

// settle makes ids freed during Cuts reusable; call it only when no Cut is live.
func (t *tailTable) settle() {
	t.free = append(t.free, t.limbo...)
	t.limbo = t.limbo[:0]
}

// extraTable keeps the rare extra keys out of the entries, in their wire form: the KvBlock
// extra_keys fields that carry them, which the snapshot encoder copies as they are and Next
// decodes. One allocation a list instead of three a key (the message, its oneof and its string),
// 220 bytes a store with a LoRA name and a salt. Like tailTable, ids are rewritten only when no
// Cut is live.
type extraTable struct {
	keys  [][]byte
	free  []uint32
	limbo []uint32
}

func (x *extraTable) add(keys []*kvpb.KvBlockExtraKey) uint32 {
	size := 0
	for _, k := range keys {
		if k != nil {
			n := proto.Size(k)
			size += 1 + protowire.SizeVarint(uint64(n)) + n
		}
	}
	c := make([]byte, 0, size)
	for _, k := range keys {
		if k != nil {
			c = appendExtraKey(c, k)
		}
	}
	if n := len(x.free); n > 0 {
		id := x.free[n-1]
		x.free = x.free[:n-1]
		x.keys[id] = c
		return id
	}
	x.keys = append(x.keys, c)
	return uint32(len(x.keys) - 1)
}

// appendExtraKey appends one KvBlock extra_keys field: proto.Marshal's bytes for the key, or, for
// a string that is not valid UTF-8 (which Marshal refuses; the relay refuses such batches before
// they reach the record, but the record takes any batch), the same fields written as they are.
func appendExtraKey(b []byte, k *kvpb.KvBlockExtraKey) []byte {
	b = append(b, tagBlockExtraKey)
	m, err := proto.Marshal(k)
	if err != nil {
		m = extraKeyAsIs(k)
	}
	b = protowire.AppendVarint(b, uint64(len(m)))
	return append(b, m...)
}

func extraKeyAsIs(k *kvpb.KvBlockExtraKey) []byte {
	var m []byte
	switch key := k.Key.(type) {
	case *kvpb.KvBlockExtraKey_Text:
		m = protowire.AppendTag(m, 1, protowire.BytesType)
		m = protowire.AppendString(m, key.Text)
	case *kvpb.KvBlockExtraKey_Blob:
		m = protowire.AppendTag(m, 2, protowire.BytesType)
		m = protowire.AppendBytes(m, key.Blob)
	case *kvpb.KvBlockExtraKey_Number:
		m = protowire.AppendTag(m, 3, protowire.VarintType)
		m = protowire.AppendVarint(m, uint64(key.Number))
	case *kvpb.KvBlockExtraKey_Multimodal:
		var mm []byte
		if id := key.Multimodal.GetIdentifier(); id != "" {
			mm = protowire.AppendTag(mm, 1, protowire.BytesType)
			mm = protowire.AppendString(mm, id)
		}
		if off := key.Multimodal.GetOffset(); off != 0 {
			mm = protowire.AppendTag(mm, 2, protowire.VarintType)
			mm = protowire.AppendVarint(mm, uint64(off))
		}
		m = protowire.AppendTag(m, 4, protowire.BytesType)
		m = protowire.AppendBytes(m, mm)
	}
	return m
}

// decodeExtraKeys turns an extra-key list back into messages (for Next).
func decodeExtraKeys(b []byte) []*kvpb.KvBlockExtraKey {
	var out []*kvpb.KvBlockExtraKey
	for len(b) > 0 {
		// Written by appendExtraKey: a tag byte, a length and the message.
		n, w := protowire.ConsumeVarint(b[1:])
		m := b[1+w : 1+w+int(n)]
		b = b[1+w+int(n):]
		k := &kvpb.KvBlockExtraKey{}
		if err := proto.Unmarshal(m, k); err != nil {
			k = extraKeyFromAsIs(m)
		}
		out = append(out, k)
	}
	return out
}

// extraKeyFromAsIs reads what extraKeyAsIs wrote, strings taken as they are.
func extraKeyFromAsIs(m []byte) *kvpb.KvBlockExtraKey {
	k := &kvpb.KvBlockExtraKey{}
	num, typ, n := protowire.ConsumeTag(m)
	m = m[n:]
	switch {
	case num == 1 && typ == protowire.BytesType:
		v, _ := protowire.ConsumeBytes(m)
		k.Key = &kvpb.KvBlockExtraKey_Text{Text: string(v)}
	case num == 4 && typ == protowire.BytesType:
		v, _ := protowire.ConsumeBytes(m)
		mm := &kvpb.KvMultimodalKey{}
		for len(v) > 0 {
			f, t, n := protowire.ConsumeTag(v)
			v = v[n:]
			if f == 1 && t == protowire.BytesType {
				s, n := protowire.ConsumeBytes(v)
				mm.Identifier = string(s)
				v = v[n:]
			} else {
				o, n := protowire.ConsumeVarint(v)
				mm.Offset = int64(o)
				v = v[n:]
			}
		}
		k.Key = &kvpb.KvBlockExtraKey_Multimodal{Multimodal: mm}
	}
	return k
}

func (x *extraTable) drop(id uint32, shared bool) {
	if shared {
		x.limbo = append(x.limbo, id)
		return
	}
	x.keys[id] = nil
	x.free = append(x.free, id)
}

func (x *extraTable) settle() {
	x.free = append(x.free, x.limbo...)
	x.limbo = x.limbo[:0]
}
