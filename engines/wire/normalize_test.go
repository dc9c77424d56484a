package wire

import (
	"encoding/json"
	"math"
	"slices"
	"strings"
	"testing"

	"google.golang.org/protobuf/proto"

	"github.com/kvrelay/kvrelay/proto/kvpb"
)

func TestHashesFoldLikeTheEngines(t *testing.T) {
	cases := []struct {
		name string
		hash any
		want int64
		ok   bool
	}{
		{"small int", 7, 7, true},
		{"uint64 2^63", uint64(1) << 63, math.MinInt64, true},
		{"uint64 max", uint64(math.MaxUint64), -1, true},
		{"negative", -3, -3, true},
		{"int64 min", int64(math.MinInt64), math.MinInt64, true},
		{"32 bytes", append(make([]byte, 24), 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xfe), -2, true},
		{"8 bytes", []byte{0, 0, 0, 0, 0, 0, 0x12, 0x34}, 0x1234, true},
		{"short bytes", []byte{0x01, 0x02}, 0x0102, true},
		{"text", "nope", 0, false},
		{"bool", true, 0, false},
		{"float", 1.5, 0, false},
		{"nil", nil, 0, false},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			b, d := mustNormalize(t, NewNormalizer(VLLM), batch(t, 0, stored([]any{c.hash}, nil, toks(1, 2), 2)), 1, -1)
			if !c.ok {
				if d != dropsOf(DropMalformed, 1) {
					t.Fatalf("drops %v, want malformed", d)
				}
				return
			}
			if d.Total() != 0 || !slices.Equal(storedHashes(b.Events[0].GetStored()), []int64{c.want}) {
				t.Fatalf("drops %v batch %v", d, b)
			}
		})
	}
	// An unreadable parent is no parent; the store survives.
	b, _ := mustNormalize(t, NewNormalizer(VLLM), batch(t, 0, stored([]any{1}, "nope", toks(1, 2), 2)), 1, -1)
	if len(b.Events) != 1 || b.Events[0].GetStored().ParentBlockHash != nil {
		t.Errorf("parent %v", b.Events)
	}
}

func TestEnvelopeLayouts(t *testing.T) {
	unknown := om{"type", "BlockInactive", "block_hashes", []any{1}}
	cases := []struct {
		name     string
		payload  []byte
		sockRank int32
		rank     *int32
		ts       float64
		ids      []uint64
	}{
		{"omitted rank", enc(t, []any{2.5, []any{}}), -1, nil, 2.5, nil},
		{"nil rank", enc(t, []any{2.5, []any{}, nil}), -1, nil, 2.5, nil},
		{"trailing fields", enc(t, []any{2.5, []any{unknown, cleared()}, 2, "future", om{"x", 1}}), -1, ptr(int32(2)), 2.5, []uint64{2}},
		{"int ts", enc(t, []any{17, []any{}, 1}), -1, ptr(int32(1)), 17, nil},
		{"text ts reads 0", enc(t, []any{"soon", []any{}, 1}), -1, ptr(int32(1)), 0, nil},
		{"text rank is none", enc(t, []any{1.0, []any{}, "one"}), -1, nil, 1, nil},
		{"rank beyond int32 is none", enc(t, []any{1.0, []any{}, int64(1) << 40}), -1, nil, 1, nil},
		{"socket rank wins", enc(t, []any{1.0, []any{}, 0}), 3, ptr(int32(3)), 1, nil},
		{"socket rank without payload rank", enc(t, []any{1.0, []any{}}), 4, ptr(int32(4)), 1, nil},
		{"map envelope vllm", enc(t, om{"events", []any{cleared()}, "ts", 3.0, "data_parallel_rank", 6, "extra", []any{1}}), -1, ptr(int32(6)), 3, []uint64{1}},
		{"map envelope sglang", enc(t, om{"ts", 3.0, "attn_dp_rank", 1, "events", []any{}}), -1, ptr(int32(1)), 3, nil},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			b, _ := mustNormalize(t, NewNormalizer(VLLM), c.payload, 77, c.sockRank)
			if b.GetSequenceNumber() != 77 || b.GetTimestamp() != c.ts || !slices.Equal(eventIDs(b), c.ids) {
				t.Errorf("seq %d ts %v ids %v", b.GetSequenceNumber(), b.GetTimestamp(), eventIDs(b))
			}
			if (b.DpRank == nil) != (c.rank == nil) || (c.rank != nil && *b.DpRank != *c.rank) {
				t.Errorf("rank %v, want %v", b.DpRank, c.rank)
			}
		})
	}
}

