package monitor

import (
	"context"
	"maps"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/proto"

	"github.com/kvrelay/kvrelay/proto/kvpb"
)

func TestAppliesInOrderAndDropsStale(t *testing.T) {
	r := newRig(t, nil)
	c := r.srv.next(t).answer(t)
	if c.req.GetStartSequenceNumber() != 0 || len(c.req.GetRankCursors()) != 0 {
		t.Fatalf("first subscribe: start %d cursors %v", c.req.GetStartSequenceNumber(), c.req.GetRankCursors())
	}
	// 1 below a cursor of 2 would read as a counter reset, so start at 10.
	c.send(t, batch(-1, 10), batch(-1, 11), batch(-1, 11), batch(-1, 10), batch(-1, 12))
	r.sink.expect(t, "apply r0 s10", "apply r0 s11", "apply r0 s12")
	r.sink.quiet(t)
	// The counters and the lag follow the sink's apply: on a loaded machine
	// the last batch's may not be in yet.
	eventually(t, "the last apply's counters", func() bool {
		return r.histogramCount(t, "kvrelay_gateway_lag_seconds") >= 3
	})
	if got := r.counter(t, "batches", "stale"); got != 2 {
		t.Errorf("stale = %v, want 2", got)
	}
	if got := r.counter(t, "batches", "applied"); got != 3 {
		t.Errorf("applied = %v, want 3", got)
	}
	st := r.status(t)
	if st.State != StateStreaming || st.BatchesApplied != 3 || len(st.Ranks) != 1 || st.Ranks[0].Cursor != 12 {
		t.Errorf("status %+v", st)
	}
	if got := r.histogramCount(t, "kvrelay_gateway_lag_seconds"); got != 3 {
		t.Errorf("lag samples = %d, want one per applied batch", got)
	}
}

func TestGapReconnectsWithCursors(t *testing.T) {
	r := newRig(t, nil)
	c := r.srv.next(t).answer(t)
	c.send(t, batch(0, 1), batch(0, 2), batch(0, 3), batch(1, 10))
	r.sink.expect(t, "apply r0 s1", "apply r0 s2", "apply r0 s3", "apply r1 s10")
	c.send(t, batch(0, 6)) // 4 and 5 are missing
	c.waitEnded(t)         // the monitor drops the stream at once

	c2 := r.srv.next(t).answer(t)
	if got := c2.req.GetStartSequenceNumber(); got != 3 {
		t.Errorf("start_sequence_number = %d, want rank 0's cursor 3", got)
	}
	if want := map[int32]uint64{0: 3, 1: 10}; !maps.Equal(c2.req.GetRankCursors(), want) {
		t.Errorf("rank_cursors = %v, want %v", c2.req.GetRankCursors(), want)
	}
	c2.send(t, batch(0, 4), batch(0, 5), batch(0, 6), batch(1, 11))
	r.sink.expect(t, "apply r0 s4", "apply r0 s5", "apply r0 s6", "apply r1 s11")
	if got := r.counter(t, "gaps", "replay_requested"); got != 1 {
		t.Errorf("replay_requested = %v", got)
	}
	if got := r.counter(t, "missed"); got != 0 {
		t.Errorf("missed = %v, want 0 (the replay recovered it)", got)
	}
	if st := r.status(t); st.Degraded {
		t.Errorf("degraded after a recovered gap: %+v", st)
	}
}

