package index

import (
	"testing"
)

// A run started as a branch off another run's position keeps that run (its
// parent) alive after the last reverse entry naming the parent goes; the
// parent goes with its last branch. This is what lets a block appended at a
// run's end skip the look at the heads (place).

// liveRuns counts the runs of every shard that are not freed, and the heads.
func liveRuns(ix *Index) (runs, heads int) {
	for i := range ix.shards {
		s := &ix.shards[i]
		s.mu.Lock()
		runs += s.runsUsed - len(s.runsFree)
		heads += s.heads
		s.mu.Unlock()
	}
	return runs, heads
}

// branchSetup: A stores X0..X4; B stores X0, X1, then Y2 under X1 (a branch
// at offset 2 of A's run, which becomes a run of its own); then A drops all
// of X and B drops X0 and X1, so no reverse entry names the X run any more
// while B's Y2 run, its branch, lives.
func branchSetup(t *testing.T) (ix *Index, xy []uint32, p []uint64) {
	t.Helper()
	ix = New(Options{BlockSize: 4})
	x := make([]uint32, 20)
	for i := range x {
		x[i] = uint32(i + 1)
	}
	y := []uint32{90, 91, 92, 93}
	xy = append(append([]uint32(nil), x[:8]...), y...)
	ix.Apply("A", batch(0, stored(chainBlocks(100, x))))
	ix.Apply("B", batch(0, stored(chainBlocks(200, x[:8])), stored(chainBlocks(202, y), withParent(202))))
	p = PrefixHashes(xy, 4, Namespace{})
	if _, ok := ix.headLoc(ix.shardIndex(p[2]), p[2]); !ok {
		t.Fatal("Y2 does not head a run of its own after B's branch")
	}
	ix.Apply("A", batch(0, removed(unspec, 101, 102, 103, 104, 105)))
	ix.Apply("B", batch(0, removed(unspec, 201, 202)))
	return ix, xy, p
}

func TestBranchKeepsItsParentRunUntilItGoes(t *testing.T) {
	ix, xy, p := branchSetup(t)
	if _, ok := ix.headLoc(ix.shardIndex(p[0]), p[0]); !ok {
		t.Fatal("the X run was freed while its branch (Y2's run) lives")
	}
	if runs, heads := liveRuns(ix); runs != 2 || heads != 2 {
		t.Fatalf("live runs %d, heads %d; want 2 and 2 (the X run kept for its branch, the branch)", runs, heads)
	}
	// The kept run has no holders: nobody matches the request.
	if m := ix.FindMatches(xy, Namespace{}); len(m.Workers) != 0 {
		t.Fatalf("matches %+v; want none (B holds Y2 behind a hole)", m.Workers)
	}
	ix.Apply("B", batch(0, removed(unspec, 203)))
	if runs, heads := liveRuns(ix); runs != 0 || heads != 0 {
		t.Fatalf("after the branch went: live runs %d, heads %d; want 0 and 0 (the parent goes with it)", runs, heads)
	}
}

func TestAppendAtKeptRunsEndFindsTheBranch(t *testing.T) {
	ix, xy, p := branchSetup(t)
	// C stores X0, X1, Y2 from the root: X0 and X1 are found in the kept X
	// run, and Y2 continues it at offset 2, where the run goes on with X2:
	// Y2 must be filed at its existing run, not appended anywhere.
	ix.Apply("C", batch(0, stored(chainBlocks(300, xy))))
	hl, ok := ix.headLoc(ix.shardIndex(p[2]), p[2])
	if !ok {
		t.Fatal("Y2 no longer heads a run")
	}
	ws := ix.workers["C"]
	rt := ws.ranks[0]
	i := rt.find(303)
	if i < 0 {
		t.Fatal("C's Y2 has no reverse entry")
	}
	if l := unpackLoc(rt.slots[i].pos, ix.shardBits); l != hl {
		t.Fatalf("C's Y2 filed at %v; want the branch's run at %v (one position per prefix hash)", l, hl)
	}
	ix.Apply("B", batch(0, stored(chainBlocks(200, xy[:8]))))
	m := ix.FindMatches(xy, Namespace{})
	if m.Blocks("C") != 3 || m.Blocks("B") != 3 {
		t.Fatalf("matches %+v; want B and C at 3 blocks", m.Workers)
	}
	ix.Apply("B", batch(0, removed(unspec, 201, 202, 203)))
	ix.Apply("C", batch(0, removed(unspec, 301, 302, 303)))
	if runs, heads := liveRuns(ix); runs != 0 || heads != 0 {
		t.Fatalf("after every block went: live runs %d, heads %d; want 0 and 0", runs, heads)
	}
}

// The same branch, then the parent's run ends where a new chain appends:
// a worker storing X0 then X1 (two events, the second under X0) appends X1
// at the end of a fresh X run; no head is X1, and the lookup agrees.
func TestAppendWithoutHeadLookAfterParentFreed(t *testing.T) {
	ix, xy, p := branchSetup(t)
	ix.Apply("B", batch(0, removed(unspec, 203)))
	ix.Apply("D", batch(0, stored(chainBlocks(400, xy[:4])), stored(chainBlocks(401, xy[4:12]), withParent(401))))
	for k := 1; k < 3; k++ {
		if _, ok := ix.headLoc(ix.shardIndex(p[k]), p[k]); ok {
			t.Fatalf("block %d heads a run; want it appended to D's run", k)
		}
	}
	if got := ix.FindMatches(xy, Namespace{}).Blocks("D"); got != 3 {
		t.Fatalf("D matches %d blocks; want 3", got)
	}
}
