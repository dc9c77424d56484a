package record

import (
	"fmt"
	"maps"
	"slices"
	"testing"

	"google.golang.org/protobuf/proto"

	"github.com/kvrelay/kvrelay/proto/kvpb"
)

// This file holds the test helpers: batch builders, a naive model of the record written
// independently of the compact one, and a checker for snapshot chunks.

const testBlockSize = 4

func tokensFor(h int64) []uint32 {
	t := make([]uint32, testBlockSize)
	for i := range t {
		t[i] = uint32(h)*31 + uint32(i)
	}
	return t
}

type storeOpt func(*kvpb.KvBlocksStored)

func withParent(p int64) storeOpt {
	return func(s *kvpb.KvBlocksStored) { s.ParentBlockHash = proto.Int64(p) }
}
func withTier(t kvpb.KvCacheTier) storeOpt {
	return func(s *kvpb.KvBlocksStored) { s.Tier = t.Enum() }
}
func withMedium(m string) storeOpt {
	return func(s *kvpb.KvBlocksStored) { s.Medium = proto.String(m) }
}
func withKind(k string) storeOpt {
	return func(s *kvpb.KvBlocksStored) { s.KvCacheSpecKind = proto.String(k) }
}
func withGroup(g uint32) storeOpt {
	return func(s *kvpb.KvBlocksStored) { s.GroupIdx = proto.Uint32(g) }
}
func withSession(id string) storeOpt {
	return func(s *kvpb.KvBlocksStored) { s.SessionId = proto.String(id) }
}
func withCacheLevel(l int32) storeOpt {
	return func(s *kvpb.KvBlocksStored) {
		for _, b := range s.Blocks {
			b.CacheLevel = proto.Int32(l)
		}
	}
}

func storedEv(hashes []int64, opts ...storeOpt) *kvpb.KvCacheEvent {
	s := &kvpb.KvBlocksStored{}
	for _, h := range hashes {
		s.Blocks = append(s.Blocks, &kvpb.KvBlock{BlockHash: h, TokenIds: tokensFor(h), BlockSize: testBlockSize})
	}
	for _, o := range opts {
		o(s)
	}
	return &kvpb.KvCacheEvent{EventId: 1, Data: &kvpb.KvCacheEvent_Stored{Stored: s}}
}

func removedEv(tier kvpb.KvCacheTier, hashes ...int64) *kvpb.KvCacheEvent {
	rm := &kvpb.KvBlocksRemoved{BlockHashes: hashes}
	if tier != kvpb.KvCacheTier_KV_CACHE_TIER_UNSPECIFIED {
		rm.Tier = tier.Enum()
	}
	return &kvpb.KvCacheEvent{EventId: 1, Data: &kvpb.KvCacheEvent_Removed{Removed: rm}}
}

func clearedEv() *kvpb.KvCacheEvent {
	return &kvpb.KvCacheEvent{Data: &kvpb.KvCacheEvent_Cleared{Cleared: &kvpb.KvCacheCleared{}}}
}

func batchOf(rank int32, events ...*kvpb.KvCacheEvent) *kvpb.KvEventBatch {
	b := &kvpb.KvEventBatch{Events: events}
	if rank != NoRank {
		b.DpRank = proto.Int32(rank)
	}
	return b
}

func chain(from int64, n int) []int64 {
	h := make([]int64, n)
	for i := range h {
		h[i] = from + int64(i)
	}
	return h
}

// modelKey and modelEntry: the naive record, a map per rank.
type modelKey struct {
	tier kvpb.KvCacheTier
	hash int64
}

type modelEntry struct {
	Copies    int
	Parent    int64
	HasParent bool
	Tokens    []uint32
	Block     *kvpb.KvBlock           // block-level fields, tokens and hash cleared
	Tail      *kvpb.KvBlocksStored    // store-level fields, blocks and parent cleared
	Extra     []*kvpb.KvBlockExtraKey // as stored
}

type model map[int32]map[modelKey]*modelEntry

