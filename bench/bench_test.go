package bench

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"
	"google.golang.org/protobuf/proto"

	"github.com/kvrelay/kvrelay/proto/kvpb"
	"github.com/kvrelay/kvrelay/relay"
	"github.com/kvrelay/kvrelay/testkit/pyenv"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m,
		// grpc-go's client keeps a resolver goroutine briefly after Close.
		goleak.IgnoreTopFunction("google.golang.org/grpc/internal/grpcsync.(*CallbackSerializer).run"),
	)
}

// TestQuick runs `kvrelay bench --quick` end to end (the relay in-process)
// and checks that every part produced its table (bench/plot tests the
// plots). It asserts no
// timing: the figures of a quick run on a CI machine mean nothing.
func TestQuick(t *testing.T) {
	if testing.Short() {
		t.Skip("starts Python peers")
	}
	out := t.TempDir()
	// Only a backstop against a hang: a quick run takes about a minute on
	// a loaded 2-core machine, and waits longer for a relay that is slow
	// but still delivering.
	ctx, cancel := context.WithTimeout(context.Background(), 8*time.Minute)
	defer cancel()
	res, err := Run(ctx, Options{Quick: true, Out: out, Repo: pyenv.RepoRoot(), Python: pyenv.Python(t)})
	if err != nil {
		t.Fatal(err)
	}
	sb := res.SideBySide
	if sb == nil || len(sb.Relays) != 3 {
		t.Fatalf("side by side: %+v", sb)
	}
	for _, r := range sb.Relays {
		if !r.Available {
			t.Errorf("%s not available: %s", r.Name, r.Reason)
			continue
		}
		if r.step(1000) == nil || r.step(10000) == nil {
			t.Errorf("%s lacks the 1,000 or the 10,000 batches/s step: %+v", r.Name, r.Steps)
		}
		for _, s := range r.Steps {
			t.Logf("%s at %.0f/s: published %d, received %d, p50 %.1f ms: %s", r.Name, s.Target, s.Published, s.Received, s.P50ms, s.Verdict)
			if s.Published == 0 || s.Received == 0 {
				t.Errorf("%s at %.0f/s: published %d, received %d (%s)", r.Name, s.Target, s.Published, s.Received, s.Verdict)
			}
		}
	}
	if sb.Relays[1].PeakRSS == 0 {
		t.Error("the Python relay's peak RSS was not read")
	}
	if sc := res.Scale; sc == nil || len(sc.Snapshot) == 0 || len(sc.Resume) == 0 || len(sc.Fanout) == 0 {
		t.Errorf("scale curves missing: %+v", sc)
	} else if sc.Snapshot[0].Chunks == 0 {
		t.Error("the snapshot point has no chunk")
	}
	if rt := res.Route; rt == nil || len(rt.Points) == 0 {
		t.Errorf("route points missing: %+v", rt)
	}
	md, err := os.ReadFile(filepath.Join(out, "results.md"))
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"kvrelay / Python", "Goals of issue 7", "snapshot", "Fan-out", "route"} {
		if !strings.Contains(string(md), want) {
			t.Errorf("results.md lacks %q", want)
		}
	}
	if _, err := os.Stat(filepath.Join(out, "results.json")); err != nil {
		t.Error(err)
	}
}

// TestSummarize checks the subscriber's wire reader against real protobuf
// encodings, including the fields it skips.
func TestSummarize(t *testing.T) {
	h := encodeBlockHash(1, 12345, 0)
	tests := []struct {
		name  string
		batch *kvpb.KvEventBatch
		want  batchSummary
	}{
		{
			name: "store and removal",
			batch: &kvpb.KvEventBatch{
				SequenceNumber: 9, Timestamp: 1796225246.5, DpRank: proto.Int32(1),
				Events: []*kvpb.KvCacheEvent{
					{EventId: 1, Data: &kvpb.KvCacheEvent_Removed{Removed: &kvpb.KvBlocksRemoved{BlockHashes: []int64{5, 6}}}},
					{EventId: 2, Data: &kvpb.KvCacheEvent_Stored{Stored: &kvpb.KvBlocksStored{
						Medium: proto.String("GPU"),
						Blocks: []*kvpb.KvBlock{
							{BlockHash: int64(h), TokenIds: []uint32{1, 2, 3}, BlockSize: 16},
							{BlockHash: int64(h + 1), TokenIds: []uint32{4}, BlockSize: 16},
						},
					}}},
				},
				Load: &kvpb.EngineLoad{RunningRequests: 3},
			},
			want: batchSummary{timestamp: 1796225246.5, blocks: 2, firstHash: h, hasHash: true},
		},
		{
			name:  "snapshot chunk",
			batch: &kvpb.KvEventBatch{Timestamp: 2, Snapshot: &kvpb.KvSnapshotChunk{}},
			want:  batchSummary{timestamp: 2, snapshot: true},
		},
		{name: "empty", batch: &kvpb.KvEventBatch{}, want: batchSummary{}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			b, err := proto.Marshal(tt.batch)
			if err != nil {
				t.Fatal(err)
			}
			got, err := summarize(b)
			if err != nil {
				t.Fatal(err)
			}
			if got != tt.want {
				t.Errorf("summarize = %+v, want %+v", got, tt.want)
			}
		})
	}
}

