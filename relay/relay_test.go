package relay

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/kvrelay/kvrelay/proto/kvpb"
)

// Rust 9: a cursor inside the window gets the batches after it, then live.
func TestHistoryServesACursorInsideTheWindowThenLive(t *testing.T) {
	l := newLab(t, labOpts{})
	p := l.pubs[0]
	for i := 0; i <= 5; i++ {
		p.publish(payload(0, stored(-1, int64(100+i))))
	}
	l.cursor(0, 5)
	s := l.subscribe(2)
	if got := take(t, s, 3); got != "0:3 0:4 0:5" {
		t.Fatalf("history: %s", got)
	}
	p.publish(payload(0, stored(-1, 106)))
	if got := take(t, s, 1); got != "0:6" {
		t.Fatalf("live: %s", got)
	}
	tip := l.subscribe(6)
	quiet(t, tip)
	p.publish(payload(0, stored(-1, 107)))
	if got := take(t, tip, 1); got != "0:7" {
		t.Fatalf("live only: %s", got)
	}
	if got := counter(l.m().served.WithLabelValues("history")); got != 2 {
		t.Fatalf("served from history %v, want 2", got)
	}
}

// Rust 10: cursors outside the window are OUT_OF_RANGE, with a reason.
func TestCursorsOutsideTheWindowAreOutOfRange(t *testing.T) {
	fresh := newLab(t, labOpts{noReplay: true})
	err := fresh.subscribeErr(&kvpb.SubscribeKvEventsRequest{StartSequenceNumber: 1})
	if !errors.Is(err, ErrOutOfRange) || !strings.Contains(err.Error(), "holds no history yet") {
		t.Fatalf("fresh relay: %v", err)
	}

	l := newLab(t, labOpts{noReplay: true, history: 3})
	p := l.pubs[0]
	p.restart(7)
	for i := 0; i < 3; i++ {
		p.publish(payload(0, stored(-1, int64(i+1))))
	}
	l.cursor(0, 9)
	s := l.subscribe(6)
	if got := take(t, s, 3); got != "0:7 0:8 0:9" {
		t.Fatalf("cursor 6: %s", got)
	}
	err = l.subscribeErr(&kvpb.SubscribeKvEventsRequest{StartSequenceNumber: 5})
	if !errors.Is(err, ErrOutOfRange) || !strings.Contains(err.Error(), "sequence 7") {
		t.Fatalf("cursor 5: %v", err)
	}
	err = l.subscribeErr(&kvpb.SubscribeKvEventsRequest{StartSequenceNumber: 20})
	if !errors.Is(err, ErrOutOfRange) || !strings.Contains(err.Error(), "cursor 20 of rank 0 is ahead of anything relayed") || strings.Contains(err.Error(), "restarted") {
		t.Fatalf("cursor 20: %v", err)
	}
	if got := counter(l.m().served.WithLabelValues("out_of_range")); got != 2 {
		t.Fatalf("out_of_range %v, want 2", got)
	}
}

// Rust 29: behind the window, the message points at the snapshot.
func TestAStaleCursorBelowTheWindowIsRefusedAndZeroGetsTheSnapshot(t *testing.T) {
	l := newLab(t, labOpts{noReplay: true, history: 2})
	p := l.pubs[0]
	p.publish(payload(0, stored(-1, 1)))
	for i := 1; i <= 4; i++ {
		p.publish(payload(0, stored(int64(i), int64(i+1))))
	}
	l.cursor(0, 4)
	err := l.subscribeErr(&kvpb.SubscribeKvEventsRequest{StartSequenceNumber: 1})
	if !errors.Is(err, ErrOutOfRange) || !strings.Contains(err.Error(), "resubscribe from zero for a state snapshot") {
		t.Fatalf("cursor 1: %v", err)
	}
	s := l.subscribe(0)
	chunk := next(t, s)
	if describe(chunk) != "0:4 snap 0/1" || chunk.GetSnapshot().GetBlocks() != 5 {
		t.Fatalf("snapshot %s blocks %d", describe(chunk), chunk.GetSnapshot().GetBlocks())
	}
	p.publish(payload(0, stored(-1, 9)))
	if got := take(t, s, 1); got != "0:5" {
		t.Fatalf("live: %s", got)
	}
}

