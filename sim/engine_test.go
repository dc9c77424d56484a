package sim

import (
	"bytes"
	"context"
	"encoding/binary"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/kvrelay/kvrelay/internal/freeport"
	"github.com/kvrelay/kvrelay/sim/prefixcache"
)

// TestReplayReproducesLiveSet is the end-to-end exactness check for every
// engine and wire generation: a consumer that decodes every batch the
// simulator buffered (through a real DEALER on the replay ROUTER) and counts
// copies holds exactly the simulator's true live set, on every rank.
func TestReplayReproducesLiveSet(t *testing.T) {
	for _, engine := range []string{"vllm", "sglang", "tokenspeed"} {
		for _, gen := range WireGenerations(engine) {
			t.Run(engine+"/"+gen, func(t *testing.T) {
				opts := Options{Engine: engine, Wire: gen, DPSize: 2, CapacityBlocks: 12}
				e := startSim(t, opts, `, "topic": "kv"`)
				if e.WireGeneration() != gen {
					t.Fatalf("wire %s", e.WireGeneration())
				}
				if _, err := e.RunWorkload(60); err != nil {
					t.Fatal(err)
				}
				live := e.LiveSet()
				for _, ep := range e.Endpoints() {
					seqs, payloads, ended := replayFrom(t, ep.Replay, 0, engine == "vllm", "kv")
					if !ended {
						t.Fatalf("rank %d: no end marker", ep.Rank)
					}
					if uint64(len(seqs)) != live[ep.Rank].NextSeq {
						t.Fatalf("rank %d: replayed %d batches, next seq %d", ep.Rank, len(seqs), live[ep.Rank].NextSeq)
					}
					m := map[prefixcache.LiveKey]int{}
					for i, p := range payloads {
						if seqs[i] != uint64(i) {
							t.Fatalf("rank %d: reply %d has seq %d", ep.Rank, i, seqs[i])
						}
						rank, evs := decodeBatch(t, p, e.Medium(prefixcache.Host))
						if rank != ep.Rank && !(rank == -1 && strings.HasSuffix(gen, "6")) {
							t.Fatalf("batch rank %d on rank %d's stream", rank, ep.Rank)
						}
						if i == 0 && engine == "sglang" {
							if diff := cmp.Diff([]prefixcache.Event{prefixcache.AllBlocksCleared{}}, evs); diff != "" {
								t.Fatalf("SGLang's first batch is not the startup clear:\n%s", diff)
							}
						}
						if len(evs) == 0 {
							t.Fatalf("empty batch at seq %d", i)
						}
						liveModel(t, m, evs)
					}
					want := liveMap(live[ep.Rank].Blocks)
					if len(want) == 0 {
						t.Fatalf("rank %d holds nothing: the workload did not reach it", ep.Rank)
					}
					if diff := cmp.Diff(want, m); diff != "" {
						t.Fatalf("rank %d: replayed state differs from the live set (-live +replayed):\n%s", ep.Rank, diff)
					}
				}
			})
		}
	}
}

// TestLiveFraming checks the live PUB: three frames (topic, 8-byte
// big-endian seq, payload), contiguous sequences per rank, each rank on its
// own offset port, and the same payloads replay serves.
func TestLiveFraming(t *testing.T) {
	e := startSim(t, Options{Engine: "vllm", DPSize: 2}, `, "topic": "kv@sim"`)
	eps := e.Endpoints()
	if eps[1].Live == eps[0].Live || !strings.HasPrefix(eps[0].Live, "tcp://127.0.0.1:") {
		t.Fatalf("endpoints %+v", eps)
	}
	sub := dialSub(t, eps[1].Live)
	// A SUB only hears what is published after its subscription lands, so
	// publish until the first batch arrives.
	var first uint64
	got := map[uint64][]byte{}
	deadline := time.Now().Add(5 * time.Second)
	for len(got) == 0 {
		if time.Now().After(deadline) {
			t.Fatal("no live batch on rank 1")
		}
		if _, err := e.Step(Request{Rank: 1, Tokens: toks(uint32(len(got)*100+int(time.Now().UnixNano()%1000)), 8)}); err != nil {
			t.Fatal(err)
		}
		if m, ok := sub.next(t, 100*time.Millisecond); ok {
			first = checkLiveMsg(t, m, "kv@sim")
			got[first] = m.Frames[2]
		}
	}
	for i := 0; i < 5; i++ {
		if _, err := e.Step(Request{Rank: 1, Tokens: toks(uint32(1000+10*i), 8)}); err != nil {
			t.Fatal(err)
		}
		m, ok := sub.next(t, 2*time.Second)
		if !ok {
			t.Fatalf("live batch %d missing", i)
		}
		seq := checkLiveMsg(t, m, "kv@sim")
		if seq != first+uint64(i)+1 {
			t.Fatalf("seq %d after %d", seq, first+uint64(i))
		}
		got[seq] = m.Frames[2]
	}
	seqs, payloads, ended := replayFrom(t, eps[1].Replay, first, true, "kv@sim")
	if !ended || len(seqs) != 6 {
		t.Fatalf("replay from %d: %d replies, ended %v", first, len(seqs), ended)
	}
	for i, s := range seqs {
		if !bytes.Equal(got[s], payloads[i]) {
			t.Fatalf("seq %d: replay payload differs from live", s)
		}
	}
	if ls := e.LiveSet(); ls[0].NextSeq != 0 {
		t.Fatalf("rank 0 published %d batches without requests", ls[0].NextSeq)
	}
}

