package relay

import (
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"strings"
	"testing"

	"github.com/kvrelay/kvrelay/proto/kvpb"
)

// Rust 17: the admission table reads the same on every wire.
func TestRestartRulesReadTheSameOnEveryWire(t *testing.T) {
	tests := []struct {
		has   bool
		last  uint64
		seq   uint64
		clear bool
		want  verdict
		why   restartReason
	}{
		{true, 500, 501, true, accept, notRestart},
		{true, 500, 503, false, gap, notRestart},
		{true, 500, 500, false, duplicate, notRestart},
		{true, 500, 500, true, restart, startupClearRestart},
		{true, 500, 499, false, restart, sequenceRegression},
		{true, 500, 0, false, restart, counterRestarted},
		{true, 500, 1, true, restart, counterRestarted},
		{true, 1, 1, false, duplicate, notRestart},
		{true, 1, 1, true, restart, startupClearRestart},
		{true, 1, 0, false, restart, sequenceRegression},
		{false, 0, 7, true, accept, notRestart},
		// kvrelay's own: a gap longer than maxGap (here 20,000: twice a
		// 10,000-batch ring with a replay) is a jump, and nothing wraps at
		// 2^64-1.
		{true, 500, 10_502, false, gap, notRestart},
		{true, 500, 20_501, false, gap, notRestart},
		{true, 500, 20_502, false, restart, sequenceJump},
		{true, 19, 1 << 63, false, restart, sequenceJump},
		{true, 19, math.MaxUint64, false, restart, sequenceJump},
		{true, math.MaxUint64, 20, false, restart, sequenceRegression},
		{true, math.MaxUint64, 0, false, restart, counterRestarted},
		{true, math.MaxUint64, math.MaxUint64, false, duplicate, notRestart},
		{true, math.MaxUint64 - 1, math.MaxUint64, false, accept, notRestart},
	}
	for _, tc := range tests {
		v, why := admit(tc.has, tc.last, tc.seq, tc.clear, 20_000)
		if v != tc.want || why != tc.why {
			t.Errorf("admit(cursor %v/%d, seq %d, clear %v) = %v %q, want %v %q", tc.has, tc.last, tc.seq, tc.clear, v, why, tc.want, tc.why)
		}
	}
}

// Rust 23: only a first batch past 1 without the startup clear joined late.
func TestAFirstBatchAtTheCountersStartOrWithAClearIsNotALateJoin(t *testing.T) {
	for _, tc := range []struct {
		seq   uint64
		clear bool
		want  bool
	}{{0, false, false}, {1, false, false}, {2, false, true}, {2, true, false}, {500, false, true}} {
		if got := joinedLate(tc.seq, tc.clear); got != tc.want {
			t.Errorf("joinedLate(%d, %v) = %v", tc.seq, tc.clear, got)
		}
	}
}

func nextErr(t *testing.T, s *Subscription) error {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), patience)
	defer cancel()
	for {
		if _, err := s.Next(ctx); err != nil {
			return err
		}
	}
}

// Rust 18: the engine's startup clear under a passed cursor is a restart.
func TestTheEnginesStartupClearUnderAPassedCursorIsARestart(t *testing.T) {
	l := newLab(t, labOpts{noReplay: true})
	p := l.pubs[0]
	for i := 0; i <= 2; i++ {
		p.publish(payload(0, stored(-1, int64(i+1))))
	}
	l.cursor(0, 2)
	s := l.subscribe(2)
	p.send(2, payload(0, stored(-1, 3)))
	l.counts("duplicates", []float64{1}, l.m().duplicates.WithLabelValues("0"))
	p.send(2, payload(0, cleared()))
	if err := nextErr(t, s); !errors.Is(err, ErrDataLoss) {
		t.Fatalf("after the startup clear: %v", err)
	}
	l.counts("restarts/relayed", []float64{1, 4}, l.m().restarts.WithLabelValues("0", string(startupClearRestart)), l.m().batches.WithLabelValues("0"))
	fresh := l.subscribe(0)
	chunk := next(t, fresh)
	if describe(chunk) != "0:2 snap 0/1" || len(chunk.GetEvents()) != 1 || chunk.GetEvents()[0].GetCleared() == nil {
		t.Fatalf("snapshot %s %v", describe(chunk), chunk.GetEvents())
	}
	p.send(3, payload(0, stored(-1, 9)))
	if got := take(t, fresh, 1); got != "0:3" {
		t.Fatalf("live: %s", got)
	}
}

