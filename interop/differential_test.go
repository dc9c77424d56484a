package interop

import (
	"context"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
	"github.com/vmihailenco/msgpack/v5"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/testing/protocmp"

	"github.com/kvrelay/kvrelay/proto/kvpb"
	"github.com/kvrelay/kvrelay/testkit/enginepeer"
	"github.com/kvrelay/kvrelay/testkit/pyenv"
)

// rankSeq names a batch: the publisher's rank and its own sequence.
type rankSeq struct {
	rank int32
	seq  uint64
}

// sentBatch is one batch the differential test put on a rank's PUB.
type sentBatch struct {
	rankSeq
	inputs   int    // events in the payload: what event ids advance by
	note     string // where the batch comes from
	intended string // non-empty: an intended kvrelay/Python difference
	golden   *goldenRef
}

// goldenRef ties a replayed golden payload to its recorded outputs.
type goldenRef struct {
	kvrelay *kvpb.KvEventBatch // expected of kvrelay (nil: undecodable, an empty batch)
	python  *kvpb.KvEventBatch // the Python relay's recorded output, for intended differences
	setBase uint64             // event ids the set consumed before this payload
}

// diffRun drives one engine peer and remembers everything it published.
type diffRun struct {
	t      *testing.T
	peer   *enginepeer.Peer
	engine string
	dp     int
	next   []uint64 // next sequence per rank
	sent   map[rankSeq]sentBatch
	order  []rankSeq
}

func newDiffRun(t *testing.T, peer *enginepeer.Peer, engine string, dp int) *diffRun {
	d := &diffRun{t: t, peer: peer, engine: engine, dp: dp, next: make([]uint64, dp), sent: map[rankSeq]sentBatch{}}
	st, err := peer.Status()
	if err != nil {
		t.Fatalf("peer status: %v", err)
	}
	for _, r := range st {
		d.next[r.Rank] = r.NextSeq
		// Batches before the test's first are the engine's own startup
		// batch: SGLang's lone AllBlocksCleared at seq 0.
		for s := uint64(0); s < r.NextSeq; s++ {
			d.record(sentBatch{rankSeq: rankSeq{int32(r.Rank), s}, inputs: 1, note: "engine startup clear"})
		}
	}
	return d
}

func (d *diffRun) record(b sentBatch) {
	d.sent[b.rankSeq] = b
	d.order = append(d.order, b.rankSeq)
}

// publish sends one batch of peer-encoded events on rank.
func (d *diffRun) publish(rank int, note string, evs ...enginepeer.Event) uint64 {
	d.t.Helper()
	res, err := d.peer.Publish(rank, evs...)
	if err != nil {
		d.t.Fatalf("publish %s: %v", note, err)
	}
	if res.Seq != d.next[rank] {
		d.t.Fatalf("publish %s: rank %d seq %d, expected %d", note, rank, res.Seq, d.next[rank])
	}
	d.next[rank]++
	d.record(sentBatch{rankSeq: rankSeq{int32(rank), res.Seq}, inputs: len(evs), note: note})
	return res.Seq
}

// raw publishes payload as rank's next batch byte for byte; like any
// batch it enters the peer's replay ring.
func (d *diffRun) raw(rank int, note, intended string, payload []byte, ref *goldenRef) {
	d.t.Helper()
	res, err := d.peer.PublishRaw(rank, payload)
	if err != nil || res.Seq != d.next[rank] || !res.Live || !res.Buffered {
		d.t.Fatalf("publish %s: %+v %v (want seq %d, live and buffered)", note, res, err, d.next[rank])
	}
	d.next[rank]++
	d.record(sentBatch{rankSeq: rankSeq{int32(rank), res.Seq}, inputs: payloadEvents(payload), note: note, intended: intended, golden: ref})
}

// payloadEvents counts the events of an engine payload [ts, events, ...]
// the way both relays number them: an envelope that does not decode as a
// batch consumes no event id.
func payloadEvents(payload []byte) int {
	var v []any
	if err := msgpack.Unmarshal(payload, &v); err != nil || len(v) < 2 {
		return 0
	}
	evs, ok := v[1].([]any)
	if !ok {
		return 0
	}
	return len(evs)
}

// last returns every rank's newest sequence.
func (d *diffRun) last() map[int32]uint64 {
	out := map[int32]uint64{}
	for r, n := range d.next {
		if n > 0 {
			out[int32(r)] = n - 1
		}
	}
	return out
}

