package relay

import (
	"context"
	"flag"
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
	"time"
)

var drillSeeds = flag.Int("relay.drills", 3, "seeds for TestRandomDrillsKeepTheRecordExact")

// A randomized drill over two ranks: live drops, replays cut short at the
// "HWM" and with replies lost mid-answer, burned sequences (never buffered),
// and duplicate sends. Afterwards the record must equal the live set of
// every batch the engine did not burn, and a subscriber attached from the
// start must have seen each rank's batches in order, once, with exactly the
// burned ones missing. (The full property test with a real prefix cache and
// restarts comes with the engine simulator.)
func TestRandomDrillsKeepTheRecordExact(t *testing.T) {
	for seed := 1; seed <= *drillSeeds; seed++ {
		t.Run(fmt.Sprint("seed=", seed), func(t *testing.T) { drill(t, uint64(seed)) })
	}
}

func drill(t *testing.T, seed uint64) {
	rng := rand.New(rand.NewPCG(seed, 7))
	const ranks, steps = 2, 400
	l := newLab(t, labOpts{ranks: ranks})
	watcher := l.subscribe(0)

	type rankModel struct {
		engineLive []int64           // what the engine believes is cached
		truth      map[int64]bool    // what the relay must hold: burned batches excluded
		relayed    []uint64          // sequences the relay must deliver
		ops        map[uint64]string // how each sequence was published, for failure reports
		nextHash   int64
	}
	models := make([]*rankModel, ranks)
	for i := range models {
		models[i] = &rankModel{truth: map[int64]bool{}, nextHash: int64(i+1) * 1_000_000, ops: map[uint64]string{}}
	}
	for step := 0; step < steps; step++ {
		rank := rng.IntN(ranks)
		m, p := models[rank], l.pubs[rank]
		// One batch: a store of 1-3 new blocks, sometimes a removal.
		var events [][]any
		var stores, removes []int64
		n := 1 + rng.IntN(3)
		hashes := make([]int64, n)
		for i := range hashes {
			hashes[i] = m.nextHash
			m.nextHash++
		}
		events = append(events, stored(-1, hashes...))
		stores = hashes
		if len(m.engineLive) > 4 && rng.IntN(3) == 0 {
			i := rng.IntN(len(m.engineLive))
			h := m.engineLive[i]
			m.engineLive = slices.Delete(m.engineLive, i, i+1)
			events = append(events, removed(h))
			removes = []int64{h}
		}
		m.engineLive = append(m.engineLive, stores...)
		pl := payload(int32(rank), events...)

		if rng.IntN(10) == 0 {
			trunc := 0
			if rng.IntN(2) == 0 {
				trunc = 1 + rng.IntN(3)
			}
			p.set(func(p *fakePub) { p.truncate = trunc })
		}
		var seq uint64
		kind := "live"
		switch k := rng.IntN(100); {
		case k < 3:
			m.ops[p.burn()] = "burn"
			continue
		case k < 20:
			seq = p.hide(pl)
			kind = "hidden"
			if rng.IntN(2) == 0 {
				p.set(func(p *fakePub) {
					if p.dropOnce == nil {
						p.dropOnce = map[uint64]bool{}
					}
					p.dropOnce[seq] = true
				})
			}
		default:
			seq = p.publish(pl)
			if rng.IntN(20) == 0 {
				p.send(seq, pl) // a duplicate right behind it
				kind = "live twice"
			}
		}
		m.relayed = append(m.relayed, seq)
		p.mu.Lock()
		m.ops[seq] = fmt.Sprintf("%s, replay truncated at %d, dropped once from a replay %v", kind, p.truncate, p.dropOnce[seq])
		p.mu.Unlock()
		for _, h := range stores {
			m.truth[h] = true
		}
		for _, h := range removes {
			delete(m.truth, h)
		}
	}
	// A last live batch per rank flushes anything hidden at the end.
	for rank, m := range models {
		h := m.nextHash
		m.truth[h] = true
		seq := l.pubs[rank].publish(payload(int32(rank), stored(-1, h)))
		m.relayed = append(m.relayed, seq)
		l.cursor(int32(rank), seq)
	}

	seen := make([][]uint64, ranks)
	total := 0
	for _, m := range models {
		total += len(m.relayed)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	for i := 0; i < total; i++ {
		b, err := watcher.Next(ctx)
		if err != nil {
			for rank, m := range models {
				t.Logf("rank %d: saw %d of %d batches", rank, len(seen[rank]), len(m.relayed))
				for _, miss := range missingSeqs(m.relayed, seen[rank]) {
					for s := max(miss, 3) - 3; s <= miss+1; s++ {
						t.Logf("rank %d seq %d: %s", rank, s, m.ops[s])
					}
				}
			}
			t.Fatalf("watcher after %d batches: %v", i, err)
		}
		seen[b.GetDpRank()] = append(seen[b.GetDpRank()], b.GetSequenceNumber())
	}
	quiet(t, watcher)
	for rank, m := range models {
		if !slices.Equal(seen[rank], m.relayed) {
			t.Fatalf("rank %d: the watcher saw %v, want %v", rank, seen[rank], m.relayed)
		}
	}
	got := map[int32]map[int64]bool{}
	for _, chunk := range l.r.Snapshot() {
		for _, ev := range chunk.GetEvents() {
			for _, b := range ev.GetStored().GetBlocks() {
				if got[chunk.GetDpRank()] == nil {
					got[chunk.GetDpRank()] = map[int64]bool{}
				}
				got[chunk.GetDpRank()][b.GetBlockHash()] = true
			}
		}
	}
	for rank, m := range models {
		if !mapsEqual(got[int32(rank)], m.truth) {
			t.Fatalf("rank %d: record holds %d blocks, the truth %d (missing %v, extra %v)", rank,
				len(got[int32(rank)]), len(m.truth), diff(m.truth, got[int32(rank)]), diff(got[int32(rank)], m.truth))
		}
	}

	st := l.r.Status()
	for _, rs := range st.Ranks {
		if rs.UnknownBefore != 0 {
			t.Fatalf("rank %d unknown_before %d", rs.Rank, rs.UnknownBefore)
		}
	}
}

func mapsEqual(a, b map[int64]bool) bool {
	if len(a) != len(b) {
		return false
	}
	for k := range a {
		if !b[k] {
			return false
		}
	}
	return true
}

func diff(a, b map[int64]bool) []int64 {
	var out []int64
	for k := range a {
		if !b[k] {
			out = append(out, k)
		}
	}
	slices.Sort(out)
	return out
}

func missingSeqs(want, got []uint64) []uint64 {
	var out []uint64
	for _, w := range want {
		if !slices.Contains(got, w) {
			out = append(out, w)
		}
	}
	return out
}
