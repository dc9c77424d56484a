package interop

import (
	"encoding/binary"
	"fmt"
	"strings"

	"google.golang.org/protobuf/proto"

	"github.com/kvrelay/kvrelay/proto/kvpb"
	"github.com/kvrelay/kvrelay/testkit/enginepeer"
)

// blockHash is a block hash as a test writes it: an unsigned integer or a
// raw digest (vLLM with integer hashes off).
type blockHash struct {
	u      uint64
	digest []byte
}

func uh(v uint64) blockHash { return blockHash{u: v} }
func dh(b []byte) blockHash { return blockHash{digest: b} }
func (h blockHash) peer() enginepeer.Hash {
	if h.digest != nil {
		return enginepeer.Digest(h.digest)
	}
	return enginepeer.U64(h.u)
}

// fold is the int64 a relay must put on the wire for h: integers keep their
// bit pattern, digests fold to their last eight bytes big-endian
// (relay-semantics §2.1).
func (h blockHash) fold() int64 {
	if h.digest != nil {
		return int64(binary.BigEndian.Uint64(h.digest[len(h.digest)-8:]))
	}
	return int64(h.u)
}

// digest32 is a 32-byte digest whose last eight bytes are tail.
func digest32(seed byte, tail uint64) []byte {
	b := make([]byte, 32)
	for i := 0; i < 24; i++ {
		b[i] = seed + byte(i)
	}
	binary.BigEndian.PutUint64(b[24:], tail)
	return b
}

// testEvent is one event a test publishes, kept in a form from which both
// the peer's command and the expected proto are derived.
type testEvent struct {
	kind      string // stored, removed, cleared
	hashes    []blockHash
	parent    *blockHash
	tokens    []int64
	blockSize int
	medium    string // "" = the engine default GPU
	loraName  string
}

func (e testEvent) peer() enginepeer.Event {
	var ev enginepeer.Event
	switch e.kind {
	case "stored":
		var parent *enginepeer.Hash
		if e.parent != nil {
			p := e.parent.peer()
			parent = &p
		}
		hs := make([]enginepeer.Hash, len(e.hashes))
		for i, h := range e.hashes {
			hs[i] = h.peer()
		}
		ev = enginepeer.Stored(parent, e.tokens, hs...)
		ev.BlockSize = e.blockSize
		if e.loraName != "" {
			ev.Fields = map[string]any{"lora_name": e.loraName}
		}
	case "removed":
		hs := make([]enginepeer.Hash, len(e.hashes))
		for i, h := range e.hashes {
			hs[i] = h.peer()
		}
		ev = enginepeer.Removed(hs...)
	case "cleared":
		ev = enginepeer.Cleared()
	}
	if e.medium != "" {
		m := e.medium
		ev.Medium = &m
	}
	return ev
}

// tierOf is the medium → (tier, cache_level) table of relay-semantics §4.2
// for the media the tests use.
func tierOf(medium string) (kvpb.KvCacheTier, *int32) {
	lvl := func(v int32) *int32 { return &v }
	switch strings.ToUpper(medium) {
	case "", "GPU", "DEVICE":
		return kvpb.KvCacheTier_KV_CACHE_TIER_DEVICE, nil
	case "CPU", "CPU_PINNED", "CPU_TIER1":
		return kvpb.KvCacheTier_KV_CACHE_TIER_HOST, lvl(1)
	case "CPU_TIER2", "DISK", "NVME", "STORAGE":
		return kvpb.KvCacheTier_KV_CACHE_TIER_DISK, lvl(2)
	default:
		return kvpb.KvCacheTier_KV_CACHE_TIER_EXTERNAL, lvl(3)
	}
}

