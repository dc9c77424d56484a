package zmqsource

import (
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/kvrelay/kvrelay/internal/enginepeer"
)

// inlineRecorder is an inline handler that keeps what it took, and can be
// slow (work per message) or decline everything.
type inlineRecorder struct {
	mu      sync.Mutex
	took    []uint64
	work    time.Duration
	decline bool
}

func (h *inlineRecorder) handle(m Message) bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.decline {
		return false
	}
	if h.work > 0 {
		time.Sleep(h.work) // stands for admission's work on this goroutine
	}
	h.took = append(h.took, m.Seq)
	return true
}

func (h *inlineRecorder) taken() []uint64 {
	h.mu.Lock()
	defer h.mu.Unlock()
	return slices.Clone(h.took)
}

// A message that arrives alone goes to the inline handler, not the queue;
// one the handler declines is queued as before.
func TestSubscriberHandsLoneMessagesInline(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a Python peer")
	}
	p := enginepeer.Start(t, enginepeer.Options{Engine: enginepeer.VLLM, NoReplay: true})
	s := newTestSubscriber(t, p.PubEndpoint(0), "", 0)
	attach(t, p, 0, s)
	h := &inlineRecorder{}
	s.SetInline(h.handle)

	const n = 20
	var published []uint64
	for range n {
		before := s.Stats().Received
		pub, err := p.Publish(0, probe())
		if err != nil {
			t.Fatal(err)
		}
		published = append(published, pub.Seq)
		waitFor(t, "the message read", 20*time.Second, func() bool { return s.Stats().Received > before })
	}
	// Each message was read alone, so nearly all were taken inline; one
	// whose read the scheduler delayed past the next publish may have been
	// queued. Together they are every message, in order.
	took := h.taken()
	queued := drainQueued(t, s, 100*time.Millisecond)
	if len(took) == 0 {
		t.Fatalf("no message was handed inline (stats %+v)", s.Stats())
	}
	if st := s.Stats(); st.Inline != uint64(len(took)) {
		t.Errorf("Stats().Inline = %d, the handler took %d", st.Inline, len(took))
	}
	got := took
	for _, m := range queued {
		got = append(got, m.Seq)
	}
	slices.Sort(got)
	if !slices.Equal(got, published) {
		t.Fatalf("inline %v and queued %v are not the published %v", took, queued, published)
	}
	t.Logf("%d of %d taken inline", len(took), n)

	// Declined: queued, in order.
	h.mu.Lock()
	h.decline = true
	h.mu.Unlock()
	pub, err := p.Publish(0, probe())
	if err != nil {
		t.Fatal(err)
	}
	m, ok := recvWithin(t, s, 20*time.Second)
	if !ok || m.Seq != pub.Seq {
		t.Fatalf("declined message: got %+v (%v), want seq %d queued", m, ok, pub.Seq)
	}
	if len(h.taken()) != len(took) {
		t.Fatalf("the handler took a message it declined")
	}
}

// Under a backlog (a burst while the handler works) messages go to the
// queue, and once one is queued nothing later is handed inline until the
// queue is empty again: every inline message precedes every queued one
// here, since nobody drains the queue.
func TestSubscriberQueuesBacklogAndNeverOvertakesIt(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a Python peer")
	}
	p := enginepeer.Start(t, enginepeer.Options{Engine: enginepeer.VLLM, NoReplay: true})
	s := newTestSubscriber(t, p.PubEndpoint(0), "", 0)
	attach(t, p, 0, s)
	h := &inlineRecorder{work: time.Millisecond}
	s.SetInline(h.handle)

	// A lone message first (inline, unless the scheduler delayed the
	// reader), then a burst the 1 ms handler cannot keep up with.
	before := s.Stats().Received
	lone, err := p.Publish(0, probe())
	if err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the lone message read", 20*time.Second, func() bool { return s.Stats().Received > before })
	const n = 300
	first, last, err := p.PublishMany(0, n, 0)
	if err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the burst read", 30*time.Second, func() bool { return s.Stats().Received == before+1+n })
	took := h.taken()
	queued := drainQueued(t, s, 100*time.Millisecond)
	if len(queued) == 0 {
		t.Fatalf("a burst of %d against a 1 ms handler queued nothing: the backlog was not seen", n)
	}
	if len(took) > 0 && took[len(took)-1] >= queued[0].Seq {
		t.Fatalf("message %d went inline after %d was queued", took[len(took)-1], queued[0].Seq)
	}
	first = lone.Seq
	var got []uint64
	got = append(got, took...)
	for _, m := range queued {
		got = append(got, m.Seq)
	}
	for i, seq := range got {
		if seq != first+uint64(i) {
			t.Fatalf("message %d is seq %d, want %d (burst %d..%d)", i, seq, first+uint64(i), first, last)
		}
	}
	t.Logf("burst of %d against a 1 ms handler: %d inline, then %d queued", n, len(took), len(queued))
}
