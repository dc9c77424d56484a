package monitor

import (
	"math"
	"testing"
)

// step feeds one batch to admission and states what must come out.
type step struct {
	rank    int32
	seq     uint64
	clears  bool
	fresh   bool // mark every rank fresh first (a new connection)
	want    verdict
	missed  uint64
	wantCur uint64 // rank's cursor afterwards
}

func TestAdmissionRules(t *testing.T) {
	tests := []struct {
		name  string
		steps []step
		// after the steps
		degraded  map[int32]bool
		liveRanks []int32
	}{
		{name: "in order", steps: []step{
			{seq: 5, want: verdictApply, wantCur: 5},
			{seq: 6, want: verdictApply, wantCur: 6},
			{seq: 7, want: verdictApply, wantCur: 7},
		}},
		{name: "first batch anywhere", steps: []step{
			{seq: 1_000_000, want: verdictApply, wantCur: 1_000_000},
		}},
		{name: "duplicate and repeat of cursor are stale", steps: []step{
			{seq: 10, want: verdictApply, wantCur: 10},
			{seq: 10, want: verdictStale, wantCur: 10},
			{seq: 9, want: verdictStale, wantCur: 10},
			{seq: 11, want: verdictApply, wantCur: 11},
		}},
		{name: "repeat of cursor on a fresh connection is stale", steps: []step{
			{seq: 10, want: verdictApply, wantCur: 10},
			{seq: 10, fresh: true, want: verdictStale, wantCur: 10},
		}},
		{name: "below cursor on a fresh connection is a restart", steps: []step{
			{seq: 10, want: verdictApply, wantCur: 10},
			{seq: 7, fresh: true, want: verdictRestart, wantCur: 7},
		}},
		{name: "fresh flag lasts one batch", steps: []step{
			{seq: 10, want: verdictApply, wantCur: 10},
			{seq: 11, fresh: true, want: verdictApply, wantCur: 11},
			{seq: 7, want: verdictStale, wantCur: 11},
		}},
		{name: "clear at or below cursor is a restart", steps: []step{
			{seq: 50, want: verdictApply, wantCur: 50},
			{seq: 50, clears: true, want: verdictRestart, wantCur: 50},
		}},
		{name: "counter back to 0 or 1 is a restart", steps: []step{
			{seq: 5, want: verdictApply, wantCur: 5},
			{seq: 0, want: verdictRestart, wantCur: 0},
			{seq: 1, want: verdictApply, wantCur: 1},
			{seq: 2, want: verdictApply, wantCur: 2},
			{seq: 1, want: verdictRestart, wantCur: 1},
		}},
		{name: "seq 1 under cursor 1 is stale", steps: []step{
			{seq: 1, want: verdictApply, wantCur: 1},
			{seq: 1, want: verdictStale, wantCur: 1},
		}},
		{name: "restart window boundary", steps: []step{
			{seq: 5000, want: verdictApply, wantCur: 5000},
			{seq: 5000 - 1023, want: verdictStale, wantCur: 5000},
			{seq: 5000 - 1024, want: verdictRestart, wantCur: 5000 - 1024},
		}},
		{name: "gap asks once for a replay, replay fills it", steps: []step{
			{seq: 10, want: verdictApply, wantCur: 10},
			{seq: 15, want: verdictReplay, missed: 4, wantCur: 10},
			{seq: 11, fresh: true, want: verdictApply, wantCur: 11},
			{seq: 15, want: verdictReplay, missed: 3, wantCur: 11}, // a new gap gets its own attempt
		}},
		{name: "small unrecovered gap keeps blocks, degrades", steps: []step{
			{seq: 10, want: verdictApply, wantCur: 10},
			{seq: 15, want: verdictReplay, missed: 4, wantCur: 10},
			{seq: 15, fresh: true, want: verdictUnrecoveredKept, missed: 4, wantCur: 15},
			{seq: 16, want: verdictApply, wantCur: 16},
		}, degraded: map[int32]bool{0: true}},
		{name: "gap of exactly 1024 is kept", steps: []step{
			{seq: 10, want: verdictApply, wantCur: 10},
			{seq: 11 + 1024, want: verdictReplay, missed: 1024, wantCur: 10},
			{seq: 11 + 1024, fresh: true, want: verdictUnrecoveredKept, missed: 1024, wantCur: 11 + 1024},
		}, degraded: map[int32]bool{0: true}},
		{name: "gap of 1025 clears", steps: []step{
			{seq: 10, want: verdictApply, wantCur: 10},
			{seq: 12 + 1024, want: verdictReplay, missed: 1025, wantCur: 10},
			{seq: 12 + 1024, fresh: true, want: verdictUnrecoveredCleared, missed: 1025, wantCur: 12 + 1024},
		}, degraded: map[int32]bool{0: false}},
		{name: "restart resets the other ranks, not this one", steps: []step{
			{rank: 0, seq: 100, want: verdictApply, wantCur: 100},
			{rank: 1, seq: 200, want: verdictApply, wantCur: 200},
			{rank: 1, seq: 0, want: verdictRestart, wantCur: 0},
		}, liveRanks: []int32{1}},
		{name: "ranks are independent", steps: []step{
			{rank: 0, seq: 100, want: verdictApply, wantCur: 100},
			{rank: 1, seq: 7, want: verdictApply, wantCur: 7},
			{rank: 0, seq: 101, want: verdictApply, wantCur: 101},
			{rank: 1, seq: 9, want: verdictReplay, missed: 1, wantCur: 7},
		}, liveRanks: []int32{0, 1}},
		{name: "restart clears degradation", steps: []step{
			{seq: 10, want: verdictApply, wantCur: 10},
			{seq: 13, want: verdictReplay, missed: 2, wantCur: 10},
			{seq: 13, want: verdictUnrecoveredKept, missed: 2, wantCur: 13},
			{seq: 0, want: verdictRestart, wantCur: 0},
		}, degraded: map[int32]bool{0: false}},
		{name: "max sequence does not wrap", steps: []step{
			{seq: math.MaxUint64, want: verdictApply, wantCur: math.MaxUint64},
			{seq: 0, want: verdictRestart, wantCur: 0},
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := newCursors()
			for i, st := range tt.steps {
				if st.fresh {
					c.markFresh()
				}
				got := c.admit(st.rank, st.seq, st.clears)
				if got.verdict != st.want || got.missed != st.missed {
					t.Fatalf("step %d (rank %d seq %d): got %v missed %d, want %v missed %d",
						i, st.rank, st.seq, got.verdict, got.missed, st.want, st.missed)
				}
				if cur := c.ranks[st.rank].last; cur != st.wantCur {
					t.Fatalf("step %d: cursor %d, want %d", i, cur, st.wantCur)
				}
			}
			for r, want := range tt.degraded {
				if got := c.ranks[r] != nil && c.ranks[r].degraded; got != want {
					t.Errorf("rank %d degraded = %v, want %v", r, got, want)
				}
			}
			if tt.liveRanks != nil {
				for r, rc := range c.ranks {
					if rc.live && !contains(tt.liveRanks, r) {
						t.Errorf("rank %d still has a cursor", r)
					}
				}
				for _, r := range tt.liveRanks {
					if c.ranks[r] == nil || !c.ranks[r].live {
						t.Errorf("rank %d lost its cursor", r)
					}
				}
			}
		})
	}
}