// Rust 19: a counter back at its start is a restart.
func TestACounterBackAtItsStartIsARestart(t *testing.T) {
	l := newLab(t, labOpts{noReplay: true})
	p := l.pubs[0]
	for i := 0; i <= 5; i++ {
		p.publish(payload(0, stored(-1, int64(i+1))))
	}
	l.cursor(0, 5)
	s := l.subscribe(5)
	p.restart(1)
	p.publish(payload(0, stored(41, 42)))
	if err := nextErr(t, s); !errors.Is(err, ErrDataLoss) {
		t.Fatalf("after the restart: %v", err)
	}
	l.counts("relayed", []float64{7}, l.m().batches.WithLabelValues("0"))
	fresh := l.subscribe(0)
	chunk := next(t, fresh)
	if describe(chunk) != "0:1 snap 0/1" || storedHashes(chunk) != "[42]" {
		t.Fatalf("snapshot %s %s", describe(chunk), storedHashes(chunk))
	}
	p.publish(payload(0, stored(42, 43)))
	if got := take(t, fresh, 1); got != "0:2" {
		t.Fatalf("live: %s", got)
	}
	if got := take(t, l.subscribe(1), 1); got != "0:2" {
		t.Fatalf("cursor 1: %s", got)
	}
}

// Rust 20: a publisher already counting is replayed from its start.
func TestAPublisherAlreadyCountingWhenTheRelayJoinsIsReplayedFromItsStart(t *testing.T) {
	l := newLab(t, labOpts{})
	p := l.pubs[0]
	for i := 0; i < 3; i++ {
		p.hide(payload(0, stored(-1, int64(i+1))))
	}
	p.publish(payload(0, stored(-1, 4)))
	l.cursor(0, 3)
	m := l.m()
	l.counts("recovered/lost/gaps", []float64{4, 0, 0}, m.recovered.WithLabelValues("0"), m.lost.WithLabelValues("0"), m.gaps.WithLabelValues("0"))
	if got := counter(m.unknownBefore.WithLabelValues("0")); got != 0 {
		t.Fatalf("unknown_before %v", got)
	}
	if got := p.askedFrom(); !slices.Equal(got, []uint64{0, 0}) {
		t.Fatalf("replays asked from %v, want the start replay and the late join's", got)
	}
	s := l.subscribe(0)
	if got := take(t, s, 4); got != "0:0 0:1 0:2 0:3" {
		t.Fatalf("history: %s", got)
	}
	p.publish(payload(0, stored(-1, 5)))
	if got := take(t, s, 1); got != "0:4" {
		t.Fatalf("live: %s", got)
	}
	if h, sn := counter(m.served.WithLabelValues("history")), counter(m.served.WithLabelValues("snapshot")); h != 1 || sn != 0 {
		t.Fatalf("history/snapshots %v/%v", h, sn)
	}
}

// Rust 21: a replay that starts past zero leaves the rest unknown.
func TestAReplayThatStartsPastZeroLeavesTheEarlierSequencesUnknown(t *testing.T) {
	l := newLab(t, labOpts{})
	p := l.pubs[0]
	p.set(func(p *fakePub) { p.ringSize = 3 })
	for i := 0; i < 7; i++ {
		p.hide(payload(0, stored(-1, int64(i+1))))
	}
	p.publish(payload(0, stored(-1, 8)))
	l.cursor(0, 7)
	m := l.m()
	l.counts("recovered/lost/unknown", []float64{3, 5, 5}, m.recovered.WithLabelValues("0"), m.lost.WithLabelValues("0"), m.unknownBefore.WithLabelValues("0"))
	s := l.subscribe(0)
	chunk := next(t, s)
	sn := chunk.GetSnapshot()
	if describe(chunk) != "0:7 snap 0/1" || sn.GetBlocks() != 3 || sn.GetUnknownBefore() != 5 {
		t.Fatalf("snapshot %s %v", describe(chunk), sn)
	}
	resume := l.subscribe(2)
	if got := take(t, resume, 3); got != "0:5 0:6 0:7" {
		t.Fatalf("cursor 2: %s", got)
	}
	p.publish(payload(0, stored(-1, 9)))
	if got := take(t, resume, 1); got != "0:8" {
		t.Fatalf("live: %s", got)
	}
}

