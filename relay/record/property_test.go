package record

import (
	"bytes"
	"fmt"
	"math/rand/v2"
	"testing"

	"google.golang.org/protobuf/proto"

	"github.com/kvrelay/kvrelay/proto/kvpb"
)

// opGen draws random operations; intn is the source of choices, so a fuzzer can drive it too.
type opGen struct {
	intn     func(n int) int
	pool     int // hashes are drawn from [1, pool]
	ranks    int // ranks NoRank .. ranks-2
	maxStore int
	// oneTier keeps every store and removal on the device tier, the case where the snapshot
	// finds parents through neighbouring slots.
	oneTier bool
}

var tails = [][]storeOpt{
	nil,
	{withMedium("GPU"), withKind("full_attention"), withGroup(0)},
	{withMedium("CPU"), withSession("s1")},
	{withSession("s2"), func(s *kvpb.KvBlocksStored) {
		s.LoraName = proto.String("adapter")
		s.CacheSalt = proto.String("salt")
		s.Ownership = proto.String("engine")
		s.Locality = kvpb.KvCacheLocality_KV_CACHE_LOCALITY_LOCAL.Enum()
		s.KvCacheSpecSlidingWindow = proto.Uint32(128)
		for _, b := range s.Blocks {
			b.LoraId = proto.Int64(7)
		}
	}},
}

var tierOpts = []storeOpt{
	nil, withTier(host), withCacheLevel(1), withCacheLevel(2), withCacheLevel(9),
	withTier(kvpb.KvCacheTier(9)), withTier(kvpb.KvCacheTier_KV_CACHE_TIER_DISK),
}

func (g *opGen) rank() int32 { return int32(g.intn(g.ranks)) - 1 }

func (g *opGen) extraKeys(s *kvpb.KvBlocksStored) {
	for i, b := range s.Blocks {
		switch g.intn(12) {
		case 0:
			b.ExtraKeys = []*kvpb.KvBlockExtraKey{{Key: &kvpb.KvBlockExtraKey_Text{Text: fmt.Sprint("t", i)}}}
		case 1:
			b.ExtraKeys = []*kvpb.KvBlockExtraKey{
				{Key: &kvpb.KvBlockExtraKey_Number{Number: int64(i)}},
				{Key: &kvpb.KvBlockExtraKey_Blob{Blob: []byte{byte(i)}}},
				{Key: &kvpb.KvBlockExtraKey_Multimodal{Multimodal: &kvpb.KvMultimodalKey{Identifier: "img", Offset: 3}}},
			}
		}
	}
}

// batch returns a random batch. Parents are always lower hashes than their children, so the
// generated forest has no cycles and parents-first is always possible.
func (g *opGen) batch() *kvpb.KvEventBatch {
	rank := g.rank()
	var events []*kvpb.KvCacheEvent
	for range 1 + g.intn(3) {
		switch k := g.intn(100); {
		case k < 55:
			n := 1 + g.intn(g.maxStore)
			first := 2 + g.intn(g.pool)
			var opts []storeOpt
			if p := g.intn(first); p > 0 && g.intn(4) > 0 {
				opts = append(opts, withParent(int64(p)))
			}
			opts = append(opts, tails[g.intn(len(tails))]...)
			hashes := chain(int64(first), n)
			if g.intn(20) == 0 {
				hashes = append(hashes, hashes[0]) // a repeat inside a store adds a copy
			}
			ev := storedEv(hashes, opts...)
			if o := tierOpts[g.intn(len(tierOpts))]; o != nil && !g.oneTier {
				o(ev.GetStored())
			}
			g.extraKeys(ev.GetStored())
			events = append(events, ev)
		case k < 97:
			hashes := make([]int64, 1+g.intn(g.maxStore))
			for i := range hashes {
				hashes[i] = int64(2 + g.intn(g.pool+g.maxStore))
			}
			rm := removedEv(noTier, hashes...)
			if g.oneTier {
				events = append(events, rm)
				continue
			}
			switch g.intn(4) {
			case 1:
				rm.GetRemoved().Tier = host.Enum()
			case 2:
				rm.GetRemoved().CacheLevel = proto.Int32(int32(g.intn(4)))
			}
			events = append(events, rm)
		default:
			events = append(events, clearedEv())
		}
	}
	return batchOf(rank, events...)
}

type pendingCut struct {
	cut     *Cut
	want    model
	stats   Stats
	cursors map[int32]uint64
	unknown map[int32]uint64
}