// hasAll reports whether bs holds, for every rank, the batch with that
// rank's sequence in want.
func hasAll(bs []*kvpb.KvEventBatch, want map[int32]uint64) bool {
	seen := map[rankSeq]bool{}
	for _, b := range bs {
		seen[rankSeq{b.GetDpRank(), b.GetSequenceNumber()}] = true
	}
	for r, s := range want {
		if !seen[rankSeq{r, s}] {
			return false
		}
	}
	return true
}

// goldenSet is one testdata/golden vector file, reduced to what the
// differential test replays.
type goldenSet struct {
	Name     string `json:"name"`
	Payloads []struct {
		Hex              string          `json:"hex"`
		Rank             int             `json:"rank"`
		Note             string          `json:"note"`
		DiffersFromPy    string          `json:"differs_from_python"`
		ExpectedByEngine json.RawMessage `json:"expected_by_engine"`
		Expected         json.RawMessage `json:"expected"`
		PythonOutput     json.RawMessage `json:"python_relay_output"`
	} `json:"payloads"`
}

func loadGolden(t *testing.T) []goldenSet {
	t.Helper()
	files, err := filepath.Glob(filepath.Join(pyenv.RepoRoot(), "testdata", "golden", "*.json"))
	if err != nil || len(files) == 0 {
		t.Fatalf("golden vectors: %v (%d files)", err, len(files))
	}
	sort.Strings(files)
	var sets []goldenSet
	for _, f := range files {
		data, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		var s goldenSet
		if err := json.Unmarshal(data, &s); err != nil {
			t.Fatalf("%s: %v", f, err)
		}
		sets = append(sets, s)
	}
	return sets
}

// goldenBatch decodes a golden expectation {"batch": ..., "drops": ...};
// {"error": "undecodable"} and an absent one give nil.
func goldenBatch(t *testing.T, set string, i int, raw json.RawMessage) *kvpb.KvEventBatch {
	t.Helper()
	if len(raw) == 0 {
		return nil
	}
	var exp struct {
		Batch json.RawMessage `json:"batch"`
		Error string          `json:"error"`
	}
	if err := json.Unmarshal(raw, &exp); err != nil {
		t.Fatalf("golden %s[%d]: %v", set, i, err)
	}
	if exp.Batch == nil {
		return nil
	}
	b := &kvpb.KvEventBatch{}
	if err := protojson.Unmarshal(exp.Batch, b); err != nil {
		t.Fatalf("golden %s[%d]: batch: %v", set, i, err)
	}
	return b
}

// as is the golden batch as the live pipeline carries it: under the
// rank and sequence it was sent with, event ids rebased to the payload
// (as checkStream rebases the relays'). An undecodable payload is relayed
// as an empty batch.
func (g *goldenRef) as(k rankSeq) *kvpb.KvEventBatch {
	var b *kvpb.KvEventBatch
	if g.kvrelay == nil {
		b = &kvpb.KvEventBatch{}
	} else {
		b = proto.Clone(g.kvrelay).(*kvpb.KvEventBatch)
	}
	b.SequenceNumber = k.seq
	r := k.rank
	b.DpRank = &r
	for _, ev := range b.Events {
		ev.EventId -= g.setBase
	}
	return b
}

// intendedFor says whether a golden entry is an intended difference for
// this engine's dialect: marked, and (when the expectation depends on the
// dialect) overridden for this engine.
func intendedFor(engine, differs string, byEngine json.RawMessage) string {
	if differs == "" {
		return ""
	}
	if len(byEngine) > 0 {
		var m map[string]json.RawMessage
		if json.Unmarshal(byEngine, &m) == nil {
			if _, ok := m[engine]; !ok {
				return ""
			}
		}
	}
	return differs
}

// diffCase is one engine flavour of the differential test.
type diffCase struct {
	name   string
	engine string
	wire   string
	dp     int
	golden bool // also replay every golden vector payload byte for byte
	steps  func(d *diffRun)
}

