package index

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/kvrelay/kvrelay/proto/kvpb"
)

// refModel is a literal, map-based restatement of the index's semantics, used
// as the oracle for randomized operation sequences.
type refModel struct {
	workers map[WorkerID]map[int32]map[uint64]*refEntry
}

type refEntry struct {
	pref uint64
	cnt  [2]int
}

func newRefModel() *refModel {
	return &refModel{workers: map[WorkerID]map[int32]map[uint64]*refEntry{}}
}

func (m *refModel) rank(w WorkerID, r int32) map[uint64]*refEntry {
	if m.workers[w] == nil {
		m.workers[w] = map[int32]map[uint64]*refEntry{}
	}
	if m.workers[w][r] == nil {
		m.workers[w][r] = map[uint64]*refEntry{}
	}
	return m.workers[w][r]
}

func (m *refModel) apply(w WorkerID, b *kvpb.KvEventBatch) {
	r := b.GetDpRank()
	for _, ev := range b.Events {
		switch e := ev.Data.(type) {
		case *kvpb.KvCacheEvent_Stored:
			s := e.Stored
			tier := 0
			if s.GetTier() == host {
				tier = 1
			}
			rt := m.rank(w, r)
			seed := NamespaceSeed(s.GetLoraName(), s.GetCacheSalt())
			var prev uint64
			have := false
			if s.ParentBlockHash != nil {
				if p, ok := rt[uint64(*s.ParentBlockHash)]; ok {
					prev, have = p.pref, true
				}
			}
			for _, b := range s.Blocks {
				p := ContentHash(b.TokenIds, seed)
				if have {
					p = ChainHash(prev, p)
				}
				have = true
				eh := uint64(b.BlockHash)
				if x, ok := rt[eh]; ok {
					x.cnt[tier] = min(x.cnt[tier]+1, copiesCap)
					p = x.pref
				} else {
					rt[eh] = &refEntry{pref: p}
					rt[eh].cnt[tier] = 1
				}
				prev = p
			}
		case *kvpb.KvCacheEvent_Removed:
			tier := 0
			if e.Removed.GetTier() == host {
				tier = 1
			}
			rt := m.rank(w, r)
			for _, h := range e.Removed.BlockHashes {
				if x, ok := rt[uint64(h)]; ok && x.cnt[tier] > 0 {
					x.cnt[tier]--
					if x.cnt == [2]int{} {
						delete(rt, uint64(h))
					}
				}
			}
		case *kvpb.KvCacheEvent_Cleared:
			delete(m.workers[w], r)
		}
	}
}

func (m *refModel) holds(w WorkerID) map[uint64]bool {
	out := map[uint64]bool{}
	for _, rt := range m.workers[w] {
		for _, e := range rt {
			out[e.pref] = true
		}
	}
	return out
}

func (m *refModel) find(tokens []uint32, bs int, ns Namespace) map[WorkerID]int {
	hs := PrefixHashes(tokens, bs, ns)
	out := map[WorkerID]int{}
	for w := range m.workers {
		h := m.holds(w)
		n := 0
		for n < len(hs) && h[hs[n]] {
			n++
		}
		if n > 0 {
			out[w] = n
		}
	}
	return out
}

func (m *refModel) liveSet(w WorkerID) []LiveBlock {
	var out []LiveBlock
	for r, rt := range m.workers[w] {
		for eh, e := range rt {
			for t, c := range e.cnt {
				if c > 0 {
					out = append(out, LiveBlock{Rank: r, Tier: Tier(t), EngineHash: eh, Copies: c})
				}
			}
		}
	}
	slices.SortFunc(out, func(a, b LiveBlock) int {
		if a.Rank != b.Rank {
			return int(a.Rank - b.Rank)
		}
		if a.Tier != b.Tier {
			return int(a.Tier) - int(b.Tier)
		}
		if a.EngineHash < b.EngineHash {
			return -1
		} else if a.EngineHash > b.EngineHash {
			return 1
		}
		return 0
	})
	return out
}

// corpus is a set of documents (8 blocks of 4 tokens) whose first blocks are
// shared in groups, with engine hashes that, like vLLM's, depend on the
// whole prefix and so agree between workers.
type corpus struct {
	docs [][]uint32
	eh   [][]int64
}

