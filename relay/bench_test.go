package relay

import (
	"context"
	"fmt"
	"testing"

	dto "github.com/prometheus/client_model/go"

	"github.com/kvrelay/kvrelay/engines"
	"github.com/kvrelay/kvrelay/proto/kvpb"
)

// benchRelay builds a relay whose rank 0 is driven directly (no Run).
func benchRelay(b *testing.B, history int) (*Relay, *rankState) {
	r, err := New(Config{
		Engine: engineForTest(), DPSize: 1, HistoryBatches: history, Logger: quietLogger(),
		KV: engines.Config{Enabled: true, Endpoint: "tcp://*:5557"},
	})
	if err != nil {
		b.Fatal(err)
	}
	return r, r.ranks[0]
}

// storeBatch is one batch storing n chained blocks starting at hash h.
func storeBatch(h int64, n int) []byte {
	hashes := make([]int64, n)
	for i := range hashes {
		hashes[i] = h + int64(i)
	}
	return payload(0, stored(-1, hashes...))
}

// BenchmarkRelayBatch measures admission of one 16-block batch (normalize,
// history, record, fan-out) with subscribers reading along.
func BenchmarkRelayBatch(b *testing.B) {
	for _, subs := range []int{0, 8} {
		b.Run(fmt.Sprintf("subscribers=%d", subs), func(b *testing.B) {
			r, rk := benchRelay(b, 10_000)
			ctx, cancel := context.WithCancel(context.Background())
			done := make(chan struct{})
			for i := 0; i < subs; i++ {
				s, err := r.Subscribe(ctx, &kvpb.SubscribeKvEventsRequest{})
				if err != nil {
					b.Fatal(err)
				}
				go func() {
					defer func() { done <- struct{}{} }()
					for {
						// As the gRPC server reads: the bytes.
						if _, err := s.NextEncoded(ctx); err != nil {
							return
						}
					}
				}()
			}
			payloads := make([][]byte, 1024)
			for i := range payloads {
				payloads[i] = storeBatch(int64(i)*16, 16)
			}
			b.ReportAllocs()
			seq := uint64(0)
			for b.Loop() {
				r.relay(rk, seq, payloads[seq%1024])
				seq++
			}
			cancel()
			for i := 0; i < subs; i++ {
				<-done
			}
		})
	}
}

// BenchmarkSnapshotSubscribe measures a cursor-0 subscription that gets a
// snapshot of a large record: time under the admission lock, and in total
// (cut, order, encode).
func BenchmarkSnapshotSubscribe(b *testing.B) {
	for _, blocks := range []int{100_000, 1_000_000} {
		b.Run(fmt.Sprintf("blocks=%d", blocks), func(b *testing.B) {
			r, rk := benchRelay(b, 16)
			const per = 64
			for i := 0; i < blocks/per; i++ {
				r.relay(rk, uint64(i), storeBatch(int64(i)*per+1, per))
			}
			var chunks int
			for b.Loop() {
				s, err := r.Subscribe(context.Background(), &kvpb.SubscribeKvEventsRequest{})
				if err != nil {
					b.Fatal(err)
				}
				chunks = 0
				for s.nextSnapshotChunk() != nil { // what Next does, chunk by chunk
					chunks++
				}
				s.Close()
			}
			var lock, total dto.Metric
			_ = r.metrics.snapshotLock.Write(&lock)
			_ = r.metrics.snapshotTotal.Write(&total)
			n := float64(lock.GetHistogram().GetSampleCount())
			b.ReportMetric(lock.GetHistogram().GetSampleSum()/n*1e3, "lock-ms/op")
			b.ReportMetric(total.GetHistogram().GetSampleSum()/n*1e3, "total-ms/op")
			b.ReportMetric(float64(chunks), "chunks")
		})
	}
}
