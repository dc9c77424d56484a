package prefixcache

import (
	"math/rand/v2"
	"testing"

	"github.com/google/go-cmp/cmp"
)

// model is an event consumer that counts copies per (tier, hash), as a relay
// does; the cache's LiveSet must always equal what it holds.
type model struct {
	t    *testing.T
	live map[LiveKey]int
}

func newModel(t *testing.T) *model { return &model{t: t, live: map[LiveKey]int{}} }

func (m *model) apply(evs []Event) {
	m.t.Helper()
	for _, ev := range evs {
		switch ev := ev.(type) {
		case BlockStored:
			if len(ev.Tokens) != len(ev.Hashes)*ev.BlockSize {
				m.t.Fatalf("stored %d hashes with %d tokens at block size %d", len(ev.Hashes), len(ev.Tokens), ev.BlockSize)
			}
			if ev.Tier == Device && ev.HasParent && m.live[LiveKey{Device, ev.Parent}] == 0 {
				m.t.Fatalf("stored under parent %d that is not live", ev.Parent)
			}
			for _, h := range ev.Hashes {
				m.live[LiveKey{ev.Tier, h}]++
			}
		case BlockRemoved:
			for _, h := range ev.Hashes {
				k := LiveKey{ev.Tier, h}
				if m.live[k] == 0 {
					m.t.Fatalf("removed %v which is not live", k)
				}
				if m.live[k]--; m.live[k] == 0 {
					delete(m.live, k)
				}
			}
		case AllBlocksCleared:
			m.live = map[LiveKey]int{}
		}
	}
}

func toks(from, n uint32) []uint32 {
	out := make([]uint32, n)
	for i := range out {
		out[i] = from + uint32(i)
	}
	return out
}

func cat(parts ...[]uint32) []uint32 {
	var out []uint32
	for _, p := range parts {
		out = append(out, p...)
	}
	return out
}

func h(tokens ...[]uint32) []uint64 { return chain(SGLangSHA256{}, cat(tokens...), 4) }