// TestSummarizeRejectsGarbage: a truncated message is an error, not a panic.
func TestSummarizeRejectsGarbage(t *testing.T) {
	b, err := proto.Marshal(&kvpb.KvEventBatch{Timestamp: 1, Events: []*kvpb.KvCacheEvent{
		{Data: &kvpb.KvCacheEvent_Stored{Stored: &kvpb.KvBlocksStored{Blocks: []*kvpb.KvBlock{{BlockHash: 7}}}}},
	}})
	if err != nil {
		t.Fatal(err)
	}
	// A cut inside a field breaks the framing for both readers; a cut at a
	// field boundary leaves a valid, shorter message for both.
	for cut := 1; cut < len(b); cut++ {
		_, err := summarize(b[:cut])
		perr := proto.Unmarshal(b[:cut], &kvpb.KvEventBatch{})
		if (err != nil) != (perr != nil) {
			t.Errorf("cut at %d: summarize says %v, protobuf says %v", cut, err, perr)
		}
	}
}

func FuzzSummarize(f *testing.F) {
	b, _ := proto.Marshal(&kvpb.KvEventBatch{Timestamp: 1, Events: []*kvpb.KvCacheEvent{
		{Data: &kvpb.KvCacheEvent_Stored{Stored: &kvpb.KvBlocksStored{Blocks: []*kvpb.KvBlock{{BlockHash: -7, TokenIds: []uint32{1}}}}}},
	}})
	f.Add(b)
	f.Add([]byte{})
	f.Fuzz(func(t *testing.T, data []byte) {
		_, _ = summarize(data) // must not panic
	})
}

func relayMessage(seq uint64, payload []byte) relay.Message {
	return relay.Message{Seq: seq, Payload: payload}
}

func TestBlockHashRoundTrip(t *testing.T) {
	for _, c := range []struct {
		rank int
		seq  uint64
		j    int
	}{{0, 0, 0}, {1, 1<<48 - 1, 63}, {127, 42, 255}} {
		rank, seq, j, ok := decodeBlockHash(encodeBlockHash(c.rank, c.seq, c.j))
		if !ok || rank != c.rank || seq != c.seq || j != c.j {
			t.Errorf("%+v round-trips to rank %d seq %d j %d ok %v", c, rank, seq, j, ok)
		}
	}
	if _, _, _, ok := decodeBlockHash(12345); ok {
		t.Error("a hash without the marker bit decoded")
	}
}

// TestPayloadEncoderDecodes: the in-memory stream is what the relay's own
// vLLM decoder accepts, and carries the store and the eviction.
func TestPayloadEncoderDecodes(t *testing.T) {
	m, err := newMemRelay(1, 16)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- m.relay.Run(ctx) }()
	defer func() { cancel(); <-done }()
	enc := newPayloadEncoder()
	const evict = 4
	for seq := range uint64(10) {
		m.feeds[0].ch <- relayMessage(seq, enc.batch(0, seq, evict, time.Now()))
	}
	if err := m.waitRelayed(ctx, 10); err != nil {
		t.Fatal(err)
	}
	// 10 stores, the first 6 of them evicted again.
	if got, want := m.relay.Status().RecordBlocks, uint64(evict*storeBlocks); got != want {
		t.Errorf("record holds %d blocks, want %d", got, want)
	}
}
