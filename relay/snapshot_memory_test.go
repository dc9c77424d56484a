package relay

import (
	"context"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/kvrelay/kvrelay/engines"
	"github.com/kvrelay/kvrelay/proto/kvpb"
)

func TestASnapshotIsEncodedOneChunkAtATime(t *testing.T) {
	// A cursor-0 subscriber of a relay whose history no longer starts at
	// the publisher's first batch gets a snapshot. The relay used to encode
	// every chunk on the first Next and hold them until sent: a subscriber
	// that never read kept a full encoding of the state (1.57 M blocks: 10
	// idle subscribers took 2.9 GiB).
	r, err := New(Config{
		Engine: engineForTest(), DPSize: 1, HistoryBatches: 16, Logger: quietLogger(),
		KV: engines.Config{Enabled: true, Endpoint: "tcp://*:5557"},
	})
	if err != nil {
		t.Fatal(err)
	}
	rk := r.ranks[0]
	const batches, per = 64, 1024
	for i := 0; i < batches; i++ {
		r.relay(rk, uint64(i), storeBatch(int64(i)*per+1, per))
	}
	s, err := r.Subscribe(context.Background(), &kvpb.SubscribeKvEventsRequest{})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	ctx := context.Background()
	first, err := s.Next(ctx)
	if err != nil {
		t.Fatal(err)
	}
	count := first.GetSnapshot().GetCount()
	if count < 4 {
		t.Fatalf("the snapshot has %d chunks; the test needs several", count)
	}
	blocks := 0
	for i := uint32(0); ; i++ {
		if held := len(s.pending); held != 0 {
			t.Fatalf("after chunk %d of %d the subscription holds %d more encoded batches, want none", i, count, held)
		}
		for _, ev := range first.GetEvents() {
			blocks += len(ev.GetStored().GetBlocks())
		}
		if i+1 == count {
			break
		}
		if first, err = s.Next(ctx); err != nil {
			t.Fatal(err)
		}
		if got := first.GetSnapshot().GetIndex(); got != i+1 {
			t.Fatalf("chunk index %d, want %d", got, i+1)
		}
	}
	if blocks != batches*per {
		t.Fatalf("the snapshot carried %d blocks, want %d", blocks, batches*per)
	}
	if s.snap.Load() != nil {
		t.Fatal("the cut is still held after the last chunk")
	}
}

func TestARankPastTheRecordCapServesAnIncompleteSnapshot(t *testing.T) {
	// Blocks never removed (a leak, or a huge offload tier) used to grow
	// the record without bound (1.57 M blocks: 401 MiB).
	reg := prometheus.NewRegistry()
	r, err := New(Config{
		Engine: engineForTest(), DPSize: 1, HistoryBatches: 16, Logger: quietLogger(), Registerer: reg,
		RecordMaxEntries: 1000,
		KV:               engines.Config{Enabled: true, Endpoint: "tcp://*:5557"},
	})
	if err != nil {
		t.Fatal(err)
	}
	rk := r.ranks[0]
	const batches, per = 40, 64
	for i := 0; i < batches; i++ {
		r.relay(rk, uint64(i), storeBatch(int64(i)*per+1, per))
	}
	_, blocks, entries := r.rec.stats()
	if entries > 1000 || blocks > 1000 {
		t.Fatalf("the record holds %d entries (%d blocks), over the cap of 1000", entries, blocks)
	}
	evicted := testutil.ToFloat64(r.metrics.recordEvicted.WithLabelValues(rk.label))
	if evicted != float64(batches*per)-float64(entries) {
		t.Fatalf("kvrelay_record_evicted_total = %v, want %d", evicted, batches*per-int(entries))
	}
	s, err := r.Subscribe(context.Background(), &kvpb.SubscribeKvEventsRequest{})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	b, err := s.Next(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if b.GetSnapshot() == nil || b.GetSnapshot().GetUnknownBefore() == 0 {
		t.Fatalf("the first batch %v does not mark the snapshot incomplete", b.GetSnapshot())
	}
}

func TestASubscribersQueueIsBoundedInBytes(t *testing.T) {
	tests := []struct {
		name   string
		bytes  int
		blocks int // per batch
	}{
		{"small batches", 16 << 10, 16},
		{"large batches", 256 << 10, 1024},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			reg := prometheus.NewRegistry()
			r, err := New(Config{
				Engine: engineForTest(), DPSize: 1, HistoryBatches: 10_000, Logger: quietLogger(), Registerer: reg,
				SubscriberBufferBytes: tt.bytes,
				KV:                    engines.Config{Enabled: true, Endpoint: "tcp://*:5557"},
			})
			if err != nil {
				t.Fatal(err)
			}
			rk := r.ranks[0]
			s, err := r.Subscribe(context.Background(), &kvpb.SubscribeKvEventsRequest{})
			if err != nil {
				t.Fatal(err)
			}
			defer s.Close()
			const batches = 200 // far under the 4,096-batch count bound
			for i := 0; i < batches; i++ {
				r.relay(rk, uint64(i), storeBatch(int64(i)*int64(tt.blocks)+1, tt.blocks))
				s.mu.Lock()
				held := s.qbytes
				s.mu.Unlock()
				if held > tt.bytes {
					t.Fatalf("after batch %d the queue holds %d encoded bytes, over its bound %d", i, held, tt.bytes)
				}
			}
			if got := testutil.ToFloat64(r.metrics.lagged); got != 1 {
				t.Fatalf("kvrelay_subscribers_lagged_total = %v, want 1", got)
			}
			// Refilled from the history, the subscriber still sees every batch.
			for i := 0; i < batches; i++ {
				b, err := s.Next(context.Background())
				if err != nil {
					t.Fatal(err)
				}
				if b.GetSequenceNumber() != uint64(i) {
					t.Fatalf("batch %d has sequence %d", i, b.GetSequenceNumber())
				}
			}
		})
	}
}