func newCorpus(rng *rand.Rand, n int) *corpus {
	c := &corpus{}
	for d := range n {
		doc := make([]uint32, 32)
		for i := range doc {
			if i < 8*(d%3) { // 0, 2 or 4 shared blocks with the group
				doc[i] = uint32(1000*(d%2) + i)
			} else {
				doc[i] = rng.Uint32N(50) // small alphabet: repeated content at other positions
			}
		}
		c.docs = append(c.docs, doc)
		hs := PrefixHashes(doc, 4, Namespace{})
		ehs := make([]int64, len(hs))
		for i, h := range hs {
			ehs[i] = int64(h ^ 0x5555)
		}
		c.eh = append(c.eh, ehs)
	}
	return c
}

func (c *corpus) storeBatch(rng *rand.Rand, r int32) *kvpb.KvEventBatch {
	d := rng.IntN(len(c.docs))
	s := rng.IntN(8)
	n := 1 + rng.IntN(8-s)
	var blocks []*kvpb.KvBlock
	for k := s; k < s+n; k++ {
		blocks = append(blocks, &kvpb.KvBlock{BlockHash: c.eh[d][k], TokenIds: c.docs[d][4*k : 4*k+4], BlockSize: 4})
	}
	var opts []storeOpt
	if s > 0 {
		p := c.eh[d][s-1]
		if rng.IntN(10) == 0 {
			p = rng.Int64() // a parent nobody holds
		}
		opts = append(opts, withParent(p))
	}
	if rng.IntN(5) == 0 {
		opts = append(opts, onTier(host))
	}
	if rng.IntN(10) == 0 {
		opts = append(opts, withNS("", "salt"))
	}
	return batch(r, stored(blocks, opts...))
}

func (c *corpus) removeBatch(rng *rand.Rand, r int32) *kvpb.KvEventBatch {
	var hs []int64
	for range 1 + rng.IntN(4) {
		d := rng.IntN(len(c.docs))
		hs = append(hs, c.eh[d][rng.IntN(8)])
	}
	t := device
	if rng.IntN(5) == 0 {
		t = host
	}
	return batch(r, removed(t, hs...))
}

func (c *corpus) query(rng *rand.Rand) ([]uint32, Namespace) {
	d := rng.IntN(len(c.docs))
	q := slices.Clone(c.docs[d][:min(32, 4*(1+rng.IntN(8))+rng.IntN(4))])
	if rng.IntN(4) == 0 {
		q[rng.IntN(len(q))] = 7777
	}
	var ns Namespace
	if rng.IntN(8) == 0 {
		ns.CacheSalt = "salt"
	}
	return q, ns
}

func TestRandomizedAgainstModel(t *testing.T) {
	for seed := range uint64(20) {
		t.Run(fmt.Sprint(seed), func(t *testing.T) {
			rng := rand.New(rand.NewPCG(seed, 99))
			c := newCorpus(rng, 8)
			ix := New(Options{BlockSize: 4, ShardBits: 2})
			ref := newRefModel()
			workers := []WorkerID{"w0", "w1", "w2", "w3", "w4"}
			for op := range 3000 {
				w := workers[rng.IntN(len(workers))]
				r := int32(rng.IntN(2))
				switch x := rng.IntN(100); {
				case x < 55:
					b := c.storeBatch(rng, r)
					if op%2 == 0 {
						ix.Apply(w, b)
					} else {
						ix.ApplyPrepared(w, Prepare(b))
					}
					ref.apply(w, b)
				case x < 93:
					b := c.removeBatch(rng, r)
					ix.Apply(w, b)
					ref.apply(w, b)
				case x < 96:
					b := batch(r, cleared())
					ix.Apply(w, b)
					ref.apply(w, b)
				case x < 98:
					ix.ClearWorkerRank(w, r)
					delete(ref.workers[w], r)
				default:
					ix.RemoveWorker(w)
					delete(ref.workers, w)
				}
				q, ns := c.query(rng)
				got := ix.FindMatches(q, ns)
				if op%3 == 0 {
					got = ix.FindMatchesContent(ContentHashes(q, 4, ns.Seed()))
				}
				if diff := cmp.Diff(ref.find(q, 4, ns), matchMap(got)); diff != "" {
					t.Fatalf("op %d: matches (-model +index):\n%s", op, diff)
				}
			}
			entries := map[uint64]bool{}
			memberships := 0
			for _, w := range workers {
				if diff := cmp.Diff(ref.liveSet(w), ix.LiveSet(w)); diff != "" {
					t.Errorf("%s live set (-model +index):\n%s", w, diff)
				}
				for p := range ref.holds(w) {
					entries[p] = true
					memberships++
				}
			}
			if st := ix.Stats(); st.Entries != len(entries) || st.Memberships != memberships {
				t.Errorf("stats entries %d memberships %d, model %d %d", st.Entries, st.Memberships, len(entries), memberships)
			}
		})
	}
}