func checkLiveMsg(t *testing.T, m zmqMsg, topic string) uint64 {
	t.Helper()
	if len(m.Frames) != 3 {
		t.Fatalf("live message has %d frames", len(m.Frames))
	}
	if string(m.Frames[0]) != topic {
		t.Fatalf("topic frame %q", m.Frames[0])
	}
	if len(m.Frames[1]) != 8 {
		t.Fatalf("seq frame %x", m.Frames[1])
	}
	return binary.BigEndian.Uint64(m.Frames[1])
}

func TestDropEveryKeepsReplay(t *testing.T) {
	e := startSim(t, Options{Engine: "tokenspeed", DropEvery: 3}, "")
	sub := dialSub(t, e.Endpoints()[0].Live)
	// Wait for the subscription with batches, then count from a known seq.
	deadline := time.Now().Add(5 * time.Second)
	var seen []uint64
	for i := 0; len(seen) == 0; i++ {
		if time.Now().After(deadline) {
			t.Fatal("no live batch")
		}
		e.Step(Request{Tokens: toks(uint32(10000+4*i), 4)})
		if m, ok := sub.next(t, 100*time.Millisecond); ok {
			seen = append(seen, checkLiveMsg(t, m, ""))
		}
	}
	for i := 0; i < 9; i++ {
		e.Step(Request{Tokens: toks(uint32(20000+4*i), 4)})
	}
	next := e.LiveSet()[0].NextSeq
	for {
		m, ok := sub.next(t, 500*time.Millisecond)
		if !ok {
			break
		}
		seen = append(seen, checkLiveMsg(t, m, ""))
	}
	// Batch k (counted from 1) is dropped when k%3 == 0, i.e. seq%3 == 2.
	var want []uint64
	for s := seen[0]; s < next; s++ {
		if s%3 != 2 {
			want = append(want, s)
		}
	}
	if diff := cmp.Diff(want, seen); diff != "" {
		t.Fatalf("live seqs (-want +got):\n%s", diff)
	}
	seqs, _, ended := replayFrom(t, e.Endpoints()[0].Replay, seen[0], false, "")
	if !ended || len(seqs) != int(next-seen[0]) {
		t.Fatalf("replay returned %d of %d", len(seqs), next-seen[0])
	}
	if st := e.PublisherStats()[0]; st.Dropped == 0 || st.Replays != 1 {
		t.Fatalf("stats %+v", st)
	}
	// Turning the knob off stops the drops.
	if err := e.Fault(Fault{Kind: FaultDropEvery, N: 0}); err != nil {
		t.Fatal(err)
	}
	before := e.PublisherStats()[0].Dropped
	for i := 0; i < 6; i++ {
		e.Step(Request{Tokens: toks(uint32(30000+4*i), 4)})
	}
	if after := e.PublisherStats()[0].Dropped; after != before {
		t.Fatalf("dropped %d more after drop_every 0", after-before)
	}
}

