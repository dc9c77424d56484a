package server_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/kvrelay/kvrelay/engines"
	"github.com/kvrelay/kvrelay/engines/sglang"
	"github.com/kvrelay/kvrelay/engines/tokenspeed"
	"github.com/kvrelay/kvrelay/engines/vllm"
	"github.com/kvrelay/kvrelay/proto/kvpb"
	"github.com/kvrelay/kvrelay/relay"
	"github.com/kvrelay/kvrelay/relay/server"
	"github.com/kvrelay/kvrelay/testkit/enginepeer"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// stack is a real engine peer (pyzmq), a relay subscribed to it, and the
// gRPC server in front, on loopback.
type stack struct {
	reg    *prometheus.Registry
	peer   *enginepeer.Peer
	relay  *relay.Relay
	addr   string
	conn   *grpc.ClientConn
	client kvpb.VllmEngineClient
}

type stackOptions struct {
	dpSize         int
	historyBatches int
	buffer         int
	upstream       string
	load           server.LoadSource
}

func startStack(t *testing.T, o stackOptions) *stack {
	t.Helper()
	if o.dpSize == 0 {
		o.dpSize = 1
	}
	peer := enginepeer.Start(t, enginepeer.Options{Engine: enginepeer.VLLM, DPSize: o.dpSize})
	kv := engines.DefaultConfig()
	kv.Enabled = true
	kv.Publisher = "zmq"
	kv.Endpoint = peer.PubEndpoint(0)
	kv.ReplayEndpoint = peer.ReplayEndpoint(0)
	reg := prometheus.NewRegistry()
	r, err := relay.New(relay.Config{
		Registerer: reg,
		Engine:     vllm.Engine, KV: kv, DPSize: o.dpSize,
		HistoryBatches: o.historyBatches, ReplayTimeout: 2 * time.Second,
		SubscriberBuffer: o.buffer,
		Logger:           slog.New(slog.NewTextHandler(io.Discard, nil)),
	})
	if err != nil {
		t.Fatalf("relay.New: %v", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = r.Run(ctx)
	}()
	svc := server.RelayService(vllm.Engine, r)
	svc.Load = o.load
	opts := server.Options{Services: []server.Service{svc}, Logger: slog.New(slog.NewTextHandler(io.Discard, nil)), ShutdownGrace: 2 * time.Second}
	if o.upstream != "" {
		opts.Upstreams = map[string]string{"vllm": o.upstream}
	}
	srv, err := server.New(opts)
	if err != nil {
		t.Fatalf("server.New: %v", err)
	}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go func() { _ = srv.Serve(lis) }()
	cc, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = cc.Close()
		srv.Stop()
		cancel()
		<-done
	})
	s := &stack{reg: reg, peer: peer, relay: r, addr: lis.Addr().String(), conn: cc, client: kvpb.NewVllmEngineClient(cc)}
	waitFor(t, 20*time.Second, "the relay to connect to every rank", r.Ready)
	return s
}