// TestDifferentialPythonRelay feeds one publisher stream, in one run, to
// `kvrelay serve` and to SMG's Python relay (py_relay_server.py) and reads
// both over gRPC. Every batch Python emits must be emitted by kvrelay under
// the same rank and sequence, and match it field by field once event ids
// are rebased to each relay's documented numbering; the only other
// differences allowed are the ones the golden vectors mark as intended.
func TestDifferentialPythonRelay(t *testing.T) {
	cases := []diffCase{
		{name: "vllm-map", engine: "vllm", wire: "map", dp: 2, golden: true, steps: vllmSteps},
		{name: "vllm-array", engine: "vllm", wire: "array", dp: 1, steps: vllmArraySteps},
		{name: "sglang-map", engine: "sglang", wire: "map", dp: 2, golden: true, steps: sglangSteps},
		{name: "tokenspeed-array", engine: "tokenspeed", wire: "array", dp: 2, golden: true, steps: tokenspeedSteps},
	}
	golden := loadGolden(t)
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) { runDifferential(t, c, golden) })
	}
}

func kvEventsConfig(engine string, pub, replay int) string {
	switch engine {
	case "sglang":
		return fmt.Sprintf(`{"publisher": "zmq", "endpoint": "tcp://*:%d", "replay_endpoint": "tcp://*:%d"}`, pub, replay)
	default:
		return fmt.Sprintf(`{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:%d", "replay_endpoint": "tcp://*:%d"}`, pub, replay)
	}
}

