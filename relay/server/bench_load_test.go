package server_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"sync"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/encoding"
	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/proto"

	"github.com/kvrelay/kvrelay/engines/load"
	"github.com/kvrelay/kvrelay/engines/vllm"
	"github.com/kvrelay/kvrelay/proto/kvpb"
	"github.com/kvrelay/kvrelay/relay/server"
)

// blocksPerBatch is the benchmark batch: one stored event of 16 blocks of
// 16 tokens, an engine step's worth.
const blocksPerBatch = 16

func benchBatch(tb testing.TB) []byte {
	blocks := make([]*kvpb.KvBlock, blocksPerBatch)
	for i := range blocks {
		toks := make([]uint32, 16)
		for j := range toks {
			toks[j] = uint32(1000*i + j)
		}
		blocks[i] = &kvpb.KvBlock{BlockHash: int64(0x1234567 * (i + 1)), TokenIds: toks, BlockSize: 16}
	}
	b, err := proto.Marshal(&kvpb.KvEventBatch{SequenceNumber: 12345, Timestamp: 1.7e9, DpRank: proto.Int32(1),
		Events: []*kvpb.KvCacheEvent{{EventId: 9, Data: &kvpb.KvCacheEvent_Stored{Stored: &kvpb.KvBlocksStored{Blocks: blocks}}}}})
	if err != nil {
		tb.Fatal(err)
	}
	return b
}

// cannedStream hands out one encoding n times, then waits like a quiet
// relay subscription (NextEncodedUntil's contract).
type cannedStream struct {
	enc  []byte
	left int
}

func (c *cannedStream) Next(context.Context) (*kvpb.KvEventBatch, error) { panic("encoded only") }
func (c *cannedStream) Close()                                           {}
func (c *cannedStream) NextEncoded(ctx context.Context) ([]byte, error) {
	return c.NextEncodedUntil(ctx, nil, nil)
}

func (c *cannedStream) NextEncodedUntil(ctx context.Context, wake <-chan struct{}, due <-chan time.Time) ([]byte, error) {
	if c.left > 0 {
		c.left--
		return c.enc, nil
	}
	select {
	case <-ctx.Done():
		return nil, ctx.Err()
	case <-wake:
	case <-due:
	}
	return nil, nil
}

// fixedLoad is a fetcher reporting the same two ranks every read.
type fixedLoad struct{}

func (fixedLoad) Name() string { return "fixed" }
func (fixedLoad) Fetch(context.Context, int64) (map[int32]*kvpb.EngineLoad, error) {
	l := &kvpb.EngineLoad{RunningRequests: 3, WaitingRequests: 1, TokenUsage: 0.25, GenThroughput: 400,
		WaitingUncachedTokens: proto.Uint32(100), CacheHitRate: proto.Float64(0.5), NumUsedTokens: proto.Int32(1000)}
	return map[int32]*kvpb.EngineLoad{0: l, 1: l}, nil
}

// rawCodec lets the benchmark's client take messages as bytes, so the
// measured CPU is the server's, not the client's decoding.
type rawCodec struct{}

func (rawCodec) Name() string { return "proto" }
func (rawCodec) Marshal(v any) (mem.BufferSlice, error) {
	b, err := proto.Marshal(v.(proto.Message))
	return mem.BufferSlice{mem.SliceBuffer(b)}, err
}
func (rawCodec) Unmarshal(data mem.BufferSlice, v any) error {
	*(v.(*[]byte)) = data.Materialize()
	return nil
}

var _ encoding.CodecV2 = rawCodec{}

func cpuTime() time.Duration {
	var ru syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// benchServer serves streams of canned batches, each handed out n times,
// with or without a load source.
func benchServer(tb testing.TB, n int, src server.LoadSource, limits server.Limits) (*grpc.ClientConn, func()) {
	enc := benchBatch(tb)
	svc := server.Service{Engine: vllm.Engine, Ready: func() bool { return true },
		Subscribe: func(context.Context, *kvpb.SubscribeKvEventsRequest) (server.Stream, error) {
			return &cannedStream{enc: enc, left: n}, nil
		}}
	if src != nil {
		svc.Load = src
	}
	srv, err := server.New(server.Options{Services: []server.Service{svc}, Limits: limits,
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil)), ShutdownGrace: time.Second})
	if err != nil {
		tb.Fatal(err)
	}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatal(err)
	}
	go func() { _ = srv.Serve(lis) }()
	cc, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDefaultCallOptions(grpc.ForceCodecV2(rawCodec{})))
	if err != nil {
		tb.Fatal(err)
	}
	return cc, func() { _ = cc.Close(); srv.Stop() }
}