func waitFor(t *testing.T, d time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// publish sends one single-block store on rank and returns its sequence.
func (s *stack) publish(t *testing.T, rank int, hash uint64) uint64 {
	t.Helper()
	p, err := s.peer.Publish(rank, enginepeer.Stored(nil, []int64{1, 2, 3, 4}, enginepeer.U64(hash)))
	if err != nil {
		t.Fatalf("publish on rank %d: %v", rank, err)
	}
	return p.Seq
}

// relayed waits until the relay's cursor for rank reaches seq.
func (s *stack) relayed(t *testing.T, rank int, seq uint64) {
	t.Helper()
	waitFor(t, 20*time.Second, fmt.Sprintf("rank %d to relay seq %d", rank, seq), func() bool {
		for _, rs := range s.relay.Status().Ranks {
			if int(rs.Rank) == rank && rs.Cursor != nil && *rs.Cursor >= seq {
				return true
			}
		}
		return false
	})
}

type key struct {
	rank int32
	seq  uint64
}

// recvN reads n batches, failing on a stream error.
func recvN(t *testing.T, st grpc.ServerStreamingClient[kvpb.KvEventBatch], n int) []*kvpb.KvEventBatch {
	t.Helper()
	var out []*kvpb.KvEventBatch
	for len(out) < n {
		b, err := st.Recv()
		if err != nil {
			t.Fatalf("after %d of %d batches: %v", len(out), n, err)
		}
		out = append(out, b)
	}
	return out
}

func keys(bs []*kvpb.KvEventBatch) []key {
	var out []key
	for _, b := range bs {
		out = append(out, key{b.GetDpRank(), b.GetSequenceNumber()})
	}
	return out
}

func TestTwoRanksFromZeroAndResumeByRank0Cursor(t *testing.T) {
	s := startStack(t, stackOptions{dpSize: 2})
	for i := 0; i < 3; i++ { // in this log order: 0:0 1:0 0:1 1:1 0:2 1:2
		s.publish(t, 0, uint64(100+i))
		s.relayed(t, 0, uint64(i))
		s.publish(t, 1, uint64(200+i))
		s.relayed(t, 1, uint64(i))
	}

	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	st, err := s.client.SubscribeKvEvents(ctx, &kvpb.SubscribeKvEventsRequest{})
	if err != nil {
		t.Fatal(err)
	}
	all := recvN(t, st, 6)
	seen := map[key]bool{}
	for _, k := range keys(all) {
		if seen[k] {
			t.Fatalf("duplicate batch %+v in %v", k, keys(all))
		}
		seen[k] = true
	}
	for _, rank := range []int32{0, 1} {
		for seq := uint64(0); seq < 3; seq++ {
			if !seen[key{rank, seq}] {
				t.Fatalf("missing rank %d seq %d in %v", rank, seq, keys(all))
			}
		}
	}
	for _, b := range all {
		if b.GetSnapshot() != nil {
			t.Fatalf("a complete window is served as history, got a snapshot chunk %v", b)
		}
	}

	// Rank 0's seq 1 alone cannot resume: rank 1 relayed two batches after
	// it, and the client may hold either (the relay's rules, issue 14.1).
	// It is refused on the call.
	refused, err := s.client.SubscribeKvEvents(ctx, &kvpb.SubscribeKvEventsRequest{StartSequenceNumber: 1})
	if err == nil {
		_, err = refused.Recv()
	}
	if status.Code(err) != codes.OutOfRange {
		t.Fatalf("resume after rank 0 seq 1: %v, want OUT_OF_RANGE", err)
	}
	// Resume after rank 0's seq 2: everything logged after that batch, of
	// both ranks, and nothing before it.
	var pos int
	for i, k := range keys(all) {
		if k == (key{0, 2}) {
			pos = i
		}
	}
	want := keys(all)[pos+1:]
	st2, err := s.client.SubscribeKvEvents(ctx, &kvpb.SubscribeKvEventsRequest{StartSequenceNumber: 2})
	if err != nil {
		t.Fatal(err)
	}
	got := keys(recvN(t, st2, len(want)))
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("resume after rank 0 seq 2: got %v, want %v", got, want)
	}

	// Both streams continue live with the next batch, once.
	next := s.publish(t, 1, 300)
	for name, stream := range map[string]grpc.ServerStreamingClient[kvpb.KvEventBatch]{"from zero": st, "resumed": st2} {
		b := recvN(t, stream, 1)[0]
		if b.GetDpRank() != 1 || b.GetSequenceNumber() != next {
			t.Fatalf("%s stream: live batch rank %d seq %d, want rank 1 seq %d", name, b.GetDpRank(), b.GetSequenceNumber(), next)
		}
	}
}

func TestRankCursorsResumeEveryRankExactly(t *testing.T) {
	s := startStack(t, stackOptions{dpSize: 2})
	for i := 0; i < 4; i++ {
		s.publish(t, 0, uint64(100+i))
		s.publish(t, 1, uint64(200+i))
	}
	s.relayed(t, 0, 3)
	s.relayed(t, 1, 3)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	st, err := s.client.SubscribeKvEvents(ctx, &kvpb.SubscribeKvEventsRequest{
		StartSequenceNumber: 1,
		RankCursors:         map[int32]uint64{0: 1, 1: 2},
	})
	if err != nil {
		t.Fatal(err)
	}
	got := map[key]bool{}
	for _, k := range keys(recvN(t, st, 3)) {
		got[k] = true
	}
	for _, k := range []key{{0, 2}, {0, 3}, {1, 3}} {
		if !got[k] {
			t.Fatalf("rank cursors {0:1, 1:2}: missing %+v, got %v", k, got)
		}
	}
}