func runDifferential(t *testing.T, c diffCase, golden []goldenSet) {
	kvrelayBin(t) // first: a tree that does not build fails before anything starts
	peer := enginepeer.Start(t, enginepeer.Options{Engine: c.engine, DPSize: c.dp, Wire: c.wire})
	pub, replay := peer.PubEndpoint(0), peer.ReplayEndpoint(0)
	kv := startKvrelay(t, "kvrelay serve", c.engine, kvEventsConfig(c.engine, endpointPort(t, pub), endpointPort(t, replay)), c.dp, freePort(t))
	py, pyAddr := startPyRelay(t, c.engine, pub, replay, c.dp)
	logs := []*proc{kv.proc, py}

	kvLive := subscribeKv(t, "kvrelay", kv.addr, c.engine, &kvpb.SubscribeKvEventsRequest{})
	pyLive := subscribeKv(t, "python relay", pyAddr, c.engine, &kvpb.SubscribeKvEventsRequest{})
	d := newDiffRun(t, peer, c.engine, c.dp)

	// The Python relay connects its SUB sockets when the call comes in, and
	// PUB/SUB drops what is published before the subscription lands: send
	// empty batches on every rank until Python has one from each rank.
	waitFor(t, waitTimeout, func() (bool, string) {
		bs, err := pyLive.snapshot()
		if err != nil {
			return false, fmt.Sprintf("python stream ended: %v", err)
		}
		ranks := map[int32]bool{}
		for _, b := range bs {
			ranks[b.GetDpRank()] = true
		}
		if len(ranks) == c.dp {
			return true, ""
		}
		for r := 0; r < c.dp; r++ {
			d.publish(r, "warm-up")
		}
		return false, fmt.Sprintf("python relay has batches of ranks %v", ranks)
	}, logs...)

	c.steps(d)
	if c.golden {
		for _, set := range golden {
			var setBase uint64
			for i, p := range set.Payloads {
				payload, err := hex.DecodeString(p.Hex)
				if err != nil {
					t.Fatalf("%s[%d]: %v", set.Name, i, err)
				}
				rank := 0
				if p.Rank > 0 {
					rank = p.Rank % c.dp
				}
				var ref *goldenRef
				if p.Rank >= 0 {
					// A negative rank is "no socket rank"; here every
					// payload has one, so its expectation does not apply.
					expected := p.Expected
					var byEngine map[string]json.RawMessage
					if len(p.ExpectedByEngine) > 0 && json.Unmarshal(p.ExpectedByEngine, &byEngine) == nil && byEngine[c.engine] != nil {
						expected = byEngine[c.engine]
					}
					ref = &goldenRef{kvrelay: goldenBatch(t, set.Name, i, expected), python: goldenBatch(t, set.Name, i, p.PythonOutput), setBase: setBase}
				}
				setBase += uint64(payloadEvents(payload))
				d.raw(rank, fmt.Sprintf("golden %s[%d] %s", set.Name, i, p.Note), intendedFor(c.engine, p.DiffersFromPy, p.ExpectedByEngine), payload, ref)
			}
			// Each set starts from a clean record, as in the golden runs.
			for r := 0; r < c.dp; r++ {
				d.publish(r, "clear after golden "+set.Name, enginepeer.Cleared())
			}
		}
	}
	// A batch lost on the PUB, which both relays must fetch from the ROUTER.
	dropAndReplay(d)
	for r := 0; r < d.dp; r++ {
		d.publish(r, "clear, then store again", enginepeer.Cleared(), enginepeer.Stored(nil, tokens(4, 0), h(uint64(r+1)<<32+1)))
	}
	// End markers: an empty batch per rank, awaited on both streams.
	for r := 0; r < c.dp; r++ {
		d.publish(r, "end marker")
	}
	end := d.last()
	pyBatches := pyLive.waitBatches(t, "the end markers", func(bs []*kvpb.KvEventBatch) bool { return hasAll(bs, end) }, logs...)
	kvBatches := kvLive.waitBatches(t, "the end markers", func(bs []*kvpb.KvEventBatch) bool { return hasAll(bs, end) }, logs...)

	// kvrelay keeps the publisher's history: a subscriber arriving now at
	// cursor 0 gets the same batches from each rank's sequence 0.
	kvLate := subscribeKv(t, "kvrelay (late)", kv.addr, c.engine, &kvpb.SubscribeKvEventsRequest{})
	kvLateBatches := kvLate.waitBatches(t, "the end markers", func(bs []*kvpb.KvEventBatch) bool { return hasAll(bs, end) }, logs...)

	kvByKey := checkStream(t, "kvrelay live", kvBatches, d, true)
	lateByKey := checkStream(t, "kvrelay late", kvLateBatches, d, true)
	pyByKey := checkStream(t, "python relay", pyBatches, d, false)

	for k, b := range lateByKey {
		if lb, ok := kvByKey[k]; !ok || !proto.Equal(lb, b) {
			t.Errorf("kvrelay's history and live stream differ at rank %d seq %d", k.rank, k.seq)
		}
	}
	if len(lateByKey) != len(d.sent) {
		t.Errorf("kvrelay's history holds %d batches, the peer published %d", len(lateByKey), len(d.sent))
	}

	// The comparison proper.
	var compared, intended int
	for _, k := range d.order {
		pb, inPy := pyByKey[k]
		kb, inKv := kvByKey[k]
		s := d.sent[k]
		if !inKv {
			t.Errorf("kvrelay never emitted rank %d seq %d (%s)", k.rank, k.seq, s.note)
			continue
		}
		if !inPy {
			if s.note != "warm-up" && s.note != "engine startup clear" {
				t.Errorf("python never emitted rank %d seq %d (%s), though it was subscribed", k.rank, k.seq, s.note)
			}
			continue
		}
		diff := cmp.Diff(pb, kb, protocmp.Transform())
		switch {
		case s.intended != "":
			intended++
			if diff == "" {
				t.Logf("rank %d seq %d (%s): marked as an intended difference, but both relays agree", k.rank, k.seq, s.note)
			} else {
				t.Logf("intended difference at rank %d seq %d (%s): %s", k.rank, k.seq, s.note, s.intended)
			}
		case diff != "":
			t.Errorf("rank %d seq %d (%s): kvrelay differs from the Python relay (-python +kvrelay):\n%s", k.rank, k.seq, s.note, diff)
		default:
			compared++
		}
	}
	// End to end, kvrelay gives exactly the golden vectors' expectations,
	// and where Python differs on purpose it gives its recorded output.
	var goldenChecked int
	for _, k := range d.order {
		s := d.sent[k]
		if s.golden == nil {
			continue
		}
		if diff := cmp.Diff(s.golden.as(k), kvByKey[k], protocmp.Transform()); diff != "" {
			t.Errorf("rank %d seq %d (%s): kvrelay differs from the golden expectation (-golden +kvrelay):\n%s", k.rank, k.seq, s.note, diff)
		}
		goldenChecked++
		if s.intended != "" && s.golden.python != nil {
			want := (&goldenRef{kvrelay: s.golden.python, setBase: s.golden.setBase}).as(k)
			if diff := cmp.Diff(want, pyByKey[k], protocmp.Transform()); diff != "" {
				t.Errorf("rank %d seq %d (%s): the Python relay differs from its recorded output (-recorded +python):\n%s", k.rank, k.seq, s.note, diff)
			}
		}
	}
	t.Logf("%s: %d batches published, %d identical in both relays, %d intended differences, %d checked against the golden vectors",
		c.name, len(d.sent), compared, intended, goldenChecked)
	if compared == 0 {
		t.Fatal("nothing was compared")
	}

	// Cursors: Python keeps nothing between calls and refuses any non-zero
	// cursor on the call itself; kvrelay resumes after rank 0's cursor from
	// its history.
	mid := end[0] / 2
	if err := subscribeErr(t, pyAddr, c.engine, &kvpb.SubscribeKvEventsRequest{StartSequenceNumber: mid}); status.Code(err) != codes.OutOfRange {
		t.Errorf("python relay with cursor %d: %v, want OUT_OF_RANGE on the call", mid, err)
	}
	ahead := end[0] + 100
	if err := subscribeErr(t, kv.addr, c.engine, &kvpb.SubscribeKvEventsRequest{StartSequenceNumber: ahead}); status.Code(err) != codes.OutOfRange {
		t.Errorf("kvrelay with cursor %d beyond the publisher: %v, want OUT_OF_RANGE on the call", ahead, err)
	}
	at := -1
	for i, b := range kvLateBatches {
		if b.GetDpRank() == 0 && b.GetSequenceNumber() == mid {
			at = i
		}
	}
	if at < 0 {
		t.Fatalf("kvrelay's history lacks rank 0 seq %d", mid)
	}
	// Rank 0's cursor alone is served only where no other rank has two
	// batches after rank 0's batch `mid` in the log: a client may hold any
	// number of them, and SMG's gateway would read their repeat as a
	// restart (issue 14.1). Otherwise it is refused on the call.
	after := map[int32]int{}
	for _, b := range kvLateBatches[at+1:] {
		if b.GetDpRank() != 0 {
			after[b.GetDpRank()]++
		}
	}
	wantRefused := false
	for _, n := range after {
		wantRefused = wantRefused || n >= 2
	}
	err := subscribeErr(t, kv.addr, c.engine, &kvpb.SubscribeKvEventsRequest{StartSequenceNumber: mid})
	if refused := status.Code(err) == codes.OutOfRange; refused != wantRefused || (!refused && err != nil) {
		t.Errorf("kvrelay with rank 0's cursor %d alone (other ranks' batches after it: %v): %v, want refused=%v", mid, after, err, wantRefused)
	}
	// With every rank's cursor as of rank 0's batch `mid` in the log, the
	// resume is served from the interleaved log: exactly what followed that
	// batch there, the tail of the full history (nothing before it is
	// repeated).
	cursors := map[int32]uint64{}
	for _, b := range kvLateBatches[:at+1] {
		cursors[b.GetDpRank()] = b.GetSequenceNumber()
	}
	wantResumed := kvLateBatches[at+1:]
	kvResume := subscribeKv(t, "kvrelay (resume)", kv.addr, c.engine, &kvpb.SubscribeKvEventsRequest{StartSequenceNumber: mid, RankCursors: cursors})
	resumed := kvResume.waitBatches(t, fmt.Sprintf("the %d batches after rank 0 seq %d", len(wantResumed), mid),
		func(bs []*kvpb.KvEventBatch) bool { return len(bs) >= len(wantResumed) }, logs...)
	if diff := cmp.Diff(wantResumed, resumed, protocmp.Transform()); diff != "" {
		t.Errorf("kvrelay resumed after rank 0 seq %d with other batches than its history holds after it (-history +resumed):\n%s", mid, diff)
	}
}

