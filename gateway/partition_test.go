package gateway

import (
	"errors"
	"fmt"
	"testing"
)

// TestPartitionOfMovesOnlyWhatItMust: rendezvous assignment is a pure
// function of the name and the count; going from P to P+1 partitions
// moves workers only into the new partition (about 1/(P+1) of them), and
// the partitions stay within a third of even at 2,000 workers.
func TestPartitionOfMovesOnlyWhatItMust(t *testing.T) {
	const workers = 2000
	names := make([]string, workers)
	for i := range names {
		names[i] = fmt.Sprintf("grpc://10.0.%d.%d:50051", i/250, i%250)
	}
	for _, parts := range []int{1, 2, 3, 4, 8, 15, 16} {
		counts := make([]int, parts+1)
		moved := 0
		for _, n := range names {
			p, q := PartitionOf(n, parts), PartitionOf(n, parts+1)
			if p != PartitionOf(n, parts) {
				t.Fatalf("PartitionOf(%q, %d) is not deterministic", n, parts)
			}
			if p < 0 || p >= max(parts, 1) {
				t.Fatalf("PartitionOf(%q, %d) = %d", n, parts, p)
			}
			if q != p {
				if q != parts {
					t.Fatalf("%d → %d partitions: %q moved from %d to %d, not to the new partition", parts, parts+1, n, p, q)
				}
				moved++
			}
			counts[q]++
		}
		want := workers / (parts + 1)
		if moved < want*2/3 || moved > want*4/3 {
			t.Errorf("%d → %d partitions: %d workers moved, want about %d", parts, parts+1, moved, want)
		}
		for p, c := range counts {
			if c < want*2/3 || c > want*4/3 {
				t.Errorf("%d partitions: partition %d holds %d workers, want about %d", parts+1, p, c, want)
			}
		}
	}
}

// TestPartitionConfig: nonsense is refused naming the setting; an
// unpartitioned gateway refuses to answer for a partition.
func TestPartitionConfig(t *testing.T) {
	for _, c := range []struct{ parts, own int }{{4, 4}, {4, -1}, {-1, 0}, {MaxPartitions + 1, 0}, {1, 1}, {0, 2}} {
		if _, err := New(Config{Partitions: c.parts, Partition: c.own}); err == nil {
			t.Errorf("partitions %d, partition %d: accepted", c.parts, c.own)
		}
	}
	g, err := New(Config{Workers: []Worker{{Addr: "a:1"}}})
	if err != nil {
		t.Fatal(err)
	}
	var a PartitionAnswer
	if err := g.AnswerPartition(PartitionQuery{Model: DefaultModel}, &a); !errors.Is(err, ErrNotPartitioned) {
		t.Errorf("unpartitioned: %v", err)
	}
	g, err = New(Config{Workers: []Worker{{Addr: "a:1"}}, Partitions: 2, Partition: 1})
	if err != nil {
		t.Fatal(err)
	}
	if err := g.AnswerPartition(PartitionQuery{Model: "nope"}, &a); !errors.Is(err, ErrUnknownModel) {
		t.Errorf("unknown model: %v", err)
	}
	if own, parts := g.Partition(); own != 1 || parts != 2 {
		t.Errorf("Partition() = %d, %d", own, parts)
	}
}

// TestPartitionedMembership: every replica of a tier takes and refuses the
// same workers, whichever partition owns them, and lists all of them.
func TestPartitionedMembership(t *testing.T) {
	ids := []string{"grpc://a:1", "grpc://b:1", "grpc://c:1", "grpc://d:1", "grpc://e:1", "grpc://f:1"}
	for own := range 3 {
		g, err := New(Config{Partitions: 3, Partition: own})
		if err != nil {
			t.Fatal(err)
		}
		for _, id := range ids {
			if err := g.AddWorker(Worker{ID: id, Addr: id[len("grpc://"):]}); err != nil {
				t.Fatal(err)
			}
		}
		for _, bad := range []Worker{{ID: "grpc://x:1", Addr: "x:1", Service: "nope"}, {ID: "grpc://y:1"}, {ID: "grpc://a:1", Addr: "a:1"}} {
			if err := g.AddWorker(bad); err == nil {
				t.Errorf("partition %d took %+v", own, bad)
			}
		}
		sts := g.Workers()
		if len(sts) != len(ids) {
			t.Fatalf("partition %d lists %d workers, want %d", own, len(sts), len(ids))
		}
		for i, st := range sts {
			mine := PartitionOf(st.ID, 3) == own
			if st.ID != ids[i] || mine != (st.State != StateRemote) || mine != (st.Partition == nil) || st.Service != "vllm" {
				t.Errorf("partition %d: %+v (its partition %d)", own, st, PartitionOf(st.ID, 3))
			}
		}
		if err := g.RemoveWorker(ids[0]); err != nil {
			t.Fatal(err)
		}
		if len(g.Workers()) != len(ids)-1 {
			t.Errorf("partition %d: a removed worker is still listed", own)
		}
	}
}
