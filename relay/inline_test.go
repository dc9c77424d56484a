package relay

import (
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrelay/kvrelay/engines"
	"github.com/kvrelay/kvrelay/engines/vllm"
	"github.com/kvrelay/kvrelay/internal/enginepeer"
)

// Issue 19 item 2: over real sockets, a batch that arrives alone is admitted
// on the goroutine that read it (the inline path: no hand-off to the rank
// loop), and a stream that mixes it with the rank loop's paths (a gap filled
// from the replay, a burst that queues) stays exact: every sequence once, in
// order, each batch its own.
func TestInlineAdmissionKeepsTheStreamExact(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a Python peer")
	}
	peer := enginepeer.Start(t, enginepeer.Options{Engine: enginepeer.VLLM})
	reg := prometheus.NewRegistry()
	r, err := New(Config{
		Engine: vllm.Engine,
		KV: engines.Config{Enabled: true, Endpoint: peer.PubEndpoint(0), ReplayEndpoint: peer.ReplayEndpoint(0),
			BufferSteps: 10_000},
		DPSize:     1,
		Logger:     quietLogger(),
		Registerer: reg,
	})
	if err != nil {
		t.Fatal(err)
	}
	l := runRelay(t, r)
	l.waitFor("the rank connected", r.Ready)
	s := l.subscribe(0)

	// Each batch stores one block whose hash is its sequence + 1
	// (PublishMany's default), so a batch delivered under the wrong
	// sequence shows.
	var want uint64 // the next sequence the stream must deliver
	expect := func(last uint64) {
		t.Helper()
		for want <= last {
			b := next(t, s)
			seq := b.GetSequenceNumber()
			if seq != want {
				t.Fatalf("delivered seq %d, want %d", seq, want)
			}
			if len(b.Events) != 1 || len(b.Events[0].GetStored().GetBlocks()) != 1 ||
				b.Events[0].GetStored().GetBlocks()[0].GetBlockHash() != int64(seq)+1 {
				t.Fatalf("batch %d is not its own: %v", seq, b)
			}
			want++
		}
	}
	// The slow joiner: publish until the first batch is relayed.
	deadline := time.Now().Add(patience)
	for {
		_, last, err := peer.PublishMany(0, 1, 0)
		if err != nil {
			t.Fatal(err)
		}
		r.mu.Lock()
		relayed := r.ranks[0].hasCursor
		r.mu.Unlock()
		if relayed {
			expect(last)
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("nothing relayed")
		}
		time.Sleep(20 * time.Millisecond)
	}

	singles := func(n int) {
		for range n {
			_, last, err := peer.PublishMany(0, 1, 0)
			if err != nil {
				t.Fatal(err)
			}
			expect(last)
		}
	}
	singles(20)
	// Three batches missing from the live stream: the rank loop gets them
	// from the replay (the gap path, or the idle probe when the dropped
	// batch is the last one published); the inline path must not admit
	// anything past them meanwhile.
	recovered := counter(r.metrics.recovered.WithLabelValues("0"))
	if err := peer.DropNext(0, 3); err != nil {
		t.Fatal(err)
	}
	singles(10)
	if got := counter(r.metrics.recovered.WithLabelValues("0")) - recovered; got < 3 {
		t.Errorf("%v batches recovered from the replay, want the 3 dropped", got)
	}
	// A burst: a backlog goes through the queue and the rank loop.
	_, last, err := peer.PublishMany(0, 500, 0)
	if err != nil {
		t.Fatal(err)
	}
	expect(last)
	singles(10)

	inline := gatheredSum(t, reg, "kvrelay_zmq_messages_admitted_inline_total")
	if inline == 0 {
		t.Fatalf("no batch was admitted inline")
	}
	t.Logf("%d batches relayed, %.0f of them inline", want, inline)
}

// gatheredSum is the sum of a counter family's series in reg.
func gatheredSum(t *testing.T, reg *prometheus.Registry, name string) float64 {
	t.Helper()
	fams, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range fams {
		if f.GetName() == name {
			var sum float64
			for _, m := range f.GetMetric() {
				sum += m.GetCounter().GetValue()
			}
			return sum
		}
	}
	t.Fatalf("%s not exported", name)
	return 0
}