// checkStream checks one relay's stream against what was published and
// returns its batches by rank and sequence, event ids rebased to each
// event's index in its payload (1-based). Both relays number events once
// per payload event, forwarded or not; they differ in where the count
// starts:
//   - kvrelay (perRank): one counter per rank, from the publisher's first
//     batch (its history holds every batch from seq 0);
//   - Python: one counter per SubscribeKvEvents call, shared by every rank,
//     from the first batch that call received.
func checkStream(t *testing.T, name string, bs []*kvpb.KvEventBatch, d *diffRun, perRank bool) map[rankSeq]*kvpb.KvEventBatch {
	t.Helper()
	out := map[rankSeq]*kvpb.KvEventBatch{}
	// kvrelay's base: per rank, the inputs of every earlier sequence.
	rankBase := map[rankSeq]uint64{}
	if perRank {
		perRankSent := map[int32][]sentBatch{}
		for _, k := range d.order {
			perRankSent[k.rank] = append(perRankSent[k.rank], d.sent[k])
		}
		for r, list := range perRankSent {
			sort.Slice(list, func(i, j int) bool { return list[i].seq < list[j].seq })
			var base uint64
			for _, s := range list {
				rankBase[rankSeq{r, s.seq}] = base
				base += uint64(s.inputs)
			}
		}
	}
	var callBase uint64
	lastSeq := map[int32]uint64{}
	for i, b := range bs {
		if b.GetSnapshot() != nil || b.GetLoad().GetLoadOnly() {
			t.Errorf("%s: batch %d is a snapshot chunk or load record; none was expected here", name, i)
			continue
		}
		if b.DpRank == nil {
			t.Errorf("%s: batch %d (seq %d) has no dp_rank", name, i, b.GetSequenceNumber())
			continue
		}
		k := rankSeq{b.GetDpRank(), b.GetSequenceNumber()}
		s, ok := d.sent[k]
		if !ok {
			t.Errorf("%s: batch %d: rank %d seq %d was never published", name, i, k.rank, k.seq)
			continue
		}
		if _, dup := out[k]; dup {
			t.Errorf("%s: rank %d seq %d came twice", name, k.rank, k.seq)
			continue
		}
		// Native sequences, in order per rank, with no gap once started
		// (the dropped batches came back through the replay).
		if prev, seen := lastSeq[k.rank]; seen && k.seq != prev+1 {
			t.Errorf("%s: rank %d went from seq %d to %d", name, k.rank, prev, k.seq)
		}
		lastSeq[k.rank] = k.seq
		base := callBase
		if perRank {
			base = rankBase[k]
		}
		nb := proto.Clone(b).(*kvpb.KvEventBatch)
		prevIdx := uint64(0)
		for _, ev := range nb.Events {
			idx := ev.EventId - base
			if ev.EventId <= base || idx > uint64(s.inputs) || idx <= prevIdx {
				t.Errorf("%s: rank %d seq %d (%s): event_id %d is not one of this payload's %d events numbered after %d",
					name, k.rank, k.seq, s.note, ev.EventId, s.inputs, base)
			}
			prevIdx = idx
			ev.EventId = idx
		}
		callBase += uint64(s.inputs)
		out[k] = nb
	}
	return out
}

