package monitor

import (
	"context"
	"fmt"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/mem"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/proto"

	"github.com/kvrelay/kvrelay/proto/kvpb"
)

// frameCodec is a server codec that sends []byte frames as they are, so a
// test can put any bytes on the wire, and reads requests as protobuf.
type frameCodec struct{}

func (frameCodec) Name() string { return "proto" }

func (frameCodec) Marshal(v any) (mem.BufferSlice, error) {
	b, ok := v.(*[]byte)
	if !ok {
		return nil, fmt.Errorf("frameCodec: cannot marshal %T", v)
	}
	return mem.BufferSlice{mem.SliceBuffer(*b)}, nil
}

func (frameCodec) Unmarshal(data mem.BufferSlice, v any) error {
	return proto.Unmarshal(data.Materialize(), v.(proto.Message))
}

// frameServer serves SubscribeKvEvents under the three service names with
// frames the test gives; it records each call's method and content-type.
type frameServer struct {
	addr string
	mu   sync.Mutex
	seen []string // "method content-type" per call
	// frames is what every call sends before it waits for the client to go.
	frames [][]byte
}

func startFrameServer(t *testing.T, frames ...[]byte) *frameServer {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	fs := &frameServer{addr: lis.Addr().String(), frames: frames}
	srv := grpc.NewServer(grpc.ForceServerCodecV2(frameCodec{}))
	for _, name := range []string{"vllm.grpc.engine.VllmEngine", "sglang.grpc.scheduler.SglangScheduler", "tokenspeed.grpc.scheduler.TokenSpeedScheduler"} {
		srv.RegisterService(&grpc.ServiceDesc{
			ServiceName: name,
			HandlerType: (*any)(nil),
			Streams: []grpc.StreamDesc{{StreamName: "SubscribeKvEvents", ServerStreams: true,
				Handler: func(_ any, stream grpc.ServerStream) error { return fs.serve(stream) }}},
		}, nil)
	}
	go func() { _ = srv.Serve(lis) }()
	t.Cleanup(srv.Stop)
	return fs
}

func (fs *frameServer) serve(stream grpc.ServerStream) error {
	var req kvpb.SubscribeKvEventsRequest
	if err := stream.RecvMsg(&req); err != nil {
		return err
	}
	method, _ := grpc.MethodFromServerStream(stream)
	md, _ := metadata.FromIncomingContext(stream.Context())
	fs.mu.Lock()
	fs.seen = append(fs.seen, method+" "+strings.Join(md.Get("content-type"), ","))
	fs.mu.Unlock()
	if err := stream.SendHeader(nil); err != nil {
		return err
	}
	for _, f := range fs.frames {
		if err := stream.SendMsg(&f); err != nil {
			return err
		}
	}
	<-stream.Context().Done()
	return nil
}

func (fs *frameServer) calls() []string {
	fs.mu.Lock()
	defer fs.mu.Unlock()
	return append([]string(nil), fs.seen...)
}

func runMonitor(t *testing.T, w Worker, sink Sink) *Monitor {
	t.Helper()
	mon, err := New(fastOptions(prometheus.NewRegistry()))
	if err != nil {
		t.Fatal(err)
	}
	if err := mon.Add(w, sink); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = mon.Run(ctx)
	}()
	t.Cleanup(func() { cancel(); <-done })
	return mon
}

// TestEachServiceIsCalledAsTheGeneratedClientCallsIt: the monitor's own
// codec keeps the wire as it was: each service's method, and the
// content-type "application/grpc" the generated client sends (a named codec
// would send "application/grpc+<name>", which servers may not accept).
func TestEachServiceIsCalledAsTheGeneratedClientCallsIt(t *testing.T) {
	for svc, method := range map[Service]string{
		ServiceVLLM:       "/vllm.grpc.engine.VllmEngine/SubscribeKvEvents",
		ServiceSGLang:     "/sglang.grpc.scheduler.SglangScheduler/SubscribeKvEvents",
		ServiceTokenSpeed: "/tokenspeed.grpc.scheduler.TokenSpeedScheduler/SubscribeKvEvents",
	} {
		t.Run(string(svc), func(t *testing.T) {
			frame, err := proto.Marshal(batch(0, 0, stored(16, 1)))
			if err != nil {
				t.Fatal(err)
			}
			fs := startFrameServer(t, frame)
			sink := newRecordingSink()
			runMonitor(t, Worker{Addr: fs.addr, Model: "m", Service: svc}, sink)
			sink.expect(t, "apply r0 s0")
			if got, want := fs.calls()[0], method+" application/grpc"; got != want {
				t.Fatalf("call %q, want %q", got, want)
			}
		})
	}
}