func TestUnrecoveredGaps(t *testing.T) {
	tests := []struct {
		name      string
		gap       uint64 // missing batches
		wantOps   []string
		outcome   string
		degraded  bool
		resyncGap float64
	}{
		{name: "kept at 1024", gap: 1024, outcome: "unrecovered_kept", degraded: true,
			wantOps: []string{"apply r0 s1035"}},
		{name: "cleared above 1024", gap: 1025, outcome: "unrecovered_cleared", resyncGap: 1,
			wantOps: []string{"clear", "apply r0 s1036"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := newRig(t, nil)
			c := r.srv.next(t).answer(t)
			c.send(t, batch(0, 10), batch(1, 50))
			r.sink.expect(t, "apply r0 s10", "apply r1 s50")
			after := 10 + tt.gap + 1
			c.send(t, batch(0, after))
			c.waitEnded(t)
			c2 := r.srv.next(t).answer(t)
			if c2.req.GetStartSequenceNumber() != 10 {
				t.Fatalf("replay asked from %d", c2.req.GetStartSequenceNumber())
			}
			c2.send(t, batch(0, after)) // the server has no history: it skips again
			r.sink.expect(t, tt.wantOps...)
			c2.send(t, batch(0, after+1))
			r.sink.expect(t, "apply r0 s"+itoa(after+1))
			if got := r.counter(t, "gaps", tt.outcome); got != 1 {
				t.Errorf("%s = %v", tt.outcome, got)
			}
			if got := r.counter(t, "missed"); got != float64(tt.gap) {
				t.Errorf("missed = %v, want %d", got, tt.gap)
			}
			if got := r.counter(t, "resyncs", "gap_cleared"); got != tt.resyncGap {
				t.Errorf("gap_cleared = %v", got)
			}
			st := r.status(t)
			if st.Degraded != tt.degraded {
				t.Errorf("degraded = %v, want %v", st.Degraded, tt.degraded)
			}
			if tt.degraded {
				if got := r.counter(t, "degraded"); got != 1 {
					t.Errorf("degraded_ranks = %v", got)
				}
			} else if len(st.Ranks) != 1 {
				// A clear resets the other ranks so they do not clear again.
				t.Errorf("ranks after a clear: %+v", st.Ranks)
			}
		})
	}
}

func TestPublisherRestart(t *testing.T) {
	tests := []struct {
		name string
		// run after the stream has applied seqs 1..5 on rank 0 and 1 on rank 1
		script func(t *testing.T, r *rig, c *call)
		ops    []string
	}{
		{name: "counter back to zero", script: func(t *testing.T, r *rig, c *call) {
			c.send(t, batch(0, 0))
		}, ops: []string{"clear", "apply r0 s0"}},
		{name: "clear event below cursor", script: func(t *testing.T, r *rig, c *call) {
			c.send(t, batch(0, 4, clearedEvent()))
		}, ops: []string{"clear", "apply r0 s4"}},
		{name: "below cursor on a fresh connection", script: func(t *testing.T, r *rig, c *call) {
			c.finish(nil)
			c2 := r.srv.next(t).answer(t)
			if c2.req.GetStartSequenceNumber() != 5 {
				t.Errorf("resubscribed from %d", c2.req.GetStartSequenceNumber())
			}
			c2.send(t, batch(0, 3))
		}, ops: []string{"clear", "apply r0 s3"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := newRig(t, nil)
			c := r.srv.next(t).answer(t)
			c.send(t, batch(0, 1), batch(0, 2), batch(0, 3), batch(0, 4), batch(0, 5), batch(1, 1))
			r.sink.expect(t, "apply r0 s1", "apply r0 s2", "apply r0 s3", "apply r0 s4", "apply r0 s5", "apply r1 s1")
			tt.script(t, r, c)
			r.sink.expect(t, tt.ops...)
			if got := r.counter(t, "resyncs", "publisher_restart"); got != 1 {
				t.Errorf("publisher_restart = %v", got)
			}
			st := r.status(t)
			if len(st.Ranks) != 1 || st.Ranks[0].Rank != 0 {
				t.Errorf("rank 1 kept its cursor through a restart: %+v", st.Ranks)
			}
		})
	}
}