// subscribeErr opens SubscribeKvEvents and returns how the call itself
// ended: nil if the server accepted it (sent headers).
func subscribeErr(t *testing.T, addr, service string, req *kvpb.SubscribeKvEventsRequest) error {
	t.Helper()
	cc, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatalf("dial %s: %v", addr, err)
	}
	defer cc.Close()
	ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
	defer cancel()
	var stream grpc.ServerStreamingClient[kvpb.KvEventBatch]
	switch service {
	case "vllm":
		stream, err = kvpb.NewVllmEngineClient(cc).SubscribeKvEvents(ctx, req)
	case "sglang":
		stream, err = kvpb.NewSglangSchedulerClient(cc).SubscribeKvEvents(ctx, req)
	default:
		stream, err = kvpb.NewTokenSpeedSchedulerClient(cc).SubscribeKvEvents(ctx, req)
	}
	if err != nil {
		return err
	}
	md, err := stream.Header()
	if err != nil {
		return err
	}
	if md == nil {
		// Trailers only: the call ended without headers; its status
		// comes with the first read.
		_, err = stream.Recv()
		return err
	}
	return nil
}

// Peer-encoded scenarios. Each covers its engine's event shapes on every
// rank, with a dropped batch the relays must fill from the replay ROUTER.

func h(v uint64) enginepeer.Hash { return enginepeer.U64(v) }

func hp(v uint64) *enginepeer.Hash { x := enginepeer.U64(v); return &x }

func tokens(n, from int) []int64 {
	out := make([]int64, n)
	for i := range out {
		out[i] = int64(from + i)
	}
	return out
}

func withFields(ev enginepeer.Event, kv ...any) enginepeer.Event {
	ev.Fields = map[string]any{}
	for i := 0; i+1 < len(kv); i += 2 {
		ev.Fields[kv[i].(string)] = kv[i+1]
	}
	return ev
}

func withMedium(ev enginepeer.Event, m string) enginepeer.Event { ev.Medium = &m; return ev }