func TestNonBatchPayloadsAreErrors(t *testing.T) {
	f1 := unhex(t, hexF1Batch1)
	nested := append(bytesRepeat(0x91, 1<<20), 0xc0)
	cases := []struct {
		name    string
		payload []byte
	}{
		{"empty", nil},
		{"int", enc(t, 5)},
		{"text", enc(t, "batch")},
		{"one element", enc(t, []any{1.0})},
		{"events not a list", enc(t, []any{1.0, 5, 0})},
		{"events nil", enc(t, []any{1.0, nil, 0})},
		{"map without events", enc(t, om{"ts", 1.0})},
		{"truncated", f1[:len(f1)/2]},
		{"truncated token list", f1[:200]},
		{"reserved code", []byte{0x92, 0xc1, 0x90}},
		{"reserved code inside an event", enc(t, []any{1.0, []any{raw{0x92, 0xa1, 'x', 0xc1}}})},
		{"array32 claims 1Mi elements", []byte{0xdd, 0x00, 0x10, 0x00, 0x00}},
		{"events claim 4Gi", []byte{0x92, 0x00, 0xdd, 0xff, 0xff, 0xff, 0xff}},
		{"bin32 claims 64MiB hash", enc(t, []any{1.0, []any{[]any{"BlockRemoved", []any{raw{0xc6, 0x04, 0, 0, 0}}}}})},
		{"str32 key claims 4GiB", enc(t, []any{1.0, []any{raw{0x81, 0xdb, 0xff, 0xff, 0xff, 0xff}}})},
		{"map32 claims 4Gi entries", enc(t, []any{1.0, []any{raw{0xdf, 0xff, 0xff, 0xff, 0xff}}})},
		{"deep nesting", enc(t, []any{1.0, []any{raw(nested)[:len(nested)-1]}})},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			n := NewNormalizer(VLLM)
			b, d, err := n.Normalize(c.payload, 1, 0)
			if !isUndecodable(err) || b != nil || d.Total() != 0 {
				t.Fatalf("got batch %v drops %v err %v, want ErrUndecodable", b, d, err)
			}
			if !strings.Contains(err.Error(), "at byte") {
				t.Errorf("error %q names no offset", err)
			}
			if n.Counts().UndecodableBatches != 1 {
				t.Errorf("undecodable count %d", n.Counts().UndecodableBatches)
			}
			// An undecodable batch consumes no event ids.
			b, _ = mustNormalize(t, n, batch(t, 0, cleared()), 2, 0)
			if !slices.Equal(eventIDs(b), []uint64{1}) {
				t.Errorf("next ids %v", eventIDs(b))
			}
		})
	}
	// A deeply nested junk event inside a good envelope is only malformed.
	junk := append(bytesRepeat(0x91, 1<<16), 0xc0)
	_, d := mustNormalize(t, NewNormalizer(VLLM), enc(t, []any{1.0, []any{raw(junk)}}), 1, 0)
	if d != dropsOf(DropMalformed, 1) {
		t.Errorf("nested junk drops %v", d)
	}
}

func bytesRepeat(b byte, n int) []byte {
	out := make([]byte, n)
	for i := range out {
		out[i] = b
	}
	return out
}

// relay-semantics §7.4: unknown and malformed events cost themselves.
func TestUnknownAndMalformedEventsCostThemselves(t *testing.T) {
	payload := batch(t, 0,
		om{"type", "TierBlocksCleared", "medium", "CPU"}, // unknown type
		om{"block_hashes", []any{1}},                     // no tag
		stored([]any{1}, nil, toks(1, 2), "two"),         // bad block_size
		5,                                                // not an event
		removed([]any{9}),
	)
	n := NewNormalizer(VLLM)
	b, d := mustNormalize(t, n, payload, 1, -1)
	if !slices.Equal(eventIDs(b), []uint64{5}) {
		t.Fatalf("ids %v, want [5]", eventIDs(b))
	}
	if d != dropsOf(DropUnknownType, 1, DropMalformed, 3) {
		t.Errorf("drops %v", d)
	}
	// Missing required fields, each on its own.
	for _, ev := range []om{
		{"type", "BlockStored", "token_ids", toks(1, 2), "block_size", 2},
		{"type", "BlockStored", "block_hashes", []any{1}, "block_size", 2},
		{"type", "BlockStored", "block_hashes", []any{1}, "token_ids", toks(1, 2)},
		{"type", "BlockStored", "block_hashes", []any{1, "x"}, "token_ids", toks(1, 2), "block_size", 2},
		{"type", "BlockRemoved"},
		{"type", "BlockRemoved", "block_hashes", 5},
		{"type", 5, "block_hashes", []any{1}},
		{"type", nil},
	} {
		_, d := mustNormalize(t, n, batch(t, 0, ev), 2, -1)
		if d != dropsOf(DropMalformed, 1) {
			t.Errorf("%v: drops %v", ev, d)
		}
	}
	for _, ev := range [][]any{{}, {5, []any{1}}, {nil}} {
		_, d := mustNormalize(t, n, batch(t, 0, ev), 3, -1)
		if d != dropsOf(DropMalformed, 1) {
			t.Errorf("array %v: drops %v", ev, d)
		}
	}
	_, d = mustNormalize(t, n, batch(t, 0, []any{"BlockInactive", 1, 2}), 4, -1)
	if d != dropsOf(DropUnknownType, 1) {
		t.Errorf("unknown array tag: drops %v", d)
	}
}

// relay-semantics §7.9: unknown keys are ignored; bigram cells fold to their
// first word.
func TestUnknownKeysAndBigramCells(t *testing.T) {
	bigrams := []any{[]any{1, 2}, []any{2, 3}, []any{3, 4}, []any{4, 5}}
	n := NewNormalizer(SGLang)
	b, d := mustNormalize(t, n, batch(t, 0,
		append(stored([]any{10}, nil, bigrams, 4), "future_field", om{"a", []any{1, 2}}, 99, "x"),
		removed([]any{10}, "another_future", 1.5),
	), 1, -1)
	if d.Total() != 0 || len(b.Events) != 2 {
		t.Fatalf("drops %v events %v", d, b.Events)
	}
	if got := b.Events[0].GetStored().Blocks[0].TokenIds; !slices.Equal(got, []uint32{1, 2, 3, 4}) {
		t.Errorf("bigram tokens %v", got)
	}
	if n.Counts().BigramStores != 1 {
		t.Errorf("bigram_stores %d", n.Counts().BigramStores)
	}
	for name, cells := range map[string][]any{
		"mixed cells":      {1, []any{2, 3}},
		"negative token":   {1, -2},
		"token beyond u32": {1, int64(1) << 32},
		"float token":      {1, 2.0},
		"triple cell":      {[]any{1, 2, 3}, []any{1, 2, 3}},
		"negative bigram":  {[]any{1, -2}, []any{3, 4}},
		"text cell":        {"a", "b"},
	} {
		_, d := mustNormalize(t, n, batch(t, 0, stored([]any{11}, nil, cells, 2)), 2, -1)
		if d != dropsOf(DropMalformed, 1) {
			t.Errorf("%s: drops %v", name, d)
		}
	}
	// Every integer width is a token.
	wide := []any{uint8(200), uint16(60000), uint32(4000000000), uint64(7), int8(5), int16(300), int32(70000), int64(9)}
	b, d = mustNormalize(t, n, batch(t, 0, stored([]any{12}, nil, wide, 8)), 3, -1)
	if d.Total() != 0 || !slices.Equal(b.Events[0].GetStored().Blocks[0].TokenIds, []uint32{200, 60000, 4000000000, 7, 5, 300, 70000, 9}) {
		t.Errorf("wide tokens: drops %v %v", d, b.Events)
	}
}

