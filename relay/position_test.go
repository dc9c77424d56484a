package relay

import "testing"

// TestSnapshotAtAndLogPosition: the position SnapshotAt reports is the log
// position of the last batch its cut holds, and a subscriber's LogPosition
// says which batches came before it (covered by the cut) and which after.
func TestSnapshotAtAndLogPosition(t *testing.T) {
	l := newLab(t, labOpts{})
	p := l.pubs[0]
	p.publish(payload(0, stored(-1, 1)))
	p.publish(payload(0, stored(1, 2)))
	l.cursor(0, 1)
	s := l.subscribe(0)
	if got := s.LogPosition(); got != 0 {
		t.Fatalf("LogPosition before any Next = %d, want 0", got)
	}
	var seen []uint64
	for range 2 {
		next(t, s)
		seen = append(seen, s.LogPosition())
	}
	chunks, cut := l.r.SnapshotAt()
	if len(chunks) == 0 {
		t.Fatal("SnapshotAt gave no chunks after two batches")
	}
	if seen[1] != cut {
		t.Fatalf("the subscriber delivered up to position %d before the cut, SnapshotAt says %d", seen[1], cut)
	}
	p.publish(payload(0, removed(2)))
	b := next(t, s)
	if got := s.LogPosition(); got <= cut || b.GetSequenceNumber() != 2 {
		t.Fatalf("batch %d after the cut at %d has position %d", b.GetSequenceNumber(), cut, got)
	}
	if _, after := l.r.SnapshotAt(); after != s.LogPosition() {
		t.Fatalf("a cut after batch 2 is at %d, the subscriber's last batch at %d", after, s.LogPosition())
	}
}