func vllmSteps(d *diffRun) {
	for r := 0; r < d.dp; r++ {
		b := uint64(r+1) << 32
		d.publish(r, "store chain with a digest root",
			enginepeer.Stored(nil, tokens(8, 0), enginepeer.Digest(digest32(byte(r), b+1)), h(b+2)),
			enginepeer.Stored(hp(b+2), tokens(4, 8), h(b+3)))
		d.publish(r, "host and disk tiers, lora, extra keys",
			withMedium(enginepeer.Stored(hp(b+3), tokens(4, 12), h(b+4)), "CPU"),
			withMedium(enginepeer.Stored(hp(b+4), tokens(4, 16), h(b+5)), "disk"),
			withFields(enginepeer.Stored(hp(b+3), tokens(8, 20), h(b+6), h(b+7)),
				"lora_name", "adapter-a", "extra_keys", []any{[]any{"salt-1", []any{"mm-img", 3}}, nil}))
		d.publish(r, "hybrid groups: main and window in one step",
			withFields(enginepeer.Stored(nil, tokens(4, 40), h(b+10)), "group_idx", 0, "kv_cache_spec_kind", "full_attention"),
			withFields(enginepeer.Stored(nil, tokens(4, 40), h(b+11)), "group_idx", 1, "kv_cache_spec_kind", "sliding_window", "kv_cache_spec_sliding_window", 128),
			withFields(enginepeer.Removed(h(b+11)), "group_idx", 1))
		d.publish(r, "gates: unknown medium, remote, kvcr, unaligned, placeholder, self-reference",
			withMedium(enginepeer.Stored(nil, tokens(4, 50), h(b+20)), "lmcache-l1"),
			withFields(enginepeer.Stored(nil, tokens(4, 50), h(b+21)), "locality", "REMOTE"),
			withFields(enginepeer.Stored(nil, tokens(4, 50), h(b+22)), "ownership", "kvcr"),
			enginepeer.Event{Type: "stored", Hashes: []enginepeer.Hash{h(b + 23)}, Tokens: tokens(5, 50), BlockSize: 4},
			enginepeer.Event{Type: "stored", Hashes: []enginepeer.Hash{h(b + 24)}, BlockSize: 0},
			enginepeer.Stored(nil, tokens(8, 50), h(b+25), h(b+25)))
		d.publish(r, "duplicate physical copy, removals incl. unknown hashes",
			enginepeer.Stored(hp(b+2), tokens(4, 8), h(b+3)),
			enginepeer.Removed(h(b+3)),
			enginepeer.Removed(h(b+3), h(b+999)),
			withMedium(enginepeer.Removed(h(b+4)), "CPU"))
	}
}

func vllmArraySteps(d *diffRun) {
	d.publish(0, "array store and removal",
		enginepeer.Stored(nil, tokens(8, 0), h(1), h(2)),
		withMedium(enginepeer.Stored(hp(2), tokens(4, 8), h(3)), "CPU"),
		withFields(enginepeer.Stored(hp(3), tokens(4, 12), h(4)), "lora_name", "adapter-b", "group_idx", 0),
		enginepeer.Removed(h(1)))
}

func sglangSteps(d *diffRun) {
	for r := 0; r < d.dp; r++ {
		neg := func(v int64) enginepeer.Hash { return enginepeer.I64(-v - int64(r)*1000) }
		p := neg(2)
		d.publish(r, "signed hashes, salted chain, session",
			withFields(enginepeer.Stored(nil, tokens(8, 0), neg(1), neg(2)), "cache_salt", "tenant-a"),
			withFields(enginepeer.Stored(&p, tokens(4, 8), neg(3)), "session_id", "s-1"))
		p3 := neg(3)
		d.publish(r, "unsalted child inherits, host tier, removal",
			enginepeer.Stored(&p3, tokens(4, 12), neg(4)),
			withMedium(enginepeer.Stored(nil, tokens(4, 100), neg(5)), "cpu_pinned"),
			enginepeer.Removed(neg(1)))
		d.publish(r, "bigram token pairs",
			withFields(enginepeer.Event{Type: "stored", Hashes: []enginepeer.Hash{neg(6)}, BlockSize: 2}, "token_ids", []any{[]any{1, 2}, []any{2, 3}}))
	}
}

func tokenspeedSteps(d *diffRun) {
	for r := 0; r < d.dp; r++ {
		b := uint64(r+7) << 40
		d.publish(r, "tokenspeed stores and removal",
			enginepeer.Stored(nil, tokens(8, 0), h(b+1), h(b+2)),
			enginepeer.Stored(hp(b+2), tokens(4, 8), h(b+3)),
			enginepeer.Removed(h(b+1)))
	}
}