func TestResidencyAgentEventsAreDropped(t *testing.T) {
	n := NewNormalizer(VLLM)
	b, d := mustNormalize(t, n, batch(t, 0,
		stored([]any{1}, nil, toks(1, 2), 2, "ownership", "kvcr"),
		removed([]any{1}, "ownership", "KVCR"),
		cleared("ownership", "Kvcr"),
		cleared(),
		stored([]any{2}, nil, toks(1, 2), 2, "ownership", "tier-b"),
	), 1, -1)
	if d != dropsOf(DropUnsupportedOwnership, 3) || !slices.Equal(eventIDs(b), []uint64{4, 5}) {
		t.Fatalf("drops %v ids %v", d, eventIDs(b))
	}
	if b.Events[1].GetStored().GetOwnership() != "tier-b" {
		t.Errorf("ownership %v", b.Events[1])
	}
	// An array clear reads ownership from slot 1.
	_, d = mustNormalize(t, n, batch(t, 0, []any{"AllBlocksCleared", "kvcr"}), 2, -1)
	if d != dropsOf(DropUnsupportedOwnership, 1) {
		t.Errorf("array clear drops %v", d)
	}
}

func TestLocalities(t *testing.T) {
	n := NewNormalizer(VLLM)
	b, d := mustNormalize(t, n, batch(t, 0,
		stored([]any{1}, nil, toks(1, 2), 2, "locality", "REMOTE"),
		removed([]any{1}, "locality", "elsewhere"),
		stored([]any{2}, nil, toks(1, 2), 2, "locality", "local"),
		removed([]any{2}, "locality", "LOCAL"),
		stored([]any{3}, nil, toks(1, 2), 2, "locality", 5), // not text: absent
	), 1, -1)
	if d != dropsOf(DropNonLocalLocality, 2) || !slices.Equal(eventIDs(b), []uint64{3, 4, 5}) {
		t.Fatalf("drops %v ids %v", d, eventIDs(b))
	}
	for _, e := range b.Events {
		var loc kvpb.KvCacheLocality
		if s := e.GetStored(); s != nil {
			loc = s.GetLocality()
		} else {
			loc = e.GetRemoved().GetLocality()
		}
		if loc != kvpb.KvCacheLocality_KV_CACHE_LOCALITY_LOCAL {
			t.Errorf("event %d locality %v", e.EventId, loc)
		}
	}
}

func TestMediaMapToTiersAndCacheLevels(t *testing.T) {
	const (
		dev  = kvpb.KvCacheTier_KV_CACHE_TIER_DEVICE
		host = kvpb.KvCacheTier_KV_CACHE_TIER_HOST
		disk = kvpb.KvCacheTier_KV_CACHE_TIER_DISK
		ext  = kvpb.KvCacheTier_KV_CACHE_TIER_EXTERNAL
	)
	cases := []struct {
		medium any
		tier   kvpb.KvCacheTier
		level  int32 // -1: none
	}{
		{nil, dev, -1}, {"GPU", dev, -1}, {"device", dev, -1},
		{"CPU", host, 1}, {"cpu_pinned", host, 1}, {"CPU_TIER1", host, 1},
		{"CPU_TIER2", disk, 2}, {"DISK", disk, 2}, {"nvme", disk, 2}, {"STORAGE", disk, 2},
		{"EXTERNAL", ext, 3}, {"NETWORK", ext, 3}, {"remote", ext, 3}, {"SHARED", ext, 3},
		{"MARS", 0, 0}, {"FS", 0, 0}, {"OBJ", 0, 0}, {"lmcache-l1", 0, 0},
	}
	for _, c := range cases {
		n := NewNormalizer(VLLM)
		s := om{"type", "BlockStored", "block_hashes", []any{1}, "token_ids", toks(1, 2), "block_size", 2, "medium", c.medium}
		r := om{"type", "BlockRemoved", "block_hashes", []any{1}, "medium", c.medium}
		b, d := mustNormalize(t, n, batch(t, 0, s, r), 1, -1)
		if c.tier == 0 {
			if d != dropsOf(DropUnknownMedium, 2) {
				t.Errorf("%v: drops %v", c.medium, d)
			}
			continue
		}
		if d.Total() != 0 || len(b.Events) != 2 {
			t.Fatalf("%v: drops %v", c.medium, d)
		}
		st, rm := b.Events[0].GetStored(), b.Events[1].GetRemoved()
		if st.GetTier() != c.tier || rm.GetTier() != c.tier {
			t.Errorf("%v: tiers %v %v", c.medium, st.GetTier(), rm.GetTier())
		}
		lvl, rlvl := st.Blocks[0].CacheLevel, rm.CacheLevel
		if c.level < 0 {
			if lvl != nil || rlvl != nil {
				t.Errorf("%v: device has cache levels %v %v", c.medium, lvl, rlvl)
			}
		} else if lvl == nil || *lvl != c.level || rlvl == nil || *rlvl != c.level {
			t.Errorf("%v: cache levels %v %v, want %d", c.medium, lvl, rlvl, c.level)
		}
		if m, ok := c.medium.(string); ok && (st.GetMedium() != m || rm.GetMedium() != m) {
			t.Errorf("%v: raw medium not kept: %v %v", c.medium, st.Medium, rm.Medium)
		}
	}
}

