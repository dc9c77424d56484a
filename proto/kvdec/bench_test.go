package kvdec_test

import (
	"math/rand/v2"
	"slices"
	"syscall"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"

	"github.com/kvrelay/kvrelay/proto/kvdec"
	"github.com/kvrelay/kvrelay/proto/kvpb"
	"github.com/kvrelay/kvrelay/relay/record"
)

// snapshotChunks is the wire of a whole snapshot of n live blocks as the
// relay sends it (record.ChunkStream.NextEncoded): one rank, 64-block
// chained vLLM stores of 16 tokens (ids < 152,000), the workload of
// BenchmarkSnapshotDelivery; lora namespaces every store.
func snapshotChunks(tb testing.TB, n int, lora bool) [][]byte {
	tb.Helper()
	rec := record.New()
	r := rand.New(rand.NewPCG(3, 4))
	for i := range n / 64 {
		st := &kvpb.KvBlocksStored{}
		if i > 0 {
			st.ParentBlockHash = proto.Int64(int64(i * 64))
		}
		if lora {
			st.LoraName = proto.String("adapter-7")
		}
		for j := range 64 {
			toks := make([]uint32, 16)
			for k := range toks {
				toks[k] = r.Uint32N(152_000)
			}
			blk := &kvpb.KvBlock{BlockHash: int64(i*64 + j + 1), TokenIds: toks, BlockSize: 16}
			if lora {
				blk.LoraId = proto.Int64(7)
			}
			st.Blocks = append(st.Blocks, blk)
		}
		rec.Apply(&kvpb.KvEventBatch{SequenceNumber: uint64(i), DpRank: proto.Int32(0),
			Events: []*kvpb.KvCacheEvent{{Data: &kvpb.KvCacheEvent_Stored{Stored: st}}}})
	}
	cut := rec.Cut(nil)
	defer cut.Release()
	var chunks [][]byte
	st := cut.Stream(map[int32]uint64{0: uint64(n / 64)}, nil, 1)
	for c := st.NextEncoded(); c != nil; c = st.NextEncoded() {
		chunks = append(chunks, slices.Clone(c))
	}
	return chunks
}

func processCPU() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		panic(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// BenchmarkDecodeSnapshot decodes every chunk of a 1 M-block snapshot with
// proto.Unmarshal and with one kvdec.Decoder, both in every iteration, in
// alternating order (an interleaved A/B on a shared machine); cpu-ms is the
// process's CPU time for one whole snapshot (the GC's work for what each
// allocates included), the median over the iterations.
func BenchmarkDecodeSnapshot(b *testing.B) {
	for _, wl := range []struct {
		name string
		lora bool
	}{{"plain", false}, {"lora", true}} {
		b.Run(wl.name, func(b *testing.B) {
			chunks := snapshotChunks(b, 1_000_000, wl.lora)
			var d kvdec.Decoder
			unmarshal := func() uint64 {
				var n uint64
				for _, c := range chunks {
					m := &kvpb.KvEventBatch{}
					if err := proto.Unmarshal(c, m); err != nil {
						b.Fatal(err)
					}
					for _, ev := range m.Events {
						n += uint64(len(ev.GetStored().GetBlocks()))
					}
				}
				return n
			}
			decode := func() uint64 {
				var n uint64
				for _, c := range chunks {
					m, err := d.Decode(c)
					if err != nil {
						b.Fatal(err)
					}
					for _, ev := range m.Events {
						n += uint64(len(ev.GetStored().GetBlocks()))
					}
				}
				return n
			}
			var cpuA, cpuB []time.Duration
			i := 0
			for b.Loop() {
				for k := range 2 {
					run, into := unmarshal, &cpuA
					if (i+k)%2 == 1 {
						run, into = decode, &cpuB
					}
					c0 := processCPU()
					if got := run(); got != 1_000_000 {
						b.Fatalf("decoded %d blocks", got)
					}
					*into = append(*into, processCPU()-c0)
				}
				i++
			}
			med := func(ds []time.Duration) float64 {
				slices.Sort(ds)
				return float64(ds[len(ds)/2]) / 1e6
			}
			b.ReportMetric(med(cpuA), "unmarshal-cpu-ms")
			b.ReportMetric(med(cpuB), "kvdec-cpu-ms")
			b.ReportMetric(med(cpuA)/med(cpuB), "ratio")
		})
	}
}