func TestCursorsOutsideTheWindowAreOutOfRangeAndZeroGetsASnapshot(t *testing.T) {
	s := startStack(t, stackOptions{historyBatches: 2})
	for i := 0; i < 5; i++ {
		s.publish(t, 0, uint64(100+i))
	}
	s.relayed(t, 0, 4)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	for _, tc := range []struct {
		cursor uint64
		want   string
	}{
		{cursor: 1, want: "resubscribe from zero"},
		{cursor: 1000, want: "ahead of anything relayed"},
	} {
		st, err := s.client.SubscribeKvEvents(ctx, &kvpb.SubscribeKvEventsRequest{StartSequenceNumber: tc.cursor})
		if err != nil {
			t.Fatal(err)
		}
		_, err = st.Recv()
		if status.Code(err) != codes.OutOfRange {
			t.Fatalf("cursor %d: got %v, want OUT_OF_RANGE", tc.cursor, err)
		}
		if msg := status.Convert(err).Message(); !containsFold(msg, tc.want) {
			t.Fatalf("cursor %d: message %q does not say %q", tc.cursor, msg, tc.want)
		}
	}

	st, err := s.client.SubscribeKvEvents(ctx, &kvpb.SubscribeKvEventsRequest{})
	if err != nil {
		t.Fatal(err)
	}
	chunk := recvN(t, st, 1)[0]
	snap := chunk.GetSnapshot()
	if snap == nil || snap.GetIndex() != 0 || snap.GetCount() != 1 {
		t.Fatalf("want a single snapshot chunk, got %v", chunk)
	}
	if chunk.GetSequenceNumber() != 4 {
		t.Fatalf("snapshot stamped %d, want the cursor 4", chunk.GetSequenceNumber())
	}
	if snap.GetBlocks() != 5 {
		t.Fatalf("snapshot lists %d blocks, want the 5 stored", snap.GetBlocks())
	}
	if len(chunk.GetEvents()) == 0 || chunk.GetEvents()[0].GetCleared() == nil {
		t.Fatalf("chunk 0 must begin with a clear: %v", chunk.GetEvents())
	}
	hashes := map[int64]bool{}
	for _, ev := range chunk.GetEvents()[1:] {
		for _, b := range ev.GetStored().GetBlocks() {
			hashes[b.GetBlockHash()] = true
		}
	}
	for h := int64(100); h < 105; h++ {
		if !hashes[h] {
			t.Fatalf("snapshot lacks block %d: %v", h, hashes)
		}
	}
	next := s.publish(t, 0, 500)
	if b := recvN(t, st, 1)[0]; b.GetSequenceNumber() != next || b.GetSnapshot() != nil {
		t.Fatalf("after the snapshot: got seq %d, want live %d", b.GetSequenceNumber(), next)
	}
}

func containsFold(s, sub string) bool {
	return len(sub) == 0 || (len(s) >= len(sub) && (indexFold(s, sub) >= 0))
}

func indexFold(s, sub string) int {
	for i := 0; i+len(sub) <= len(s); i++ {
		match := true
		for j := 0; j < len(sub); j++ {
			a, b := s[i+j], sub[j]
			if 'A' <= a && a <= 'Z' {
				a += 'a' - 'A'
			}
			if 'A' <= b && b <= 'Z' {
				b += 'a' - 'A'
			}
			if a != b {
				match = false
				break
			}
		}
		if match {
			return i
		}
	}
	return -1
}