// Rust 22: without a replay socket the batches before the start are unknown.
func TestARelayWithoutAReplaySocketMarksTheBatchesBeforeItsStartUnknown(t *testing.T) {
	l := newLab(t, labOpts{noReplay: true})
	p := l.pubs[0]
	p.restart(5)
	p.publish(payload(0, stored(41, 42)))
	l.cursor(0, 5)
	m := l.m()
	l.counts("relayed/lost/unknown/gaps", []float64{1, 5, 5, 0},
		m.batches.WithLabelValues("0"), m.lost.WithLabelValues("0"), m.unknownBefore.WithLabelValues("0"), m.gaps.WithLabelValues("0"))
	chunk := next(t, l.subscribe(0))
	if describe(chunk) != "0:5 snap 0/1" || chunk.GetSnapshot().GetUnknownBefore() != 5 {
		t.Fatalf("snapshot %s %v", describe(chunk), chunk.GetSnapshot())
	}
	s := l.subscribe(3)
	p.publish(payload(0, stored(42, 43)))
	if got := take(t, s, 2); got != "0:5 0:6" {
		t.Fatalf("cursor 3: %s", got)
	}
	if got := counter(m.served.WithLabelValues("out_of_range")); got != 0 {
		t.Fatalf("out_of_range %v", got)
	}
}

// Rust 24: the start replay is retried until the ROUTER answers.
func TestTheRelayTakesThePublishersReplayAtStartBeforeAnyLiveBatch(t *testing.T) {
	l := newLab(t, labOpts{skipPrimed: true, beforeRun: func(l *lab) {
		l.pubs[0].set(func(p *fakePub) { p.down = true })
	}})
	p := l.pubs[0]
	p.restart(1) // the mock engine counts from 1
	for i := 1; i <= 3; i++ {
		p.hide(payload(0, stored(int64(i-1), int64(i))))
	}
	l.waitFor("two failed start replays", func() bool { return counter(l.m().replays.WithLabelValues("0", "error")) >= 2 })
	p.set(func(p *fakePub) { p.down = false })
	l.cursor(0, 3)
	m := l.m()
	l.counts("primed/unknown/lost", []float64{3, 0, 0}, m.primed.WithLabelValues("0"), m.unknownBefore.WithLabelValues("0"), m.lost.WithLabelValues("0"))
	s := l.subscribe(0)
	chunk := next(t, s)
	if describe(chunk) != "0:3 snap 0/1" || chunk.GetSnapshot().GetBlocks() != 3 || chunk.GetSnapshot().GetUnknownBefore() != 0 {
		t.Fatalf("snapshot %s %v", describe(chunk), chunk.GetSnapshot())
	}
	p.publish(payload(0, stored(3, 4)))
	if got := take(t, s, 1); got != "0:4" {
		t.Fatalf("live: %s", got)
	}
	if got := take(t, l.subscribe(2), 2); got != "0:3 0:4" {
		t.Fatalf("cursor 2: %s", got)
	}
}

// Rust 25: a first subscriber makes an empty relay ask the replay again.
func TestAFirstSubscriberMakesAnEmptyRelayAskTheReplayAgain(t *testing.T) {
	l := newLab(t, labOpts{})
	p := l.pubs[0]
	p.restart(1)
	for i := 1; i <= 3; i++ {
		p.hide(payload(0, stored(-1, int64(i))))
	}
	s := l.subscribe(0)
	if got := take(t, s, 3); got != "0:1 0:2 0:3" {
		t.Fatalf("re-primed: %s", got)
	}
	p.publish(payload(0, stored(-1, 4)))
	if got := take(t, s, 1); got != "0:4" {
		t.Fatalf("live: %s", got)
	}
	m := l.m()
	l.counts("primed/relayed", []float64{3, 4}, m.primed.WithLabelValues("0"), m.batches.WithLabelValues("0"))
	if got := describe(next(t, l.subscribe(0))); got != "0:4 snap 0/1" {
		t.Fatalf("second subscriber: %s", got)
	}
	if got := counter(m.served.WithLabelValues("live")); got != 1 {
		t.Fatalf("served live %v", got)
	}
}