func TestSnapshotClearsAndResyncsCursors(t *testing.T) {
	r := newRig(t, nil)
	c := r.srv.next(t).answer(t)
	c.send(t, batch(0, 1), batch(0, 2), batch(1, 7))
	r.sink.expect(t, "apply r0 s1", "apply r0 s2", "apply r1 s7")
	c.send(t,
		chunk(0, 20, 0, 3, 0, clearedEvent(), stored(16, 1, 2)),
		chunk(0, 21, 1, 3, 0, stored(16, 3)),
		chunk(1, 22, 2, 3, 9, stored(16, 4)),
	)
	r.sink.expect(t, "clear", "apply r0 s20", "apply r0 s21", "apply r1 s22")
	eventually(t, "snapshot done", func() bool { return !r.status(t).Snapshot })
	st := r.status(t)
	want := []RankStatus{{Rank: 0, Cursor: 21, HasCursor: true}, {Rank: 1, Cursor: 22, HasCursor: true, Degraded: true}}
	if len(st.Ranks) != 2 || st.Ranks[0] != want[0] || st.Ranks[1] != want[1] {
		t.Errorf("ranks %+v, want %+v", st.Ranks, want)
	}
	// Live batches continue after the cut with no special case.
	c.send(t, batch(0, 22), batch(1, 23))
	r.sink.expect(t, "apply r0 s22", "apply r1 s23")
	if got := r.counter(t, "resyncs", "snapshot"); got != 1 {
		t.Errorf("snapshot resyncs = %v", got)
	}
	if got := r.counter(t, "batches", "snapshot"); got != 3 {
		t.Errorf("snapshot batches = %v", got)
	}
	// The gateway resumes from the chunk cursors.
	c.finish(nil)
	c2 := r.srv.next(t)
	if want := map[int32]uint64{0: 22, 1: 23}; !maps.Equal(c2.req.GetRankCursors(), want) || c2.req.GetStartSequenceNumber() != 22 {
		t.Errorf("resume start %d cursors %v", c2.req.GetStartSequenceNumber(), c2.req.GetRankCursors())
	}
}

func TestStreamEndMidSnapshotResubscribesFromZero(t *testing.T) {
	for _, end := range []error{nil, statusErr(codes.Unavailable, "relay going away")} {
		name := "clean end"
		if end != nil {
			name = "error end"
		}
		t.Run(name, func(t *testing.T) {
			r := newRig(t, nil)
			c := r.srv.next(t).answer(t)
			c.send(t, chunk(0, 30, 0, 3, 0, clearedEvent(), stored(16, 1)))
			r.sink.expect(t, "clear", "apply r0 s30")
			c.finish(end)
			c2 := r.srv.next(t).answer(t)
			if c2.req.GetStartSequenceNumber() != 0 || len(c2.req.GetRankCursors()) != 0 {
				t.Fatalf("after an abandoned snapshot: start %d cursors %v", c2.req.GetStartSequenceNumber(), c2.req.GetRankCursors())
			}
			c2.send(t, chunk(0, 40, 0, 1, 0, clearedEvent()))
			r.sink.expect(t, "clear", "apply r0 s40")
			if got := r.counter(t, "resyncs", "snapshot_abandoned"); got != 1 {
				t.Errorf("snapshot_abandoned = %v", got)
			}
		})
	}
}

func TestResyncCodesClearAndResubscribeFromZero(t *testing.T) {
	tests := []struct {
		name    string
		code    codes.Code
		reason  string
		headers bool // the error comes after headers and batches (on the stream), or alone (on the call)
	}{
		{"out of range on the call", codes.OutOfRange, "out_of_range", false},
		{"out of range on the stream", codes.OutOfRange, "out_of_range", true},
		{"data loss on the stream", codes.DataLoss, "data_loss", true},
		{"data loss on the call", codes.DataLoss, "data_loss", false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := newRig(t, nil)
			c := r.srv.next(t).answer(t)
			c.send(t, batch(0, 1), batch(0, 2), batch(1, 5))
			r.sink.expect(t, "apply r0 s1", "apply r0 s2", "apply r1 s5")
			c.finish(nil) // clean end: the next call carries the cursors
			c = r.srv.next(t)
			if c.req.GetStartSequenceNumber() != 2 {
				t.Fatalf("resume from %d", c.req.GetStartSequenceNumber())
			}
			if tt.headers {
				c.answer(t).send(t, batch(0, 3))
				r.sink.expect(t, "apply r0 s3")
			}
			c.finish(statusErr(tt.code, "resubscribe from zero"))
			r.sink.expect(t, "clear")
			c2 := r.srv.next(t).answer(t)
			if c2.req.GetStartSequenceNumber() != 0 || len(c2.req.GetRankCursors()) != 0 {
				t.Fatalf("after %v: start %d cursors %v", tt.code, c2.req.GetStartSequenceNumber(), c2.req.GetRankCursors())
			}
			if got := r.counter(t, "resyncs", tt.reason); got != 1 {
				t.Errorf("resyncs{%s} = %v", tt.reason, got)
			}
			if st := r.status(t); len(st.Ranks) != 0 {
				t.Errorf("cursors survived: %+v", st.Ranks)
			}
		})
	}
}

