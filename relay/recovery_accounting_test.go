package relay

import (
	"testing"
)

// The start replay relays the engine's newest batch, but its end marker is
// lost, so the relay asks once more from the next sequence. While that
// request is out, the rank's cursor is caught up with the engine: its
// unknown_before must already name what the replay could not reach, or a
// status or snapshot read then says nothing before the start is unknown
// (issue 15.2: "after priming: rank 0: unknown_before 0; the faults made 2
// unavoidable").
func TestUnknownBeforeIsSetWithTheCursorThatAStartReplayMoves(t *testing.T) {
	release := make(chan struct{})
	l := newLab(t, labOpts{beforeRun: func(l *lab) {
		p := l.pubs[0]
		p.ringSize = 4
		for i := 0; i < 6; i++ {
			p.hide(payload(0, stored(-1, int64(i+1))))
		}
		// The ring holds 2..5; 0 and 1 rolled out before the relay came.
		p.noEnd = true
		p.gates = map[uint64]chan struct{}{6: release}
	}})
	l.cursor(0, 5)
	if got := l.r.Status().Ranks[0].UnknownBefore; got != 2 {
		t.Fatalf("with the cursor at the engine's last batch, unknown_before is %d, want 2", got)
	}
	chunk := next(t, l.subscribe(0))
	if describe(chunk) != "0:5 snap 0/1" || chunk.GetSnapshot().GetUnknownBefore() != 2 {
		t.Fatalf("snapshot %s %v", describe(chunk), chunk.GetSnapshot())
	}
	m := l.m()
	l.counts("unknown/lost", []float64{2, 2}, m.unknownBefore.WithLabelValues("0"), m.lost.WithLabelValues("0"))
	close(release)
	l.counts("primed/unknown/lost", []float64{4, 2, 2}, m.primed.WithLabelValues("0"), m.unknownBefore.WithLabelValues("0"), m.lost.WithLabelValues("0"))
}