func TestRestart(t *testing.T) {
	for _, engine := range []string{"vllm", "sglang"} {
		t.Run(engine, func(t *testing.T) {
			e := startSim(t, Options{Engine: engine, DPSize: 2}, "")
			if _, err := e.RunWorkload(20); err != nil {
				t.Fatal(err)
			}
			rank1 := 1
			if err := e.Fault(Fault{Kind: FaultRestart, Rank: &rank1}); err != nil {
				t.Fatal(err)
			}
			ls := e.LiveSet()
			if len(ls[0].Blocks) == 0 || ls[0].NextSeq == 0 {
				t.Fatal("rank 0 was restarted too")
			}
			if len(ls[1].Blocks) != 0 {
				t.Fatalf("rank 1 kept %d blocks across a restart", len(ls[1].Blocks))
			}
			wantNext := uint64(0)
			if engine == "sglang" {
				wantNext = 1 // the startup clear
			}
			if ls[1].NextSeq != wantNext {
				t.Fatalf("rank 1 next seq %d after restart, want %d", ls[1].NextSeq, wantNext)
			}
			// The new incarnation's ring holds only its own batches.
			e.Step(Request{Rank: 1, Tokens: toks(1, 8)})
			seqs, payloads, ended := replayFrom(t, e.Endpoints()[1].Replay, 0, engine == "vllm", "")
			if !ended || len(seqs) != int(wantNext)+1 || seqs[0] != 0 {
				t.Fatalf("replay after restart: seqs %v ended %v", seqs, ended)
			}
			m := map[prefixcache.LiveKey]int{}
			for _, p := range payloads {
				_, evs := decodeBatch(t, p, e.Medium(prefixcache.Host))
				liveModel(t, m, evs)
			}
			if diff := cmp.Diff(liveMap(e.LiveSet()[1].Blocks), m); diff != "" {
				t.Fatalf("after restart (-live +replayed):\n%s", diff)
			}
			// A subscriber can connect to the new sockets.
			sub := dialSub(t, e.Endpoints()[1].Live)
			deadline := time.Now().Add(5 * time.Second)
			for i := 0; ; i++ {
				if time.Now().After(deadline) {
					t.Fatal("no live batch after restart")
				}
				e.Step(Request{Rank: 1, Tokens: toks(uint32(500+4*i), 4)})
				if _, ok := sub.next(t, 100*time.Millisecond); ok {
					break
				}
			}
		})
	}
}

func TestPauseHoldsBatches(t *testing.T) {
	e := startSim(t, Options{Engine: "vllm"}, "")
	e.Step(Request{Tokens: toks(1, 8)})
	if err := e.Fault(Fault{Kind: FaultPause}); err != nil {
		t.Fatal(err)
	}
	e.Step(Request{Tokens: toks(100, 8)})
	e.Step(Request{Tokens: toks(200, 8)})
	if st := e.PublisherStats()[0]; st.NextSeq != 1 || st.Pending != 2 {
		t.Fatalf("paused: %+v", st)
	}
	seqs, _, ended := replayFrom(t, e.Endpoints()[0].Replay, 0, true, "")
	if !ended || len(seqs) != 1 {
		t.Fatalf("replay while paused: %v", seqs)
	}
	if err := e.Fault(Fault{Kind: FaultResume}); err != nil {
		t.Fatal(err)
	}
	if st := e.PublisherStats()[0]; st.NextSeq != 3 || st.Pending != 0 {
		t.Fatalf("resumed: %+v", st)
	}
	seqs, payloads, _ := replayFrom(t, e.Endpoints()[0].Replay, 0, true, "")
	m := map[prefixcache.LiveKey]int{}
	for _, p := range payloads {
		_, evs := decodeBatch(t, p, "CPU")
		liveModel(t, m, evs)
	}
	if len(seqs) != 3 || !cmp.Equal(liveMap(e.LiveSet()[0].Blocks), m) {
		t.Fatalf("after resume: seqs %v, state differs", seqs)
	}
}

func TestTruncateReplay(t *testing.T) {
	e := startSim(t, Options{Engine: "sglang"}, "")
	for i := 0; i < 4; i++ {
		e.Step(Request{Tokens: toks(uint32(100*i), 4)})
	}
	// 5 batches: the startup clear and 4 stores.
	tests := []struct {
		n        int
		wantSeqs int
		ended    bool
	}{
		{2, 2, false},
		{0, 0, false},
		{5, 5, false}, // the marker would be the 6th message
		{6, 5, true},
		{-1, 5, true},
	}
	for _, tc := range tests {
		if err := e.Fault(Fault{Kind: FaultTruncateReplay, N: tc.n}); err != nil {
			t.Fatal(err)
		}
		// Loopback replies arrive within milliseconds; a truncated stream
		// is recognised by silence.
		seqs, _, ended := replayWait(t, e.Endpoints()[0].Replay, 0, false, "", 300*time.Millisecond)
		if len(seqs) != tc.wantSeqs || ended != tc.ended {
			t.Errorf("truncate %d: %d replies, ended %v; want %d, %v", tc.n, len(seqs), ended, tc.wantSeqs, tc.ended)
		}
	}
}

