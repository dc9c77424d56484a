package relay

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvrelay/kvrelay/proto/kvpb"
)

// interleave publishes on the ranks in the order given ("0 1 0 ..."),
// waiting for each batch to be admitted so the log order is the given one.
func (l *lab) interleave(order string) {
	l.t.Helper()
	for _, f := range strings.Fields(order) {
		var rank int32
		fmt.Sscan(f, &rank)
		p := l.pubs[rank]
		seq := p.publish(payload(rank, stored(-1, int64(1000*int(rank)+int(p.next)))))
		l.cursor(rank, seq)
	}
}

func TestTwoRanksInterleaveInOneLog(t *testing.T) {
	l := newLab(t, labOpts{ranks: 2})
	l.interleave("0 1 0 1 1 0")
	// Every rank's window runs from sequence 0: the whole log is served.
	s := l.subscribe(0)
	if got := take(t, s, 6); got != "0:0 1:0 0:1 1:1 1:2 0:2" {
		t.Fatalf("whole window: %s", got)
	}
	l.interleave("1")
	if got := take(t, s, 1); got != "1:3" {
		t.Fatalf("live: %s", got)
	}
	st := l.r.Status()
	if len(st.Ranks) != 2 || *st.Ranks[1].Cursor != 3 || *st.Ranks[0].WindowLast != 2 || st.Ranks[1].Endpoint != "tcp://127.0.0.1:5558" {
		t.Fatalf("status %+v", st.Ranks)
	}
}

// SMG's gateway resumes with rank 0's cursor: the stream continues from that
// batch's place in the log where rank 1 has at most one batch after it
// (the client lacks it, or holds it as its cursor), so rank 1 loses nothing
// and repeats nothing older than its cursor; with more, the cursor is
// refused (issue 14.1).
func TestResumingByRank0CursorLosesNothingOfOtherRanks(t *testing.T) {
	l := newLab(t, labOpts{ranks: 2})
	l.interleave("0 1 0 1 1 0 1")
	if err := l.subscribeErr(&kvpb.SubscribeKvEventsRequest{StartSequenceNumber: 1}); !errors.Is(err, ErrOutOfRange) || !strings.Contains(err.Error(), "rank 1 (tcp://127.0.0.1:5558) relayed 3 batches after it") ||
		strings.Contains(err.Error(), "5557") {
		t.Fatalf("rank 0 cursor 1, three rank-1 batches after it: %v (want rank 1 named with its own endpoint, not rank 0's)", err)
	}
	s := l.subscribe(2)
	if got := take(t, s, 1); got != "1:3" {
		t.Fatalf("rank 0 cursor 2: %s", got)
	}
	l.interleave("1 0")
	if got := take(t, s, 2); got != "1:4 0:3" {
		t.Fatalf("rank 0 cursor 2, then live: %s", got)
	}
}

func TestRankCursorsResumeEveryRankExactly(t *testing.T) {
	l := newLab(t, labOpts{ranks: 2})
	l.interleave("0 1 0 1 1 0")
	tests := []struct {
		cursors map[int32]uint64
		want    string
	}{
		{map[int32]uint64{0: 1, 1: 1}, "1:2 0:2"},
		{map[int32]uint64{0: 2, 1: 0}, "1:0 1:1 1:2"},
		{map[int32]uint64{1: 2}, "0:0 0:1 0:2"}, // rank 0 unlisted: from its start
		{map[int32]uint64{0: 2, 1: 2}, ""},
	}
	for _, tc := range tests {
		s, err := l.r.Subscribe(context.Background(), &kvpb.SubscribeKvEventsRequest{StartSequenceNumber: 99, RankCursors: tc.cursors})
		if err != nil {
			t.Fatalf("%v: %v", tc.cursors, err)
		}
		n := len(strings.Fields(tc.want))
		if got := take(t, s, n); got != tc.want {
			t.Errorf("%v: %q, want %q", tc.cursors, got, tc.want)
		}
		quiet(t, s)
		s.Close()
	}
	for _, bad := range []map[int32]uint64{{0: 1, 1: 9}, {5: 1}, {-1: 0}} {
		err := l.subscribeErr(&kvpb.SubscribeKvEventsRequest{RankCursors: bad})
		if !errors.Is(err, ErrOutOfRange) {
			t.Errorf("%v: %v, want out of range", bad, err)
		}
	}
}