func TestOutOfRangeAtZeroBacksOff(t *testing.T) {
	// A server that refuses even a subscription from zero must not be
	// hammered: nothing was reset, so the monitor backs off.
	r := newRig(t, func(o *Options) { o.InitialBackoff = 150 * time.Millisecond; o.MaxBackoff = 150 * time.Millisecond })
	c := r.srv.next(t)
	// The backoff cannot start before the refusal: timing from here, a
	// loaded machine can only make the wait look longer, never shorter.
	start := time.Now()
	c.finish(statusErr(codes.OutOfRange, "no"))
	r.sink.expect(t, "clear")
	r.srv.next(t)
	if d := time.Since(start); d < 150*time.Millisecond {
		t.Errorf("resubscribed after %v, before the backoff", d)
	}
}

// UNIMPLEMENTED takes the worker out of the index (disabled, the relay's
// message in last_error) but not for good: the answer changes when the
// worker restarts with its events on or the other service, so it is asked
// again every MaxBackoff, and a stream that then opens is followed.
func TestUnimplementedIsAskedAgainAtMaxBackoff(t *testing.T) {
	r := newRig(t, nil)
	r.srv.next(t).finish(statusErr(codes.Unimplemented, "unknown service x: this kvrelay serves SubscribeKvEvents as sglang"))
	r.sink.expect(t, "clear")
	eventually(t, "disabled", func() bool { return r.status(t).State == StateDisabled })
	if st := r.status(t); !hasSubstr(st.LastError, "serves SubscribeKvEvents as sglang") {
		t.Errorf("last error %q does not carry the relay's message", st.LastError)
	}
	// Asked again, and answered UNIMPLEMENTED again: still disabled, and
	// the worker's blocks are not cleared a second time.
	r.srv.next(t).finish(statusErr(codes.Unimplemented, "still not"))
	eventually(t, "last error updated", func() bool { return hasSubstr(r.status(t).LastError, "still not") })
	// The worker comes back with the service: its stream is followed.
	r.srv.next(t).answer(t).send(t, batch(0, 1, stored(16, 7)))
	r.sink.expect(t, "apply r0 s1")
	eventually(t, "streaming", func() bool { return r.status(t).State == StateStreaming })
	if got := r.counter(t, "failures", "unimplemented"); got != 2 {
		t.Errorf("failures{unimplemented} = %v, want 2", got)
	}
}

// A service the worker does not register at all is answered by gRPC
// itself; it is asked again all the same.
func TestUnregisteredServiceIsAskedAgain(t *testing.T) {
	srv := startServer(t)
	reg := prometheus.NewRegistry()
	mon, err := New(fastOptions(reg))
	if err != nil {
		t.Fatal(err)
	}
	sink := newRecordingSink()
	if err := mon.Add(Worker{Addr: srv.addr, Service: ServiceSGLang, Model: "m"}, sink); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Add(1)
	go func() { defer wg.Done(); _ = mon.Run(ctx) }()
	defer func() { cancel(); wg.Wait() }()
	sink.expect(t, "clear")
	eventually(t, "disabled", func() bool { return mon.Workers()[0].State == StateDisabled })
	eventually(t, "asked again", func() bool {
		return testutil.ToFloat64(mon.metrics.failures.WithLabelValues(srv.addr, "unimplemented")) >= 2
	})
	if st := mon.Workers()[0]; st.State != StateDisabled || !hasSubstr(st.LastError, "Unimplemented") {
		t.Errorf("state %s, last error %q", st.State, st.LastError)
	}
	sink.quiet(t) // cleared once, not at every answer
}

