package zmqsource

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/kvrelay/kvrelay/testkit/enginepeer"
)

func seqBytes(v uint64) []byte {
	b := make([]byte, 8)
	for i := 7; i >= 0; i-- {
		b[i] = byte(v)
		v >>= 8
	}
	return b
}

func TestParseReply(t *testing.T) {
	tests := []struct {
		name    string
		frames  [][]byte
		want    Message
		end     bool
		wantErr bool
	}{
		{"sglang 3 frames", [][]byte{{}, seqBytes(7), {0x93}}, Message{Seq: 7, Payload: []byte{0x93}}, false, false},
		{"vllm 4 frames", [][]byte{{}, []byte("kv"), seqBytes(7), {0x93}}, Message{Seq: 7, Topic: []byte("kv"), Payload: []byte{0x93}}, false, false},
		{"sglang end", [][]byte{{}, endSeq, {}}, Message{}, true, false},
		{"vllm end", [][]byte{{}, {}, endSeq, {}}, Message{}, true, false},
		{"end marker with a payload", [][]byte{{}, endSeq, {1}}, Message{}, true, false},
		{"empty last frame ends", [][]byte{{}, seqBytes(3), {}}, Message{}, true, false},
		{"2 frames", [][]byte{{}, seqBytes(1)}, Message{}, false, true},
		{"5 frames", [][]byte{{}, {}, {}, seqBytes(1), {1}}, Message{}, false, true},
		{"no delimiter", [][]byte{{1}, seqBytes(1), {1}}, Message{}, false, true},
		{"short seq", [][]byte{{}, {1, 2}, {1}}, Message{}, false, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, end, err := parseReply(tt.frames)
			if (err != nil) != tt.wantErr || end != tt.end {
				t.Fatalf("parseReply = %+v, %v, %v; want end=%v err=%v", got, end, err, tt.end, tt.wantErr)
			}
			if got.Seq != tt.want.Seq || !bytes.Equal(got.Topic, tt.want.Topic) || !bytes.Equal(got.Payload, tt.want.Payload) {
				t.Errorf("parseReply = %+v, want %+v", got, tt.want)
			}
		})
	}
}

func FuzzParseReply(f *testing.F) {
	f.Add([]byte{}, []byte("kv"), seqBytes(1), []byte{0x93}, uint8(4))
	f.Add([]byte{}, seqBytes(1), []byte{0x93}, []byte{}, uint8(3))
	f.Add([]byte{}, endSeq, []byte{}, []byte{}, uint8(3))
	f.Fuzz(func(t *testing.T, a, b, c, d []byte, n uint8) {
		frames := [][]byte{a, b, c, d}[:int(n)%5]
		m, end, err := parseReply(frames)
		if err != nil && end {
			t.Fatal("both an error and the end marker")
		}
		if err == nil && !end && len(m.Payload) == 0 {
			t.Fatal("a data reply without payload")
		}
	})
}

func publishN(t *testing.T, p *enginepeer.Peer, rank, n int) []uint64 {
	t.Helper()
	var seqs []uint64
	for i := 0; i < n; i++ {
		pub, err := p.Publish(rank, enginepeer.Stored(nil, []int64{int64(i), 2, 3, 4}, enginepeer.U64(uint64(1000+i))))
		if err != nil {
			t.Fatal(err)
		}
		seqs = append(seqs, pub.Seq)
	}
	return seqs
}

func seqsOf(msgs []Message) []uint64 {
	out := make([]uint64, len(msgs))
	for i, m := range msgs {
		out[i] = m.Seq
	}
	return out
}

func equalSeqs(a, b []uint64) bool {
	return fmt.Sprint(a) == fmt.Sprint(b)
}

func span(from, to uint64) []uint64 {
	var out []uint64
	for s := from; s <= to; s++ {
		out = append(out, s)
	}
	return out
}