func TestResetCache(t *testing.T) {
	for _, engine := range []string{"vllm", "sglang", "tokenspeed"} {
		t.Run(engine, func(t *testing.T) {
			e := startSim(t, Options{Engine: engine}, "")
			e.RunWorkload(8)
			if err := e.Fault(Fault{Kind: FaultResetCache}); err != nil {
				t.Fatal(err)
			}
			if n := len(e.LiveSet()[0].Blocks); n != 0 {
				t.Fatalf("%d blocks after reset", n)
			}
			_, payloads, _ := replayFrom(t, e.Endpoints()[0].Replay, 0, engine == "vllm", "")
			_, evs := decodeBatch(t, payloads[len(payloads)-1], "")
			_, cleared := evs[0].(prefixcache.AllBlocksCleared)
			if cleared != (engine != "tokenspeed") {
				t.Fatalf("last batch starts with %T", evs[0])
			}
		})
	}
}

func TestSecondCopiesOnVLLM(t *testing.T) {
	e := startSim(t, Options{Engine: "vllm"}, "")
	// Two requests of one step missing the same blocks: vLLM stores both.
	e.Step(Request{Tokens: toks(1, 8)}, Request{Tokens: toks(1, 8)})
	for _, b := range e.LiveSet()[0].Blocks {
		if b.Copies != 2 {
			t.Fatalf("block %d has %d copies, want 2", b.Hash, b.Copies)
		}
	}
	s := startSim(t, Options{Engine: "sglang"}, "")
	s.Step(Request{Tokens: toks(1, 8)}, Request{Tokens: toks(1, 8)})
	for _, b := range s.LiveSet()[0].Blocks {
		if b.Copies != 1 {
			t.Fatalf("sglang block %d has %d copies", b.Hash, b.Copies)
		}
	}
}

func TestDeterministicUnderSeed(t *testing.T) {
	run := func() []RankLive {
		e := startSim(t, Options{Engine: "sglang", DPSize: 2, HostCapacityBlocks: 8, CapacityBlocks: 16}, "")
		if _, err := e.RunWorkload(40); err != nil {
			t.Fatal(err)
		}
		ls := e.LiveSet()
		e.Close()
		return ls
	}
	a, b := run(), run()
	if !cmp.Equal(a, b) {
		t.Fatal("two runs under one seed differ")
	}
	hasHost := false
	for _, r := range a {
		for _, bl := range r.Blocks {
			hasHost = hasHost || bl.Tier == prefixcache.Host
		}
	}
	if !hasHost {
		t.Fatal("the host tier was never used")
	}
}

func TestStartErrors(t *testing.T) {
	tests := []struct {
		name string
		opts Options
		want string
	}{
		{"unknown engine", Options{Engine: "trtllm", KVEventsConfig: `{}`}, "unknown engine"},
		{"bad wire", Options{Engine: "vllm", Wire: "array9", KVEventsConfig: `{"enable_kv_cache_events": true}`}, "no wire generation"},
		{"disabled", Options{Engine: "vllm", KVEventsConfig: `{}`}, "disabled"},
		{"sglang null publisher", Options{Engine: "sglang", KVEventsConfig: `{"endpoint": "tcp://*:1"}`}, "disabled"},
		{"bad json", Options{Engine: "vllm", KVEventsConfig: `{"enable_kv_cache_events": tru`}, "kv-events config"},
		{"bad publisher", Options{Engine: "vllm", KVEventsConfig: `{"enable_kv_cache_events": true, "publisher": "kafka"}`}, "publisher"},
		{"host tier without medium", Options{Engine: "tokenspeed", HostCapacityBlocks: 4, KVEventsConfig: `{"enable_kv_cache_events": true}`}, "host tier"},
		{"ipc at rank 1", Options{Engine: "vllm", DPSize: 2, KVEventsConfig: `{"enable_kv_cache_events": true, "endpoint": "ipc:///tmp/x"}`}, "cannot offset"},
		{"negative dp", Options{Engine: "vllm", DPSize: -1, KVEventsConfig: `{"enable_kv_cache_events": true}`}, "dp size"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			e, err := Start(context.Background(), tc.opts)
			if err == nil {
				e.Close()
				t.Fatal("started")
			}
			if !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("error %q does not mention %q", err, tc.want)
			}
		})
	}
}

