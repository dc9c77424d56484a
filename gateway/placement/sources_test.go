package placement

import (
	"fmt"
	"testing"
	"time"
)

// hashes returns n distinct block hashes from base on.
func hashes(base, n int) []uint64 {
	out := make([]uint64, n)
	for i := range out {
		out[i] = uint64(base + i)
	}
	return out
}

// overlap is worker's placed blocks of prefix at now.
func overlap(s *Store, worker string, prefix []uint64, now time.Time) int {
	return s.Extend(prefix, matches(len(prefix)), now).Matches.Blocks(worker)
}

// TestFloodingPeerEvictsItsOwn: a peer that records far more than the
// store holds evicts its own entries, oldest first, never the gateway's
// or another peer's, while it holds the most.
func TestFloodingPeerEvictsItsOwn(t *testing.T) {
	s := newStore(t, Options{MaxEntries: 64, MaxPerRecord: 64})
	local, honest := hashes(1000, 8), hashes(2000, 8)
	s.Record("A", local, 0, t0)
	s.RecordFrom("honest", "B", honest, 0, t0)
	now := t0
	for i := range 100 { // 6,400 forged blocks in records of 64
		now = now.Add(time.Millisecond)
		s.RecordFrom("forger", "C", hashes(1_000_000+64*i, 64), 0, now)
	}
	if got := overlap(s, "A", local, now); got != 8 {
		t.Errorf("the gateway's own placement: %d blocks left, want 8", got)
	}
	if got := overlap(s, "B", honest, now); got != 8 {
		t.Errorf("the honest peer's placement: %d blocks left, want 8", got)
	}
	last := hashes(1_000_000+64*99, 64)
	if got := overlap(s, "C", last[16:], now); got != 48 {
		t.Errorf("the forger's newest blocks: %d kept, want 48 (its share)", got)
	}
	st := s.Stats()
	if st.Entries != 64 || st.Local != 8 || st.Sources != 2 || st.Evicted != 6400-48 {
		t.Errorf("stats = %+v, want 64 entries, 8 local, 2 peer sources, %d evicted", st, 6400-48)
	}
}

// TestEvictionEvensOutSources: sources past their share give entries back
// until they hold as many as the next; on a tie a peer's entry goes before
// the gateway's own.
func TestEvictionEvensOutSources(t *testing.T) {
	s := newStore(t, Options{MaxEntries: 12, MaxPerRecord: 12})
	s.Record("A", hashes(100, 6), 0, t0)
	s.RecordFrom("p", "B", hashes(200, 6), 0, t0)
	s.RecordFrom("q", "C", hashes(300, 3), 0, t0) // 15: 3 over
	st := s.Stats()
	if st.Entries != 12 || st.Local != 5 {
		t.Fatalf("stats = %+v, want 12 entries, 5 local", st)
	}
	// The peer p went first on the tie at 6, then the gateway and p took
	// turns: A keeps its newest 5 (block 101 on), B its newest 4.
	if got := overlap(s, "A", hashes(101, 5), t0); got != 5 {
		t.Errorf("A's newest 5: %d kept", got)
	}
	if got := overlap(s, "B", hashes(202, 4), t0); got != 4 {
		t.Errorf("B's newest 4: %d kept", got)
	}
	if got := overlap(s, "C", hashes(300, 3), t0); got != 3 {
		t.Errorf("C's 3 (the smallest source): %d kept", got)
	}
}

// TestSourcesPastMaxShareOverflow: a forger rotating its id gets
// MaxSources sources, then shares one overflow source that its flood
// evicts from; sources whose entries are gone are forgotten.
func TestSourcesPastMaxShareOverflow(t *testing.T) {
	s := newStore(t, Options{MaxEntries: 2 * MaxSources, MaxPerRecord: 16})
	local := hashes(1, 16)
	s.Record("A", local, 0, t0)
	for i := range 10 * MaxSources {
		s.RecordFrom(fmt.Sprint("forger", i), "B", hashes(1000+i, 1), 0, t0)
	}
	if got := overlap(s, "A", local, t0); got != 16 {
		t.Errorf("the gateway's placement: %d blocks left, want 16", got)
	}
	st := s.Stats()
	if st.Sources != MaxSources+1 {
		t.Errorf("%d peer sources, want MaxSources+1 (the overflow)", st.Sources)
	}
	// An id longer than MaxSourceID goes to the overflow too.
	long := string(make([]byte, MaxSourceID+1))
	s.RecordFrom(long, "B", hashes(50_000, 1), 0, t0)
	if got := s.Stats().Sources; got != MaxSources+1 {
		t.Errorf("a long id made a source: %d", got)
	}
	// Everything expires: every source is forgotten.
	s.Sweep(t0.Add(DefaultTTL))
	if st := s.Stats(); st.Entries != 0 || st.Sources != 0 || len(s.peers) != 0 {
		t.Errorf("after the sweep: %+v, %d sources kept", st, len(s.peers))
	}
}

// TestOwnershipOnRefresh: the gateway's own decision takes a peer's entry
// over; a peer refreshing another's entry leaves it the other's, so a
// forger replaying an honest peer's placements cannot evict them.
func TestOwnershipOnRefresh(t *testing.T) {
	s := newStore(t, Options{MaxEntries: 16, MaxPerRecord: 16})
	honest := hashes(1, 8)
	s.RecordFrom("honest", "B", honest, 0, t0)
	s.RecordFrom("forger", "B", honest, 0, t0.Add(time.Minute)) // replayed
	if st := s.Stats(); st.Sources != 1 || st.Entries != 8 {
		t.Fatalf("stats after the replay = %+v, want the honest peer's 8 only", st)
	}
	for i := range 10 {
		s.RecordFrom("forger", "C", hashes(100+16*i, 16), 0, t0.Add(time.Minute))
	}
	if got := overlap(s, "B", honest, t0.Add(time.Minute)); got != 8 {
		t.Errorf("the honest placement after the replay and a flood: %d blocks, want 8", got)
	}
	// The replay refreshed them: they live a TTL from it.
	if got := overlap(s, "B", honest, t0.Add(DefaultTTL+time.Second)); got != 8 {
		t.Errorf("refreshed entries expired early: %d", got)
	}
	s.Record("B", honest[:4], 0, t0.Add(2*time.Minute))
	if st := s.Stats(); st.Local != 4 {
		t.Errorf("the gateway's record took %d entries over, want 4", st.Local)
	}
}