// Rust 11: cursor 0 gets a complete window whole, else a snapshot.
func TestASubscriberWithoutACursorGetsTheWholeHistoryOrASnapshot(t *testing.T) {
	l := newLab(t, labOpts{})
	p := l.pubs[0]
	for i := 0; i <= 2; i++ {
		p.publish(payload(0, stored(-1, int64(10+i))))
	}
	l.cursor(0, 2)
	s := l.subscribe(0)
	if got := take(t, s, 3); got != "0:0 0:1 0:2" {
		t.Fatalf("whole window: %s", got)
	}
	p.publish(payload(0, stored(-1, 13)))
	if got := take(t, s, 1); got != "0:3" {
		t.Fatalf("live: %s", got)
	}

	late := newLab(t, labOpts{noReplay: true})
	q := late.pubs[0]
	q.restart(5)
	q.publish(payload(0, stored(41, 42)))
	late.cursor(0, 5)
	s = late.subscribe(0)
	chunk := next(t, s)
	sn := chunk.GetSnapshot()
	if describe(chunk) != "0:5 snap 0/1" || sn.GetBlocks() != 1 || sn.GetUnknownBefore() != 5 {
		t.Fatalf("snapshot %s %v", describe(chunk), sn)
	}
	if chunk.GetEvents()[0].GetCleared() == nil || storedHashes(chunk) != "[42]" {
		t.Fatalf("snapshot events %v", chunk.GetEvents())
	}
	if par := chunk.GetEvents()[1].GetStored().GetParentBlockHash(); par != 41 {
		t.Fatalf("parent %d, want 41", par)
	}
	q.publish(payload(0, stored(42, 43)))
	if got := take(t, s, 1); got != "0:6" {
		t.Fatalf("live: %s", got)
	}
	if got := counter(late.m().served.WithLabelValues("snapshot")); got != 1 {
		t.Fatalf("snapshots %v", got)
	}
}

// Rust 12: a gap is filled from the replay before anything later.
func TestAPublisherGapIsFilledFromTheEnginesReplay(t *testing.T) {
	l := newLab(t, labOpts{})
	p := l.pubs[0]
	p.publish(payload(0, stored(-1, 1)))
	p.publish(payload(0, stored(-1, 2)))
	l.cursor(0, 1)
	s := l.subscribe(1)
	p.hide(payload(0, stored(-1, 3)))
	p.hide(payload(0, stored(-1, 4)))
	p.publish(payload(0, stored(-1, 5)))
	if got := take(t, s, 3); got != "0:2 0:3 0:4" {
		t.Fatalf("stream: %s", got)
	}
	p.publish(payload(0, stored(-1, 6)))
	if got := take(t, s, 1); got != "0:5" {
		t.Fatalf("stream: %s", got)
	}
	m := l.m()
	// The replay from 2 gives 2, 3 and 4; the live copy of 4 is skipped.
	l.counts("gaps/recovered/lost/relayed", []float64{1, 3, 0, 6},
		m.gaps.WithLabelValues("0"), m.recovered.WithLabelValues("0"), m.lost.WithLabelValues("0"), m.batches.WithLabelValues("0"))
	if got := p.askedFrom(); len(got) != 2 || got[1] != 2 {
		t.Fatalf("replays asked from %v", got)
	}
	again := l.subscribe(1)
	if got := take(t, again, 4); got != "0:2 0:3 0:4 0:5" {
		t.Fatalf("resume at 1: %s", got)
	}
}

// Rust 13: a gap nothing can fill leaves a hole, not a dead end.
func TestAGapTheEngineCannotFillLeavesAHoleNotADeadEnd(t *testing.T) {
	l := newLab(t, labOpts{})
	p := l.pubs[0]
	p.publish(payload(0, stored(-1, 42)))
	p.publish(payload(0, stored(-1, 7)))
	l.cursor(0, 1)
	p.burn()
	p.burn()
	p.publish(payload(0, stored(-1, 42)))
	l.cursor(0, 4)
	m := l.m()
	// The replay from 2 gives only 4 (2 and 3 were never buffered).
	l.counts("gaps/recovered/lost", []float64{1, 1, 2},
		m.gaps.WithLabelValues("0"), m.recovered.WithLabelValues("0"), m.lost.WithLabelValues("0"))
	for _, c := range []uint64{1, 2} {
		s := l.subscribe(c)
		if got := take(t, s, 1); got != "0:4" {
			t.Fatalf("cursor %d: %s", c, got)
		}
	}
	s := l.subscribe(0)
	chunk := next(t, s)
	if describe(chunk) != "0:4 snap 0/1" || chunk.GetSnapshot().GetBlocks() != 3 {
		t.Fatalf("snapshot %s blocks %d", describe(chunk), chunk.GetSnapshot().GetBlocks())
	}
	p.publish(payload(0, stored(-1, 8)))
	if got := take(t, s, 1); got != "0:5" {
		t.Fatalf("live: %s", got)
	}
}