func mustNew(t *testing.T, cfg Config) *Cache {
	t.Helper()
	if cfg.Hasher == nil {
		cfg.Hasher = SGLangSHA256{}
	}
	if cfg.BlockSize == 0 {
		cfg.BlockSize = 4
	}
	c, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

func TestInsertTable(t *testing.T) {
	a := toks(1, 8)                  // two blocks
	b := cat(toks(1, 4), toks(9, 4)) // shares a's first block
	ha := h(a)
	hb := h(b)
	type step struct {
		newStep bool
		tokens  []uint32
		want    Result
		events  []Event
	}
	tests := []struct {
		name  string
		cfg   Config
		steps []step
		live  map[LiveKey]int
	}{
		{
			name: "store then hit",
			cfg:  Config{CapacityBlocks: 10},
			steps: []step{
				{tokens: a, want: Result{TotalBlocks: 2, StoredBlocks: 2},
					events: []Event{BlockStored{Hashes: ha, Tokens: a, BlockSize: 4}}},
				{tokens: a, want: Result{TotalBlocks: 2, DeviceHits: 2}},
			},
			live: map[LiveKey]int{{Device, ha[0]}: 1, {Device, ha[1]}: 1},
		},
		{
			name: "shared prefix chains under the parent",
			cfg:  Config{CapacityBlocks: 10},
			steps: []step{
				{tokens: a, want: Result{TotalBlocks: 2, StoredBlocks: 2},
					events: []Event{BlockStored{Hashes: ha, Tokens: a, BlockSize: 4}}},
				{tokens: b, want: Result{TotalBlocks: 2, DeviceHits: 1, StoredBlocks: 1},
					events: []Event{BlockStored{Hashes: hb[1:], Parent: ha[0], HasParent: true, Tokens: toks(9, 4), BlockSize: 4}}},
			},
			live: map[LiveKey]int{{Device, ha[0]}: 1, {Device, ha[1]}: 1, {Device, hb[1]}: 1},
		},
		{
			name: "partial tail block is not cached",
			cfg:  Config{CapacityBlocks: 10},
			steps: []step{
				{tokens: toks(1, 7), want: Result{TotalBlocks: 1, StoredBlocks: 1},
					events: []Event{BlockStored{Hashes: ha[:1], Tokens: toks(1, 4), BlockSize: 4}}},
			},
			live: map[LiveKey]int{{Device, ha[0]}: 1},
		},
		{
			name: "one block per event chains parents",
			cfg:  Config{CapacityBlocks: 10, OneBlockPerEvent: true},
			steps: []step{
				{tokens: a, want: Result{TotalBlocks: 2, StoredBlocks: 2},
					events: []Event{
						BlockStored{Hashes: ha[:1], Tokens: toks(1, 4), BlockSize: 4},
						BlockStored{Hashes: ha[1:], Parent: ha[0], HasParent: true, Tokens: toks(5, 4), BlockSize: 4},
					}},
			},
			live: map[LiveKey]int{{Device, ha[0]}: 1, {Device, ha[1]}: 1},
		},
		{
			name: "LRU evicts the oldest leaf, never an inner block",
			cfg:  Config{CapacityBlocks: 3},
			steps: []step{
				{tokens: a, want: Result{TotalBlocks: 2, StoredBlocks: 2},
					events: []Event{BlockStored{Hashes: ha, Tokens: a, BlockSize: 4}}},
				{tokens: toks(20, 4), want: Result{TotalBlocks: 1, StoredBlocks: 1},
					events: []Event{BlockStored{Hashes: h(toks(20, 4)), Tokens: toks(20, 4), BlockSize: 4}}},
				{tokens: toks(30, 4), want: Result{TotalBlocks: 1, StoredBlocks: 1},
					events: []Event{
						BlockRemoved{Hashes: ha[1:]},
						BlockStored{Hashes: h(toks(30, 4)), Tokens: toks(30, 4), BlockSize: 4},
					}},
			},
			live: map[LiveKey]int{{Device, ha[0]}: 1, {Device, h(toks(20, 4))[0]}: 1, {Device, h(toks(30, 4))[0]}: 1},
		},
		{
			name: "a prompt longer than the cache keeps its head",
			cfg:  Config{CapacityBlocks: 2},
			steps: []step{
				{tokens: toks(1, 12), want: Result{TotalBlocks: 3, StoredBlocks: 2},
					events: []Event{BlockStored{Hashes: h(toks(1, 12))[:2], Tokens: toks(1, 8), BlockSize: 4}}},
			},
			live: map[LiveKey]int{{Device, ha[0]}: 1, {Device, ha[1]}: 1},
		},
		{
			name: "second copies: same-step misses each allocate",
			cfg:  Config{CapacityBlocks: 10, SecondCopies: true},
			steps: []step{
				{newStep: true, tokens: a, want: Result{TotalBlocks: 2, StoredBlocks: 2},
					events: []Event{BlockStored{Hashes: ha, Tokens: a, BlockSize: 4}}},
				{tokens: a, want: Result{TotalBlocks: 2, StoredBlocks: 2},
					events: []Event{BlockStored{Hashes: ha, Tokens: a, BlockSize: 4}}},
				{newStep: true, tokens: a, want: Result{TotalBlocks: 2, DeviceHits: 2}},
			},
			live: map[LiveKey]int{{Device, ha[0]}: 2, {Device, ha[1]}: 2},
		},
		{
			name: "without second copies a same-step repeat shares",
			cfg:  Config{CapacityBlocks: 10},
			steps: []step{
				{newStep: true, tokens: a, want: Result{TotalBlocks: 2, StoredBlocks: 2},
					events: []Event{BlockStored{Hashes: ha, Tokens: a, BlockSize: 4}}},
				{tokens: a, want: Result{TotalBlocks: 2, DeviceHits: 2}},
			},
			live: map[LiveKey]int{{Device, ha[0]}: 1, {Device, ha[1]}: 1},
		},
		{
			name: "copies are evicted one at a time",
			cfg:  Config{CapacityBlocks: 2, SecondCopies: true},
			steps: []step{
				{newStep: true, tokens: toks(1, 4), want: Result{TotalBlocks: 1, StoredBlocks: 1},
					events: []Event{BlockStored{Hashes: ha[:1], Tokens: toks(1, 4), BlockSize: 4}}},
				{tokens: toks(1, 4), want: Result{TotalBlocks: 1, StoredBlocks: 1},
					events: []Event{BlockStored{Hashes: ha[:1], Tokens: toks(1, 4), BlockSize: 4}}},
				{newStep: true, tokens: toks(20, 4), want: Result{TotalBlocks: 1, StoredBlocks: 1},
					events: []Event{
						BlockRemoved{Hashes: ha[:1]},
						BlockStored{Hashes: h(toks(20, 4)), Tokens: toks(20, 4), BlockSize: 4},
					}},
			},
			live: map[LiveKey]int{{Device, ha[0]}: 1, {Device, h(toks(20, 4))[0]}: 1},
		},
		{
			name: "host tier: offload on evict, reload on hit",
			cfg:  Config{CapacityBlocks: 1, HostCapacityBlocks: 2},
			steps: []step{
				{tokens: toks(1, 4), want: Result{TotalBlocks: 1, StoredBlocks: 1},
					events: []Event{BlockStored{Hashes: ha[:1], Tokens: toks(1, 4), BlockSize: 4}}},
				{tokens: toks(20, 4), want: Result{TotalBlocks: 1, StoredBlocks: 1},
					events: []Event{
						BlockRemoved{Hashes: ha[:1]},
						BlockStored{Hashes: ha[:1], Tokens: toks(1, 4), BlockSize: 4, Tier: Host},
						BlockStored{Hashes: h(toks(20, 4)), Tokens: toks(20, 4), BlockSize: 4},
					}},
				{tokens: toks(1, 4), want: Result{TotalBlocks: 1, HostHits: 1, StoredBlocks: 1},
					events: []Event{
						BlockRemoved{Hashes: h(toks(20, 4))},
						BlockStored{Hashes: h(toks(20, 4)), Tokens: toks(20, 4), BlockSize: 4, Tier: Host},
						BlockStored{Hashes: ha[:1], Tokens: toks(1, 4), BlockSize: 4},
					}},
			},
			live: map[LiveKey]int{{Device, ha[0]}: 1, {Host, ha[0]}: 1, {Host, h(toks(20, 4))[0]}: 1},
		},
		{
			name: "host tier evicts its own LRU",
			cfg:  Config{CapacityBlocks: 1, HostCapacityBlocks: 1},
			steps: []step{
				{tokens: toks(1, 4), want: Result{TotalBlocks: 1, StoredBlocks: 1},
					events: []Event{BlockStored{Hashes: ha[:1], Tokens: toks(1, 4), BlockSize: 4}}},
				{tokens: toks(20, 4), want: Result{TotalBlocks: 1, StoredBlocks: 1},
					events: []Event{
						BlockRemoved{Hashes: ha[:1]},
						BlockStored{Hashes: ha[:1], Tokens: toks(1, 4), BlockSize: 4, Tier: Host},
						BlockStored{Hashes: h(toks(20, 4)), Tokens: toks(20, 4), BlockSize: 4},
					}},
				{tokens: toks(30, 4), want: Result{TotalBlocks: 1, StoredBlocks: 1},
					events: []Event{
						BlockRemoved{Hashes: h(toks(20, 4))},
						BlockRemoved{Hashes: ha[:1], Tier: Host},
						BlockStored{Hashes: h(toks(20, 4)), Tokens: toks(20, 4), BlockSize: 4, Tier: Host},
						BlockStored{Hashes: h(toks(30, 4)), Tokens: toks(30, 4), BlockSize: 4},
					}},
			},
			live: map[LiveKey]int{{Device, h(toks(30, 4))[0]}: 1, {Host, h(toks(20, 4))[0]}: 1},
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			c := mustNew(t, tc.cfg)
			m := newModel(t)
			for i, s := range tc.steps {
				if s.newStep {
					c.BeginStep()
				}
				res, evs := c.Insert(s.tokens)
				if diff := cmp.Diff(s.want, res); diff != "" {
					t.Errorf("step %d result (-want +got):\n%s", i, diff)
				}
				if diff := cmp.Diff(s.events, evs); diff != "" {
					t.Errorf("step %d events (-want +got):\n%s", i, diff)
				}
				m.apply(evs)
				checkInvariants(t, c)
			}
			if diff := cmp.Diff(tc.live, c.LiveSet()); diff != "" {
				t.Errorf("live set (-want +got):\n%s", diff)
			}
			if diff := cmp.Diff(m.live, c.LiveSet()); diff != "" {
				t.Errorf("model vs live set (-model +live):\n%s", diff)
			}
		})
	}
}