// A rank unlisted in rank_cursors whose history does not reach back to its
// first batch cannot be served without a snapshot: out of range.
func TestRankCursorsRefuseAnUnlistedRankWithoutItsStart(t *testing.T) {
	l := newLab(t, labOpts{ranks: 2, noReplay: true})
	l.pubs[1].restart(4)
	l.interleave("0 1 0")
	err := l.subscribeErr(&kvpb.SubscribeKvEventsRequest{RankCursors: map[int32]uint64{0: 1}})
	if !errors.Is(err, ErrOutOfRange) || !strings.Contains(err.Error(), "rank 1") {
		t.Fatalf("unlisted rank 1: %v", err)
	}
	s, err := l.r.Subscribe(context.Background(), &kvpb.SubscribeKvEventsRequest{RankCursors: map[int32]uint64{0: 0, 1: 4}})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if got := take(t, s, 2); got != "0:0 0:1" {
		t.Fatalf("rank 0 from its start: %s", got)
	}
}

// A snapshot over two ranks stamps each rank's chunks up to that rank's own
// cursor; the live stream then continues every rank at cursor+1.
func TestASnapshotOfTwoRanksEndsAtEachRanksCursor(t *testing.T) {
	l := newLab(t, labOpts{ranks: 2, history: 3})
	l.interleave("0 1 0 1 1 0 1")
	s := l.subscribe(0)
	l.interleave("0")
	var chunks []*kvpb.KvEventBatch
	last := map[int32]uint64{}
	for {
		b := next(t, s)
		if b.GetSnapshot() == nil {
			if got := describe(b); got != "0:3" {
				t.Fatalf("first live batch %s", got)
			}
			break
		}
		chunks = append(chunks, b)
		last[b.GetDpRank()] = b.GetSequenceNumber()
	}
	if last[0] != 2 || last[1] != 3 {
		t.Fatalf("last stamps %v, want each rank's cursor (2 and 3)", last)
	}
	if chunks[0].GetEvents()[0].GetCleared() == nil {
		t.Fatal("chunk 0 does not begin with the clear")
	}
	if got := storedHashes(chunks...); !strings.Contains(got, "[1003]") || !strings.Contains(got, "[2]") {
		t.Fatalf("snapshot stores %s", got)
	}
	if got := chunks[0].GetSnapshot().GetBlocks(); got != 7 {
		t.Fatalf("snapshot blocks %d, want 7", got)
	}
}

// A restart of one rank ends every subscriber and clears the log, but keeps
// the other rank's record: the next snapshot still has it.
func TestARestartOfOneRankKeepsTheOtherRanksRecord(t *testing.T) {
	l := newLab(t, labOpts{ranks: 2, noReplay: true})
	l.interleave("0 1 0 1 1")
	s := l.subscribe(0)
	l.pubs[1].restart(0)
	l.pubs[1].publish(payload(1, stored(-1, 5000)))
	if err := nextErr(t, s); !errors.Is(err, ErrDataLoss) || !strings.Contains(err.Error(), "rank 1") {
		t.Fatalf("after rank 1's restart: %v", err)
	}
	l.counts("relayed", []float64{4}, l.m().batches.WithLabelValues("1"))
	fresh := l.subscribe(0)
	var stores []string
	for {
		b := next(t, fresh)
		if b.GetSnapshot() == nil {
			t.Fatalf("unexpected %s", describe(b))
		}
		stores = append(stores, storedHashes(b))
		if b.GetSnapshot().GetIndex()+1 == b.GetSnapshot().GetCount() {
			break
		}
	}
	if got := strings.Join(stores, " "); !strings.Contains(got, "[0] [1]") || !strings.Contains(got, "[5000]") || strings.Contains(got, "[1001]") {
		t.Fatalf("snapshot stores %q: want rank 0's and rank 1's new incarnation only", got)
	}
	if got := storedHashes(l.r.Snapshot()...); got != strings.Join(stores, " ") {
		t.Fatalf("Snapshot() %q, the subscriber got %q", got, strings.Join(stores, " "))
	}
}