// Rust 14: a partial replay recovers what it can and loses the rest.
func TestAPartialReplayRecoversWhatItCanAndLosesTheRest(t *testing.T) {
	l := newLab(t, labOpts{})
	p := l.pubs[0]
	p.set(func(p *fakePub) { p.ringSize = 2 })
	p.publish(payload(0, stored(-1, 1)))
	l.cursor(0, 0)
	s := l.subscribe(0)
	take(t, s, 1)
	p.hide(payload(0, stored(-1, 2)))
	p.hide(payload(0, stored(-1, 3)))
	p.hide(payload(0, stored(-1, 4)))
	p.publish(payload(0, stored(-1, 5)))
	if got := take(t, s, 2); got != "0:3 0:4" {
		t.Fatalf("stream: %s", got)
	}
	l.cursor(0, 4)
	l.counts("recovered/lost", []float64{2, 2}, l.m().recovered.WithLabelValues("0"), l.m().lost.WithLabelValues("0"))
	// The ring held only 3 and 4 when asked; the live 4 was a duplicate.
	p.publish(payload(0, stored(-1, 6)))
	if got := take(t, s, 1); got != "0:5" {
		t.Fatalf("live: %s", got)
	}
}

// Rust 15: an undecodable payload is relayed as an empty batch.
func TestUndecodablePayloadsRelayAsEmptyBatches(t *testing.T) {
	l := newLab(t, labOpts{noReplay: true})
	p := l.pubs[0]
	p.publish(payload(0, stored(-1, 1)))
	p.publish([]byte{0xc1, 0x00})
	p.publish(payload(0, stored(-1, 2)))
	l.cursor(0, 2)
	s := l.subscribe(0)
	b := []*kvpb.KvEventBatch{next(t, s), next(t, s), next(t, s)}
	if describe(b[1]) != "0:1" || len(b[1].GetEvents()) != 0 || describe(b[2]) != "0:2" {
		t.Fatalf("stream %s %s %s", describe(b[0]), describe(b[1]), describe(b[2]))
	}
	l.counts("undecodable", []float64{1}, l.m().undecodable.WithLabelValues("0"))
}

// Rust 16: a regression ends live streams and clears the history.
func TestASequenceRegressionEndsLiveStreamsAndClearsTheHistory(t *testing.T) {
	l := newLab(t, labOpts{noReplay: true})
	p := l.pubs[0]
	for i := 0; i <= 3; i++ {
		p.publish(payload(0, stored(-1, int64(i+1))))
	}
	l.cursor(0, 3)
	s := l.subscribe(0)
	if got := take(t, s, 4); got != "0:0 0:1 0:2 0:3" {
		t.Fatalf("stream: %s", got)
	}
	p.restart(0)
	p.publish(payload(0, stored(-1, 50)))
	ctx, cancel := context.WithTimeout(context.Background(), 5e9)
	defer cancel()
	if _, err := s.Next(ctx); !errors.Is(err, ErrDataLoss) || !strings.Contains(err.Error(), "restarted") {
		t.Fatalf("after the restart: %v", err)
	}
	l.counts("restarts", []float64{1}, l.m().restarts.WithLabelValues("0", string(counterRestarted)))
	if err := l.subscribeErr(&kvpb.SubscribeKvEventsRequest{StartSequenceNumber: 3}); !errors.Is(err, ErrOutOfRange) {
		t.Fatalf("old cursor: %v", err)
	}
	p.publish(payload(0, stored(-1, 51)))
	l.cursor(0, 1)
	fresh := l.subscribe(0)
	if got := take(t, fresh, 2); got != "0:0 0:1" {
		t.Fatalf("new incarnation: %s", got)
	}
	// The old incarnation's four blocks left the record with it.
	if got := l.r.Status().RecordBlocks; got != 2 {
		t.Fatalf("record blocks %d, want 2", got)
	}
}