func TestNonMainAttentionGroupsAreDroppedAndRemembered(t *testing.T) {
	n := NewNormalizer(VLLM)
	grp := func(ev om, g int, kind any) om {
		ev = append(ev, "group_idx", g)
		if kind != nil {
			ev = append(ev, "kv_cache_spec_kind", kind)
		}
		return ev
	}
	b, d := mustNormalize(t, n, batch(t, 0,
		grp(stored([]any{1}, nil, toks(1, 2), 2), 1, "mamba"),               // 1 dropped: rank has a main group (pre-pass)
		grp(stored([]any{1}, nil, toks(1, 2), 2), 0, "full_attention"),      // 2
		grp(stored([]any{2}, nil, toks(1, 2), 2), 2, "mla_attention"),       // 3
		grp(stored([]any{3}, nil, toks(1, 2), 2), 3, "sink_full_attention"), // 4
		grp(removed([]any{1}), 1, nil),                                      // 5 dropped: learned non-main
		grp(stored([]any{4}, nil, toks(1, 2), 2), 1, nil),                   // 6 dropped: kind-less follows group 1
		grp(removed([]any{3}), 3, nil),                                      // 7
		grp(removed([]any{9}), 7, nil),                                      // 8: unknown group is main
		grp(stored([]any{5}, nil, toks(1, 2), 2), 4, "sliding_window"),      // 9 dropped
	), 1, -1)
	if d != dropsOf(DropNonMainAttentionGroup, 4) {
		t.Errorf("drops %v", d)
	}
	if !slices.Equal(eventIDs(b), []uint64{2, 3, 4, 7, 8}) {
		t.Errorf("ids %v", eventIDs(b))
	}
	// A later batch: the groups are remembered.
	_, d = mustNormalize(t, n, batch(t, 0, grp(removed([]any{5}), 4, nil)), 2, -1)
	if d != dropsOf(DropNonMainAttentionGroup, 1) {
		t.Errorf("second batch drops %v", d)
	}
}

// Rust semantics: a rank that shows only sliding-window groups forwards its
// window stores (hashes on the tail of the tokens) until a main group
// appears; then only removals of what it forwarded pass.
func TestWindowOnlyRankIsForwardedUntilAMainGroupAppears(t *testing.T) {
	n := NewNormalizer(VLLM)
	win := func(ev om) om { return append(ev, "group_idx", 1) }
	b, d := mustNormalize(t, n, batch(t, 0,
		append(win(stored([]any{21, 22}, nil, toks(1, 12), 4)), "kv_cache_spec_kind", "sliding_window", "kv_cache_spec_sliding_window", 8),
		win(removed([]any{21})),
	), 1, -1)
	if d.Total() != 0 || len(b.Events) != 2 {
		t.Fatalf("drops %v events %d", d, len(b.Events))
	}
	s := b.Events[0].GetStored()
	if !slices.Equal(s.Blocks[0].TokenIds, []uint32{5, 6, 7, 8}) || !slices.Equal(s.Blocks[1].TokenIds, []uint32{9, 10, 11, 12}) ||
		s.GetKvCacheSpecSlidingWindow() != 8 || s.GetGroupIdx() != 1 {
		t.Errorf("window store %v", s)
	}
	c := n.Counts()
	if c.WindowOnlyStores != 1 || c.TailAlignedStores != 1 {
		t.Errorf("counts %+v", c)
	}
	b, d = mustNormalize(t, n, batch(t, 0,
		append(stored([]any{31}, nil, toks(1, 4), 4), "group_idx", 0, "kv_cache_spec_kind", "full_attention"),
		append(win(stored([]any{32}, nil, toks(1, 4), 4)), "kv_cache_spec_kind", "sliding_window"),
		win(removed([]any{22, 23})), // only 22 was forwarded while window-only
		win(removed([]any{23})),
	), 2, -1)
	if d != dropsOf(DropNonMainAttentionGroup, 2) || !slices.Equal(eventIDs(b), []uint64{3, 5}) {
		t.Fatalf("drops %v ids %v", d, eventIDs(b))
	}
	if got := b.Events[1].GetRemoved().BlockHashes; !slices.Equal(got, []int64{22}) {
		t.Errorf("window removal kept %v, want [22]", got)
	}
	// 22 is no longer remembered, so removing it again is a non-main drop.
	_, d = mustNormalize(t, n, batch(t, 0, win(removed([]any{22}))), 3, -1)
	if d != dropsOf(DropNonMainAttentionGroup, 1) {
		t.Errorf("repeat removal drops %v", d)
	}
}

func TestPlaceholdersUnalignedAndSelfReferencingStores(t *testing.T) {
	n := NewNormalizer(VLLM)
	b, d := mustNormalize(t, n, batch(t, 0,
		stored([]any{}, nil, toks(1, 2), 2),             // placeholder: no hashes
		stored([]any{1}, nil, []any{}, 0),               // placeholder: offload chunk key
		stored([]any{2}, nil, toks(1, 2), 0),            // unaligned: block_size 0
		stored([]any{3}, nil, toks(1, 3), 2),            // unaligned: 3 tokens, blocks of 2
		stored([]any{4}, nil, toks(1, 2), int64(1)<<31), // unaligned: block_size ≥ 2^31
		stored([]any{5, 7, 5}, nil, toks(1, 3), 1),      // self-referencing
		stored([]any{8}, 8, toks(1, 2), 2),              // parent == hash
		stored([]any{6}, nil, toks(1, 2), 2),
		stored([]any{9, 10, 11}, nil, toks(1, 4), 2), // more hashes than tokens
		stored([]any{12}, nil, toks(1, 2), -2),       // negative block size
	), 1, -1)
	if d != dropsOf(DropPlaceholder, 2, DropUnalignedBlocks, 5, DropSelfReferencingHashes, 2) {
		t.Errorf("drops %v", d)
	}
	if len(b.Events) != 1 || !slices.Equal(storedHashes(b.Events[0].GetStored()), []int64{6}) {
		t.Errorf("survivors %v", b.Events)
	}
	// Self-reference detection past the small-store path.
	long := make([]any, 40)
	for i := range long {
		long[i] = i + 100
	}
	long[39] = 100
	_, d = mustNormalize(t, n, batch(t, 0, stored(long, nil, toks(1, 40), 1)), 2, -1)
	if d != dropsOf(DropSelfReferencingHashes, 1) {
		t.Errorf("long self-ref drops %v", d)
	}
}