// TestAMalformedFrameEndsTheStreamWithItsCause: a frame the decoder refuses
// ends the stream like any stream error (the worker backs off and
// subscribes again), after the frames before it were applied, and the
// worker's last error says what was wrong with it.
func TestAMalformedFrameEndsTheStreamWithItsCause(t *testing.T) {
	good, err := proto.Marshal(batch(0, 0, stored(16, 1)))
	if err != nil {
		t.Fatal(err)
	}
	// Event 0's store's block 0 declares 5 bytes of tokens and holds 1.
	bad := []byte{0x1a, 0x07, 0x12, 0x05, 0x0a, 0x03, 0x12, 0x05, 0x01}
	fs := startFrameServer(t, good, bad)
	sink := newRecordingSink()
	mon := runMonitor(t, Worker{Addr: fs.addr, Model: "m"}, sink)
	sink.expect(t, "apply r0 s0")
	eventually(t, "a second subscribe call after the bad frame", func() bool { return len(fs.calls()) >= 2 })
	eventually(t, "the decoder's error as the worker's last error", func() bool {
		ws := mon.Workers()
		return len(ws) == 1 && strings.Contains(ws[0].LastError, "kvdec: KvEventBatch: events[0]: stored: blocks[0]: token_ids:")
	})
}

// keepingSink copies what it is given (as the Sink contract asks of a sink
// that keeps anything) and says when it has n batches.
type keepingSink struct {
	mu      sync.Mutex
	batches []*kvpb.KvEventBatch
	n       int
	done    chan struct{}
}

func (k *keepingSink) Apply(_ string, b *kvpb.KvEventBatch) {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.batches = append(k.batches, proto.Clone(b).(*kvpb.KvEventBatch))
	if len(k.batches) == k.n {
		close(k.done)
	}
}

func (k *keepingSink) ClearWorker(string) {}

// TestBatchesArriveWholeThroughTheReusedDecoder: a run of batches of
// different sizes and kinds, decoded into the stream's reused storage, each
// reaches the sink equal to what the server sent.
func TestBatchesArriveWholeThroughTheReusedDecoder(t *testing.T) {
	var sent []*kvpb.KvEventBatch
	var frames [][]byte
	for seq := range uint64(40) {
		var hashes []int64
		for i := range int64(1 + seq*37%300) {
			hashes = append(hashes, int64(seq)*1000+i)
		}
		b := batch(int32(seq%2), seq/2, stored(16, hashes...))
		if seq%3 == 0 {
			b.Events = append(b.Events, &kvpb.KvCacheEvent{Data: &kvpb.KvCacheEvent_Removed{Removed: &kvpb.KvBlocksRemoved{BlockHashes: hashes[:1]}}})
		}
		if seq%5 == 0 {
			b.Events[0].GetStored().LoraName = proto.String(fmt.Sprintf("lora-%d", seq))
		}
		f, err := proto.Marshal(b)
		if err != nil {
			t.Fatal(err)
		}
		sent, frames = append(sent, b), append(frames, f)
	}
	fs := startFrameServer(t, frames...)
	sink := &keepingSink{n: len(sent), done: make(chan struct{})}
	runMonitor(t, Worker{Addr: fs.addr, Model: "m"}, sink)
	select {
	case <-sink.done:
	case <-time.After(waitFor):
	}
	sink.mu.Lock()
	defer sink.mu.Unlock()
	if len(sink.batches) < len(sent) {
		t.Fatalf("the sink got %d of %d batches", len(sink.batches), len(sent))
	}
	for i, b := range sent {
		if !proto.Equal(sink.batches[i], b) {
			t.Fatalf("batch %d differs:\n got  %v\n want %v", i, sink.batches[i], b)
		}
	}
}

// A frame grpc-go hands over in pieces is joined in the stream's scratch
// buffer; after one huge batch that buffer is let go, not kept at the
// batch's size for the rest of the stream (found in review: an 8 MB batch
// pinned 9 MB per worker stream).
func TestAHugeFrameInPiecesIsNotKeptAfterItsBatch(t *testing.T) {
	inPieces := func(f []byte, piece int) mem.BufferSlice {
		var bs mem.BufferSlice
		for len(f) > piece {
			bs, f = append(bs, mem.SliceBuffer(f[:piece])), f[piece:]
		}
		return append(bs, mem.SliceBuffer(f))
	}
	hashes := make([]int64, 500_000) // 8 MB of frame with its tokens
	for i := range hashes {
		hashes[i] = int64(i + 1)
	}
	huge := batch(0, 1, stored(4, hashes...))
	small := batch(0, 2, stored(16, 7, 8, 9))
	var d decodedBatch
	for _, tc := range []struct {
		name string
		b    *kvpb.KvEventBatch
	}{{"huge", huge}, {"small", small}} {
		f, err := proto.Marshal(tc.b)
		if err != nil {
			t.Fatal(err)
		}
		if err := (batchCodec{}).Unmarshal(inPieces(f, 16<<10), &d); err != nil {
			t.Fatalf("%s batch (%d bytes): %v", tc.name, len(f), err)
		}
		if !proto.Equal(d.batch, tc.b) {
			t.Fatalf("%s batch decoded differently", tc.name)
		}
		if c := cap(d.scratch); c > keepScratch {
			t.Fatalf("after the %s batch (%d bytes in %d pieces) the stream keeps %d bytes of scratch, over %d", tc.name, len(f), len(f)/(16<<10)+1, c, keepScratch)
		}
	}
}
