package relay

import (
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/vmihailenco/msgpack/v5"

	"github.com/kvrelay/kvrelay/engines"
)

// Found by TestExactnessAgainstTheSimulatedEngine (vllm/array6/seed=1 and
// sglang/array7/seed=1, with duplicate injection): a cache reset's
// AllBlocksCleared delivered a second time was read by the admission table
// as a restarted publisher's startup clear at the cursor, so the rank was
// started over and every subscriber ended with DATA_LOSS. The same bytes
// under the same sequence are the same batch; a restarted publisher's clear
// carries a new time.
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

// Found by TestExactnessAgainstTheSimulatedEngine (vllm/array12/seed=3,
// with duplicate injection): the catch-up replay runs on a timer, so it can
// come between a live batch and a redelivery of it. It relayed what the
// live stream had missed past the cursor, the redelivered batch then sat
// below the cursor, and the admission table read it as a sequence
// regression: a spurious restart, DATA_LOSS for every subscriber and the
// rank's record started over.
func TestARedeliveryOfTheCursorBatchAfterACatchUpIsADuplicate(t *testing.T) {
	p := newFakePub(0)
	reg := prometheus.NewRegistry()
	r, err := New(Config{
		Engine:        engineForTest(),
		KV:            engines.Config{Enabled: true, Publisher: "zmq", Endpoint: "tcp://*:5557", ReplayEndpoint: "tcp://*:5657"},
		DPSize:        1,
		ReplayTimeout: 200 * time.Millisecond,
		PrimeRetry:    20 * time.Millisecond,
		CatchUpDelay:  -1,
		IdleProbe:     150 * time.Millisecond,
		Logger:        quietLogger(),
		Registerer:    reg,
		Transport: func(int32, string, string, time.Duration) (Feed, Replayer, error) {
			return p, fakeReplayer{p}, nil
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	l := runRelay(t, r)
	l.pubs, l.reg = []*fakePub{p}, reg
	l.waitFor("the start replay", func() bool { return len(p.askedFrom()) > 0 })

	p.publish(payload(0, stored(-1, 1)))
	atCursor := payload(0, stored(-1, 2))
	c := p.publish(atCursor)
	l.cursor(0, c)
	s := l.subscribe(c)
	p.hide(payload(0, stored(-1, 3))) // lost live: only the idle catch-up finds it
	l.cursor(0, c+1)
	p.send(c, atCursor) // the redelivery of the old cursor's batch
	l.counts("duplicates", []float64{1}, l.m().duplicates.WithLabelValues("0"))
	p.publish(payload(0, stored(-1, 4)))
	if got := take(t, s, 2); got != fmt.Sprintf("0:%d 0:%d", c+1, c+2) {
		t.Fatalf("after the catch-up and the redelivery: %s", got)
	}
	if rs := r.Status().Ranks[0]; rs.Restarts != 0 {
		t.Fatalf("the redelivery restarted the rank: %+v", rs)
	}
}
