package monitor

import (
	"context"
	"fmt"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrelay/kvrelay/proto/kvpb"
)

// statusSink records each batch it is handed with the worker's CaughtUp
// as the monitor reports it during the apply.
type statusSink struct {
	*recordingSink
	mon *Monitor
}

func (s statusSink) Apply(worker string, b *kvpb.KvEventBatch) {
	s.record(fmt.Sprintf("apply s%d caught_up=%v", b.GetSequenceNumber(), s.mon.Workers()[0].CaughtUp))
}

func caughtUpRig(t *testing.T) (*scriptedServer, *Monitor, statusSink) {
	t.Helper()
	srv := startServer(t)
	mon, err := New(fastOptions(prometheus.NewRegistry()))
	if err != nil {
		t.Fatal(err)
	}
	sink := statusSink{newRecordingSink(), mon}
	if err := mon.Add(Worker{Addr: srv.addr, Model: "m"}, sink); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = mon.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
	return srv, mon, sink
}

// TestCaughtUp: a worker is caught up once its stream has delivered its
// state: after the last chunk of a snapshot is in the sink (not while it
// is applied, nor after an earlier chunk), after a batch applied outside a
// snapshot, or on a load-only record (a relay sends one only with nothing
// else queued). An open stream that delivered nothing is not, and a
// reconnect does not undo it.
func TestCaughtUp(t *testing.T) {
	caught := func(mon *Monitor) func() bool { return func() bool { return mon.Workers()[0].CaughtUp } }

	t.Run("snapshot", func(t *testing.T) {
		srv, mon, sink := caughtUpRig(t)
		c := srv.next(t).answer(t)
		eventually(t, "streaming", func() bool { return mon.Workers()[0].State == StateStreaming })
		c.send(t, chunk(0, 20, 0, 2, 0, clearedEvent(), stored(16, 1, 2)))
		sink.expect(t, "clear", "apply s20 caught_up=false")
		if mon.Workers()[0].CaughtUp {
			t.Fatal("caught up after the first of two chunks")
		}
		c.send(t, chunk(0, 21, 1, 2, 0, stored(16, 3)))
		sink.expect(t, "apply s21 caught_up=false")
		eventually(t, "caught up after the last chunk", caught(mon))
		// A reconnect, with nothing delivered yet, leaves it caught up.
		c.finish(nil)
		srv.next(t).answer(t)
		if !mon.Workers()[0].CaughtUp {
			t.Fatal("a reconnect undid caught up")
		}
	})
	t.Run("batch", func(t *testing.T) {
		srv, mon, sink := caughtUpRig(t)
		c := srv.next(t).answer(t)
		eventually(t, "streaming", func() bool { return mon.Workers()[0].State == StateStreaming })
		if mon.Workers()[0].CaughtUp {
			t.Fatal("caught up with nothing delivered")
		}
		c.send(t, batch(0, 1, stored(16, 1)))
		sink.expect(t, "apply s1 caught_up=false")
		eventually(t, "caught up after a batch", caught(mon))
	})
	t.Run("load_only", func(t *testing.T) {
		srv, mon, sink := caughtUpRig(t)
		c := srv.next(t).answer(t)
		hb := batch(0, 0)
		hb.Load = &kvpb.EngineLoad{RunningRequests: 1, LoadOnly: true}
		c.send(t, hb)
		eventually(t, "caught up on a load-only record", caught(mon))
		sink.quiet(t)
	})
}