func modelTier(t *kvpb.KvCacheTier, level *int32) kvpb.KvCacheTier {
	if t != nil && *t != kvpb.KvCacheTier_KV_CACHE_TIER_UNSPECIFIED {
		if *t > kvpb.KvCacheTier_KV_CACHE_TIER_EXTERNAL || *t < 0 {
			return kvpb.KvCacheTier_KV_CACHE_TIER_EXTERNAL
		}
		return *t
	}
	if level == nil {
		return kvpb.KvCacheTier_KV_CACHE_TIER_DEVICE
	}
	switch *level {
	case 0:
		return kvpb.KvCacheTier_KV_CACHE_TIER_DEVICE
	case 1:
		return kvpb.KvCacheTier_KV_CACHE_TIER_HOST
	case 2:
		return kvpb.KvCacheTier_KV_CACHE_TIER_DISK
	}
	return kvpb.KvCacheTier_KV_CACHE_TIER_EXTERNAL
}

type modelCounts struct{ stored, removed, removedUnknown, capped, cleared uint64 }

func (m model) apply(b *kvpb.KvEventBatch, c *modelCounts) {
	rank := NoRank
	if b.DpRank != nil {
		rank = *b.DpRank
	}
	for _, ev := range b.Events {
		switch {
		case ev.GetStored() != nil:
			s := ev.GetStored()
			if len(s.Blocks) == 0 {
				continue
			}
			tier := modelTier(s.Tier, s.Blocks[0].CacheLevel)
			tail := proto.Clone(s).(*kvpb.KvBlocksStored)
			tail.Blocks, tail.ParentBlockHash = nil, nil
			parent, has := s.GetParentBlockHash(), s.ParentBlockHash != nil
			for _, blk := range s.Blocks {
				c.stored++
				if m[rank] == nil {
					m[rank] = map[modelKey]*modelEntry{}
				}
				k := modelKey{tier, blk.BlockHash}
				if e := m[rank][k]; e != nil {
					if e.Copies == CopiesCap {
						c.capped++
					} else {
						e.Copies++
					}
				} else {
					bl := proto.Clone(blk).(*kvpb.KvBlock)
					bl.BlockHash, bl.TokenIds, bl.ExtraKeys = 0, nil, nil
					m[rank][k] = &modelEntry{
						Copies: 1, Parent: parent, HasParent: has, Tokens: slices.Clone(blk.TokenIds),
						Block: bl, Tail: tail, Extra: blk.ExtraKeys,
					}
				}
				parent, has = blk.BlockHash, true
			}
		case ev.GetRemoved() != nil:
			rm := ev.GetRemoved()
			tier := modelTier(rm.Tier, rm.CacheLevel)
			for _, h := range rm.BlockHashes {
				e := m[rank][modelKey{tier, h}]
				if e == nil {
					c.removedUnknown++
					continue
				}
				c.removed++
				e.Copies--
				if e.Copies == 0 {
					delete(m[rank], modelKey{tier, h})
				}
			}
		case ev.GetCleared() != nil:
			delete(m, rank)
			c.cleared++
		}
	}
}

func (m model) clone() model {
	c := model{}
	for r, es := range m {
		c[r] = map[modelKey]*modelEntry{}
		for k, e := range es {
			ce := *e
			c[r][k] = &ce
		}
	}
	return c
}

func (m model) prune() model {
	for r, es := range m {
		if len(es) == 0 {
			delete(m, r)
		}
	}
	return m
}

func (m model) stats() (entries, blocks uint64, ranks []RankStats) {
	for _, r := range slices.Sorted(maps.Keys(m)) {
		var rs RankStats
		rs.Rank = r
		for _, e := range m[r] {
			rs.Entries++
			rs.Blocks += uint64(e.Copies)
		}
		if rs.Entries == 0 {
			continue
		}
		ranks = append(ranks, rs)
		entries += rs.Entries
		blocks += rs.Blocks
	}
	return entries, blocks, ranks
}

