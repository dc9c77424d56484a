package zmqsource

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/kvrelay/kvrelay/testkit/enginepeer"
)

func TestParseSeq(t *testing.T) {
	tests := []struct {
		name string
		in   []byte
		want uint64
		ok   bool
	}{
		{"8 bytes", []byte{0, 0, 0, 0, 0, 0, 0, 5}, 5, true},
		{"8 bytes max", []byte{0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xfe}, 1<<64 - 2, true},
		{"empty", nil, 0, false},
		{"2 bytes zero-extended", []byte{1, 2}, 0x0102, true},
		{"1 byte", []byte{7}, 7, true},
		{"9 bytes fitting 64 bits", []byte{0, 0, 0, 0, 0, 0, 0, 0, 9}, 9, true},
		{"9 bytes overflowing", []byte{1, 0, 0, 0, 0, 0, 0, 0, 9}, 0, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, ok := parseSeq(tt.in)
			if ok != tt.ok || got != tt.want {
				t.Errorf("parseSeq(%x) = %d, %v; want %d, %v", tt.in, got, ok, tt.want, tt.ok)
			}
		})
	}
}

func FuzzParseSeq(f *testing.F) {
	f.Add([]byte{0, 0, 0, 0, 0, 0, 0, 1})
	f.Add([]byte{})
	f.Add([]byte{1, 2, 3})
	f.Add(make([]byte, 12))
	f.Fuzz(func(t *testing.T, b []byte) {
		v, ok := parseSeq(b)
		if !ok {
			return
		}
		// Whatever is accepted must round-trip as a big-endian number.
		var want [8]byte
		binary.BigEndian.PutUint64(want[:], v)
		n := min(len(b), 8)
		if string(b[len(b)-n:]) != string(want[8-n:]) {
			t.Fatalf("parseSeq(%x) = %d does not match its low bytes", b, v)
		}
	})
}

func TestQueue(t *testing.T) {
	q := newQueue(100, 1<<20)
	// Interleave pushes and pops so the ring wraps and grows while wrapped.
	next, want := uint64(0), uint64(0)
	for round := 0; round < 49; round++ {
		for i := 0; i < 3; i++ {
			if !q.push(Message{Seq: next}) {
				t.Fatalf("push %d refused below the limit", next)
			}
			next++
		}
		m, ok := q.pop()
		if !ok || m.Seq != want {
			t.Fatalf("pop = %d, %v; want %d", m.Seq, ok, want)
		}
		want++
	}
	// 98 queued; two more reach the limit.
	for i := 0; i < 2; i++ {
		if !q.push(Message{Seq: next}) {
			t.Fatalf("push %d refused below the limit", next)
		}
		next++
	}
	if q.push(Message{Seq: next}) {
		t.Fatal("push accepted above the limit")
	}
	for ; want < next; want++ {
		m, ok := q.pop()
		if !ok || m.Seq != want {
			t.Fatalf("pop = %d, %v; want %d", m.Seq, ok, want)
		}
	}
	if _, ok := q.pop(); ok {
		t.Fatal("pop from an empty queue succeeded")
	}
}