// Replay against the real engine framings: vLLM's 4-frame replies with the
// topic, SGLang's and TokenSpeed's 3-frame replies, and their end markers.
func TestReplayFramings(t *testing.T) {
	for _, engine := range []string{enginepeer.VLLM, enginepeer.SGLang, enginepeer.TokenSpeed} {
		t.Run(engine, func(t *testing.T) {
			p := enginepeer.Start(t, enginepeer.Options{Engine: engine, DPSize: 2, Topic: "kv", BufferSteps: 5})
			publishN(t, p, 1, 8) // rank 1 only: rank 0 keeps what it has
			st, err := p.Status()
			if err != nil {
				t.Fatal(err)
			}
			last := st[1].NextSeq - 1
			r := &Replayer{Endpoint: p.ReplayEndpoint(1), PerReply: 2 * time.Second, Logger: quietLogger()}

			tests := []struct {
				name string
				from uint64
				want []uint64
			}{
				{"tail", last - 1, span(last-1, last)},
				{"older than the ring starts at its oldest", 0, span(last-4, last)},
				{"newer than everything: end marker only", last + 10, nil},
			}
			for _, tt := range tests {
				msgs, complete, err := r.Replay(context.Background(), tt.from)
				if err != nil || !complete {
					t.Fatalf("%s: Replay(%d) = complete %v, err %v", tt.name, tt.from, complete, err)
				}
				if !equalSeqs(seqsOf(msgs), tt.want) {
					t.Errorf("%s: seqs %v, want %v", tt.name, seqsOf(msgs), tt.want)
				}
				for _, m := range msgs {
					if len(m.Payload) == 0 || m.Payload[0] != 0x93 {
						t.Errorf("%s: payload %x", tt.name, m.Payload)
					}
					wantTopic := ""
					if engine == enginepeer.VLLM {
						wantTopic = "kv" // only vLLM's replies carry it
					}
					if string(m.Topic) != wantTopic {
						t.Errorf("%s: topic %q, want %q", tt.name, m.Topic, wantTopic)
					}
				}
			}

			// Rank 0's ring: empty for vLLM and TokenSpeed, SGLang's startup clear.
			msgs, complete, err := (&Replayer{Endpoint: p.ReplayEndpoint(0), Logger: quietLogger()}).Replay(context.Background(), 0)
			if err != nil || !complete {
				t.Fatalf("rank 0: complete %v, err %v", complete, err)
			}
			wantRank0 := 0
			if engine == enginepeer.SGLang {
				wantRank0 = 1
			}
			if len(msgs) != wantRank0 {
				t.Errorf("rank 0 replayed %v, want %d batches", seqsOf(msgs), wantRank0)
			}
		})
	}
}

// Replayed payloads are the bytes that went out live, including a batch the
// live stream dropped (the gap a relay fills).
func TestReplayMatchesLiveAndFillsDrop(t *testing.T) {
	p := enginepeer.Start(t, enginepeer.Options{Engine: enginepeer.VLLM})
	s := newTestSubscriber(t, p.PubEndpoint(0), "", 0)
	first := attach(t, p, 0, s)
	publishN(t, p, 0, 2)
	if err := p.DropNext(0, 1); err != nil {
		t.Fatal(err)
	}
	dropped, err := p.Publish(0, probe())
	if err != nil {
		t.Fatal(err)
	}
	if dropped.Live || !dropped.Buffered {
		t.Fatalf("drop_next publish = %+v", dropped)
	}
	if err := p.BurnNext(0, 1); err != nil {
		t.Fatal(err)
	}
	burned, err := p.Publish(0, probe())
	if err != nil {
		t.Fatal(err)
	}
	publishN(t, p, 0, 1)
	live := append([]Message{first}, drainQueued(t, s, 500*time.Millisecond)...)
	liveBySeq := map[uint64][]byte{}
	for _, m := range live {
		liveBySeq[m.Seq] = m.Payload
	}
	if _, ok := liveBySeq[dropped.Seq]; ok {
		t.Fatalf("dropped seq %d arrived live", dropped.Seq)
	}

	msgs, complete, err := (&Replayer{Endpoint: p.ReplayEndpoint(0), Logger: quietLogger()}).Replay(context.Background(), first.Seq)
	if err != nil || !complete {
		t.Fatalf("Replay: complete %v, err %v", complete, err)
	}
	var replayed []uint64
	for _, m := range msgs {
		replayed = append(replayed, m.Seq)
		if want, ok := liveBySeq[m.Seq]; ok && !bytes.Equal(want, m.Payload) {
			t.Errorf("seq %d: replayed payload differs from live", m.Seq)
		}
	}
	want := []uint64{}
	for seq := first.Seq; seq <= burned.Seq+1; seq++ {
		if seq != burned.Seq {
			want = append(want, seq)
		}
	}
	if !equalSeqs(replayed, want) {
		t.Errorf("replayed %v, want %v (seq %d burned, %d dropped live)", replayed, want, burned.Seq, dropped.Seq)
	}
}