func TestStoresAndRemovalsAreForwardedOneForOne(t *testing.T) {
	n := NewNormalizer(VLLM)
	salted := func(ev om) om { return append(ev, "cache_salt", "s") }
	b, d := mustNormalize(t, n, batch(t, 0,
		salted(stored([]any{1, 2}, nil, toks(1, 4), 2)),
		salted(stored([]any{1, 2}, nil, toks(1, 4), 2)), // second physical copy: duplicate
		stored([]any{3}, nil, toks(1, 2), 2),
		stored([]any{2, 4}, nil, toks(1, 4), 2), // not all seen
		removed([]any{1}),
		removed([]any{1}),
		removed([]any{1}), // nothing left: still forwarded
	), 1, -1)
	c := n.Counts()
	if d.Total() != 0 || len(b.Events) != 7 || c.ForwardedStored != 4 || c.ForwardedRemoved != 3 {
		t.Fatalf("drops %v events %d counts %+v", d, len(b.Events), c)
	}
	// Both copies of 1 are gone, so its namespace no longer passes down;
	// 2 still holds two copies (one overwritten by the unsalted store).
	b, _ = mustNormalize(t, n, batch(t, 0, stored([]any{50}, 1, toks(1, 2), 2)), 2, -1)
	if b.Events[0].GetStored().CacheSalt != nil {
		t.Errorf("orphan inherited %v", b.Events[0].GetStored().GetCacheSalt())
	}
}

// relay-semantics §7.9: a parent record outlives all but its last copy.
func TestParentRecordOutlivesAllButItsLastCopy(t *testing.T) {
	n := NewNormalizer(SGLang)
	salt := "tenant-a"
	mustNormalize(t, n, batch(t, 0,
		stored([]any{1}, nil, toks(1, 2), 2, "cache_salt", salt),
		stored([]any{1}, nil, toks(1, 2), 2, "cache_salt", salt),
		removed([]any{1}),
	), 1, -1)
	b, _ := mustNormalize(t, n, batch(t, 0, stored([]any{2}, 1, toks(3, 4), 2)), 2, -1)
	if b.Events[0].GetStored().GetCacheSalt() != salt {
		t.Errorf("child of a remaining copy: salt %v", b.Events[0].GetStored().CacheSalt)
	}
	mustNormalize(t, n, batch(t, 0, removed([]any{1})), 3, -1)
	b, _ = mustNormalize(t, n, batch(t, 0, stored([]any{3}, 1, toks(3, 4), 2)), 4, -1)
	if b.Events[0].GetStored().CacheSalt != nil {
		t.Errorf("child of a removed parent: salt %v", b.Events[0].GetStored().GetCacheSalt())
	}
}

func TestCopiesAreCappedAtEight(t *testing.T) {
	n := NewNormalizer(VLLM)
	var evs []any
	for i := 0; i < 12; i++ {
		evs = append(evs, stored([]any{1}, nil, toks(1, 2), 2, "lora_name", "L"))
	}
	mustNormalize(t, n, batch(t, 0, evs...), 1, -1)
	if rec, _ := n.ranks[0].tiers[0].get(1); rec.copies != copiesCap {
		got := rec.copies
		t.Fatalf("copies %d, want %d", got, copiesCap)
	}
	var rms []any
	for i := 0; i < copiesCap; i++ {
		rms = append(rms, removed([]any{1}))
	}
	mustNormalize(t, n, batch(t, 0, rms...), 2, -1)
	if _, ok := n.ranks[0].tiers[0].get(1); ok {
		t.Errorf("record survives %d removals", copiesCap)
	}
}

func TestNamespacesComeFromTheEventExtraKeysOrParent(t *testing.T) {
	n := NewNormalizer(VLLM)
	ns := func(s *kvpb.KvBlocksStored) [2]string {
		return [2]string{s.GetLoraName(), s.GetCacheSalt()}
	}
	b, _ := mustNormalize(t, n, batch(t, 0,
		stored([]any{1}, nil, toks(1, 2), 2, "lora_name", "adapter", "extra_keys", []any{[]any{"adapter", "", "salt-1"}}),
		stored([]any{2}, 1, toks(3, 4), 2),                                    // child: inherits both
		stored([]any{3}, 2, toks(5, 6), 2),                                    // grandchild: inherits both
		stored([]any{4}, 3, toks(7, 8), 2, "lora_name", "", "cache_salt", ""), // empty counts as absent
		stored([]any{5}, 3, toks(7, 8), 2, "cache_salt", "own"),               // its own salt wins
		stored([]any{6}, 99, toks(7, 8), 2),                                   // unknown parent
		stored([]any{7}, 1, toks(3, 4), 2, "medium", "CPU"),                   // another tier does not inherit
	), 1, -1)
	want := [][2]string{{"adapter", "salt-1"}, {"adapter", "salt-1"}, {"adapter", "salt-1"}, {"adapter", "salt-1"}, {"adapter", "own"}, {"", ""}, {"", ""}}
	for i, w := range want {
		if got := ns(b.Events[i].GetStored()); got != w {
			t.Errorf("event %d namespace %v, want %v", i+1, got, w)
		}
	}
	if s := b.Events[5].GetStored(); s.LoraName != nil || s.CacheSalt != nil {
		t.Errorf("unknown parent gave %v %v", s.LoraName, s.CacheSalt)
	}
	// Another rank does not inherit.
	b, _ = mustNormalize(t, n, batch(t, 1, stored([]any{8}, 1, toks(3, 4), 2)), 1, 1)
	if s := b.Events[0].GetStored(); s.LoraName != nil || s.CacheSalt != nil {
		t.Errorf("rank 1 inherited %v %v", s.GetLoraName(), s.GetCacheSalt())
	}
	// Extra keys map to the proto; unmodelled items are dropped.
	b, _ = mustNormalize(t, n, batch(t, 0, stored([]any{9, 10}, nil, toks(1, 4), 2, "extra_keys", []any{
		[]any{"text", 5, []byte{1, 2}, []any{"img0", 16}, 1.5, true, nil, om{"a", 1}, []any{"x"}, uint64(math.MaxUint64)},
		nil,
	})), 2, 0)
	keys := b.Events[0].GetStored().Blocks[0].ExtraKeys
	want2 := []*kvpb.KvBlockExtraKey{
		{Key: &kvpb.KvBlockExtraKey_Text{Text: "text"}},
		{Key: &kvpb.KvBlockExtraKey_Number{Number: 5}},
		{Key: &kvpb.KvBlockExtraKey_Blob{Blob: []byte{1, 2}}},
		{Key: &kvpb.KvBlockExtraKey_Multimodal{Multimodal: &kvpb.KvMultimodalKey{Identifier: "img0", Offset: 16}}},
	}
	if len(keys) != len(want2) {
		t.Fatalf("extra keys %v", keys)
	}
	for i := range want2 {
		if !proto.Equal(keys[i], want2[i]) {
			t.Errorf("key %d: %v, want %v", i, keys[i], want2[i])
		}
	}
	if b.Events[0].GetStored().Blocks[1].ExtraKeys != nil || b.Events[0].GetStored().GetCacheSalt() != "text" {
		t.Errorf("block 1 keys %v salt %v", b.Events[0].GetStored().Blocks[1].ExtraKeys, b.Events[0].GetStored().CacheSalt)
	}
}