func openStream(ctx context.Context, cc *grpc.ClientConn) (grpc.ClientStream, error) {
	desc := &grpc.StreamDesc{ServerStreams: true}
	st, err := cc.NewStream(ctx, desc, "/vllm.grpc.engine.VllmEngine/SubscribeKvEvents")
	if err != nil {
		return nil, err
	}
	if err := st.SendMsg(&kvpb.SubscribeKvEventsRequest{}); err != nil {
		return nil, err
	}
	return st, st.CloseSend()
}

func startPoller(tb testing.TB) (*load.Poller, func()) {
	p, err := load.NewPoller(load.Options{Fetcher: fixedLoad{}, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		tb.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = p.Run(ctx) }()
	for {
		if _, ok := p.Latest(0); ok {
			break
		}
		time.Sleep(time.Millisecond)
	}
	return p, func() { cancel(); <-done }
}

// BenchmarkStreamStamping sends b.N batches of 16 blocks to one subscriber
// over loopback gRPC, without and with the load record stamped on each;
// cpu-ns/block is the process's CPU (server and a client that does not
// decode) per block. Compare the two sub-benchmarks of one run.
func BenchmarkStreamStamping(b *testing.B) {
	for _, withLoad := range []bool{false, true} {
		b.Run(fmt.Sprintf("load=%v", withLoad), func(b *testing.B) {
			var src server.LoadSource
			if withLoad {
				p, stop := startPoller(b)
				defer stop()
				src = p
			}
			cc, stop := benchServer(b, b.N, src, server.Limits{})
			defer stop()
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			b.ResetTimer()
			cpu0 := cpuTime()
			st, err := openStream(ctx, cc)
			if err != nil {
				b.Fatal(err)
			}
			var got []byte
			for i := 0; i < b.N; i++ {
				if err := st.RecvMsg(&got); err != nil {
					b.Fatal(err)
				}
				if i == 0 && withLoad && len(got) == len(benchBatch(b)) {
					b.Fatal("no record on the batch")
				}
			}
			b.StopTimer()
			b.ReportMetric(float64(cpuTime()-cpu0)/float64(b.N*blocksPerBatch), "cpu-ns/block")
		})
	}
}

// TestQuietStreamsHeartbeatCost is the cost of 1,000 quiet streams'
// heartbeats: each gets one batch, then only load_only batches (1 s, then
// every 5 s once unchanged). Run with KVRELAY_MEASURE=1; it reports the
// process's CPU over a 12 s window past the backoff as a fraction of one
// core, beside the same streams with no load source.
func TestQuietStreamsHeartbeatCost(t *testing.T) {
	if testing.Short() || !measure() {
		t.Skip("a measurement (KVRELAY_MEASURE=1), not a check")
	}
	const streams = 1000
	window := 12 * time.Second
	for _, withLoad := range []bool{false, true} {
		var src server.LoadSource
		stopPoller := func() {}
		if withLoad {
			var p *load.Poller
			p, stopPoller = startPoller(t)
			src = p
		}
		cc, stop := benchServer(t, 1, src, server.Limits{MaxSubscribers: streams, MaxSubscribersPerPeer: streams, MaxStreamsPerConn: streams + 10})
		ctx, cancel := context.WithCancel(context.Background())
		var wg sync.WaitGroup
		var mu sync.Mutex
		received := 0
		for i := 0; i < streams; i++ {
			st, err := openStream(ctx, cc)
			if err != nil {
				t.Fatal(err)
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				var got []byte
				for st.RecvMsg(&got) == nil {
					mu.Lock()
					received++
					mu.Unlock()
				}
			}()
		}
		// Past the first heartbeats and into the 5 s backoff.
		time.Sleep(4 * time.Second)
		mu.Lock()
		r0 := received
		mu.Unlock()
		cpu0, wall0 := cpuTime(), time.Now()
		time.Sleep(window)
		cpu, wall := cpuTime()-cpu0, time.Since(wall0)
		mu.Lock()
		msgs := received - r0
		mu.Unlock()
		t.Logf("load=%v: %d quiet streams, %d messages in %v: %.2f%% of one core (process CPU %v)",
			withLoad, streams, msgs, wall.Round(time.Millisecond), 100*cpu.Seconds()/wall.Seconds(), cpu.Round(time.Millisecond))
		cancel()
		wg.Wait()
		stop()
		stopPoller()
	}
}

func measure() bool { return os.Getenv("KVRELAY_MEASURE") == "1" }

// BenchmarkStampWork is the stamping's own work per batch, without the
// transport: the scan for the batch's rank and sequence and the record's
// bytes (server.StampForBench runs what the send path runs for a batch
// from the history or a snapshot; a live batch's key comes from the relay
// without the scan).
func BenchmarkStampWork(b *testing.B) {
	p, stop := startPoller(b)
	defer stop()
	enc := benchBatch(b)
	rec := load.NewRecorder(p)
	var slab server.SuffixSlab
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if suffix := server.StampForBench(rec, &slab, enc); len(suffix) == 0 {
			b.Fatal("no record")
		}
	}
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*blocksPerBatch), "ns/block")
}
