package natsevents

import (
	"testing"
	"time"

	"github.com/kvrelay/kvrelay/gateway/monitor"
	"github.com/kvrelay/kvrelay/sim"
)

// stepRank serves n requests of the built-in workload on rank only, so that
// one rank moves while another stays where it is.
func (w *worker) stepRank(rank, n int) {
	w.t.Helper()
	for range n {
		if _, err := w.eng.Step(sim.Request{Rank: rank, Tokens: w.eng.NextRequest().Tokens}); err != nil {
			w.t.Fatal(err)
		}
	}
}

// holdReplay makes the engine's replay of rank (nil: every rank) wait
// until releaseReplay: a relay's start replay of that rank then primes
// only when the test says.
func (w *worker) holdReplay(rank *int) {
	w.t.Helper()
	if err := w.eng.Fault(sim.Fault{Kind: sim.FaultReplayDelay, Rank: rank, N: int(time.Hour / time.Millisecond)}); err != nil {
		w.t.Fatal(err)
	}
}

func (w *worker) releaseReplay(rank *int) {
	w.t.Helper()
	if err := w.eng.Fault(sim.Fault{Kind: sim.FaultReplayDelay, Rank: rank, N: 0}); err != nil {
		w.t.Fatal(err)
	}
}

// primed waits until every rank of the current relay has relayed a batch.
func (w *worker) primed() {
	w.t.Helper()
	eventually(w.t, w.name+"'s relay primed", func() bool {
		for _, r := range w.rel.Status().Ranks {
			if r.Cursor == nil {
				return false
			}
		}
		return true
	})
}

// TestRestartedRelaySnapshotCoversEveryRank is issue 30's first fault: a
// relay restarted on a busy engine primes its ranks at different times
// (here rank 1's replay answers late), and rank 0 has new batches before
// rank 1 has primed. A snapshot written then holds rank 0 only, at a
// stream sequence above rank 1's earlier messages, which rank 1's
// re-publication cannot move (they are duplicates): a replica starting
// from it would miss rank 1's blocks. The sink must write no snapshot
// that hides a rank's messages, and the first snapshot must come as soon
// as every rank can be covered, not a period later (SnapshotEvery is an
// hour here).
func TestRestartedRelaySnapshotCoversEveryRank(t *testing.T) {
	js, a := startPublishing(t, 40)
	a.run(10)
	follower := startReplica(t, js.URL(), monitor.Worker{ID: a.name, Addr: deadAddr})
	follower.exact(a.name, a.eng, "before the restart")

	a.down()
	one := 1
	a.holdReplay(&one)
	a.startRelay()
	a.startSink(js.URL())
	// Rank 0 primes at once and moves on, and the stream stores new
	// messages of it, while rank 1's replay waits.
	a.stepRank(0, 5)
	eventually(t, "a new message of rank 0 stored", func() bool {
		return a.sinkCount("kvrelay_nats_events_published_total", "result", "stored") >= 1
	})
	if got := a.sinkCount("kvrelay_nats_events_snapshots_total", "result", "written"); got != 0 {
		t.Errorf("%v snapshots written before rank 1 primed: they cannot cover rank 1", got)
	}
	a.releaseReplay(&one)
	released := time.Now()
	a.primed()
	// Both ranks move: every rank now has a batch the stream did not hold.
	a.run(10)
	a.snapshotsWritten(1, "the restarted relay's first snapshot")
	t.Logf("first snapshot %v after rank 1's replay was released", time.Since(released).Round(time.Millisecond))

	// A replica that starts now has only the snapshot and what follows it.
	late := startReplica(t, js.URL(), monitor.Worker{ID: a.name, Addr: deadAddr})
	late.exact(a.name, a.eng, "a replica started after the restart")
	follower.exact(a.name, a.eng, "the replica that followed the restart")
	a.run(10)
	late.exact(a.name, a.eng, "a replica started after the restart, later")
}

// TestIdleRankSettlesByItsNewestBatch: after a relay restart, a rank whose
// engine publishes nothing new re-publishes only duplicates; once the
// duplicate of its newest stored batch is answered, none of its later
// batches can be one, so the snapshot is written without waiting for
// that rank to move.
func TestIdleRankSettlesByItsNewestBatch(t *testing.T) {
	js, a := startPublishing(t, 30)
	a.stepRank(0, 3) // rank 0's newest stored message is a batch, not a chunk
	a.stepRank(1, 3)
	follower := startReplica(t, js.URL(), monitor.Worker{ID: a.name, Addr: deadAddr})
	follower.exact(a.name, a.eng, "before the restart")

	a.down()
	a.holdReplay(nil)
	a.startRelay()
	a.startSink(js.URL())
	eventually(t, "the sink subscribed", func() bool { return a.rel.Status().Subscribers >= 1 })
	a.releaseReplay(nil)
	a.primed()
	a.stepRank(0, 3) // rank 1 stays idle
	a.snapshotsWritten(1, "a snapshot with rank 1 idle")
	late := startReplica(t, js.URL(), monitor.Worker{ID: a.name, Addr: deadAddr})
	late.exact(a.name, a.eng, "a replica started after the restart")
}