// A subscriber that stops reading overflows its queue and is refilled from
// the history; one reading along is never held up.
func TestASlowSubscriberIsRefilledFromHistoryWhileAFastOneIsUnaffected(t *testing.T) {
	l := newLab(t, labOpts{noReplay: true, subBuffer: 4, history: 100})
	p := l.pubs[0]
	slow := l.subscribe(0)
	fast := l.subscribe(0)
	var want []string
	for i := 0; i < 20; i++ {
		seq := p.publish(payload(0, stored(-1, int64(i+1))))
		want = append(want, fmt.Sprintf("0:%d", seq))
		if got := take(t, fast, 1); got != want[i] {
			t.Fatalf("fast subscriber got %s, want %s", got, want[i])
		}
	}
	if got := take(t, slow, 20); got != strings.Join(want, " ") {
		t.Fatalf("slow subscriber: %s", got)
	}
	quiet(t, slow)
	if got := counter(l.m().lagged); got < 1 {
		t.Fatalf("lagged %v", got)
	}
	p.publish(payload(0, stored(-1, 99)))
	if got := take(t, slow, 1); got != "0:20" {
		t.Fatalf("slow subscriber, live again: %s", got)
	}
}

// When the history no longer reaches back to where the slow subscriber is,
// it ends with DATA_LOSS; the fast one goes on.
func TestASlowSubscriberBeyondTheHistoryEndsWithDataLoss(t *testing.T) {
	l := newLab(t, labOpts{noReplay: true, subBuffer: 4, history: 5})
	p := l.pubs[0]
	slow := l.subscribe(0)
	fast := l.subscribe(0)
	for i := 0; i < 20; i++ {
		seq := p.publish(payload(0, stored(-1, int64(i+1))))
		if got := take(t, fast, 1); got != fmt.Sprintf("0:%d", seq) {
			t.Fatalf("fast subscriber got %s at %d", got, seq)
		}
	}
	if got := take(t, slow, 4); got != "0:0 0:1 0:2 0:3" {
		t.Fatalf("slow subscriber's queue: %s", got)
	}
	err := nextErr(t, slow)
	if !errors.Is(err, ErrDataLoss) || !strings.Contains(err.Error(), "fell 16 batches behind") {
		t.Fatalf("slow subscriber: %v", err)
	}
	p.publish(payload(0, stored(-1, 99)))
	if got := take(t, fast, 1); got != "0:20" {
		t.Fatalf("fast subscriber: %s", got)
	}
	l.counts("ended", []float64{1}, l.m().ended.WithLabelValues("fell_behind"))
}

// Many subscribers come and go while batches flow: every one sees a gapless,
// duplicate-free run of sequences (run with -race).
func TestConcurrentSubscribersSeeContiguousStreams(t *testing.T) {
	l := newLab(t, labOpts{noReplay: true, subBuffer: 8, history: 10_000})
	p := l.pubs[0]
	p.publish(payload(0, stored(-1, 1)))
	l.cursor(0, 0)
	const total = 300
	var wg sync.WaitGroup
	errs := make(chan error, 16)
	for w := 0; w < 6; w++ {
		wg.Go(func() {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			s, err := l.r.Subscribe(ctx, &kvpb.SubscribeKvEventsRequest{})
			if err != nil {
				errs <- err
				return
			}
			defer s.Close()
			var prev int64 = -1
			for prev < total {
				b, err := s.Next(ctx)
				if err != nil {
					errs <- fmt.Errorf("after %d: %w", prev, err)
					return
				}
				seq := int64(b.GetSequenceNumber())
				if prev >= 0 && seq != prev+1 {
					errs <- fmt.Errorf("sequence %d after %d", seq, prev)
					return
				}
				prev = seq
				if w%2 == 0 && seq%50 == 0 {
					time.Sleep(2 * time.Millisecond) // fall behind now and then
				}
			}
		})
	}
	for i := 1; i <= total; i++ {
		p.publish(payload(0, stored(-1, int64(i+1))))
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
}
