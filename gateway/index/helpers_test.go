package index

import (
	"github.com/kvrelay/kvrelay/proto/kvpb"
)

// blk builds a stored block whose engine hash is eh.
func blk(eh int64, tokens ...uint32) *kvpb.KvBlock {
	return &kvpb.KvBlock{BlockHash: eh, TokenIds: tokens, BlockSize: int32(len(tokens))}
}

type storeOpt func(*kvpb.KvBlocksStored)

func withParent(p int64) storeOpt { return func(s *kvpb.KvBlocksStored) { s.ParentBlockHash = &p } }
func onTier(t kvpb.KvCacheTier) storeOpt {
	return func(s *kvpb.KvBlocksStored) { s.Tier = &t }
}
func withNS(lora, salt string) storeOpt {
	return func(s *kvpb.KvBlocksStored) {
		if lora != "" {
			s.LoraName = &lora
		}
		if salt != "" {
			s.CacheSalt = &salt
		}
	}
}

func stored(blocks []*kvpb.KvBlock, opts ...storeOpt) *kvpb.KvCacheEvent {
	s := &kvpb.KvBlocksStored{Blocks: blocks}
	for _, o := range opts {
		o(s)
	}
	return &kvpb.KvCacheEvent{Data: &kvpb.KvCacheEvent_Stored{Stored: s}}
}

func removed(tier kvpb.KvCacheTier, hashes ...int64) *kvpb.KvCacheEvent {
	r := &kvpb.KvBlocksRemoved{BlockHashes: hashes}
	if tier != kvpb.KvCacheTier_KV_CACHE_TIER_UNSPECIFIED {
		r.Tier = &tier
	}
	return &kvpb.KvCacheEvent{Data: &kvpb.KvCacheEvent_Removed{Removed: r}}
}

func cleared() *kvpb.KvCacheEvent {
	return &kvpb.KvCacheEvent{Data: &kvpb.KvCacheEvent_Cleared{Cleared: &kvpb.KvCacheCleared{}}}
}

func batch(rank int32, evs ...*kvpb.KvCacheEvent) *kvpb.KvEventBatch {
	return &kvpb.KvEventBatch{DpRank: &rank, Events: evs}
}

const (
	device = kvpb.KvCacheTier_KV_CACHE_TIER_DEVICE
	host   = kvpb.KvCacheTier_KV_CACHE_TIER_HOST
	disk   = kvpb.KvCacheTier_KV_CACHE_TIER_DISK
	unspec = kvpb.KvCacheTier_KV_CACHE_TIER_UNSPECIFIED
)

// chainBlocks returns blocks of 4 tokens for tokens, engine hashes base+1, base+2, ….
func chainBlocks(base int64, tokens []uint32) []*kvpb.KvBlock {
	var out []*kvpb.KvBlock
	for i := 0; i+4 <= len(tokens); i += 4 {
		out = append(out, blk(base+int64(i/4)+1, tokens[i:i+4]...))
	}
	return out
}