func TestClearAndEvictAll(t *testing.T) {
	for _, clear := range []bool{true, false} {
		c := mustNew(t, Config{CapacityBlocks: 4, HostCapacityBlocks: 2, SecondCopies: true})
		m := newModel(t)
		c.BeginStep()
		for _, tk := range [][]uint32{toks(1, 8), toks(1, 8), toks(40, 8), toks(60, 4)} {
			_, evs := c.Insert(tk)
			m.apply(evs)
		}
		if len(c.LiveSet()) == 0 {
			t.Fatal("nothing cached")
		}
		var evs []Event
		if clear {
			evs = c.Clear()
			if diff := cmp.Diff([]Event{AllBlocksCleared{}}, evs); diff != "" {
				t.Fatal(diff)
			}
		} else {
			evs = c.EvictAll()
			for _, ev := range evs {
				if _, ok := ev.(BlockRemoved); !ok {
					t.Fatalf("EvictAll produced %T", ev)
				}
			}
		}
		m.apply(evs)
		if got := c.LiveSet(); len(got) != 0 || len(m.live) != 0 {
			t.Fatalf("clear=%v: live %v, model %v", clear, got, m.live)
		}
		if c.Used(Device) != 0 || c.Used(Host) != 0 {
			t.Fatalf("clear=%v: used %d/%d", clear, c.Used(Device), c.Used(Host))
		}
	}
}