// Rust 26: a start replay beginning past the publisher's start.
func TestAStartReplayThatBeginsPastThePublishersStartMarksTheRestUnknown(t *testing.T) {
	l := newLab(t, labOpts{beforeRun: func(l *lab) {
		p := l.pubs[0]
		p.ringSize = 2
		for i := 0; i < 8; i++ {
			p.hide(payload(0, stored(-1, int64(i+1))))
		}
	}})
	l.cursor(0, 7)
	m := l.m()
	l.counts("primed/unknown/lost", []float64{2, 6, 6}, m.primed.WithLabelValues("0"), m.unknownBefore.WithLabelValues("0"), m.lost.WithLabelValues("0"))
	chunk := next(t, l.subscribe(0))
	if describe(chunk) != "0:7 snap 0/1" || chunk.GetSnapshot().GetUnknownBefore() != 6 {
		t.Fatalf("snapshot %s %v", describe(chunk), chunk.GetSnapshot())
	}
}

// Rust 28: after the window rolled, cursor 0 gets a snapshot, then every
// later batch exactly once, including one admitted before the first read.
func TestAfterTheWindowRolledASubscriberWithoutACursorGetsASnapshotThenLive(t *testing.T) {
	l := newLab(t, labOpts{noReplay: true, history: 3})
	p := l.pubs[0]
	p.publish(payload(0, cleared()))
	p.publish(payload(0, stored(-1, 10, 11)))
	p.publish(payload(0, stored(11, 12)))
	p.publish(payload(0, stored(-1, 20)))
	p.publish(payload(0, removed(20)))
	p.publish(payload(0, stored(-1, 21, 22)))
	l.cursor(0, 5)
	s := l.subscribe(0)
	p.publish(payload(0, stored(22, 23)))
	l.cursor(0, 6)
	chunk := next(t, s)
	sn := chunk.GetSnapshot()
	if describe(chunk) != "0:5 snap 0/1" || sn.GetBlocks() != 5 || sn.GetUnknownBefore() != 0 {
		t.Fatalf("snapshot %s %v", describe(chunk), sn)
	}
	if chunk.GetEvents()[0].GetCleared() == nil || storedHashes(chunk) != "[10 11 12] [21 22]" {
		t.Fatalf("snapshot events %s", storedHashes(chunk))
	}
	if got := take(t, s, 1); got != "0:6" {
		t.Fatalf("live: %s", got)
	}
	p.publish(payload(0, stored(-1, 30)))
	if got := take(t, s, 1); got != "0:7" {
		t.Fatalf("live: %s", got)
	}
	quiet(t, s)
}

// SGLang truncates a long replay at its send HWM, end marker included: the
// relay resumes from the next missing sequence until the gap is covered.
func TestATruncatedReplayIsResumedFromTheNextMissingSequence(t *testing.T) {
	l := newLab(t, labOpts{})
	p := l.pubs[0]
	p.set(func(p *fakePub) { p.truncate = 3 })
	p.publish(payload(0, stored(-1, 100)))
	l.cursor(0, 0)
	s := l.subscribe(0)
	take(t, s, 1)
	for i := 1; i <= 9; i++ {
		p.hide(payload(0, stored(-1, int64(100+i))))
	}
	p.publish(payload(0, stored(-1, 110)))
	want := []string{}
	for i := 1; i <= 10; i++ {
		want = append(want, fmt.Sprintf("0:%d", i))
	}
	if got := take(t, s, 10); got != strings.Join(want, " ") {
		t.Fatalf("stream: %s", got)
	}
	if got := p.askedFrom(); !slices.Equal(got, []uint64{0, 1, 4, 7}) {
		t.Fatalf("replays asked from %v", got)
	}
	l.counts("recovered/lost", []float64{9, 0}, l.m().recovered.WithLabelValues("0"), l.m().lost.WithLabelValues("0"))
}

// A reply lost in the middle of an answer is asked for again, not recorded
// as lost; a sequence the engine burned (never buffered) becomes a hole.
func TestAHoleInTheMiddleOfAReplayIsAskedAgainBeforeItIsLost(t *testing.T) {
	l := newLab(t, labOpts{})
	p := l.pubs[0]
	p.publish(payload(0, stored(-1, 100)))
	l.cursor(0, 0)
	s := l.subscribe(0)
	take(t, s, 1)
	p.hide(payload(0, stored(-1, 101)))
	p.hide(payload(0, stored(-1, 102)))
	p.burn()                            // 3
	p.hide(payload(0, stored(-1, 104))) // 4
	p.hide(payload(0, stored(-1, 105))) // 5
	p.set(func(p *fakePub) { p.dropOnce = map[uint64]bool{2: true} })
	p.publish(payload(0, stored(-1, 106))) // 6
	if got := take(t, s, 5); got != "0:1 0:2 0:4 0:5 0:6" {
		t.Fatalf("stream: %s", got)
	}
	// From 1: 1 (2 dropped) → from 2: 2 (3 missing) → from 3: 4.. (3 lost).
	if got := p.askedFrom(); !slices.Equal(got, []uint64{0, 1, 2, 3}) {
		t.Fatalf("replays asked from %v", got)
	}
	l.counts("recovered/lost", []float64{5, 1}, l.m().recovered.WithLabelValues("0"), l.m().lost.WithLabelValues("0"))
	if got := take(t, l.subscribe(2), 3); got != "0:4 0:5 0:6" {
		t.Fatalf("cursor 2: %s", got)
	}
	if got := take(t, l.subscribe(3), 3); got != "0:4 0:5 0:6" {
		t.Fatalf("cursor in the hole: %s", got)
	}
}