// dropAndReplay loses one batch on every rank's PUB (a high-water-mark
// drop); the next batch reveals the gap and both relays must fetch the
// lost one from the rank's replay ROUTER.
func dropAndReplay(d *diffRun) {
	d.t.Helper()
	for r := 0; r < d.dp; r++ {
		if err := d.peer.DropNext(r, 1); err != nil {
			d.t.Fatalf("drop: %v", err)
		}
		b := uint64(r+1)<<36 | 0xd00
		d.publish(r, "dropped live, only in the replay ring", enginepeer.Stored(nil, tokens(4, 0), h(b+1)))
		d.publish(r, "after the drop", enginepeer.Stored(hp(b+1), tokens(4, 4), h(b+2)))
	}
}

// TestReplayHole shows the one recovery difference: a sequence the engine
// never buffered (a failed send) leaves a hole in its replay ring. When the
// next live batch reveals the gap, kvrelay records the hole and relays
// everything after it; the Python relay requires a contiguous replay and
// ends the stream with DATA_LOSS.
func TestReplayHole(t *testing.T) {
	kvrelayBin(t)
	peer := enginepeer.Start(t, enginepeer.Options{Engine: enginepeer.VLLM})
	pub, replay := peer.PubEndpoint(0), peer.ReplayEndpoint(0)
	kv := startKvrelay(t, "kvrelay serve", "vllm", kvEventsConfig("vllm", endpointPort(t, pub), endpointPort(t, replay)), 1, freePort(t))
	py, pyAddr := startPyRelay(t, "vllm", pub, replay, 1)
	logs := []*proc{kv.proc, py}
	kvLive := subscribeKv(t, "kvrelay", kv.addr, "vllm", &kvpb.SubscribeKvEventsRequest{})
	pyLive := subscribeKv(t, "python relay", pyAddr, "vllm", &kvpb.SubscribeKvEventsRequest{})
	d := newDiffRun(t, peer, "vllm", 1)
	pyLive.waitBatches(t, "a warm-up batch", func(bs []*kvpb.KvEventBatch) bool {
		if len(bs) == 0 {
			d.publish(0, "warm-up")
		}
		return len(bs) > 0
	}, logs...)

	// hole: neither sent nor buffered; dropped: buffered only; then live.
	if err := peer.BurnNext(0, 1); err != nil {
		t.Fatal(err)
	}
	res, err := peer.Publish(0, enginepeer.Stored(nil, tokens(4, 0), h(1)))
	if err != nil || res.Live || res.Buffered {
		t.Fatalf("burned publish: %+v %v", res, err)
	}
	hole := res.Seq
	d.next[0]++
	if err := peer.DropNext(0, 1); err != nil {
		t.Fatal(err)
	}
	dropped := d.publish(0, "dropped live, buffered", enginepeer.Stored(nil, tokens(4, 4), h(2)))
	after := d.publish(0, "live after the hole", enginepeer.Stored(hp(2), tokens(4, 8), h(3)))

	kvBatches := kvLive.waitBatches(t, "the batch after the hole", func(bs []*kvpb.KvEventBatch) bool {
		return hasAll(bs, map[int32]uint64{0: after})
	}, logs...)
	var seqs []uint64
	for _, b := range kvBatches {
		seqs = append(seqs, b.GetSequenceNumber())
	}
	if !hasAll(kvBatches, map[int32]uint64{0: dropped}) || hasAll(kvBatches, map[int32]uint64{0: hole}) {
		t.Errorf("kvrelay relayed seqs %v; want %d (from the replay) and %d but not the hole %d", seqs, dropped, after, hole)
	}
	waitFor(t, waitTimeout, func() (bool, string) {
		ms, err := scrape(kv.metrics + "/metrics")
		if err != nil {
			return false, err.Error()
		}
		lost, _ := metricSum(ms, "kvrelay_batches_lost_total", map[string]string{"rank": "0"})
		return lost == 1, fmt.Sprintf("kvrelay_batches_lost_total{rank=\"0\"} is %g, want 1", lost)
	}, logs...)

	waitFor(t, waitTimeout, func() (bool, string) {
		_, err := pyLive.snapshot()
		return err != nil, "the python stream is still open"
	}, logs...)
	_, pyErr := pyLive.snapshot()
	if status.Code(pyErr) != codes.DataLoss || !strings.Contains(status.Convert(pyErr).Message(), "not contiguous") {
		t.Errorf("python relay ended with %v; want DATA_LOSS for a replay that is not contiguous", pyErr)
	}
}