func TestNewRejectsBadConfig(t *testing.T) {
	for _, cfg := range []Config{
		{BlockSize: 0, CapacityBlocks: 1, Hasher: SGLangSHA256{}},
		{BlockSize: 4, CapacityBlocks: 0, Hasher: SGLangSHA256{}},
		{BlockSize: 4, CapacityBlocks: 1, HostCapacityBlocks: -1, Hasher: SGLangSHA256{}},
		{BlockSize: 4, CapacityBlocks: 1},
	} {
		if _, err := New(cfg); err == nil {
			t.Errorf("New(%+v) accepted", cfg)
		}
	}
}

// checkInvariants verifies the cache's internal structure: a prefix-closed
// tree, exact child and copy counts, and capacities respected.
func checkInvariants(t *testing.T, c *Cache) {
	t.Helper()
	children := map[*node]int{}
	copies := 0
	for d, n := range c.nodes {
		if n.digest != d {
			t.Fatalf("node under wrong digest")
		}
		if n.copies < 1 {
			t.Fatalf("node %d with %d copies", n.hash, n.copies)
		}
		if n.parent != nil {
			if c.nodes[n.parent.digest] != n.parent {
				t.Fatalf("node %d's parent is not cached", n.hash)
			}
			children[n.parent]++
		}
		copies += n.copies
	}
	for _, n := range c.nodes {
		if n.children != children[n] {
			t.Fatalf("node %d counts %d children, has %d", n.hash, n.children, children[n])
		}
	}
	if copies != c.used {
		t.Fatalf("used %d, copies %d", c.used, copies)
	}
	if c.used > c.cfg.CapacityBlocks {
		t.Fatalf("used %d over capacity %d", c.used, c.cfg.CapacityBlocks)
	}
	if c.lru.Len() != len(c.nodes) || c.hostLRU.Len() != len(c.host) {
		t.Fatalf("LRU lists out of step")
	}
	if c.cfg.HostCapacityBlocks > 0 && len(c.host) > c.cfg.HostCapacityBlocks {
		t.Fatalf("host %d over capacity %d", len(c.host), c.cfg.HostCapacityBlocks)
	}
}