func TestPublisherRestartEndsLiveStreamsWithDataLoss(t *testing.T) {
	s := startStack(t, stackOptions{})
	s.publish(t, 0, 1)
	s.publish(t, 0, 2)
	s.relayed(t, 0, 1)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	st, err := s.client.SubscribeKvEvents(ctx, &kvpb.SubscribeKvEventsRequest{})
	if err != nil {
		t.Fatal(err)
	}
	recvN(t, st, 2)
	if err := s.peer.Restart(0); err != nil {
		t.Fatal(err)
	}
	// The new incarnation counts from 0 again. One batch, 0, stays below
	// the relay's cursor (1): seen live it is a regression, and if the SUB
	// reconnects too late to see it, the relay's catch-up replay finds the
	// restart. Publishing more, as a loop waiting for the relay did, reaches
	// 2, which a relay that missed 0 reads as the old incarnation's next.
	s.publish(t, 0, 9)
	errc := make(chan error, 1)
	go func() {
		for {
			if _, err := st.Recv(); err != nil {
				errc <- err
				return
			}
		}
	}()
	select {
	case err := <-errc:
		if status.Code(err) != codes.DataLoss {
			t.Fatalf("after a publisher restart: got %v, want DATA_LOSS", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("the stream did not end after the publisher restarted")
	}
}

// serveEventsOff serves services with their events off (no relay) on
// loopback until the test ends, and returns a client of it.
func serveEventsOff(t *testing.T, services ...server.Service) *grpc.ClientConn {
	t.Helper()
	srv, err := server.New(server.Options{Services: services, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go func() { _ = srv.Serve(lis) }()
	t.Cleanup(srv.Stop)
	cc, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cc.Close() })
	return cc
}

func TestDisabledEventsAreUnimplementedWithTheEnginesMessage(t *testing.T) {
	cc := serveEventsOff(t, server.Service{Engine: vllm.Engine})
	st, err := kvpb.NewVllmEngineClient(cc).SubscribeKvEvents(context.Background(), &kvpb.SubscribeKvEventsRequest{})
	if err != nil {
		t.Fatal(err)
	}
	_, err = st.Recv()
	if status.Code(err) != codes.Unimplemented || status.Convert(err).Message() != vllm.Engine.DisabledMessage {
		t.Fatalf("got %v, want UNIMPLEMENTED %q", err, vllm.Engine.DisabledMessage)
	}
}

// A client naming a service the relay does not serve (a gateway worker's
// service=sglang against a vLLM relay) gets UNIMPLEMENTED, the code SMG
// relies on, with a message naming what the relay serves. A call to one of
// a served service's other methods (GetLoads without --upstream) gets
// UNIMPLEMENTED saying the method is not served, not that the service is
// unknown.
func TestUnknownServiceIsUnimplementedNamingTheServedOnes(t *testing.T) {
	cc := serveEventsOff(t, server.Service{Engine: vllm.Engine}, server.Service{Engine: tokenspeed.Engine})
	for _, tc := range []struct {
		name          string
		call          func() error
		want, notWant []string
	}{
		{
			name: "unknown service",
			call: func() error {
				st, err := kvpb.NewSglangSchedulerClient(cc).SubscribeKvEvents(context.Background(), &kvpb.SubscribeKvEventsRequest{})
				if err == nil {
					_, err = st.Recv()
				}
				return err
			},
			want: []string{sglang.Engine.ServiceName, "vllm (" + vllm.Engine.ServiceName + ")", "tokenspeed (" + tokenspeed.Engine.ServiceName + ")", "service="},
		},
		{
			name: "unknown method of a served service",
			call: func() error {
				return cc.Invoke(context.Background(), "/"+vllm.Engine.ServiceName+"/GetLoads",
					&kvpb.VllmGetLoadsRequest{}, &kvpb.VllmGetLoadsResponse{})
			},
			want:    []string{"method GetLoads is not served by kvrelay", "--upstream"},
			notWant: []string{"unknown service", "service="},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.call()
			msg := status.Convert(err).Message()
			if status.Code(err) != codes.Unimplemented {
				t.Fatalf("got %v, want UNIMPLEMENTED", err)
			}
			for _, want := range tc.want {
				if !strings.Contains(msg, want) {
					t.Errorf("message %q does not name %q", msg, want)
				}
			}
			for _, bad := range tc.notWant {
				if strings.Contains(msg, bad) {
					t.Errorf("message %q says %q", msg, bad)
				}
			}
		})
	}
}

func TestHealthIsServingOnceConnectedAndHeadersComeFirst(t *testing.T) {
	s := startStack(t, stackOptions{})
	hc := healthpb.NewHealthClient(s.conn)
	waitFor(t, 5*time.Second, "health SERVING", func() bool {
		resp, err := hc.Check(context.Background(), &healthpb.HealthCheckRequest{Service: vllm.Engine.ServiceName})
		return err == nil && resp.GetStatus() == healthpb.HealthCheckResponse_SERVING
	})
	// Nothing was published: the call still resolves with headers at once.
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	st, err := s.client.SubscribeKvEvents(ctx, &kvpb.SubscribeKvEventsRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := st.Header(); err != nil {
		t.Fatalf("headers before any event: %v", err)
	}
}

func TestSlowSubscriberDoesNotHoldBackAFastOne(t *testing.T) {
	// A small per-subscriber buffer and a history deep enough to refill it:
	// the slow subscriber overflows its buffer (its gRPC window fills first)
	// and must be refilled from history, while the fast one keeps pace.
	s := startStack(t, stackOptions{buffer: 16, historyBatches: 100_000})
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	s.publish(t, 0, 1)
	s.relayed(t, 0, 0)
	slow, err := s.client.SubscribeKvEvents(ctx, &kvpb.SubscribeKvEventsRequest{})
	if err != nil {
		t.Fatal(err)
	}
	fast, err := s.client.SubscribeKvEvents(ctx, &kvpb.SubscribeKvEventsRequest{})
	if err != nil {
		t.Fatal(err)
	}
	recvN(t, fast, 1)
	// About 1 KiB per batch: 3,000 batches outgrow the slow stream's HTTP/2
	// flow-control windows, so its sends block and its buffer overflows.
	tokens := make([]int64, 256)
	for i := range tokens {
		tokens[i] = int64(i)
	}
	const n = 3000
	first, last, err := s.peer.PublishMany(0, n, 0, enginepeer.Stored(nil, tokens, enginepeer.U64(7)))
	if err != nil {
		t.Fatal(err)
	}
	got := recvN(t, fast, n)
	for i, b := range got {
		if b.GetSequenceNumber() != first+uint64(i) {
			t.Fatalf("fast subscriber: batch %d is seq %d, want %d", i, b.GetSequenceNumber(), first+uint64(i))
		}
	}
	waitFor(t, 10*time.Second, "the slow subscriber to be counted as lagged", func() bool {
		return s.relay.Status().Subscribers == 2 && testutilLagged(s) > 0
	})
	// The slow one, refilled from history, sees every batch with no gap.
	expect := uint64(0)
	for {
		b, err := slow.Recv()
		if err != nil {
			t.Fatalf("slow subscriber ended with %v after seq %d; the history reaches back, so it must be refilled", err, expect)
		}
		if b.GetSequenceNumber() != expect {
			t.Fatalf("slow subscriber: seq %d, want %d (a gap)", b.GetSequenceNumber(), expect)
		}
		if expect == last {
			return
		}
		expect++
	}
}

// upstreamEcho is the engine's own servicer behind the proxy: a unary method
// that echoes with metadata and a chosen status, and a server stream.
func startUpstream(t *testing.T) string {
	t.Helper()
	desc := grpc.ServiceDesc{
		ServiceName: "vllm.grpc.engine.VllmEngine",
		HandlerType: (*any)(nil),
		Methods: []grpc.MethodDesc{{
			MethodName: "GetModelInfo",
			Handler: func(_ any, ctx context.Context, dec func(any) error, _ grpc.UnaryServerInterceptor) (any, error) {
				in := &wrapperspb.StringValue{}
				if err := dec(in); err != nil {
					return nil, err
				}
				md, _ := metadata.FromIncomingContext(ctx)
				if in.GetValue() == "fail" {
					return nil, status.Error(codes.FailedPrecondition, "upstream says no")
				}
				if _, ok := ctx.Deadline(); !ok {
					return nil, status.Error(codes.InvalidArgument, "no deadline reached the upstream")
				}
				_ = grpc.SetHeader(ctx, metadata.Pairs("x-upstream", "yes"))
				return wrapperspb.String(in.GetValue() + "|" + firstOf(md.Get("x-caller"))), nil
			},
		}},
		Streams: []grpc.StreamDesc{{
			StreamName:    "Generate",
			ServerStreams: true,
			Handler: func(_ any, stream grpc.ServerStream) error {
				in := &wrapperspb.StringValue{}
				if err := stream.RecvMsg(in); err != nil {
					return err
				}
				for i := 0; i < 3; i++ {
					if err := stream.SendMsg(wrapperspb.String(fmt.Sprintf("%s-%d", in.GetValue(), i))); err != nil {
						return err
					}
				}
				return nil
			},
		}},
	}
	s := grpc.NewServer()
	s.RegisterService(&desc, struct{}{})
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go func() { _ = s.Serve(lis) }()
	t.Cleanup(s.Stop)
	return lis.Addr().String()
}

// testutilLagged reads how often a subscriber was refilled after lagging.
func testutilLagged(s *stack) float64 {
	mfs, err := s.reg.Gather()
	if err != nil {
		return 0
	}
	for _, mf := range mfs {
		if mf.GetName() == "kvrelay_subscribers_lagged_total" {
			var sum float64
			for _, m := range mf.GetMetric() {
				sum += m.GetCounter().GetValue()
			}
			return sum
		}
	}
	return 0
}

func firstOf(v []string) string {
	if len(v) == 0 {
		return ""
	}
	return v[0]
}

func TestProxyForwardsUnaryAndStreamingCalls(t *testing.T) {
	up := startUpstream(t)
	s := startStack(t, stackOptions{upstream: up})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	ctx = metadata.AppendToOutgoingContext(ctx, "x-caller", "gateway")

	out := &wrapperspb.StringValue{}
	var hdr metadata.MD
	if err := s.conn.Invoke(ctx, "/vllm.grpc.engine.VllmEngine/GetModelInfo", wrapperspb.String("hi"), out, grpc.Header(&hdr)); err != nil {
		t.Fatalf("unary through the proxy: %v", err)
	}
	if out.GetValue() != "hi|gateway" {
		t.Fatalf("unary answer %q, want the echo with the caller's metadata", out.GetValue())
	}
	if firstOf(hdr.Get("x-upstream")) != "yes" {
		t.Fatalf("the upstream's response header did not come through: %v", hdr)
	}
	err := s.conn.Invoke(ctx, "/vllm.grpc.engine.VllmEngine/GetModelInfo", wrapperspb.String("fail"), out)
	if status.Code(err) != codes.FailedPrecondition || status.Convert(err).Message() != "upstream says no" {
		t.Fatalf("the upstream's status was not preserved: %v", err)
	}

	st, err := s.conn.NewStream(ctx, &grpc.StreamDesc{ServerStreams: true}, "/vllm.grpc.engine.VllmEngine/Generate")
	if err != nil {
		t.Fatal(err)
	}
	if err := st.SendMsg(wrapperspb.String("tok")); err != nil {
		t.Fatal(err)
	}
	if err := st.CloseSend(); err != nil {
		t.Fatal(err)
	}
	var got []string
	for {
		m := &wrapperspb.StringValue{}
		if err := st.RecvMsg(m); err != nil {
			if !errors.Is(err, io.EOF) {
				t.Fatalf("stream through the proxy: %v", err)
			}
			break
		}
		got = append(got, m.GetValue())
	}
	if fmt.Sprint(got) != "[tok-0 tok-1 tok-2]" {
		t.Fatalf("streamed %v", got)
	}

	// SubscribeKvEvents is still served by the relay, not forwarded.
	sub, err := s.client.SubscribeKvEvents(ctx, &kvpb.SubscribeKvEventsRequest{StartSequenceNumber: 1 << 40})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := sub.Recv(); status.Code(err) != codes.OutOfRange {
		t.Fatalf("SubscribeKvEvents went to the upstream? got %v", err)
	}
}
