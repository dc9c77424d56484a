package index

import (
	"fmt"
	"math/rand/v2"
	"testing"

	"github.com/google/go-cmp/cmp"
	"github.com/kvrelay/kvrelay/proto/kvpb"
)

// A fleet of 10,000 worker slots in which 16 workers, spread over the slot
// range (both ends), hold the queried prefixes: a lookup's per-slot
// scratch is 10,000 wide and only the coverage entries of the runs walked
// are visited. The matches must equal the model's through stores, removals
// (holes), clears and worker removal, which take the workers alive from
// many to one and to none.
func TestSparseCandidatesAgainstModelAtLargeFleet(t *testing.T) {
	const fleet = 10_000
	holderSlots := []int{0, 1, 63, 64, 127, 130, 1000, 2047, 2048, 4095, 5000, 6001, 7777, 9000, 9998, 9999}
	rng := rand.New(rand.NewPCG(19, 4))
	c := newCorpus(rng, 8)
	ix := New(Options{BlockSize: 4, ShardBits: 2})
	// Every worker takes a slot, in order, by storing one block of its own that
	// no query contains; the model leaves these out, as they match nothing.
	for i := range fleet {
		ix.Apply(fmt.Sprintf("w%05d", i), batch(0, stored([]*kvpb.KvBlock{blk(int64(1<<40+i), 100_000+uint32(i), 1, 2, 3)})))
	}
	ref := newRefModel()
	var holders []WorkerID
	for _, s := range holderSlots {
		holders = append(holders, WorkerID(fmt.Sprintf("w%05d", s)))
	}
	lookups, multi := 0, 0
	for op := range 3000 {
		w := holders[rng.IntN(len(holders))]
		r := int32(rng.IntN(2))
		switch x := rng.IntN(100); {
		case x < 65:
			b := c.storeBatch(rng, r)
			ix.Apply(w, b)
			ref.apply(w, b)
		case x < 97:
			b := c.removeBatch(rng, r)
			ix.Apply(w, b)
			ref.apply(w, b)
		case x < 99:
			b := batch(r, cleared())
			ix.Apply(w, b)
			ref.apply(w, b)
		default:
			// Drop the worker's held blocks but keep its slot.
			ix.ClearWorker(w)
			delete(ref.workers, w)
		}
		q, ns := c.query(rng)
		want := ref.find(q, 4, ns)
		got := matchMap(ix.FindMatches(q, ns))
		if op%3 == 0 {
			got = matchMap(ix.FindMatchesContent(ContentHashes(q, 4, ns.Seed())))
		}
		if diff := cmp.Diff(want, got); diff != "" {
			t.Fatalf("op %d: matches (-model +index):\n%s", op, diff)
		}
		lookups++
		if len(want) > 1 {
			multi++
		}
	}
	// The comparison is only as good as the lookups that had several
	// candidates to narrow.
	if multi < lookups/4 {
		t.Fatalf("only %d of %d lookups matched more than one worker", multi, lookups)
	}
}

// A lookup is redone from scratch when it saw a change: its per-slot
// scratch is tagged by run (stamp), so a redone attempt, and one after the
// stamp is cleared near its wrap, gives the answer a fresh state gives.
func TestWalkRedoneAttemptsStartClean(t *testing.T) {
	ix := New(Options{BlockSize: 4})
	toks := docTokens(3, 10)
	ix.Apply("a", batch(0, stored(chainBlocks(100, toks))))
	ix.Apply("b", batch(0, stored(chainBlocks(200, toks[:24]))))
	ix.Apply("c", batch(0, stored(chainBlocks(300, toks[:8])), stored(chainBlocks(400, docTokens(4, 2)), withParent(302))))
	content := ContentHashes(toks, 4, Namespace{}.Seed())
	want := map[WorkerID]int32{"a": 10, "b": 6, "c": 2}
	o := ix.order.Load()
	got := func(ws *walkState) map[WorkerID]int32 {
		out := map[WorkerID]int32{}
		for _, k := range ws.done {
			out[o.names[uint32(k)]] = keyBlocks(k)
		}
		return out
	}
	ws := &walkState{}
	for _, tc := range []struct {
		name  string
		stamp uint32
	}{
		{"fresh", 0},
		{"again", 5},
		{"stamp wraps", 1<<31 + 1},
	} {
		if tc.name != "again" {
			ws.stamp = tc.stamp
		}
		for range 2 {
			ws.hc = hashCursor{content: content, n: len(content)}
			if !ix.tryWalk(ws, 0, o) {
				t.Fatalf("%s: the attempt saw a change with no writer", tc.name)
			}
			if diff := cmp.Diff(want, got(ws)); diff != "" {
				t.Fatalf("%s: matches by worker (-want +got):\n%s", tc.name, diff)
			}
		}
	}
}
