package natsevents

import (
	"context"
	"fmt"
	"sync"
	"testing"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// TestNoRespondersEndsThePass: a publish nobody answers (JetStream has no
// stream leader for the moment, as in a cluster's failover) ends the pass
// at once and is not sent again. nats.go's default resends it twice, 250 ms
// apart, while the publishes after it go on: the stream could then store a
// rank's batch after later ones, a disorder every consumer from an older
// snapshot reads as a gap, until the next periodic snapshot.
func TestNoRespondersEndsThePass(t *testing.T) {
	js := startJetStream(t)
	// The stream exists but not on the sink's subjects, so JetStream does
	// not answer them: the test does, as the server or JetStream would.
	nc, jsc := jetStreamClient(t, js.URL())
	if _, err := jsc.CreateStream(context.Background(), jetstream.StreamConfig{Name: DefaultStream, Subjects: []string{"elsewhere.>"}}); err != nil {
		t.Fatal(err)
	}
	var (
		mu    sync.Mutex
		first string             // the reply subject of the first publish
		sent  = map[string]int{} // times each publish (by reply subject) came
		seq   uint64
	)
	sub, err := nc.Subscribe(DefaultSubjectPrefix+".>", func(m *nats.Msg) {
		mu.Lock()
		if first == "" && m.Subject != sinkMarkSubject(DefaultSubjectPrefix, WorkerToken("a")) {
			first = m.Reply // a batch's, not the pass's marker
		}
		sent[m.Reply]++
		unanswered := m.Reply == first
		seq++
		ack := fmt.Sprintf(`{"stream":%q,"seq":%d}`, DefaultStream, seq)
		mu.Unlock()
		reply := nats.NewMsg(m.Reply)
		if unanswered {
			reply.Header.Set("Status", "503") // the server's "no responders"
		} else {
			reply.Data = []byte(ack)
		}
		_ = m.RespondMsg(reply)
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = sub.Unsubscribe() })
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}

	a := startWorker(t, "a", 1)
	a.run(5)
	a.startSink(js.URL())
	eventually(t, "the pass to end on the unanswered publish", func() bool {
		return a.sinkCount("kvrelay_nats_events_resyncs_total", "reason", "publish_failed") >= 1
	})
	mu.Lock()
	n := sent[first]
	mu.Unlock()
	if n != 1 {
		t.Fatalf("the unanswered publish was sent %d times before the pass ended; want once (no resend behind later batches)", n)
	}
}