func TestAClearResetsItsRankOnly(t *testing.T) {
	n := NewNormalizer(VLLM)
	for _, r := range []int32{0, 1} {
		mustNormalize(t, n, batch(t, r, stored([]any{1}, nil, toks(1, 2), 2, "cache_salt", "s")), 1, r)
	}
	b, d := mustNormalize(t, n, batch(t, 0, cleared(), stored([]any{2}, 1, toks(3, 4), 2)), 2, 0)
	if d.Total() != 0 || b.Events[0].GetCleared() == nil || b.Events[1].GetStored().CacheSalt != nil {
		t.Errorf("rank 0 after its clear: %v", b.Events)
	}
	b, _ = mustNormalize(t, n, batch(t, 1, stored([]any{2}, 1, toks(3, 4), 2)), 2, 1)
	if b.Events[0].GetStored().GetCacheSalt() != "s" {
		t.Errorf("rank 1 lost its record")
	}
	// With no rank anywhere, the state keys as -1 and a clear resets it.
	mustNormalize(t, n, enc(t, []any{1.0, []any{stored([]any{1}, nil, toks(1, 2), 2, "cache_salt", "t")}}), 3, -1)
	if _, ok := n.ranks[-1]; !ok {
		t.Fatalf("no rank -1 state")
	}
	mustNormalize(t, n, enc(t, []any{1.0, []any{cleared()}}), 4, -1)
	if _, ok := n.ranks[-1]; ok {
		t.Errorf("rank -1 not cleared")
	}
	if c := n.Counts(); c.ForwardedCleared != 2 {
		t.Errorf("cleared count %d", c.ForwardedCleared)
	}
}

func TestArrayAndMapLayoutsDecodeAlike(t *testing.T) {
	extra := []any{[]any{"salt-x"}, nil}
	mapBatch := batch(t, 2,
		om{"session_id", "sess", "ownership", "tier-b", "locality", "LOCAL", "kv_cache_spec_sliding_window", 64,
			"kv_cache_spec_kind", "full_attention", "group_idx", 3, "extra_keys", extra, "lora_name", "L", "medium", "CPU",
			"lora_id", 9, "block_size", 2, "token_ids", toks(1, 4), "parent_block_hash", 70, "block_hashes", []any{71, 72},
			"type", "BlockStored"},
		om{"type", "BlockRemoved", "ownership", "tier-b", "locality", "local", "group_idx", 3, "medium", "CPU", "block_hashes", []any{71}},
		om{"type", "AllBlocksCleared", "ownership", "tier-b"},
	)
	arrayBatch := batch(t, 2,
		[]any{"BlockStored", []any{71, 72}, 70, toks(1, 4), 2, 9, "CPU", "L", extra, 3, "full_attention", 64, "LOCAL", "tier-b", "sess", "future"},
		[]any{"BlockRemoved", []any{71}, "CPU", 3, "local", "tier-b", "future"},
		[]any{"AllBlocksCleared", "tier-b"},
	)
	bm, dm := mustNormalize(t, NewNormalizer(VLLM), mapBatch, 5, -1)
	ba, da := mustNormalize(t, NewNormalizer(VLLM), arrayBatch, 5, -1)
	if dm.Total() != 0 || da.Total() != 0 || !proto.Equal(bm, ba) {
		t.Fatalf("layouts differ:\nmap   %v %v\narray %v %v", dm, bm, da, ba)
	}
	s := bm.Events[0].GetStored()
	want := &kvpb.KvBlocksStored{
		ParentBlockHash: ptr(int64(70)), Tier: ptr(kvpb.KvCacheTier_KV_CACHE_TIER_HOST), Medium: ptr("CPU"),
		GroupIdx: ptr(uint32(3)), KvCacheSpecKind: ptr("full_attention"), KvCacheSpecSlidingWindow: ptr(uint32(64)),
		Locality: ptr(kvpb.KvCacheLocality_KV_CACHE_LOCALITY_LOCAL), Ownership: ptr("tier-b"), SessionId: ptr("sess"),
		LoraName: ptr("L"), CacheSalt: ptr("salt-x"),
		Blocks: []*kvpb.KvBlock{
			{BlockHash: 71, TokenIds: []uint32{1, 2}, BlockSize: 2, LoraId: ptr(int64(9)), CacheLevel: ptr(int32(1)),
				ExtraKeys: []*kvpb.KvBlockExtraKey{{Key: &kvpb.KvBlockExtraKey_Text{Text: "salt-x"}}}},
			{BlockHash: 72, TokenIds: []uint32{3, 4}, BlockSize: 2, LoraId: ptr(int64(9)), CacheLevel: ptr(int32(1))},
		},
	}
	if !proto.Equal(s, want) {
		t.Errorf("stored\n got %v\nwant %v", s, want)
	}
	wantR := &kvpb.KvBlocksRemoved{BlockHashes: []int64{71}, CacheLevel: ptr(int32(1)), Tier: want.Tier, Medium: ptr("CPU"),
		GroupIdx: ptr(uint32(3)), Locality: want.Locality, Ownership: ptr("tier-b")}
	if !proto.Equal(bm.Events[1].GetRemoved(), wantR) {
		t.Errorf("removed %v", bm.Events[1].GetRemoved())
	}
	if bm.Events[2].GetCleared().GetOwnership() != "tier-b" {
		t.Errorf("cleared %v", bm.Events[2])
	}
}