// TestConnectingEndpointHint: an endpoint without a wildcard makes the
// publisher dial, as the engines do; with nothing listening the error must
// say so and name the endpoint form that binds, as `kvrelay serve` does,
// and still carry ZeroMQ's own cause.
func TestConnectingEndpointHint(t *testing.T) {
	port := itoa(freeport.ForTest(t, 1)) // free: nothing listens there
	endpoint := "tcp://127.0.0.1:" + port
	e, err := Start(context.Background(), Options{Engine: "vllm",
		KVEventsConfig: `{"enable_kv_cache_events": true, "endpoint": "` + endpoint + `"}`})
	if err == nil {
		e.Close()
		t.Fatal("started with nothing listening at a connecting endpoint")
	}
	for _, want := range []string{endpoint, "instead of binding it", "tcp://*:PORT", "connection refused"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not mention %q", err, want)
		}
	}
}

func TestInprocEndpoints(t *testing.T) {
	e, err := Start(context.Background(), Options{Engine: "vllm", DPSize: 2, BlockSize: 4,
		KVEventsConfig: `{"enable_kv_cache_events": true, "endpoint": "inproc://simtest", "replay_endpoint": "inproc://simtest-replay"}`})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	eps := e.Endpoints()
	if eps[1].Live != "inproc://simtest_dp1" || eps[1].Replay != "inproc://simtest-replay_dp1" {
		t.Fatalf("endpoints %+v", eps)
	}
	e.Step(Request{Rank: 1, Tokens: toks(1, 8)})
	seqs, _, ended := replayFrom(t, eps[1].Replay, 0, true, "")
	if !ended || len(seqs) != 1 {
		t.Fatalf("inproc replay: %v %v", seqs, ended)
	}
}

func TestContextCancelCloses(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	base := freeport.ForTest(t, 1)
	e, err := Start(ctx, Options{Engine: "vllm", KVEventsConfig: `{"enable_kv_cache_events": true, "endpoint": "tcp://*:` + itoa(base) + `"}`})
	if err != nil {
		t.Fatal(err)
	}
	cancel()
	deadline := time.Now().Add(5 * time.Second)
	for {
		if _, err := e.Step(Request{Tokens: toks(1, 16)}); err != nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("engine still stepping after its context was cancelled")
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func TestReplayRingKeepsBufferSteps(t *testing.T) {
	e := startSim(t, Options{Engine: "tokenspeed"}, `, "buffer_steps": 3`)
	for i := 0; i < 5; i++ {
		e.Step(Request{Tokens: toks(uint32(100*i), 4)})
	}
	// A start older than the ring gets the oldest buffered batch onwards,
	// with no indication, as in the engines.
	seqs, _, ended := replayFrom(t, e.Endpoints()[0].Replay, 0, false, "")
	if !ended || !cmp.Equal(seqs, []uint64{2, 3, 4}) {
		t.Fatalf("replay from 0: %v ended %v", seqs, ended)
	}
	// A start past the newest gets only the end marker.
	seqs, _, ended = replayFrom(t, e.Endpoints()[0].Replay, 99, false, "")
	if !ended || len(seqs) != 0 {
		t.Fatalf("replay from 99: %v ended %v", seqs, ended)
	}
}

func TestRingZeroCapacity(t *testing.T) {
	r := newRing(0)
	r.push(ringEntry{seq: 1})
	if got := r.from(0); len(got) != 0 {
		t.Fatalf("a zero ring kept %v", got)
	}
}

func TestRunPacesRequests(t *testing.T) {
	e := startSim(t, Options{Engine: "tokenspeed"}, "")
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	if err := e.Run(ctx, 1000, 10*time.Millisecond, 0); err != nil {
		t.Fatal(err)
	}
	// 1000/s for 0.3 s is about 300; the bounds only guard against a Run
	// that serves nothing or ignores its rate.
	if n := e.Stats().Requests; n < 1 || n > 330 {
		t.Fatalf("served %d requests in 0.3 s at 1000/s", n)
	}
	if err := e.Run(context.Background(), -1, time.Millisecond, 0); err == nil {
		t.Fatal("negative rate accepted")
	}
}