func TestUnansweredSubscribeHitsDeadline(t *testing.T) {
	// The deadline cannot start before the rig: timing from here, a loaded
	// machine can only make the wait look longer, never shorter.
	start := time.Now()
	r := newRig(t, nil) // deadline 300 ms
	c := r.srv.next(t)  // never answered
	c.waitEnded(t)      // the monitor gives up and cancels the call
	if d := time.Since(start); d < 250*time.Millisecond {
		t.Errorf("call abandoned after %v, before the deadline", d)
	}
	c2 := r.srv.next(t).answer(t) // and tries again
	c2.send(t, batch(0, 1))
	r.sink.expect(t, "apply r0 s1")
	if got := r.counter(t, "failures", "deadline"); got != 1 {
		t.Errorf("failures{deadline} = %v", got)
	}
	if got := r.counter(t, "subscriptions"); got != 1 {
		t.Errorf("subscriptions = %v", got)
	}
}

func TestAnsweredIdleStreamIsNotAbandoned(t *testing.T) {
	// Headers are the answer: an idle engine may publish nothing for long.
	r := newRig(t, nil)
	c := r.srv.next(t).answer(t)
	r.srv.none(t, 700*time.Millisecond) // more than twice the deadline
	c.send(t, batch(0, 1))
	r.sink.expect(t, "apply r0 s1")
}

func TestBackoffBounds(t *testing.T) {
	if got := (Options{}).withDefaults(); got.InitialBackoff != 100*time.Millisecond || got.MaxBackoff != 5*time.Second || got.SubscribeDeadline != 2*time.Second {
		t.Errorf("defaults %+v", got)
	}
	// Calls are refused in a loop; each wait is at least the current delay,
	// and the delay doubles from the initial value up to the cap.
	r := newRig(t, func(o *Options) { o.InitialBackoff = 40 * time.Millisecond; o.MaxBackoff = 120 * time.Millisecond })
	var gaps []time.Duration
	last := time.Now()
	for i := 0; i < 5; i++ {
		c := r.srv.next(t)
		now := time.Now()
		if i > 0 {
			gaps = append(gaps, now.Sub(last))
		}
		last = now
		c.finish(statusErr(codes.Unavailable, "not yet"))
	}
	minimum := []time.Duration{40, 80, 120, 120}
	for i, g := range gaps {
		if g < minimum[i]*time.Millisecond {
			t.Errorf("wait %d = %v, want at least %v", i, g, minimum[i]*time.Millisecond)
		}
	}
	if st := r.status(t); st.LastError == "" || st.State == StateStreaming {
		t.Errorf("status %+v", st)
	}
	// A success resets the delay.
	c := r.srv.next(t).answer(t)
	start := time.Now() // before the end the wait follows
	c.finish(nil)
	r.srv.next(t)
	if d := time.Since(start); d < 40*time.Millisecond {
		t.Errorf("after a success: waited %v", d)
	}
}