// replayChunks rebuilds a model from snapshot chunks alone.
func replayChunks(t testing.TB, chunks []*kvpb.KvEventBatch) model {
	t.Helper()
	m := model{}
	var c modelCounts
	for _, b := range chunks {
		m.apply(b, &c)
	}
	return m.prune()
}

// diffModels names the first difference between two models, or returns "". It compares by hand:
// cmp with protocmp is too slow for thousands of entries under -race.
func diffModels(want, got model) string {
	want, got = want.prune(), got.prune()
	for _, r := range slices.Sorted(maps.Keys(want)) {
		if len(want[r]) != len(got[r]) {
			return fmt.Sprintf("rank %d: %d entries, want %d", r, len(got[r]), len(want[r]))
		}
		for k, w := range want[r] {
			g := got[r][k]
			switch {
			case g == nil:
				return fmt.Sprintf("rank %d: %v missing", r, k)
			case g.Copies != w.Copies || g.Parent != w.Parent || g.HasParent != w.HasParent:
				return fmt.Sprintf("rank %d %v: copies/parent %d/%d/%v, want %d/%d/%v", r, k,
					g.Copies, g.Parent, g.HasParent, w.Copies, w.Parent, w.HasParent)
			case !slices.Equal(g.Tokens, w.Tokens):
				return fmt.Sprintf("rank %d %v: tokens %v, want %v", r, k, g.Tokens, w.Tokens)
			case !proto.Equal(g.Block, w.Block):
				return fmt.Sprintf("rank %d %v: block %v, want %v", r, k, g.Block, w.Block)
			case !proto.Equal(g.Tail, w.Tail):
				return fmt.Sprintf("rank %d %v: tail %v, want %v", r, k, g.Tail, w.Tail)
			case len(g.Extra) != len(w.Extra):
				return fmt.Sprintf("rank %d %v: extra keys %v, want %v", r, k, g.Extra, w.Extra)
			}
			for i := range w.Extra {
				if !proto.Equal(g.Extra[i], w.Extra[i]) {
					return fmt.Sprintf("rank %d %v: extra keys %v, want %v", r, k, g.Extra, w.Extra)
				}
			}
		}
	}
	if len(got) != len(want) {
		return fmt.Sprintf("ranks %v, want %v", slices.Sorted(maps.Keys(got)), slices.Sorted(maps.Keys(want)))
	}
	return ""
}

// chunkRule is what checkChunks expects of a snapshot.
type chunkRule struct {
	cursors       map[int32]uint64
	unknownBefore map[int32]uint64
	maxUnits      int // per chunk; 0 means ChunkBlocks
}