// ReplayUpTo stops after n replies, complete, whatever follows; the ROUTER
// serves the next request whole after the DEALERs that left early.
func TestReplayUpTo(t *testing.T) {
	for _, engine := range []string{enginepeer.VLLM, enginepeer.SGLang, enginepeer.TokenSpeed} {
		t.Run(engine, func(t *testing.T) {
			p := enginepeer.Start(t, enginepeer.Options{Engine: engine, StartupClear: "none", BufferSteps: 50})
			seqs := publishN(t, p, 0, 8)
			first, last := seqs[0], seqs[len(seqs)-1]
			r := &Replayer{Endpoint: p.ReplayEndpoint(0), PerReply: 2 * time.Second, Logger: quietLogger()}
			tests := []struct {
				name string
				from uint64
				n    int
				want []uint64
			}{
				{"the head alone", first + 3, 1, span(first+3, first+3)},
				{"three", first + 3, 3, span(first+3, first+5)},
				{"fewer than n: up to the end marker", last - 1, 5, span(last-1, last)},
				{"newer than everything: end marker only", last + 10, 1, nil},
			}
			for _, tt := range tests {
				msgs, complete, err := r.ReplayUpTo(context.Background(), tt.from, tt.n)
				if err != nil || !complete || !equalSeqs(seqsOf(msgs), tt.want) {
					t.Fatalf("%s: ReplayUpTo(%d, %d) = %v, complete %v, err %v; want %v, complete",
						tt.name, tt.from, tt.n, seqsOf(msgs), complete, err, tt.want)
				}
			}
			if _, _, err := r.ReplayUpTo(context.Background(), first, 0); err == nil {
				t.Error("ReplayUpTo(0 replies) did not fail")
			}
			msgs, complete, err := r.Replay(context.Background(), first)
			if err != nil || !complete || !equalSeqs(seqsOf(msgs), seqs) {
				t.Fatalf("the whole ring after the early leavers: %v, complete %v, err %v; want %v", seqsOf(msgs), complete, err, seqs)
			}
		})
	}
	// SGLang drops replies past its ROUTER's HWM, the end marker with them:
	// the head is still a complete answer.
	t.Run("an answer cut short after the head", func(t *testing.T) {
		p := enginepeer.Start(t, enginepeer.Options{Engine: enginepeer.SGLang, StartupClear: "none"})
		publishN(t, p, 0, 6)
		if err := p.TruncateReplay(0, 2); err != nil {
			t.Fatal(err)
		}
		r := &Replayer{Endpoint: p.ReplayEndpoint(0), PerReply: time.Minute, Logger: quietLogger()}
		msgs, complete, err := r.ReplayUpTo(context.Background(), 1, 1)
		if err != nil || !complete || !equalSeqs(seqsOf(msgs), []uint64{1}) {
			t.Fatalf("%v, complete %v, err %v; want [1], complete", seqsOf(msgs), complete, err)
		}
	})
}

