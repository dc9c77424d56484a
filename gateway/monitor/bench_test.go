package monitor

import (
	"testing"

	"github.com/kvrelay/kvrelay/proto/kvpb"
)

type discardSink struct{}

func (discardSink) Apply(string, *kvpb.KvEventBatch) {}
func (discardSink) ClearWorker(string)               {}

// BenchmarkHandle measures the monitor's own cost per live batch (admission,
// metrics, block-size check), with a sink that does nothing.
func BenchmarkHandle(b *testing.B) {
	m, err := New(Options{})
	if err != nil {
		b.Fatal(err)
	}
	s := newSubscription(m, Worker{ID: "w", Addr: "w:1", Model: "m"}, discardSink{})
	batches := make([]*kvpb.KvEventBatch, 1024)
	for i := range batches {
		batches[i] = batch(int32(i%2), 0, stored(16, int64(i)))
	}
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		bt := batches[i%len(batches)]
		bt.SequenceNumber = uint64(i/2 + 1)
		s.handle(bt)
	}
}