func TestLoadOnlySkipsAdmission(t *testing.T) {
	var mu sync.Mutex
	var loads []uint32
	r := newRig(t, func(o *Options) {
		o.OnLoad = func(worker string, rank int32, l *kvpb.EngineLoad) {
			mu.Lock()
			loads = append(loads, l.GetRunningRequests())
			mu.Unlock()
		}
	})
	c := r.srv.next(t).answer(t)
	b1 := batch(0, 1)
	b1.Load = &kvpb.EngineLoad{RunningRequests: 3}
	hb := batch(0, 1) // heartbeat: repeats the cursor
	hb.Load = &kvpb.EngineLoad{RunningRequests: 4, LoadOnly: true}
	hb0 := batch(0, 0) // before the first batch: numbered 0
	hb0.Load = &kvpb.EngineLoad{RunningRequests: 5, LoadOnly: true}
	c.send(t, hb0, b1, hb, batch(0, 2))
	r.sink.expect(t, "apply r0 s1", "apply r0 s2")
	r.sink.quiet(t)
	if got := r.counter(t, "batches", "load_only"); got != 2 {
		t.Errorf("load_only = %v", got)
	}
	if got := r.counter(t, "batches", "stale"); got != 0 {
		t.Errorf("a load-only batch reached admission: stale = %v", got)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(loads) != 3 || loads[0] != 5 || loads[1] != 3 || loads[2] != 4 {
		t.Errorf("loads %v", loads)
	}
}

func TestBlockSizeLearned(t *testing.T) {
	var mu sync.Mutex
	learned := map[string]int{}
	r := newRig(t, func(o *Options) {
		o.OnBlockSize = func(model string, n int) { mu.Lock(); learned[model] = n; mu.Unlock() }
	})
	c := r.srv.next(t).answer(t)
	c.send(t, batch(0, 1, clearedEvent()), batch(0, 2, stored(32, 7)), batch(0, 3, stored(16, 8)))
	r.sink.expect(t, "apply r0 s1", "apply r0 s2", "apply r0 s3")
	if got := r.mon.BlockSize("m"); got != 32 {
		t.Errorf("BlockSize = %d, want 32 (the largest stored block)", got)
	}
	if st := r.status(t); st.BlockSize != 32 {
		t.Errorf("status block size %d", st.BlockSize)
	}
	mu.Lock()
	defer mu.Unlock()
	if learned["m"] != 32 || len(learned) != 1 {
		t.Errorf("OnBlockSize saw %v", learned)
	}
}

// vLLM at KV-group granularity (hash_block_size 4 under 16-token pages)
// stores a partial page as one 4-token block (block_pool.py,
// _get_partial_block_parent_hash_and_start) and full pages at 16. A worker
// whose first store is a partial page must not set the model's block size
// to 4, whichever worker speaks first; nor may a later partial page lower it.
func TestBlockSizeNotPoisonedByPartialPages(t *testing.T) {
	var mu sync.Mutex
	var calls []int
	r := newRig(t, func(o *Options) {
		o.OnBlockSize = func(model string, n int) { mu.Lock(); calls = append(calls, n); mu.Unlock() }
	})
	c := r.srv.next(t).answer(t)
	c.send(t, batch(0, 1, stored(4, 70)), batch(0, 2, stored(16, 71, 72)), batch(0, 3, stored(4, 73)))
	r.sink.expect(t, "apply r0 s1", "apply r0 s2", "apply r0 s3")
	if got := r.mon.BlockSize("m"); got != 16 {
		t.Errorf("BlockSize = %d after a partial page (4), two full pages (16) and a partial page, want 16", got)
	}
	if st := r.status(t); st.BlockSize != 16 {
		t.Errorf("status block size %d, want 16", st.BlockSize)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(calls) == 0 || calls[len(calls)-1] != 16 {
		t.Errorf("OnBlockSize calls %v, want the last to be 16", calls)
	}
}

func TestRemoveStopsAndClears(t *testing.T) {
	r := newRig(t, nil)
	c := r.srv.next(t).answer(t)
	c.send(t, batch(0, 1))
	r.sink.expect(t, "apply r0 s1")
	if err := r.mon.Remove(r.id); err != nil {
		t.Fatal(err)
	}
	r.sink.expect(t, "clear")
	c.waitEnded(t)
	if len(r.mon.Workers()) != 0 {
		t.Error("worker still listed")
	}
	if err := r.mon.Remove(r.id); err == nil {
		t.Error("second Remove succeeded")
	}
	// Re-adding starts a fresh subscription from zero.
	if err := r.mon.Add(Worker{Addr: r.srv.addr, Model: "m"}, r.sink); err != nil {
		t.Fatal(err)
	}
	if c2 := r.srv.next(t); c2.req.GetStartSequenceNumber() != 0 {
		t.Errorf("re-added worker resumed from %d", c2.req.GetStartSequenceNumber())
	}
}

func TestAddValidates(t *testing.T) {
	mon, err := New(Options{})
	if err != nil {
		t.Fatal(err)
	}
	sink := newRecordingSink()
	tests := []struct {
		name string
		w    Worker
		sink Sink
	}{
		{"no address", Worker{}, sink},
		{"no sink", Worker{Addr: "127.0.0.1:1"}, nil},
		{"bad service", Worker{Addr: "127.0.0.1:1", Service: "trtllm"}, sink},
	}
	for _, tt := range tests {
		if err := mon.Add(tt.w, tt.sink); err == nil {
			t.Errorf("%s: accepted", tt.name)
		}
	}
	if err := mon.Add(Worker{Addr: "127.0.0.1:1"}, sink); err != nil {
		t.Fatal(err)
	}
	if err := mon.Add(Worker{Addr: "127.0.0.1:1"}, sink); err == nil {
		t.Error("duplicate accepted")
	}
	// Two monitors cannot share a registry.
	reg := prometheus.NewRegistry()
	if _, err := New(Options{Registerer: reg}); err != nil {
		t.Fatal(err)
	}
	if _, err := New(Options{Registerer: reg}); err == nil {
		t.Error("second monitor on one registry accepted")
	}
}

var _ grpc.ServerStreamingServer[kvpb.KvEventBatch] = (grpc.ServerStreamingServer[kvpb.KvEventBatch])(nil)

func itoa(v uint64) string {
	if v == 0 {
		return "0"
	}
	var b [20]byte
	i := len(b)
	for v > 0 {
		i--
		b[i] = byte('0' + v%10)
		v /= 10
	}
	return string(b[i:])
}

// flavourServer serves SubscribeKvEvents under all three service names and
// reports which one each call used.
type flavourServer struct {
	methods chan string
}

func (f *flavourServer) serve(stream grpc.ServerStream) error {
	m, _ := grpc.Method(stream.Context())
	f.methods <- m
	if err := stream.SendHeader(nil); err != nil {
		return err
	}
	r := int32(0)
	if err := stream.SendMsg(&kvpb.KvEventBatch{SequenceNumber: 1, DpRank: &r}); err != nil {
		return err
	}
	<-stream.Context().Done()
	return nil
}

type vllmFlavour struct {
	kvpb.UnimplementedVllmEngineServer
	f *flavourServer
}

func (v vllmFlavour) SubscribeKvEvents(_ *kvpb.SubscribeKvEventsRequest, s grpc.ServerStreamingServer[kvpb.KvEventBatch]) error {
	return v.f.serve(s)
}

type sglangFlavour struct {
	kvpb.UnimplementedSglangSchedulerServer
	f *flavourServer
}

func (v sglangFlavour) SubscribeKvEvents(_ *kvpb.SubscribeKvEventsRequest, s grpc.ServerStreamingServer[kvpb.KvEventBatch]) error {
	return v.f.serve(s)
}

type tokenspeedFlavour struct {
	kvpb.UnimplementedTokenSpeedSchedulerServer
	f *flavourServer
}

func (v tokenspeedFlavour) SubscribeKvEvents(_ *kvpb.SubscribeKvEventsRequest, s grpc.ServerStreamingServer[kvpb.KvEventBatch]) error {
	return v.f.serve(s)
}

func TestServiceFlavours(t *testing.T) {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	f := &flavourServer{methods: make(chan string, 8)}
	srv := grpc.NewServer()
	kvpb.RegisterVllmEngineServer(srv, vllmFlavour{f: f})
	kvpb.RegisterSglangSchedulerServer(srv, sglangFlavour{f: f})
	kvpb.RegisterTokenSpeedSchedulerServer(srv, tokenspeedFlavour{f: f})
	go func() { _ = srv.Serve(lis) }()
	defer srv.Stop()

	tests := []struct {
		service Service
		method  string
	}{
		{ServiceVLLM, "/vllm.grpc.engine.VllmEngine/SubscribeKvEvents"},
		{ServiceSGLang, "/sglang.grpc.scheduler.SglangScheduler/SubscribeKvEvents"},
		{ServiceTokenSpeed, "/tokenspeed.grpc.scheduler.TokenSpeedScheduler/SubscribeKvEvents"},
	}
	for _, tt := range tests {
		t.Run(string(tt.service), func(t *testing.T) {
			mon, err := New(fastOptions(prometheus.NewRegistry()))
			if err != nil {
				t.Fatal(err)
			}
			sink := newRecordingSink()
			if err := mon.Add(Worker{Addr: lis.Addr().String(), Service: tt.service}, sink); err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithCancel(context.Background())
			done := make(chan struct{})
			go func() { defer close(done); _ = mon.Run(ctx) }()
			defer func() { cancel(); <-done }()
			if got := <-f.methods; got != tt.method {
				t.Errorf("called %s, want %s", got, tt.method)
			}
			sink.expect(t, "apply r0 s1")
		})
	}
}

func TestRepeatedResyncsBackOff(t *testing.T) {
	// A worker that serves a snapshot and then DATA_LOSS, over and over: the
	// first resync is immediate, the next ones wait and the wait grows.
	r := newRig(t, func(o *Options) { o.InitialBackoff = 100 * time.Millisecond; o.MaxBackoff = 400 * time.Millisecond })
	var arrivals []time.Time
	for i := 0; i < 4; i++ {
		c := r.srv.next(t)
		arrivals = append(arrivals, time.Now())
		c.answer(t).send(t, chunk(0, 10, 0, 1, 0, clearedEvent()))
		r.sink.expect(t, "clear", "apply r0 s10")
		c.finish(statusErr(codes.DataLoss, "fell behind"))
		r.sink.expect(t, "clear")
	}
	r.srv.next(t)
	arrivals = append(arrivals, time.Now())
	minimum := []time.Duration{0, 100, 200, 400} // before calls 2..5
	for i, m := range minimum {
		if gap := arrivals[i+1].Sub(arrivals[i]); gap < m*time.Millisecond {
			t.Errorf("call %d came %v after the previous one, want at least %v", i+2, gap, m*time.Millisecond)
		}
	}
	if got := r.counter(t, "resyncs", "data_loss"); got != 4 {
		t.Errorf("data_loss resyncs = %v", got)
	}
}

func TestABatchOver4MiBIsApplied(t *testing.T) {
	// 131,072 blocks of 16 tokens: about 6.5 MB, one real engine batch that
	// a relay never splits. gRPC's default receive limit (4 MiB) failed
	// the stream at every resubscribe.
	tests := []struct {
		name   string
		blocks int
	}{
		{"131,072 blocks", 131072},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			hashes := make([]int64, tt.blocks)
			for i := range hashes {
				hashes[i] = int64(i + 1)
			}
			b := batch(-1, 10, stored(16, hashes...))
			if size := proto.Size(b); size <= 4<<20 {
				t.Fatalf("the batch is %d bytes, not over 4 MiB", size)
			}
			// Decoding 6.5 MB under -race on a loaded machine takes a while.
			r := newRig(t, func(o *Options) { o.SubscribeDeadline = 6 * waitFor })
			r.srv.next(t).answer(t).send(t, b)
			// Encoding, sending and decoding 6.5 MB under -race, with other
			// packages' tests on the same two cores, can outlast waitFor.
			select {
			case got := <-r.sink.ch:
				if got != "apply r0 s10" {
					t.Fatalf("sink got %q, want the batch applied", got)
				}
			case <-time.After(6 * waitFor):
				t.Fatalf("the batch was not applied; failures: %v", r.failureCounts())
			}
			if f := r.failureCounts(); len(f) != 0 {
				t.Fatalf("subscription failures %v", f)
			}
		})
	}
}

// failureCounts lists the rig worker's subscription failures by reason.
func (r *rig) failureCounts() map[string]float64 {
	out := map[string]float64{}
	mfs, _ := r.reg.Gather()
	for _, mf := range mfs {
		if mf.GetName() != "kvrelay_gateway_subscription_failures_total" {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "reason" && m.GetCounter().GetValue() > 0 {
					out[l.GetValue()] = m.GetCounter().GetValue()
				}
			}
		}
	}
	return out
}