func TestReplayIncomplete(t *testing.T) {
	p := enginepeer.Start(t, enginepeer.Options{Engine: enginepeer.SGLang, StartupClear: "none"})
	publishN(t, p, 0, 6)
	r := &Replayer{Endpoint: p.ReplayEndpoint(0), PerReply: 300 * time.Millisecond, Logger: quietLogger()}

	t.Run("truncated without end marker", func(t *testing.T) {
		if err := p.TruncateReplay(0, 2); err != nil {
			t.Fatal(err)
		}
		defer func() { _ = p.TruncateReplay(0, -1) }()
		msgs, complete, err := r.Replay(context.Background(), 1)
		if err != nil || complete {
			t.Fatalf("complete %v, err %v; want an incomplete replay and no error", complete, err)
		}
		if !equalSeqs(seqsOf(msgs), []uint64{1, 2}) {
			t.Errorf("seqs %v, want [1 2]", seqsOf(msgs))
		}
	})

	t.Run("engine not answering", func(t *testing.T) {
		if err := p.PauseReplay(0); err != nil {
			t.Fatal(err)
		}
		msgs, complete, err := r.Replay(context.Background(), 0)
		if err != nil || complete || len(msgs) != 0 {
			t.Fatalf("got %d msgs, complete %v, err %v; want nothing and no error", len(msgs), complete, err)
		}
		if err := p.ResumeReplay(0); err != nil {
			t.Fatal(err)
		}
		// The ROUTER works again; the stale request's answer went nowhere.
		msgs, complete, err = r.Replay(context.Background(), 4)
		if err != nil || !complete || !equalSeqs(seqsOf(msgs), []uint64{4, 5}) {
			t.Fatalf("after resume: %v, complete %v, err %v", seqsOf(msgs), complete, err)
		}
	})

	t.Run("context cancelled", func(t *testing.T) {
		if err := p.PauseReplay(0); err != nil {
			t.Fatal(err)
		}
		defer func() { _ = p.ResumeReplay(0) }()
		ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
		defer cancel()
		slow := &Replayer{Endpoint: p.ReplayEndpoint(0), PerReply: time.Minute, Logger: quietLogger()}
		if _, _, err := slow.Replay(ctx, 0); !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("err %v, want deadline exceeded", err)
		}
	})
}

func TestReplayAbsentRouter(t *testing.T) {
	r := &Replayer{Endpoint: fmt.Sprintf("tcp://127.0.0.1:%d", freePort(t)), PerReply: 500 * time.Millisecond, Logger: quietLogger()}
	msgs, complete, err := r.Replay(context.Background(), 0)
	if err == nil || complete || msgs != nil {
		t.Fatalf("got %d msgs, complete %v, err %v; want a connection error", len(msgs), complete, err)
	}
	t.Log(err)
}

// A TCP server that accepts but never speaks ZMTP must not hang the dial.
func TestReplaySilentServer(t *testing.T) {
	l, _ := silentListener(t)
	r := &Replayer{Endpoint: "tcp://" + l, PerReply: 200 * time.Millisecond, Logger: quietLogger()}
	msgs, complete, err := r.Replay(context.Background(), 0)
	if err == nil || complete || msgs != nil {
		t.Fatalf("got %d msgs, complete %v, err %v; want a timeout error", len(msgs), complete, err)
	}
	t.Log(err)
}

func TestReplayBadEndpoint(t *testing.T) {
	if _, _, err := (&Replayer{Endpoint: "nonsense"}).Replay(context.Background(), 0); err == nil {
		t.Fatal("no error for an endpoint without scheme")
	}
}

// A replay longer than the ROUTER's default send HWM (1000). libzmq's
// ROUTER drops silently when the DEALER falls behind, in the middle of the
// stream and not only at its end, and the end marker can still arrive: the
// Replayer reports exactly what came, in order, and the relay must check
// contiguity. Measured: 100-300 of 5000 lost under -race.
func TestReplayLong(t *testing.T) {
	const n = 5000
	p := enginepeer.Start(t, enginepeer.Options{Engine: enginepeer.VLLM, BufferSteps: n})
	if _, _, err := p.PublishMany(0, n, 0, probe()); err != nil {
		t.Fatal(err)
	}
	r := &Replayer{Endpoint: p.ReplayEndpoint(0), PerReply: time.Second, Logger: quietLogger()}
	msgs, complete, err := r.Replay(context.Background(), 0)
	if err != nil {
		t.Fatal(err)
	}
	holes := 0
	for i, m := range msgs {
		if i > 0 && m.Seq <= msgs[i-1].Seq {
			t.Fatalf("reply %d has seq %d after %d: out of order", i, m.Seq, msgs[i-1].Seq)
		}
		if i > 0 && m.Seq != msgs[i-1].Seq+1 {
			holes++
		}
		if m.Seq >= n {
			t.Fatalf("reply seq %d was never published", m.Seq)
		}
	}
	if len(msgs) == 0 || msgs[0].Seq != 0 {
		t.Fatalf("replay did not start at 0: %d replies", len(msgs))
	}
	t.Logf("replay of %d: received %d in %d runs, complete %v", n, len(msgs), holes+1, complete)
}