func TestEventIDsAndCountersAcrossBatches(t *testing.T) {
	n := NewNormalizer(VLLM)
	var last uint64
	for seq := uint64(0); seq < 5; seq++ {
		b, _ := mustNormalize(t, n, batch(t, 0, stored([]any{int(seq) + 1}, nil, toks(1, 2), 2), om{"type", "Nope"}, removed([]any{int(seq) + 1})), seq, 0)
		for _, id := range eventIDs(b) {
			if id <= last {
				t.Fatalf("event id %d after %d", id, last)
			}
			last = id
		}
	}
	if last != 15 {
		t.Errorf("last id %d, want 15", last)
	}
	n.Reset()
	b, _ := mustNormalize(t, n, batch(t, 0, cleared()), 0, 0)
	if !slices.Equal(eventIDs(b), []uint64{16}) {
		t.Errorf("ids after Reset %v", eventIDs(b))
	}
	c := n.Counts()
	if c.ForwardedStored != 5 || c.ForwardedRemoved != 5 || c.ForwardedCleared != 1 || c.Dropped != dropsOf(DropUnknownType, 5) {
		t.Errorf("counts %+v", c)
	}
	if len(n.ranks) != 0 {
		t.Errorf("Reset kept %d ranks' records", len(n.ranks))
	}
}

func TestDropsPrintAsJSON(t *testing.T) {
	d := dropsOf(DropMalformed, 2, DropUnknownType, 1)
	out, err := json.Marshal(d)
	if err != nil || string(out) != `{"unknown_type":1,"malformed":2}` {
		t.Errorf("json %s %v", out, err)
	}
	if d.String() != string(out) || d.Total() != 3 || d.Map()["malformed"] != 2 || len(d.Map()) != 2 {
		t.Errorf("String %q Total %d Map %v", d.String(), d.Total(), d.Map())
	}
	if s, _ := json.Marshal(Drops{}); string(s) != "{}" {
		t.Errorf("empty drops %s", s)
	}
	names := []string{}
	for _, r := range DropReasons() {
		names = append(names, r.String())
	}
	want := "unknown_type unsupported_ownership non_local_locality unknown_medium non_main_attention_group unaligned_blocks self_referencing_hashes placeholder malformed"
	if strings.Join(names, " ") != want {
		t.Errorf("reasons %v", names)
	}
}

// Namespaces no record uses are compacted away; live ones keep passing down.
func TestNamespaceTableCompacts(t *testing.T) {
	n := NewNormalizer(SGLang)
	mustNormalize(t, n, batch(t, 0, stored([]any{1}, nil, toks(1, 2), 2, "cache_salt", "keep")), 0, 0)
	for i := 0; i < 3000; i++ {
		salt := "s" + strings.Repeat("x", i%7) + string(rune('a'+i%26)) + jsonUint(uint64(i))
		mustNormalize(t, n, batch(t, 0,
			stored([]any{1000 + i}, nil, toks(1, 2), 2, "cache_salt", salt),
			removed([]any{1000 + i})), uint64(i+1), 0)
	}
	if len(n.nsList) > 2100 {
		t.Errorf("namespace table holds %d entries", len(n.nsList))
	}
	b, _ := mustNormalize(t, n, batch(t, 0, stored([]any{2}, 1, toks(3, 4), 2)), 9999, 0)
	if b.Events[0].GetStored().GetCacheSalt() != "keep" {
		t.Errorf("live namespace lost in compaction: %v", b.Events[0].GetStored().CacheSalt)
	}
}

// A batch's output owns its memory: neither the payload nor the decoder's
// scratch, both reused for the next batch, show through.
func TestOutputDoesNotAliasPayloadOrScratch(t *testing.T) {
	n := NewNormalizer(VLLM)
	payload := batch(t, 0,
		stored([]any{1, 2}, nil, toks(1, 4), 2, "extra_keys", []any{[]any{[]byte{7, 7}, "k"}, nil}, "session_id", "sess"),
		removed([]any{1}))
	first, _ := mustNormalize(t, n, payload, 1, 0)
	want := proto.Clone(first)
	for i := range payload {
		payload[i] = 0
	}
	mustNormalize(t, n, batch(t, 0,
		stored([]any{8, 9}, nil, toks(50, 53), 2, "extra_keys", []any{[]any{[]byte{1, 1}, "z"}, nil}, "session_id", "other"),
		removed([]any{9})), 2, 0)
	if !proto.Equal(first, want) {
		t.Errorf("first batch changed:\n now %v\nwas %v", first, want)
	}
}