func TestResume(t *testing.T) {
	c := newCursors()
	if start, m := c.resume(); start != 0 || m != nil {
		t.Fatalf("empty: start %d map %v", start, m)
	}
	c.admit(1, 40, false)
	if start, m := c.resume(); start != 0 || len(m) != 1 || m[1] != 40 {
		t.Fatalf("rank 1 only: start %d map %v", start, m)
	}
	c.admit(0, 7, false)
	start, m := c.resume()
	if start != 7 || len(m) != 2 || m[0] != 7 || m[1] != 40 {
		t.Fatalf("two ranks: start %d map %v", start, m)
	}
	c.resetAll()
	if start, m := c.resume(); start != 0 || m != nil {
		t.Fatalf("after reset: start %d map %v", start, m)
	}
}

func contains(s []int32, v int32) bool {
	for _, x := range s {
		if x == v {
			return true
		}
	}
	return false
}

// FuzzAdmission drives admission with arbitrary batches and checks the
// invariants every verdict must keep.
func FuzzAdmission(f *testing.F) {
	f.Add([]byte{0, 5, 0, 6, 1, 3, 0, 0, 2, 200})
	f.Add([]byte{0, 10, 0, 20, 0, 20, 0, 1})
	f.Fuzz(func(t *testing.T, data []byte) {
		c := newCursors()
		for i := 0; i+1 < len(data); i += 2 {
			op, v := data[i], data[i+1]
			rank := int32(op & 3)
			if op&4 != 0 {
				c.markFresh()
			}
			seq := uint64(v) * uint64(1+(op>>5)) * 37
			before := *c.rank(rank)
			adm := c.admit(rank, seq, op&8 != 0)
			after := c.ranks[rank]
			switch adm.verdict {
			case verdictApply, verdictRestart, verdictUnrecoveredKept, verdictUnrecoveredCleared:
				if !after.live || after.last != seq {
					t.Fatalf("%v: cursor %v/%d, want %d", adm.verdict, after.live, after.last, seq)
				}
			case verdictStale, verdictReplay:
				if after.last != before.last || after.live != before.live {
					t.Fatalf("%v moved the cursor from %d to %d", adm.verdict, before.last, after.last)
				}
			}
			if adm.verdict == verdictReplay && !after.replayPending {
				t.Fatal("replay without a pending replay")
			}
			if adm.verdict == verdictUnrecoveredCleared || adm.verdict == verdictRestart {
				if len(c.ranks) != 1 {
					t.Fatalf("%v left %d ranks", adm.verdict, len(c.ranks))
				}
			}
		}
	})
}
