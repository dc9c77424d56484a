package relay

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"strconv"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrelay/kvrelay/engines"
	"github.com/kvrelay/kvrelay/proto/kvpb"
	"github.com/kvrelay/kvrelay/testkit/enginepeer"
)

// The relay over real libzmq sockets for every engine: a pyzmq + msgspec
// publisher behaving like the engine's ZmqEventPublisher (its bind rules,
// buffer_steps ring, replay framing: 4 frames with the topic for vLLM, 3
// for SGLang and TokenSpeed), three DP ranks, a topic. It covers priming
// from the replay (the publisher spoke before the relay started), live
// drops filled from the replay, a replay cut short at the "HWM" (SGLang's
// send-HWM truncation: no end marker) and resumed, a burned sequence that
// no replay has (a named hole), and a publisher restart (DATA_LOSS to live
// subscribers, then the new incarnation relayed from its start). After each
// phase the relay's snapshot must equal what the publisher stored.
func TestRelayFollowsEveryEnginesRealPublisher(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a Python peer")
	}
	tests := []struct {
		engine string
		wire   string
		topic  string
		hash   func(int64) enginepeer.Hash
	}{
		{enginepeer.VLLM, "map", "kv@vllm", func(v int64) enginepeer.Hash { return enginepeer.U64(uint64(v)) }},
		{enginepeer.VLLM, "array", "", func(v int64) enginepeer.Hash { return enginepeer.U64(uint64(v)) }},
		{enginepeer.TokenSpeed, "array", "kv@ts", func(v int64) enginepeer.Hash { return enginepeer.U64(uint64(v)) }},
		{enginepeer.SGLang, "array", "kv@sglang", enginepeer.I64},
	}
	for _, tc := range tests {
		t.Run(tc.engine+"/"+tc.wire, func(t *testing.T) {
			interopEngineDrill(t, enginepeer.Options{Engine: tc.engine, Wire: tc.wire, Topic: tc.topic}, tc.hash)
		})
	}
}

// The same drill with each engine release's own publisher module (its
// EventPublisherFactory, ZmqEventPublisher, KVEventBatch and event structs,
// loaded from the release's wheel by testdata/engines/release_peer.py) in
// place of our imitation: the framing, replay ROUTER, msgspec encoding and
// rank port offsets are the engine's. Three DP ranks, priming from the
// replay (the relay joins late), live drops filled from the replay, a
// truncated replay, a burned sequence, a publisher restart; the record is
// compared with what the publisher stored after every phase. The newest
// release of each engine runs here; older ones with KVRELAY_ENGINE_TIER=long.
func TestRelayFollowsEachEngineReleasesOwnPublisher(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a Python peer")
	}
	releases, err := enginepeer.Releases()
	if err != nil {
		t.Fatal(err)
	}
	for _, rel := range releases {
		hash := func(v int64) enginepeer.Hash { return enginepeer.U64(uint64(v)) }
		if rel.Engine == enginepeer.SGLang {
			hash = enginepeer.I64
		}
		dp := 3
		if rel.NoDPRanks {
			dp = 1
		}
		t.Run(rel.Name, func(t *testing.T) {
			interopEngineDrill(t, enginepeer.Options{Engine: rel.Engine, Topic: "kv@" + rel.Name, Release: &rel, DPSize: dp}, hash)
		})
	}
}

// interopModel is what a rank's publisher has stored: hash → copies.
type interopModel map[int32]map[exactKey]int