// Unknown keys and trailing slots may hold any msgpack value; each is
// skipped whole and the event still decodes.
func TestValuesOfEveryShapeAreSkipped(t *testing.T) {
	values := map[string]raw{
		"nil": {0xc0}, "false": {0xc2}, "true": {0xc3}, "neg fixint": {0xff},
		"bin8": {0xc4, 1, 9}, "bin16": {0xc5, 0, 1, 9}, "bin32": {0xc6, 0, 0, 0, 1, 9},
		"ext8": {0xc7, 1, 5, 9}, "ext16": {0xc8, 0, 1, 5, 9}, "ext32": {0xc9, 0, 0, 0, 1, 5, 9},
		"float32": {0xca, 0, 0, 0, 0}, "float64": {0xcb, 0, 0, 0, 0, 0, 0, 0, 0},
		"uint8": {0xcc, 1}, "uint16": {0xcd, 0, 1}, "uint32": {0xce, 0, 0, 0, 1}, "uint64": {0xcf, 0, 0, 0, 0, 0, 0, 0, 1},
		"int8": {0xd0, 1}, "int16": {0xd1, 0, 1}, "int32": {0xd2, 0, 0, 0, 1}, "int64": {0xd3, 0, 0, 0, 0, 0, 0, 0, 1},
		"fixext1": {0xd4, 1, 9}, "fixext2": {0xd5, 1, 9, 9}, "fixext4": {0xd6, 1, 9, 9, 9, 9},
		"fixext8": {0xd7, 1, 9, 9, 9, 9, 9, 9, 9, 9}, "fixext16": append(raw{0xd8, 1}, make(raw, 16)...),
		"fixstr": {0xa1, 'x'}, "str8": {0xd9, 1, 'x'}, "str16": {0xda, 0, 1, 'x'}, "str32": {0xdb, 0, 0, 0, 1, 'x'},
		"array16": {0xdc, 0, 2, 1, 2}, "array32": {0xdd, 0, 0, 0, 1, 0xc0}, "map16": {0xde, 0, 1, 1, 2},
		"map32": {0xdf, 0, 0, 0, 1, 0xa1, 'k', 0x91, 0x90}, "fixmap": {0x81, 0x01, 0x81, 0x02, 0x03},
	}
	for name, v := range values {
		n := NewNormalizer(VLLM)
		payload := batch(t, 0,
			append(stored([]any{1}, nil, toks(1, 2), 2), "future", v, v, "x"),
			[]any{"BlockRemoved", []any{1}, "GPU", nil, nil, nil, v},
			[]any{"Unknown", v},
		)
		b, d := mustNormalize(t, n, payload, 1, -1)
		if d != dropsOf(DropUnknownType, 1) || len(b.Events) != 2 {
			t.Errorf("%s: drops %v events %d", name, d, len(b.Events))
		}
		// Truncating inside the value is a structural error, never a panic.
		if _, _, err := NewNormalizer(VLLM).Normalize(payload[:len(payload)-len(v)-12], 1, 0); !isUndecodable(err) {
			t.Errorf("%s truncated: err %v", name, err)
		}
	}
}

func TestSGLangSlot7(t *testing.T) {
	arr := func(slot7 any) []byte {
		return batch(t, 0, []any{"BlockStored", []any{1}, nil, toks(1, 2), 2, nil, "GPU", slot7})
	}
	cases := []struct {
		name       string
		slot7      any
		lora, salt string
		session    string
		vllmLora   string
	}{
		{"metadata map", om{"cache_salt", "tenant-a"}, "", "tenant-a", "", ""},
		{"metadata with session", om{"session_id", "s", 5, 6, "cache_salt", "t", "other", []any{1}}, "", "t", "s", ""},
		{"metadata salt not text", om{"cache_salt", 5}, "", "", "", ""},
		{"text slot is a lora name", "adapter", "adapter", "", "", "adapter"},
		{"nil slot", nil, "", "", "", ""},
		{"number slot", 7, "", "", "", ""},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			b, d := mustNormalize(t, NewNormalizer(SGLang), arr(c.slot7), 1, 0)
			if d.Total() != 0 {
				t.Fatalf("drops %v", d)
			}
			s := b.Events[0].GetStored()
			if s.GetLoraName() != c.lora || s.GetCacheSalt() != c.salt || s.GetSessionId() != c.session {
				t.Errorf("lora %q salt %q session %q", s.GetLoraName(), s.GetCacheSalt(), s.GetSessionId())
			}
			// vLLM reads the slot as lora_name only.
			b, _ = mustNormalize(t, NewNormalizer(VLLM), arr(c.slot7), 1, 0)
			if s := b.Events[0].GetStored(); s.GetLoraName() != c.vllmLora || s.CacheSalt != nil {
				t.Errorf("as vLLM: lora %q salt %v", s.GetLoraName(), s.CacheSalt)
			}
		})
	}
}

func TestEnvelopeEdgeCases(t *testing.T) {
	cases := []struct {
		name    string
		payload []byte
		ts      float64
		err     bool
	}{
		{"float32 ts", []byte{0x92, 0xca, 0x3f, 0xc0, 0, 0, 0x90}, 1.5, false},
		{"negative ts", enc(t, []any{-2, []any{}}), -2, false},
		{"nil ts", enc(t, []any{nil, []any{}}), 0, false},
		{"map envelope with odd keys", enc(t, om{1, 2, "ts", 4.0, "events", []any{}}), 4, false},
		{"map envelope repeating events", enc(t, om{"events", []any{}, "events", []any{}}), 0, true},
		{"trailing bytes after the envelope", append(enc(t, []any{1.0, []any{}}), 0xc1, 0xc1), 1, false},
	}
	for _, c := range cases {
		b, _, err := NewNormalizer(VLLM).Normalize(c.payload, 1, 0)
		if c.err {
			if !isUndecodable(err) {
				t.Errorf("%s: err %v", c.name, err)
			}
			continue
		}
		if err != nil || b.GetTimestamp() != c.ts {
			t.Errorf("%s: ts %v err %v", c.name, b.GetTimestamp(), err)
		}
	}
	if VLLM.String() != "vllm" || SGLang.String() != "sglang" || TokenSpeed.String() != "tokenspeed" || Dialect(0).String() != "unknown" {
		t.Errorf("dialect names")
	}
	if DropReason(200).String() != "invalid" {
		t.Errorf("bad reason name")
	}
}