// TestRandomizedInvariants drives caches of random shapes with random
// prefix-sharing prompts and checks, after every request, that an event
// consumer counting copies holds exactly the cache's live set.
func TestRandomizedInvariants(t *testing.T) {
	hashers := []Hasher{SGLangSHA256{}, VLLMSHA256CBOR{}, TokenSpeedFNV{}}
	// The run must reach the interesting paths, or it proves little.
	var sawCopies, sawHost, sawEvict bool
	for seed := uint64(1); seed <= 24; seed++ {
		rng := rand.New(rand.NewPCG(seed, 7))
		cfg := Config{
			BlockSize:        1 + rng.IntN(4),
			CapacityBlocks:   1 + rng.IntN(24),
			Hasher:           hashers[rng.IntN(len(hashers))],
			OneBlockPerEvent: rng.IntN(2) == 0,
			SecondCopies:     rng.IntN(2) == 0,
		}
		if rng.IntN(2) == 0 {
			cfg.HostCapacityBlocks = 1 + rng.IntN(8)
		}
		c, err := New(cfg)
		if err != nil {
			t.Fatal(err)
		}
		m := newModel(t)
		// A few prompt stems so requests share prefixes; tokens come from a
		// tiny alphabet so blocks collide across stems too.
		stems := make([][]uint32, 1+rng.IntN(4))
		for i := range stems {
			stems[i] = make([]uint32, rng.IntN(12))
			for j := range stems[i] {
				stems[i][j] = uint32(rng.IntN(3))
			}
		}
		for i := 0; i < 200; i++ {
			if rng.IntN(3) == 0 {
				c.BeginStep()
			}
			var evs []Event
			switch r := rng.IntN(100); {
			case r == 0:
				evs = c.Clear()
			case r == 1:
				evs = c.EvictAll()
			default:
				p := append([]uint32(nil), stems[rng.IntN(len(stems))]...)
				for n := rng.IntN(10); n > 0; n-- {
					p = append(p, uint32(rng.IntN(3)))
				}
				res, e := c.Insert(p)
				if res.DeviceHits+res.StoredBlocks > res.TotalBlocks || res.HostHits > res.StoredBlocks {
					t.Fatalf("seed %d: inconsistent result %+v", seed, res)
				}
				evs = e
			}
			m.apply(evs)
			checkInvariants(t, c)
			for k, n := range m.live {
				sawCopies = sawCopies || n > 1
				sawHost = sawHost || k.Tier == Host
			}
			for _, ev := range evs {
				if r, ok := ev.(BlockRemoved); ok && r.Tier == Device {
					sawEvict = true
				}
			}
			if diff := cmp.Diff(m.live, c.LiveSet()); diff != "" {
				t.Fatalf("seed %d step %d cfg %+v: model vs live (-model +live):\n%s", seed, i, cfg, diff)
			}
		}
	}
	if !sawCopies || !sawHost || !sawEvict {
		t.Fatalf("coverage: copies=%v host=%v evict=%v", sawCopies, sawHost, sawEvict)
	}
}

// BenchmarkInsert measures one chat-like request (a 256-token shared prefix
// plus a 64-token unique tail, block size 16) against a full cache.
func BenchmarkInsert(b *testing.B) {
	for _, hs := range []Hasher{SGLangSHA256{}, VLLMSHA256CBOR{}, TokenSpeedFNV{}} {
		b.Run(fmtHasher(hs), func(b *testing.B) {
			c, _ := New(Config{BlockSize: 16, CapacityBlocks: 1024, Hasher: hs})
			prefix := toks(0, 256)
			b.ReportAllocs()
			for i := 0; i < b.N; i++ {
				c.BeginStep()
				c.Insert(cat(prefix, toks(uint32(1000+i*64), 64)))
			}
		})
	}
}

func fmtHasher(h Hasher) string {
	switch h.(type) {
	case SGLangSHA256:
		return "sglang"
	case VLLMSHA256CBOR:
		return "vllm"
	}
	return "tokenspeed"
}