func TestSubscriberCloseWhileDialing(t *testing.T) {
	s := NewSubscriber(SubscriberOptions{
		Endpoint:   fmt.Sprintf("tcp://127.0.0.1:%d", freePort(t)),
		Logger:     quietLogger(),
		MinBackoff: 10 * time.Millisecond,
	})
	time.Sleep(100 * time.Millisecond)
	if s.Connected() {
		t.Fatal("connected to a port nobody listens on")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	if _, err := s.Recv(ctx); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Recv without messages = %v, want deadline exceeded", err)
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	if err := s.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
	if _, err := s.Recv(context.Background()); !errors.Is(err, ErrClosed) {
		t.Fatalf("Recv after Close = %v, want ErrClosed", err)
	}
}

// A peer that accepts TCP but never completes the ZMTP handshake must not
// wedge the connection loop: each attempt times out and a new one follows.
func TestSubscriberSilentServer(t *testing.T) {
	addr, accepted := silentListener(t)
	s := NewSubscriber(SubscriberOptions{
		Endpoint:    "tcp://" + addr,
		Logger:      quietLogger(),
		MinBackoff:  10 * time.Millisecond,
		MaxBackoff:  20 * time.Millisecond,
		DialTimeout: 50 * time.Millisecond,
	})
	waitFor(t, "a second connection attempt", 10*time.Second, func() bool { return accepted() >= 2 })
	if s.Connected() {
		t.Error("connected without a handshake")
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
}

func TestSubscriberBadEndpointDoesNotPanic(t *testing.T) {
	s := NewSubscriber(SubscriberOptions{Endpoint: "no-scheme", Logger: quietLogger()})
	time.Sleep(20 * time.Millisecond)
	if s.Connected() {
		t.Fatal("connected to a malformed endpoint")
	}
	_ = s.Close()
}

// Several ranks, each on its own port with its own seq counter; the SUB
// matches the topic by prefix and a non-matching subscription gets nothing.
func TestSubscriberRanksAndTopicPrefix(t *testing.T) {
	for _, engine := range []string{enginepeer.VLLM, enginepeer.SGLang, enginepeer.TokenSpeed} {
		t.Run(engine, func(t *testing.T) {
			p := enginepeer.Start(t, enginepeer.Options{Engine: engine, DPSize: 2, Topic: "kv@model-a", NoReplay: true})
			other := newTestSubscriber(t, p.PubEndpoint(0), "kv@model-b", 0)
			subs := []*Subscriber{
				newTestSubscriber(t, p.PubEndpoint(0), "kv@", 0),
				newTestSubscriber(t, p.PubEndpoint(1), "", 0),
			}
			for rank, s := range subs {
				first := attach(t, p, rank, s)
				var got []uint64
				for i := 0; i < 3; i++ {
					pub, err := p.Publish(rank, enginepeer.Removed(enginepeer.U64(uint64(i))))
					if err != nil {
						t.Fatal(err)
					}
					m, ok := recvWithin(t, s, 5*time.Second)
					if !ok {
						t.Fatalf("rank %d: message %d not received", rank, pub.Seq)
					}
					if string(m.Topic) != "kv@model-a" {
						t.Errorf("rank %d: topic %q", rank, m.Topic)
					}
					if len(m.Payload) == 0 || m.Payload[0] != 0x93 {
						t.Errorf("rank %d: payload %x is not a 3-element msgpack batch", rank, m.Payload)
					}
					got = append(got, m.Seq)
					if m.Seq != pub.Seq {
						t.Errorf("rank %d: got seq %d, published %d", rank, m.Seq, pub.Seq)
					}
				}
				if got[0] != first.Seq+1 || got[2] != got[0]+2 {
					t.Errorf("rank %d: seqs %v after probe %d are not consecutive", rank, got, first.Seq)
				}
			}
			if st := other.Stats(); st.Received != 0 {
				t.Errorf("non-matching subscription received %d messages", st.Received)
			}
			for _, s := range subs {
				if st := s.Stats(); st.Short != 0 || st.Dropped != 0 {
					t.Errorf("unexpected counters %+v", st)
				}
			}
		})
	}
}

func TestSubscriberSkipsMalformedMessages(t *testing.T) {
	p := enginepeer.Start(t, enginepeer.Options{Engine: enginepeer.VLLM, NoReplay: true})
	s := newTestSubscriber(t, p.PubEndpoint(0), "", 0)
	attach(t, p, 0, s)
	seq8 := make([]byte, 8)
	malformed := [][][]byte{
		{{}, seq8},                    // 2 frames
		{{}},                          // 1 frame
		{{}, {}, {0x93}},              // empty seq frame
		{{}, make([]byte, 9), {0x93}}, // fine: 9 zero bytes still fit
		{{}, {1, 0, 0, 0, 0, 0, 0, 0, 0}, {0x93}}, // 9 bytes overflowing
	}
	for _, frames := range malformed {
		if err := p.SendRaw(0, frames...); err != nil {
			t.Fatal(err)
		}
	}
	pub, err := p.Publish(0, probe())
	if err != nil {
		t.Fatal(err)
	}
	got := drainQueued(t, s, time.Second)
	if len(got) != 2 || got[0].Seq != 0 || got[1].Seq != pub.Seq {
		t.Fatalf("received %+v; want the 9-byte seq 0 message then seq %d", got, pub.Seq)
	}
	if st := s.Stats(); st.Short != 2 || st.BadSequence != 2 {
		t.Errorf("Short = %d, BadSequence = %d, want 2 and 2 (stats %+v)", st.Short, st.BadSequence, st)
	}
}

func TestSubscriberStartsBeforeEngine(t *testing.T) {
	port := freePort(t)
	s := newTestSubscriber(t, fmt.Sprintf("tcp://127.0.0.1:%d", port), "", 0)
	time.Sleep(300 * time.Millisecond) // several failed dials
	if s.Connected() {
		t.Fatal("connected before the engine exists")
	}
	p := enginepeer.Start(t, enginepeer.Options{
		Engine:   enginepeer.VLLM,
		Endpoint: fmt.Sprintf("tcp://*:%d", port),
		NoReplay: true,
	})
	m := attach(t, p, 0, s)
	if st := s.Stats(); st.Reconnects != 0 || st.Received < 1 {
		t.Errorf("stats %+v after the first connection", st)
	}
	t.Logf("first message seq %d", m.Seq)
}

func TestSubscriberFollowsEngineRestart(t *testing.T) {
	p := enginepeer.Start(t, enginepeer.Options{Engine: enginepeer.SGLang, NoReplay: true})
	s := newTestSubscriber(t, p.PubEndpoint(0), "", 0)
	attach(t, p, 0, s)
	// Well ahead of the new incarnation: after the restart, attach publishes
	// a probe every 100 ms until one arrives, and a loaded machine can lose
	// several to the slow joiner before the SUB's subscription lands.
	var published uint64
	for i := 0; i < 20; i++ {
		pub, err := p.Publish(0, probe())
		if err != nil {
			t.Fatal(err)
		}
		published = pub.Seq
	}
	// Read up to the last one published: on a loaded machine they can
	// arrive far apart, so wait for it rather than for a quiet spell.
	var last uint64
	for last < published {
		m, ok := recvWithin(t, s, 30*time.Second)
		if !ok {
			t.Fatalf("the batches up to seq %d did not arrive (last %d)", published, last)
		}
		last = m.Seq
	}
	if last < 5 {
		t.Fatalf("last seq before restart %d, want >= 5", last)
	}
	if err := p.Restart(0); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "a second connection", 10*time.Second, func() bool { return s.Stats().Reconnects >= 1 })
	m := attach(t, p, 0, s)
	if m.Seq >= last {
		t.Errorf("after restart got seq %d, want a new incarnation below %d", m.Seq, last)
	}
	if !s.Connected() {
		t.Error("not connected after receiving")
	}
}

func TestSubscriberDropsWhenQueueFull(t *testing.T) {
	const hwm = 10
	p := enginepeer.Start(t, enginepeer.Options{Engine: enginepeer.TokenSpeed, NoReplay: true})
	s := newTestSubscriber(t, p.PubEndpoint(0), "", hwm)
	// Attach without consuming: watch the counter instead of calling Recv.
	waitFor(t, "connection", 10*time.Second, s.Connected)
	waitFor(t, "a probe", 10*time.Second, func() bool {
		if _, err := p.Publish(0, probe()); err != nil {
			t.Fatal(err)
		}
		time.Sleep(50 * time.Millisecond)
		return s.Stats().Received > 0
	})
	base := s.Stats().Received
	first, last, err := p.PublishMany(0, 50, 0)
	if err != nil {
		t.Fatal(err)
	}
	waitFor(t, "all 50 read off the socket", 10*time.Second, func() bool { return s.Stats().Received == base+50 })
	st := s.Stats()
	if st.Dropped != st.Received-hwm {
		t.Fatalf("Dropped = %d, want %d (stats %+v)", st.Dropped, st.Received-hwm, st)
	}
	got := drainQueued(t, s, 200*time.Millisecond)
	if len(got) != hwm {
		t.Fatalf("queued %d messages, want %d", len(got), hwm)
	}
	// The oldest messages stay; the newest were dropped and show as a gap.
	for i := 1; i < len(got); i++ {
		if got[i].Seq != got[i-1].Seq+1 {
			t.Fatalf("queued seqs not consecutive: %d then %d", got[i-1].Seq, got[i].Seq)
		}
	}
	if got[len(got)-1].Seq >= last {
		t.Errorf("queue kept seq %d, but burst %d..%d should have overflowed it", got[len(got)-1].Seq, first, last)
	}
}

// A burst the subscriber can absorb (engine hwm 100000, queue 100000) must
// arrive complete and in order. Throughput is logged, not asserted.
func TestSubscriberBurstNoLoss(t *testing.T) {
	if testing.Short() {
		t.Skip("burst test skipped in -short mode")
	}
	const n = 20_000
	p := enginepeer.Start(t, enginepeer.Options{Engine: enginepeer.VLLM, NoReplay: true})
	s := newTestSubscriber(t, p.PubEndpoint(0), "", 0)
	attach(t, p, 0, s)

	start := time.Now()
	type result struct {
		first, last uint64
		err         error
	}
	published := make(chan result, 1)
	go func() {
		f, l, err := p.PublishMany(0, n, 0, probe())
		published <- result{f, l, err}
	}()
	var seqs []uint64
	for len(seqs) < n {
		m, ok := recvWithin(t, s, 10*time.Second)
		if !ok {
			break
		}
		seqs = append(seqs, m.Seq)
	}
	elapsed := time.Since(start)
	r := <-published
	if r.err != nil {
		t.Fatal(r.err)
	}
	lost := n - len(seqs)
	t.Logf("burst of %d: received %d, lost %d, %.0f msg/s end to end, stats %+v",
		n, len(seqs), lost, float64(len(seqs))/elapsed.Seconds(), s.Stats())
	if lost != 0 {
		t.Fatalf("lost %d of %d messages", lost, n)
	}
	for i, seq := range seqs {
		if seq != r.first+uint64(i) {
			t.Fatalf("message %d has seq %d, want %d", i, seq, r.first+uint64(i))
		}
	}
}

// BenchmarkSubscriberThroughput measures messages per second from a pyzmq
// PUB through the Subscriber to Recv, with and without the read buffer. The
// Python publisher may be the bottleneck; compare the two variants. Use a
// fixed count, e.g. -benchtime=100000x.
func BenchmarkSubscriberThroughput(b *testing.B) {
	for _, variant := range []struct {
		name string
		raw  bool
	}{{"buffered", false}, {"stock", true}} {
		b.Run(variant.name, func(b *testing.B) {
			p := enginepeer.Start(b, enginepeer.Options{Engine: enginepeer.VLLM, NoReplay: true, Timeout: 5 * time.Minute})
			s := NewSubscriber(SubscriberOptions{
				Endpoint:          p.PubEndpoint(0),
				Logger:            quietLogger(),
				MinBackoff:        20 * time.Millisecond,
				DisableReadBuffer: variant.raw,
			})
			defer s.Close()
			attach(b, p, 0, s)
			b.ResetTimer()
			done := make(chan error, 1)
			go func() {
				_, _, err := p.PublishMany(0, b.N, 0, probe())
				done <- err
			}()
			got := 0
			for got < b.N {
				if _, ok := recvWithin(b, s, 10*time.Second); !ok {
					break
				}
				got++
			}
			b.StopTimer()
			if err := <-done; err != nil {
				b.Fatal(err)
			}
			b.ReportMetric(float64(got)/b.Elapsed().Seconds(), "msgs/s")
			b.ReportMetric(float64(b.N-got), "lost")
		})
	}
}

// TestSubscriberDirectWait covers the consumer that waits in its own select
// (the relay's rank loop): Ready and TryRecv deliver every message in order
// without Recv, and ConnChanged is signalled when the connection comes up
// and when an engine restart takes it down.
func TestSubscriberDirectWait(t *testing.T) {
	p := enginepeer.Start(t, enginepeer.Options{Engine: enginepeer.SGLang, NoReplay: true})
	s := newTestSubscriber(t, p.PubEndpoint(0), "", 0)
	// connChange waits for one signal and reports the state after it.
	connChange := func(what string) bool {
		t.Helper()
		select {
		case <-s.ConnChanged():
			return s.Connected()
		case <-time.After(20 * time.Second):
			t.Fatalf("no ConnChanged signal %s (connected=%v)", what, s.Connected())
			return false
		}
	}
	for !connChange("for the first connection") {
	}
	first := attach(t, p, 0, s)
	var published uint64
	for i := 0; i < 5; i++ {
		pub, err := p.Publish(0, probe())
		if err != nil {
			t.Fatal(err)
		}
		published = pub.Seq
	}
	want := first.Seq + 1
	deadline := time.After(30 * time.Second)
	for want <= published {
		select {
		case <-s.Ready():
		case <-deadline:
			t.Fatalf("Ready: batches up to %d did not arrive (next wanted %d, stats %+v)", published, want, s.Stats())
		}
		for {
			m, ok := s.TryRecv()
			if !ok {
				break
			}
			if m.Seq != want {
				t.Fatalf("TryRecv seq %d, want %d", m.Seq, want)
			}
			want++
		}
	}
	if m, ok := s.TryRecv(); ok {
		t.Fatalf("TryRecv on an empty queue returned seq %d", m.Seq)
	}

	// The restart closes the connection: a signal with Connected false
	// (the redial may already be done when it is read, then Connected is
	// true again and the reconnect count says what happened).
	if err := p.Restart(0); err != nil {
		t.Fatal(err)
	}
	for connChange("after the engine restarted") && s.Stats().Reconnects == 0 {
	}
	waitFor(t, "the connection back", 10*time.Second, s.Connected)

	if _, err := p.Publish(0, probe()); err != nil {
		t.Fatal(err)
	}
	_ = s.Close()
	if m, ok := s.TryRecv(); ok {
		t.Fatalf("TryRecv after Close returned seq %d", m.Seq)
	}
}
