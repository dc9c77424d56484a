package monitor

import (
	"math/rand/v2"
	"runtime"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/protobuf/proto"

	"github.com/kvrelay/kvrelay/proto/kvdec"
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

// liveFrames are n batches of the bench's live stream as a relay sends them:
// two ranks, each batch a 64-block vLLM store of 16-token blocks (ids below
// 152,000) and the removal of the 64 blocks its rank stored 512 batches
// earlier.
func liveFrames(tb testing.TB, n int) [][]byte {
	tb.Helper()
	r := rand.New(rand.NewPCG(5, 6))
	frames := make([][]byte, n)
	for i := range frames {
		rank := int32(i % 2)
		st := &kvpb.KvBlocksStored{ParentBlockHash: proto.Int64(int64(i)<<8 - 1)}
		rm := &kvpb.KvBlocksRemoved{}
		for j := range 64 {
			toks := make([]uint32, 16)
			for k := range toks {
				toks[k] = r.Uint32N(152_000)
			}
			st.Blocks = append(st.Blocks, &kvpb.KvBlock{BlockHash: int64(i)<<8 | int64(j), TokenIds: toks, BlockSize: 16})
			rm.BlockHashes = append(rm.BlockHashes, int64(i-1024)<<8|int64(j))
		}
		b := &kvpb.KvEventBatch{SequenceNumber: uint64(i / 2), DpRank: &rank, Timestamp: 1.7e9,
			Events: []*kvpb.KvCacheEvent{{EventId: uint64(i), Data: &kvpb.KvCacheEvent_Stored{Stored: st}}}}
		if i >= 1024 {
			b.Events = append(b.Events, &kvpb.KvCacheEvent{EventId: uint64(i), Data: &kvpb.KvCacheEvent_Removed{Removed: rm}})
		}
		f, err := proto.Marshal(b)
		if err != nil {
			tb.Fatal(err)
		}
		frames[i] = f
	}
	return frames
}

// BenchmarkReceiveLiveBatch is the gateway's receive path per live batch:
// decode a frame, then the monitor's admission (a sink that does nothing),
// with the generated client's proto.Unmarshal and with the monitor's kvdec
// decoder, both in every iteration in alternating order (an interleaved A/B
// on a shared machine). cpu-µs is the process's CPU time per batch, GC
// included; allocs is heap allocations per batch.
func BenchmarkReceiveLiveBatch(b *testing.B) {
	frames := liveFrames(b, 4096)
	var dec kvdec.Decoder
	run := func(useKvdec bool, s *subscription, seq *uint64) {
		for _, f := range frames {
			var bt *kvpb.KvEventBatch
			if useKvdec {
				var err error
				if bt, err = dec.Decode(f); err != nil {
					b.Fatal(err)
				}
			} else {
				bt = &kvpb.KvEventBatch{}
				if err := proto.Unmarshal(f, bt); err != nil {
					b.Fatal(err)
				}
			}
			*seq++
			bt.SequenceNumber = *seq / 2 // always the next one: every batch is applied
			s.handle(bt)
		}
	}
	m, err := New(Options{Registerer: prometheus.NewRegistry()})
	if err != nil {
		b.Fatal(err)
	}
	subs := [2]*subscription{
		newSubscription(m, Worker{ID: "a", Addr: "a:1", Model: "m"}, discardSink{}),
		newSubscription(m, Worker{ID: "b", Addr: "b:1", Model: "m"}, discardSink{}),
	}
	var seqs [2]uint64
	var cpu [2]time.Duration
	var allocs [2]uint64
	var ms runtime.MemStats
	i := 0
	for b.Loop() {
		for k := range 2 {
			which := (i + k) % 2 // 0: proto.Unmarshal, 1: kvdec
			runtime.ReadMemStats(&ms)
			a0, c0 := ms.Mallocs, processCPU()
			run(which == 1, subs[which], &seqs[which])
			cpu[which] += processCPU() - c0
			runtime.ReadMemStats(&ms)
			allocs[which] += ms.Mallocs - a0
		}
		i++
	}
	per := float64(b.N * len(frames))
	b.ReportMetric(float64(cpu[0].Microseconds())/per, "unmarshal-cpu-µs/batch")
	b.ReportMetric(float64(cpu[1].Microseconds())/per, "kvdec-cpu-µs/batch")
	b.ReportMetric(float64(allocs[0])/per, "unmarshal-allocs/batch")
	b.ReportMetric(float64(allocs[1])/per, "kvdec-allocs/batch")
}

func processCPU() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		panic(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