// Concurrent writers (one per worker, as the monitor runs them) and readers:
// the race detector checks the locking, and the final state must equal the
// model fed the same per-worker sequences.
func TestConcurrentApplyAndFind(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	c := newCorpus(rng, 64)
	ix := New(Options{BlockSize: 4, TTL: 1 << 40, ShardBits: 3})
	// 4 writers × 20 workers: the holder bitsets widen and the tables grow
	// while readers probe them.
	name := func(w, i int) WorkerID { return fmt.Sprintf("w%d-%02d", w, i%20) }
	const writers, ops = 4, 1500
	seqs := make([][]*kvpb.KvEventBatch, writers)
	for w := range writers {
		wr := rand.New(rand.NewPCG(uint64(w), 7))
		for range ops {
			r := int32(wr.IntN(2))
			if wr.IntN(3) == 0 {
				seqs[w] = append(seqs[w], c.removeBatch(wr, r))
			} else {
				seqs[w] = append(seqs[w], c.storeBatch(wr, r))
			}
		}
	}
	var wg sync.WaitGroup
	for w := range writers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i, b := range seqs[w] {
				ix.Apply(name(w, i), b)
			}
		}()
	}
	// The readers also take stats and prune, which read the shards under
	// their locks while writers change them.
	stopReaders := startReaders(t, ix, c, 3, func() {
		_ = ix.Stats()
		ix.Prune(ix.now())
	})
	wg.Wait()
	stopReaders()
	ref := newRefModel()
	for w := range writers {
		for i, b := range seqs[w] {
			ref.apply(name(w, i), b)
		}
	}
	for w := range writers {
		for i := range 20 {
			if diff := cmp.Diff(ref.liveSet(name(w, i)), ix.LiveSet(name(w, i))); diff != "" {
				t.Errorf("%s live set (-model +index):\n%s", name(w, i), diff)
			}
		}
	}
	for range 200 {
		q, ns := c.query(rng)
		if diff := cmp.Diff(ref.find(q, 4, ns), matchMap(ix.FindMatches(q, ns))); diff != "" {
			t.Fatalf("matches (-model +index):\n%s", diff)
		}
	}
}

// TestPruneWhileLookingUp runs stores, removals and prunes (with a clock
// that moves, so stamps change) against concurrent lookups, which refresh
// stamps without a lock; under -race it checks that every stamp access is
// atomic where it must be. The index must still empty out exactly.
func TestPruneWhileLookingUp(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	c := newCorpus(rng, 32)
	clk := &lockedClock{t: time.Unix(5_000_000, 0)}
	ix := New(Options{BlockSize: 4, ShardBits: 1, TTL: 3 * time.Second, MaxEntries: 200, Now: clk.Now})
	stopReaders := startReaders(t, ix, c, 1, nil)
	var wg sync.WaitGroup
	for w := range 3 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			wr := rand.New(rand.NewPCG(uint64(w), 9))
			for i := range 1500 {
				if wr.IntN(3) == 0 {
					ix.Apply(fmt.Sprint("w", w), c.removeBatch(wr, 0))
				} else {
					ix.Apply(fmt.Sprint("w", w), c.storeBatch(wr, 0))
				}
				if i%50 == 0 {
					clk.Add(time.Second)
					ix.Prune(clk.Now())
				}
			}
		}()
	}
	wg.Wait()
	stopReaders()
	for w := range 3 {
		ix.RemoveWorker(fmt.Sprint("w", w))
	}
	if st := ix.Stats(); st.Entries != 0 || st.Memberships != 0 {
		t.Fatalf("entries left after removing every worker: %+v", st)
	}
}

// startReaders runs two goroutines looking up c's queries against ix until
// the returned function is called (which waits for them); a match deeper than
// its request, or of no block, fails t. also, if not nil, runs after each
// lookup.
func startReaders(t *testing.T, ix *Index, c *corpus, seed uint64, also func()) (stop func()) {
	done := make(chan struct{})
	var readers sync.WaitGroup
	for r := range 2 {
		readers.Add(1)
		go func() {
			defer readers.Done()
			qr := rand.New(rand.NewPCG(uint64(r), seed))
			for {
				select {
				case <-done:
					return
				default:
				}
				q, ns := c.query(qr)
				m := ix.FindMatches(q, ns)
				for _, x := range m.Workers {
					if x.Blocks <= 0 || x.Blocks > m.RequestBlocks {
						t.Errorf("impossible match %+v of %d", x, m.RequestBlocks)
						return
					}
				}
				if also != nil {
					also()
				}
			}
		}()
	}
	return func() { close(done); readers.Wait() }
}
