package relay

import (
	"errors"
	"testing"

	"github.com/vmihailenco/msgpack/v5"
)

// Found by TestExactnessAgainstTheSimulatedEngine (seeds 101, vllm/array6,
// and 103, sglang/array7): a cache reset's AllBlocksCleared delivered a
// second time was read by the admission table as a restarted publisher's
// startup clear at the cursor, so the rank was started over and every
// subscriber ended with DATA_LOSS. The same bytes under the same sequence
// are the same batch; a restarted publisher's clear carries a new time.
func TestARedeliveredClearAtTheCursorIsADuplicateNotARestart(t *testing.T) {
	l := newLab(t, labOpts{noReplay: true})
	p := l.pubs[0]
	p.publish(payload(0, stored(-1, 1)))
	p.publish(payload(0, stored(-1, 2)))
	clearSeq := p.publish(payload(0, cleared()))
	l.cursor(0, clearSeq)
	s := l.subscribe(clearSeq)

	p.send(clearSeq, payload(0, cleared()))
	l.counts("duplicates/restarts", []float64{1, 0},
		l.m().duplicates.WithLabelValues("0"), l.m().restarts.WithLabelValues("0", string(startupClearRestart)))
	next := p.publish(payload(0, stored(-1, 3)))
	if got := take(t, s, 1); got != "0:3" || next != 3 {
		t.Fatalf("after the redelivered clear: %s (published %d)", got, next)
	}

	// A clear with other bytes under the cursor is still a startup clear.
	other, err := msgpack.Marshal([]any{1700000099.25, []any{cleared()}, int32(0)})
	if err != nil {
		t.Fatal(err)
	}
	p.send(next, other)
	if err := nextErr(t, s); !errors.Is(err, ErrDataLoss) {
		t.Fatalf("after a new incarnation's clear at the cursor: %v", err)
	}
	l.counts("restarts", []float64{1}, l.m().restarts.WithLabelValues("0", string(startupClearRestart)))
}