// expectedEvent is the proto an SMG relay must produce for e (event_id
// left 0: the caller numbers it).
func expectedEvent(e testEvent) *kvpb.KvCacheEvent {
	medium := e.medium
	if medium == "" {
		medium = "GPU"
	}
	tier, level := tierOf(medium)
	local := kvpb.KvCacheLocality_KV_CACHE_LOCALITY_LOCAL
	switch e.kind {
	case "stored":
		bs := e.blockSize
		if bs == 0 {
			bs = len(e.tokens) / len(e.hashes)
		}
		st := &kvpb.KvBlocksStored{Tier: &tier, Medium: proto.String(medium), Locality: &local}
		if e.parent != nil {
			st.ParentBlockHash = proto.Int64(e.parent.fold())
		}
		if e.loraName != "" {
			st.LoraName = proto.String(e.loraName)
		}
		for i, h := range e.hashes {
			toks := make([]uint32, bs)
			for j := range toks {
				toks[j] = uint32(e.tokens[i*bs+j])
			}
			st.Blocks = append(st.Blocks, &kvpb.KvBlock{BlockHash: h.fold(), TokenIds: toks, BlockSize: int32(bs), CacheLevel: level})
		}
		return &kvpb.KvCacheEvent{Data: &kvpb.KvCacheEvent_Stored{Stored: st}}
	case "removed":
		rm := &kvpb.KvBlocksRemoved{Tier: &tier, Medium: proto.String(medium), Locality: &local, CacheLevel: level}
		for _, h := range e.hashes {
			rm.BlockHashes = append(rm.BlockHashes, h.fold())
		}
		return &kvpb.KvCacheEvent{Data: &kvpb.KvCacheEvent_Removed{Removed: rm}}
	case "cleared":
		return &kvpb.KvCacheEvent{Data: &kvpb.KvCacheEvent_Cleared{Cleared: &kvpb.KvCacheCleared{}}}
	}
	panic(fmt.Sprintf("unknown test event kind %q", e.kind))
}

// published is one batch a test published and where it went.
type published struct {
	rank   int
	seq    uint64
	ts     float64
	events []testEvent
}

// expectedBatch is the proto both SMG relays must produce for p, event ids
// numbered from firstID (0: all left 0).
func expectedBatch(p published, firstID uint64) *kvpb.KvEventBatch {
	rank := int32(p.rank)
	b := &kvpb.KvEventBatch{SequenceNumber: p.seq, Timestamp: p.ts, DpRank: &rank}
	for i, e := range p.events {
		ev := expectedEvent(e)
		if firstID != 0 {
			ev.EventId = firstID + uint64(i)
		}
		b.Events = append(b.Events, ev)
	}
	return b
}

// generatedBatch is the i-th batch of a varied, self-contained stream: every
// event in it refers only to hashes stored in the same batch, so a
// subscriber that joins anywhere sees each batch forwarded whole.
func generatedBatch(i int) []testEvent {
	base := uint64(1_000_000 + 100*i)
	toks := func(n, from int) []int64 {
		out := make([]int64, n)
		for j := range out {
			out[j] = int64(from + j)
		}
		return out
	}
	root := uh(base + 1)
	if i%3 == 1 {
		root = dh(digest32(byte(i), base+1))
	}
	child := uh(base + 2)
	if i%3 == 2 {
		// A hash with the sign bit set, as SGLang and half of vLLM's send.
		child = uh(1<<63 | base + 2)
	}
	stored := testEvent{kind: "stored", hashes: []blockHash{root}, tokens: toks(4, 10*i), blockSize: 4}
	chained := testEvent{kind: "stored", hashes: []blockHash{child, uh(base + 3)}, parent: &root, tokens: toks(8, 10*i+4), blockSize: 4}
	var evs []testEvent
	if i%5 == 4 {
		evs = append(evs, testEvent{kind: "cleared"})
	}
	switch i % 4 {
	case 1:
		stored.medium, chained.medium = "CPU", "CPU"
	case 2:
		chained.loraName = fmt.Sprintf("adapter-%d", i)
	}
	evs = append(evs, stored, chained)
	if i%2 == 0 {
		evs = append(evs, testEvent{kind: "removed", hashes: []blockHash{uh(base + 3)}, medium: chained.medium})
	}
	return evs
}