// checkChunks verifies the snapshot contract and returns the units (one per physical copy) per
// chunk.
func checkChunks(t testing.TB, chunks []*kvpb.KvEventBatch, rule chunkRule) []int {
	t.Helper()
	if len(chunks) == 0 {
		t.Fatalf("no chunks")
	}
	var total uint64
	units := make([]int, len(chunks))
	lastSeq := map[int32]uint64{}
	seen := map[int32]map[int64]bool{}
	rankOf := func(b *kvpb.KvEventBatch) int32 {
		if b.DpRank == nil {
			return NoRank
		}
		return *b.DpRank
	}
	// The live set of each rank, to tell live parents from dead ones.
	live := map[int32]map[int64]bool{}
	for _, b := range chunks {
		r := rankOf(b)
		if live[r] == nil {
			live[r] = map[int64]bool{}
		}
		for _, ev := range b.Events {
			for _, blk := range ev.GetStored().GetBlocks() {
				live[r][blk.BlockHash] = true
			}
		}
	}
	prevRank := int32(-2)
	for i, b := range chunks {
		r := rankOf(b)
		sn := b.GetSnapshot()
		if sn == nil || sn.Index != uint32(i) || sn.Count != uint32(len(chunks)) {
			t.Fatalf("chunk %d: marker %v", i, sn)
		}
		if sn.UnknownBefore != rule.unknownBefore[r] {
			t.Fatalf("chunk %d: unknown_before %d, want %d", i, sn.UnknownBefore, rule.unknownBefore[r])
		}
		if i > 0 && sn.Blocks != chunks[0].Snapshot.Blocks {
			t.Fatalf("chunk %d: blocks %d, chunk 0 says %d", i, sn.Blocks, chunks[0].Snapshot.Blocks)
		}
		if r < prevRank {
			t.Fatalf("chunk %d: rank %d after rank %d", i, r, prevRank)
		}
		if r != prevRank {
			if prevRank != -2 && lastSeq[prevRank] != rule.cursors[prevRank] {
				t.Fatalf("rank %d: last stamp %d, want its cursor %d", prevRank, lastSeq[prevRank], rule.cursors[prevRank])
			}
		} else if b.SequenceNumber != lastSeq[r]+1 && (b.SequenceNumber != 0 || lastSeq[r] != 0) {
			// Stamps saturate at 0 when the byte bound needs more chunks than sequences.
			t.Fatalf("chunk %d: seq %d does not follow %d", i, b.SequenceNumber, lastSeq[r])
		}
		prevRank = r
		lastSeq[r] = b.SequenceNumber
		if seen[r] == nil {
			seen[r] = map[int64]bool{}
		}
		for j, ev := range b.Events {
			if ev.EventId != 0 {
				t.Fatalf("chunk %d event %d: event_id %d", i, j, ev.EventId)
			}
			if ev.GetCleared() != nil {
				if i != 0 || j != 0 {
					t.Fatalf("chunk %d event %d: a clear outside the start of chunk 0", i, j)
				}
				continue
			}
			if i == 0 && j == 0 {
				t.Fatalf("chunk 0 does not start with a clear")
			}
			s := ev.GetStored()
			if s == nil || len(s.Blocks) == 0 {
				t.Fatalf("chunk %d event %d: not a non-empty store: %v", i, j, ev)
			}
			parent, has := s.GetParentBlockHash(), s.ParentBlockHash != nil
			for _, blk := range s.Blocks {
				if has && live[r][parent] && !seen[r][parent] {
					t.Fatalf("chunk %d: block %d comes before its live parent %d", i, blk.BlockHash, parent)
				}
				seen[r][blk.BlockHash] = true
				parent, has = blk.BlockHash, true
				units[i]++
			}
		}
		if i == 0 && len(b.Events) == 0 {
			t.Fatalf("chunk 0 is empty")
		}
		if size := proto.Size(b); size > MaxChunkBytes {
			t.Fatalf("chunk %d is %d bytes, over MaxChunkBytes %d", i, size, MaxChunkBytes)
		}
		total += uint64(units[i])
	}
	if lastSeq[prevRank] != rule.cursors[prevRank] {
		t.Fatalf("rank %d: last stamp %d, want its cursor %d", prevRank, lastSeq[prevRank], rule.cursors[prevRank])
	}
	if total != chunks[0].Snapshot.Blocks {
		t.Fatalf("the chunks hold %d units, the marker says %d", total, chunks[0].Snapshot.Blocks)
	}
	if rule.maxUnits >= 0 {
		limit := max(rule.maxUnits, 0)
		if limit == 0 {
			limit = ChunkBlocks
		}
		for i, n := range units {
			if n > limit {
				t.Fatalf("chunk %d holds %d units, more than %d", i, n, limit)
			}
		}
	}
	return units
}

func mustEqualStats(t testing.TB, got Stats, entries, blocks uint64, ranks []RankStats) {
	t.Helper()
	if got.Entries != entries || got.Blocks != blocks || !slices.Equal(got.Ranks, ranks) {
		t.Fatalf("stats: entries %d blocks %d ranks %v; want %d %d %v", got.Entries, got.Blocks, got.Ranks,
			entries, blocks, ranks)
	}
}

func (k modelKey) String() string { return fmt.Sprintf("%v/%d", k.tier, k.hash) }