// runRandom drives a Record and the naive model with the same operations, checks the counters
// as it goes and every Cut's snapshot (taken while later mutations run) against the model at the
// cut.
func runRandom(t testing.TB, g *opGen, ops int, statsEvery int) {
	r := New()
	m := model{}
	var counts modelCounts
	var pending []pendingCut
	verify := func(p pendingCut) {
		t.Helper()
		chunks := p.cut.Chunks(p.cursors, p.unknown, 5)
		checkChunks(t, chunks, chunkRule{cursors: p.cursors, unknownBefore: p.unknown, maxUnits: -1})
		if d := diffModels(p.want, replayChunks(t, chunks)); d != "" {
			t.Fatalf("snapshot differs from the model at the cut (-want +got):\n%s", d)
		}
		fresh := New()
		for _, b := range chunks {
			fresh.Apply(b)
		}
		mustEqualStats(t, fresh.Stats(), p.stats.Entries, p.stats.Blocks, p.stats.Ranks)
		requireEncodedEqualsMarshal(t, p.cut, p.cursors, p.unknown, 5)
		p.cut.Release()
	}
	for i := range ops {
		switch k := g.intn(200); {
		case k < 4 && len(pending) < 3:
			cursors, unknown := map[int32]uint64{}, map[int32]uint64{}
			for rank := NoRank; rank < int32(g.ranks-1); rank++ {
				cursors[rank] = uint64(g.intn(6))
				if g.intn(2) == 0 {
					cursors[rank] += uint64(g.intn(100000))
				}
				unknown[rank] = uint64(g.intn(3))
			}
			var ranks []int32
			if g.intn(3) == 0 {
				ranks = []int32{g.rank()}
			}
			want := model{}
			for rank, es := range m.clone() {
				if ranks == nil || rank == ranks[0] {
					want[rank] = es
				}
			}
			e, b, rs := want.stats()
			pending = append(pending, pendingCut{r.Cut(ranks), want, Stats{Entries: e, Blocks: b, Ranks: rs}, cursors, unknown})
		case k < 8 && len(pending) > 0:
			j := g.intn(len(pending))
			verify(pending[j])
			pending = append(pending[:j], pending[j+1:]...)
		case k == 8:
			rank := g.rank()
			r.ClearRank(rank)
			delete(m, rank)
		case k == 9 && g.intn(4) == 0:
			r.Reset()
			m = model{}
		default:
			b := g.batch()
			r.Apply(b)
			m.apply(b, &counts)
		}
		if i%statsEvery == 0 || i == ops-1 {
			got := r.Stats()
			e, b, rs := m.stats()
			mustEqualStats(t, got, e, b, rs)
			if got.Stored != counts.stored || got.Removed != counts.removed ||
				got.RemovedUnknown != counts.removedUnknown || got.Capped != counts.capped || got.Cleared != counts.cleared {
				t.Fatalf("op %d: counters %+v, model %+v", i, got, counts)
			}
		}
	}
	for _, p := range pending {
		verify(p)
	}
	// With every Cut released, the record must still snapshot to the model.
	e, b, rs := m.stats()
	verify(pendingCut{r.Cut(nil), m.clone(), Stats{Entries: e, Blocks: b, Ranks: rs}, map[int32]uint64{}, map[int32]uint64{}})
	if n := r.liveCuts.Load(); n != 0 {
		t.Fatalf("%d cuts still live", n)
	}
}

func TestRandomOperationsMatchANaiveModel(t *testing.T) {
	for _, tc := range []struct {
		name       string
		seed       uint64
		pool       int
		ranks      int
		maxStore   int
		oneTier    bool
		ops        int
		statsEvery int
	}{
		{name: "small pool, many repeats", seed: 1, pool: 30, ranks: 3, maxStore: 4, ops: 500, statsEvery: 1},
		{name: "one tier", seed: 2, pool: 60, ranks: 2, maxStore: 8, oneTier: true, ops: 500, statsEvery: 1},
		{name: "many segments", seed: 3, pool: 3000, ranks: 2, maxStore: 64, ops: 120, statsEvery: 20},
		{name: "many segments, one tier", seed: 4, pool: 3000, ranks: 2, maxStore: 64, oneTier: true, ops: 120, statsEvery: 20},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rng := rand.New(rand.NewPCG(tc.seed, 99))
			g := &opGen{intn: rng.IntN, pool: tc.pool, ranks: tc.ranks, maxStore: tc.maxStore, oneTier: tc.oneTier}
			runRandom(t, g, tc.ops, tc.statsEvery)
		})
	}
}

