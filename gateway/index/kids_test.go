package index

import (
	"testing"
)

// A run started as a branch off another run's position keeps that run (its
// parent) alive after the last reverse entry naming the parent goes; the
// parent goes with its last branch. This is what lets a block appended at a
// run's end skip the child table (place).

// liveRuns counts the runs in use, the child table's entries and the heads
// table's.
func liveRuns(ix *Index) (runs, kids, heads int) {
	f := &ix.fw
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.liveRuns(), f.kids.n, f.heads.n
}

// posOf is the position w's rank 0 filed engine hash eh at.
func posOf(t *testing.T, ix *Index, w WorkerID, eh uint64) loc {
	t.Helper()
	rt := ix.workers[w].ranks[0]
	i := rt.find(eh)
	if i < 0 {
		t.Fatalf("%s has no reverse entry for %d", w, eh)
	}
	return loc(rt.slots[i].pos)
}

// branchSetup: A stores X0..X4; B stores X0, X1, then Y2 under X1 (a branch
// after offset 1 of A's run, which becomes a run of its own); then A drops
// all of X and B drops X0 and X1, so no reverse entry names the X run any
// more while B's Y2 run, its branch, lives.
func branchSetup(t *testing.T) (ix *Index, xy []uint32) {
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
	xr, yl := posOf(t, ix, "A", 101).run(), posOf(t, ix, "B", 203)
	if yl.off() != 0 || yl.run() == xr {
		t.Fatalf("Y2 filed at %v; want offset 0 of a run of its own", yl)
	}
	if r := ix.fw.run(yl.run()); r.from != makeLoc(xr, 1) {
		t.Fatalf("Y2's run hangs after run %d offset %d; want X's run %d, offset 1", r.from.run(), r.from.off(), xr)
	}
	ix.Apply("A", batch(0, removed(unspec, 101, 102, 103, 104, 105)))
	ix.Apply("B", batch(0, removed(unspec, 201, 202)))
	if runs, kids, heads := liveRuns(ix); runs != 2 || kids != 2 || heads != 1 {
		t.Fatalf("X's run with no reverse entry and a live branch: %d runs, %d children, %d heads; want 2, 2 and 1 (kept)", runs, kids, heads)
	}
	return ix, xy
}

func TestBranchKeepsItsParentRunUntilItGoes(t *testing.T) {
	ix, xy := branchSetup(t)
	if m := ix.FindMatches(xy, Namespace{}); len(m.Workers) != 0 {
		t.Fatalf("matches %+v; want none (B holds Y2 but not X0, X1)", m.Workers)
	}
	ix.Apply("B", batch(0, removed(unspec, 203)))
	if runs, kids, heads := liveRuns(ix); runs != 0 || kids != 0 || heads != 0 {
		t.Fatalf("after the branch went: %d runs, %d children, %d heads; want none (the parent goes with it)", runs, kids, heads)
	}
}

func TestAppendAtKeptRunsEndFindsTheBranch(t *testing.T) {
	ix, xy := branchSetup(t)
	// C stores X0, X1, Y2 from the root: X0 and X1 are found in the kept X
	// run, and Y2 leaves it after offset 1, where the run goes on with X2:
	// Y2 must be filed at its existing run, not appended anywhere.
	ix.Apply("C", batch(0, stored(chainBlocks(300, xy))))
	if got, want := posOf(t, ix, "C", 303), posOf(t, ix, "B", 203); got != want {
		t.Fatalf("C's Y2 filed at %v; want the branch's run at %v (one position per path)", got, want)
	}
	ix.Apply("B", batch(0, stored(chainBlocks(200, xy[:8]))))
	m := ix.FindMatches(xy, Namespace{})
	if m.Blocks("C") != 3 || m.Blocks("B") != 3 {
		t.Fatalf("matches %+v; want B and C at 3 blocks", m.Workers)
	}
	if h := ix.FindMatchesHashes(PrefixHashes(xy, 4, Namespace{})); h.Blocks("C") != 3 || h.Blocks("B") != 3 {
		t.Fatalf("matches by prefix hashes %+v; want B and C at 3 blocks", h.Workers)
	}
	ix.Apply("B", batch(0, removed(unspec, 201, 202, 203)))
	ix.Apply("C", batch(0, removed(unspec, 301, 302, 303)))
	if runs, kids, heads := liveRuns(ix); runs != 0 || kids != 0 || heads != 0 {
		t.Fatalf("after every block went: %d runs, %d children, %d heads; want none", runs, kids, heads)
	}
}

// The same branch, then the parent's run ends where a new chain appends:
// a worker storing X0 then X1 (two events, the second under X0) appends X1
// at the end of a fresh X run, with no look at the child table, and the
// lookups (content and prefix hashes) agree.
func TestAppendWithoutChildLookAfterParentFreed(t *testing.T) {
	ix, xy := branchSetup(t)
	ix.Apply("B", batch(0, removed(unspec, 203)))
	ix.Apply("D", batch(0, stored(chainBlocks(400, xy[:4])), stored(chainBlocks(401, xy[4:12]), withParent(401))))
	x0 := posOf(t, ix, "D", 401)
	for k, eh := range []uint64{402, 403} {
		if l := posOf(t, ix, "D", eh); l != makeLoc(x0.run(), k+1) {
			t.Fatalf("block %d filed at %v; want appended to D's run at offset %d", k+1, l, k+1)
		}
	}
	if got := ix.FindMatches(xy, Namespace{}).Blocks("D"); got != 3 {
		t.Fatalf("D matches %d blocks; want 3", got)
	}
	if got := ix.FindMatchesHashes(PrefixHashes(xy, 4, Namespace{})).Blocks("D"); got != 3 {
		t.Fatalf("D matches %d blocks by prefix hashes; want 3", got)
	}
}