func interopEngineDrill(t *testing.T, opts enginepeer.Options, hash func(int64) enginepeer.Hash) {
	// Three ranks, or one for releases that published no DP rank. The
	// phases name two ranks besides 0: ra (drops) and rb (drops and a
	// truncated replay); with one rank they all fall on rank 0.
	dp := 3
	if opts.DPSize == 1 {
		dp = 1
	}
	opts.DPSize = dp
	ra, rb := 1%dp, 2%dp
	engine, topic := opts.Engine, opts.Topic
	peer := enginepeer.Start(t, opts)
	model := interopModel{}
	stores := make([]int64, dp)
	last := make([]uint64, dp)
	device := uint8(kvpb.KvCacheTier_KV_CACHE_TIER_DEVICE)
	// publish stores a new block on rank, and every third batch also
	// removes the rank's oldest live block: the record must follow both.
	publish := func(rank int) uint64 {
		t.Helper()
		stores[rank]++
		h := int64(rank)*1_000_000 + stores[rank]
		evs := []enginepeer.Event{enginepeer.Stored(nil, []int64{h % 1000, h%1000 + 1}, hash(h))}
		if model[int32(rank)] == nil {
			model[int32(rank)] = map[exactKey]int{}
		}
		if stores[rank]%3 == 0 {
			old := int64(rank)*1_000_000 + stores[rank] - 2
			evs = append(evs, enginepeer.Removed(hash(old)))
			delete(model[int32(rank)], exactKey{device, uint64(old)})
		}
		model[int32(rank)][exactKey{device, uint64(h)}]++
		pub, err := peer.Publish(rank, evs...)
		if err != nil {
			t.Fatal(err)
		}
		last[rank] = pub.Seq
		return pub.Seq
	}
	// The publisher speaks before the relay exists: priming must recover
	// it from the replay.
	for rank := 0; rank < dp; rank++ {
		publish(rank)
		publish(rank)
	}

	dialect := exactnessEngines[engine]
	// A replay that stays unanswered for the timeout is a hole, rightly.
	// The engines' own publishers serve replays on their publishing thread,
	// between 100 ms queue polls, so on a loaded machine their answer can
	// take longer than the imitation's; 300 ms once cost 3 holes there.
	replayTimeout := 300 * time.Millisecond
	if opts.Release != nil {
		replayTimeout = time.Second
	}
	inj := &dupInjector{} // no duplicates: only to watch the SUB reconnect
	kv := engines.Config{Enabled: true, Endpoint: peer.PubEndpoint(0), ReplayEndpoint: peer.ReplayEndpoint(0), Topic: topic, HWM: engines.DefaultHWM}
	r, err := New(Config{
		Engine:        dialect,
		KV:            kv,
		DPSize:        dp,
		ReplayTimeout: replayTimeout,
		PrimeRetry:    50 * time.Millisecond,
		Logger:        quietLogger(),
		Registerer:    prometheus.NewRegistry(),
		Transport:     inj.wrap(zmqTransport(kv.Topic, kv.HWM, zmqLimits{}, quietLogger())),
	})
	if err != nil {
		t.Fatal(err)
	}
	l := runRelay(t, r)
	l.waitFor("every rank connected", r.Ready)
	for rank := 0; rank < dp; rank++ {
		l.cursor(int32(rank), last[rank])
	}
	expectExact := func(phase string, holes []uint64) {
		t.Helper()
		st := r.Status()
		for _, rs := range st.Ranks {
			if rs.Cursor == nil || *rs.Cursor != last[rs.Rank] {
				t.Fatalf("%s: rank %d cursor %v, publisher at %d", phase, rs.Rank, rs.Cursor, last[rs.Rank])
			}
			if rs.HoleSequences != holes[rs.Rank] || rs.UnknownBefore != 0 {
				t.Fatalf("%s: rank %d: %d hole sequences and unknown_before %d, want %d and 0", phase, rs.Rank,
					rs.HoleSequences, rs.UnknownBefore, holes[rs.Rank])
			}
		}
		got := snapshotLiveSet(r.Snapshot())
		for rank := int32(0); rank < int32(dp); rank++ {
			if !maps.Equal(got[rank], model[rank]) {
				t.Fatalf("%s: rank %d: the record differs from what the publisher stored: %s", phase, rank,
					describeDiff(got[rank], model[rank]))
			}
		}
	}
	expectExact("primed", []uint64{0, 0, 0})

	for i := 0; i < 12; i++ {
		for rank := 0; rank < dp; rank++ {
			publish(rank)
		}
	}
	// Rank ra loses three batches live; rank rb loses five and its replay is
	// cut after two replies, with no end marker, until the gap is covered.
	if ra != rb { // with one rank, rb's five drops are ra's too (and 8 would outlast the 7 rounds below)
		if err := peer.DropNext(ra, 3); err != nil {
			t.Fatal(err)
		}
	}
	if err := peer.DropNext(rb, 5); err != nil {
		t.Fatal(err)
	}
	if err := peer.TruncateReplay(rb, 2); err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 7; i++ {
		for rank := 0; rank < dp; rank++ {
			publish(rank)
		}
	}
	for rank := 0; rank < dp; rank++ {
		l.cursor(int32(rank), last[rank])
	}
	if err := peer.TruncateReplay(rb, -1); err != nil {
		t.Fatal(err)
	}
	expectExact("drops filled", []uint64{0, 0, 0})
	if got := counter(r.metrics.replays.WithLabelValues(strconv.Itoa(rb), "truncated")); got < 1 {
		t.Errorf("rank %d's truncated replays %v, want at least one", rb, got)
	}
	if got := counter(r.metrics.recovered.WithLabelValues(strconv.Itoa(ra))); got < 3 {
		t.Errorf("rank %d recovered %v batches from the replay, want at least 3", ra, got)
	}

	// Every rank is whole in the history from its first sequence: cursor 0
	// gets the whole log, each rank contiguous from 0.
	s := l.subscribe(0)
	want := make([]uint64, dp)
	total := 0
	for rank := 0; rank < dp; rank++ {
		total += int(last[rank]) + 1
	}
	for n := 0; n < total; n++ {
		b := next(t, s)
		rank := b.GetDpRank()
		if b.GetSequenceNumber() != want[rank] {
			t.Fatalf("rank %d: sequence %d, want %d", rank, b.GetSequenceNumber(), want[rank])
		}
		want[rank]++
	}

	// A sequence the engine burned (a failed send: neither live nor in its
	// ring) is a hole no replay can fill; it is named, and the record
	// stays exact because the burned batch changed nothing.
	if err := peer.BurnNext(0, 1); err != nil {
		t.Fatal(err)
	}
	burned := last[0] + 1
	pub, err := peer.Publish(0) // the burned one: no events reach anyone
	if err != nil || pub.Seq != burned || pub.Buffered {
		t.Fatalf("burn: %+v, %v", pub, err)
	}
	last[0] = burned
	publish(0)
	l.cursor(0, last[0])
	expectExact("burned", []uint64{1, 0, 0})
	if b := next(t, s); b.GetDpRank() != 0 || b.GetSequenceNumber() != burned+1 {
		t.Fatalf("after the burn: %s, want 0:%d", describe(b), burned+1)
	}

	// Rank ra's publisher restarts: live subscribers end with DATA_LOSS,
	// and the new incarnation is relayed from its own start.
	old := last[ra]
	reconnects := inj.reconnects(int32(ra))
	if err := peer.Restart(ra); err != nil {
		t.Fatal(err)
	}
	model[int32(ra)] = map[exactKey]int{}
	last[ra] = 0 // SGLang's startup clear is 0; the others have published nothing yet
	l.waitFor(fmt.Sprintf("rank %d's SUB to reconnect", ra), func() bool { return inj.reconnects(int32(ra)) > reconnects })
	// Publish only while the new sequences stay below the old cursor (one
	// the relay reads as the next of the old incarnation is no restart to
	// anyone); if the relay saw none of them, its catch-up replay finds the
	// restart.
	deadline := time.Now().Add(30 * time.Second)
	for {
		if time.Now().After(deadline) {
			t.Fatalf("no data loss after rank %d's restart (new sequence %d, old %d): %+v", ra, last[ra], old, r.Status().Ranks[ra])
		}
		if last[ra]+3 < old {
			publish(ra)
		}
		nctx, ncancel := context.WithTimeout(context.Background(), 150*time.Millisecond)
		_, err := s.Next(nctx)
		ncancel()
		if errors.Is(err, ErrDataLoss) {
			break
		}
		if err != nil && !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("after rank %d's restart: %v", ra, err)
		}
	}
	publish(ra)
	l.cursor(int32(ra), last[ra])
	// The restart cleared the history window, and with it rank 0's hole.
	expectExact("restarted", []uint64{0, 0, 0})
	if rs := r.Status().Ranks[ra]; rs.Restarts != 1 || rs.StartedAt == nil || *rs.StartedAt != 0 {
		t.Fatalf("rank %d after its restart: %+v", ra, rs)
	}
	// A fresh subscriber gets a snapshot at every rank's cursor: the other
	// ranks' histories no longer start at their first batch. With one rank,
	// the history is whole from the new incarnation's 0, and is sent as is.
	fresh := l.subscribe(0)
	chunk := next(t, fresh)
	if dp == 1 {
		if chunk.GetSnapshot() != nil || chunk.GetSequenceNumber() != 0 {
			t.Fatalf("after the restart of the only rank, cursor 0 got %s, want its history from 0", describe(chunk))
		}
		return
	}
	if chunk.GetSnapshot() == nil {
		t.Fatalf("after the restart, cursor 0 got %s, want a snapshot", describe(chunk))
	}
}