// TestACutIsUnchangedByLaterMutations takes a multi-segment state, cuts it, then rewrites the
// record (removals, new stores with new tails and extra keys, a rank clear, a reset), and expects
// the same chunks as before the mutations.
func TestACutIsUnchangedByLaterMutations(t *testing.T) {
	rng := rand.New(rand.NewPCG(7, 7))
	r := New()
	m := model{}
	var counts modelCounts
	apply := func(b *kvpb.KvEventBatch) {
		r.Apply(b)
		m.apply(b, &counts)
	}
	for i := range 24 {
		ev := storedEv(chain(int64(i*64+1), 64), tails[i%len(tails)]...)
		(&opGen{intn: rng.IntN}).extraKeys(ev.GetStored())
		apply(batchOf(int32(i%2), ev))
	}
	want := m.clone()
	cursors := map[int32]uint64{0: 1000, 1: 1000}
	c := r.Cut(nil)
	before := c.Chunks(cursors, nil, 1)

	for _, step := range []func(){
		func() {
			for h := range 24 * 64 {
				if rng.IntN(2) == 0 {
					apply(batchOf(0, removedEv(noTier, int64(h+1))))
				}
			}
		},
		func() {
			for i := range 12 {
				ev := storedEv(chain(int64(100000+i*64), 64), withSession(fmt.Sprint("new", i)))
				(&opGen{intn: rng.IntN}).extraKeys(ev.GetStored())
				apply(batchOf(0, ev))
			}
		},
		func() { apply(batchOf(1, clearedEv())) },
		func() { r.Reset(); m = model{} },
		func() { apply(batchOf(0, storedEv(chain(1, 1200), withMedium("CPU")))) },
	} {
		step()
		after := c.Chunks(cursors, nil, 1)
		if len(after) != len(before) {
			t.Fatalf("%d chunks after a mutation, %d before", len(after), len(before))
		}
		for i := range before {
			if !bytes.Equal(marshal(t, before[i]), marshal(t, after[i])) {
				t.Fatalf("chunk %d changed after a mutation", i)
			}
		}
	}
	checkChunks(t, before, chunkRule{cursors: cursors})
	if d := diffModels(want, replayChunks(t, before)); d != "" {
		t.Fatalf("snapshot differs (-want +got):\n%s", d)
	}
	c.Release()

	// Released: the record writes in place again and still matches the model.
	apply(batchOf(0, removedEv(noTier, chain(1, 600)...)))
	c = r.Cut(nil)
	defer c.Release()
	if d := diffModels(m, replayChunks(t, c.Chunks(cursors, nil, 1))); d != "" {
		t.Fatalf("snapshot after release differs (-want +got):\n%s", d)
	}
}

// fuzzSource turns fuzz bytes into choices; it answers 0 once they run out.
type fuzzSource struct{ data []byte }

func (f *fuzzSource) intn(n int) int {
	if len(f.data) == 0 || n <= 1 {
		return 0
	}
	v := int(f.data[0])
	f.data = f.data[1:]
	if n > 256 && len(f.data) > 0 {
		v = v<<8 | int(f.data[0])
		f.data = f.data[1:]
	}
	return v % n
}

func FuzzRecordAgainstModel(f *testing.F) {
	f.Add([]byte{})
	f.Add([]byte{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15})
	f.Add([]byte("\x00\x10\x20\x30\x01\x02\x03\x04\x05\x06\x07\x08\x03\x05\x07\x02\x01\x01\x09\x00\x00\xff"))
	f.Fuzz(func(t *testing.T, data []byte) {
		src := &fuzzSource{data: data}
		g := &opGen{intn: src.intn, pool: 20, ranks: 3, maxStore: 5, oneTier: len(data) > 0 && data[0]&1 == 1}
		runRandom(t, g, len(data)/2+1, 1)
	})
}

func marshal(t testing.TB, m proto.Message) []byte {
	t.Helper()
	b, err := proto.MarshalOptions{Deterministic: true}.Marshal(m)
	if err != nil {
		t.Fatalf("marshal: %v", err)
	}
	return b
}

// TestASnapshotReplayedIntoAFreshRecordReproducesIt replays a snapshot of a random multi-rank,
// multi-tier state into a new Record: the Stats match, and the new record's snapshot is the same,
// byte for byte.
func TestASnapshotReplayedIntoAFreshRecordReproducesIt(t *testing.T) {
	rng := rand.New(rand.NewPCG(11, 11))
	g := &opGen{intn: rng.IntN, pool: 400, ranks: 3, maxStore: 32}
	r := New()
	for range 600 {
		r.Apply(g.batch())
	}
	cursors := map[int32]uint64{NoRank: 50, 0: 3, 1: 70}
	unknown := map[int32]uint64{0: 2}
	c := r.Cut(nil)
	first := c.Chunks(cursors, unknown, 9)
	c.Release()
	checkChunks(t, first, chunkRule{cursors: cursors, unknownBefore: unknown, maxUnits: -1})

	fresh := New()
	for _, b := range first {
		fresh.Apply(b)
	}
	want := r.Stats()
	if want.Entries == 0 || len(want.Ranks) < 2 {
		t.Fatalf("the generated state is too small to say anything: %+v", want)
	}
	mustEqualStats(t, fresh.Stats(), want.Entries, want.Blocks, want.Ranks)

	c = fresh.Cut(nil)
	second := c.Chunks(cursors, unknown, 9)
	c.Release()
	if len(second) != len(first) {
		t.Fatalf("%d chunks from the replayed record, %d from the original", len(second), len(first))
	}
	for i := range first {
		if !bytes.Equal(marshal(t, first[i]), marshal(t, second[i])) {
			t.Fatalf("chunk %d differs:\n%v\n%v", i, first[i], second[i])
		}
	}
}