// Live copies of what a replay already gave are duplicates, not a
// regression, even when several are still queued.
func TestLiveCopiesOfReplayedBatchesAreDuplicatesNotARestart(t *testing.T) {
	l := newLab(t, labOpts{})
	p := l.pubs[0]
	p.publish(payload(0, stored(-1, 100)))
	l.cursor(0, 0)
	s := l.subscribe(0)
	take(t, s, 1)
	p.hide(payload(0, stored(-1, 101)))
	// 2..4 are in the ring before the relay sees 2 live, so the replay
	// from 1 returns them all; their live copies follow.
	for i := 2; i <= 4; i++ {
		p.hide(payload(0, stored(-1, int64(100+i))))
	}
	for _, seq := range []uint64{2, 3, 4} {
		p.mu.Lock()
		m := p.ring[len(p.ring)-int(5-seq)]
		p.mu.Unlock()
		p.send(seq, m.Payload)
	}
	if got := take(t, s, 4); got != "0:1 0:2 0:3 0:4" {
		t.Fatalf("stream: %s", got)
	}
	p.publish(payload(0, stored(-1, 105)))
	if got := take(t, s, 1); got != "0:5" {
		t.Fatalf("stream: %s", got)
	}
	l.counts("duplicates/restarts", []float64{3, 0}, l.m().duplicates.WithLabelValues("0"), l.m().restarts.WithLabelValues("0", string(sequenceRegression)))
}

// A subscription from zero with nothing relayed gets live batches only.
func TestSubscribeBeforeAnythingIsRelayedGetsLiveOnly(t *testing.T) {
	l := newLab(t, labOpts{noReplay: true})
	s := l.subscribe(0)
	quiet(t, s)
	l.pubs[0].publish(payload(0, stored(-1, 1)))
	if got := take(t, s, 1); got != "0:0" {
		t.Fatalf("live: %s", got)
	}
}

func TestDisabledEventsAnswerErrDisabled(t *testing.T) {
	r, err := New(Config{Engine: engineForTest(), DPSize: 1, Logger: quietLogger()})
	if err != nil {
		t.Fatal(err)
	}
	_, err = r.Subscribe(context.Background(), &kvpb.SubscribeKvEventsRequest{})
	if !errors.Is(err, ErrDisabled) || err.Error() != engineForTest().DisabledMessage {
		t.Fatalf("Subscribe: %v", err)
	}
	if !r.Ready() {
		t.Fatal("a disabled relay has nothing to wait for")
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error)
	go func() { done <- r.Run(ctx) }()
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}

// The engines count from 0: a first live batch at 1 asks the replay for 0.
// A counter that starts at 1 (SMG's mock engine) loses nothing by it.
func TestAFirstLiveBatchAtOneRecoversZero(t *testing.T) {
	l := newLab(t, labOpts{})
	p := l.pubs[0]
	p.hide(payload(0, stored(-1, 1)))
	p.publish(payload(0, stored(-1, 2)))
	l.cursor(0, 1)
	if got := take(t, l.subscribe(0), 2); got != "0:0 0:1" {
		t.Fatalf("engine counting from 0: %s", got)
	}

	mock := newLab(t, labOpts{})
	q := mock.pubs[0]
	q.restart(1)
	q.publish(payload(0, stored(-1, 1)))
	mock.cursor(0, 1)
	st := mock.r.Status().Ranks[0]
	if st.Holes != 0 || st.UnknownBefore != 0 || *st.WindowFirst != 1 {
		t.Fatalf("mock engine counting from 1: %+v", st)
	}
	if got := q.askedFrom(); !slices.Equal(got, []uint64{0, 0}) {
		t.Fatalf("replays asked from %v", got)
	}
}
