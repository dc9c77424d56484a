package server_test

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"net"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/kvrelay/kvrelay/engines/vllm"
	"github.com/kvrelay/kvrelay/proto/kvpb"
	"github.com/kvrelay/kvrelay/relay/server"
)

// endless is a subscription that always has a batch ready: a server whose
// sends are limited only by the client and the transport.
type endless struct {
	batch  *kvpb.KvEventBatch
	seq    atomic.Uint64
	closed *atomic.Int64
}

func (e *endless) Next(ctx context.Context) (*kvpb.KvEventBatch, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	b := &kvpb.KvEventBatch{SequenceNumber: e.seq.Add(1), Events: e.batch.Events}
	return b, nil
}

func (e *endless) Close() { e.closed.Add(1) }

// limitStack is a gRPC server in front of endless subscriptions of blockBytes
// of token ids per batch, on loopback.
type limitStack struct {
	reg    *prometheus.Registry
	addr   string
	closed atomic.Int64
	opened atomic.Int64
}

func startLimitStack(t *testing.T, limits server.Limits, tokens int) *limitStack {
	t.Helper()
	ls := &limitStack{reg: prometheus.NewRegistry()}
	toks := make([]uint32, tokens)
	batch := &kvpb.KvEventBatch{Events: []*kvpb.KvCacheEvent{{Data: &kvpb.KvCacheEvent_Stored{Stored: &kvpb.KvBlocksStored{
		Blocks: []*kvpb.KvBlock{{BlockHash: 1, TokenIds: toks}},
	}}}}}
	svc := server.Service{
		Engine: vllm.Engine,
		Subscribe: func(ctx context.Context, req *kvpb.SubscribeKvEventsRequest) (server.Stream, error) {
			ls.opened.Add(1)
			return &endless{batch: batch, closed: &ls.closed}, nil
		},
		Ready: func() bool { return true },
	}
	srv, err := server.New(server.Options{
		Services: []server.Service{svc}, Registerer: ls.reg, Limits: limits,
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil)), ShutdownGrace: 2 * time.Second,
	})
	if err != nil {
		t.Fatal(err)
	}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	served := make(chan struct{})
	go func() {
		defer close(served)
		_ = srv.Serve(lis)
	}()
	t.Cleanup(func() {
		srv.Stop()
		<-served
	})
	ls.addr = lis.Addr().String()
	return ls
}

func (ls *limitStack) client(t *testing.T) kvpb.VllmEngineClient {
	t.Helper()
	cc, err := grpc.NewClient(ls.addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cc.Close() })
	return kvpb.NewVllmEngineClient(cc)
}

func (ls *limitStack) ended(code codes.Code) float64 {
	return counterValue(ls.reg, "kvrelay_grpc_streams_ended_total", map[string]string{"code": code.String()})
}

func (ls *limitStack) limited(reason string) float64 {
	return counterValue(ls.reg, "kvrelay_grpc_streams_limited_total", map[string]string{"reason": reason})
}

// counterValue sums the series of a counter whose labels include want.
func counterValue(reg *prometheus.Registry, name string, want map[string]string) float64 {
	mfs, err := reg.Gather()
	if err != nil {
		return -1
	}
	var sum float64
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			matched := 0
			for _, lp := range m.GetLabel() {
				if v, ok := want[lp.GetName()]; ok && v == lp.GetValue() {
					matched++
				}
			}
			if matched == len(want) {
				sum += m.GetCounter().GetValue()
			}
		}
	}
	return sum
}

func TestAClientThatDisconnectsIsCountedCanceled(t *testing.T) {
	// Batches are always ready, so a send is in flight whenever the client
	// goes away: the send fails with UNAVAILABLE ("transport is closing"),
	// and that must still count as the client's cancel.
	ls := startLimitStack(t, server.Limits{}, 4096)
	const cycles = 40
	for i := 0; i < cycles; i++ {
		// Half the clients cancel the call, half drop the connection (a
		// gateway that exits): both went away.
		cc, err := grpc.NewClient(ls.addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithCancel(context.Background())
		st, err := kvpb.NewVllmEngineClient(cc).SubscribeKvEvents(ctx, &kvpb.SubscribeKvEventsRequest{})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := st.Recv(); err != nil {
			t.Fatal(err)
		}
		if i%2 == 0 {
			cancel()
		}
		_ = cc.Close()
		cancel()
	}
	waitFor(t, 30*time.Second, "every stream to end", func() bool {
		return ls.ended(codes.Canceled)+ls.ended(codes.Unavailable) == cycles
	})
	if got := ls.ended(codes.Unavailable); got != 0 {
		t.Fatalf("%v of %d client disconnects counted as Unavailable, want all Canceled", got, cycles)
	}
}

func TestSubscriberCapsRefuseWithResourceExhausted(t *testing.T) {
	tests := []struct {
		name    string
		limits  server.Limits
		allowed int
		reason  string
		message string
	}{
		{"per peer", server.Limits{MaxSubscribersPerPeer: 2, MaxSubscribers: 100}, 2, "peer_limit", "--max-subscribers-per-peer"},
		{"total", server.Limits{MaxSubscribersPerPeer: 100, MaxSubscribers: 3}, 3, "total_limit", "--max-subscribers"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ls := startLimitStack(t, tt.limits, 16)
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			var open []grpc.ServerStreamingClient[kvpb.KvEventBatch]
			for i := 0; i < tt.allowed; i++ {
				// Its own connection each: the caps span connections.
				st, err := ls.client(t).SubscribeKvEvents(ctx, &kvpb.SubscribeKvEventsRequest{})
				if err != nil {
					t.Fatal(err)
				}
				if _, err := st.Recv(); err != nil {
					t.Fatalf("stream %d within the cap: %v", i, err)
				}
				open = append(open, st)
			}
			st, err := ls.client(t).SubscribeKvEvents(ctx, &kvpb.SubscribeKvEventsRequest{})
			if err == nil {
				_, err = st.Recv()
			}
			if status.Code(err) != codes.ResourceExhausted || !strings.Contains(err.Error(), tt.message) {
				t.Fatalf("stream over the cap: %v, want RESOURCE_EXHAUSTED naming %s", err, tt.message)
			}
			if got := ls.limited(tt.reason); got != 1 {
				t.Fatalf("kvrelay_grpc_streams_limited_total{reason=%q} = %v, want 1", tt.reason, got)
			}
			if got := ls.opened.Load(); got != int64(tt.allowed) {
				t.Fatalf("%d subscriptions opened, want %d (a refused stream must not reach the relay)", got, tt.allowed)
			}
			cancel()
			for _, st := range open {
				for {
					if _, err := st.Recv(); err != nil {
						break
					}
				}
			}
		})
	}
}

func TestASubscriberThatStopsReadingIsCutOff(t *testing.T) {
	// 64 KiB batches fill the client's flow-control windows within a few
	// sends; then the server's send blocks until the client reads.
	const stall = 300 * time.Millisecond
	ls := startLimitStack(t, server.Limits{SendStall: stall, MaxSubscribersPerPeer: 1}, 16*1024)
	client := ls.client(t)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	idle, err := client.SubscribeKvEvents(ctx, &kvpb.SubscribeKvEventsRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := idle.Recv(); err != nil {
		t.Fatal(err)
	}
	// Read nothing more.
	waitFor(t, 30*time.Second, "the stalled stream to be cut off", func() bool {
		return ls.limited("send_stalled") == 1 && ls.ended(codes.ResourceExhausted) == 1
	})
	waitFor(t, 30*time.Second, "the stalled subscription to be closed", func() bool { return ls.closed.Load() == 1 })
	// Its slot is free again (the per-peer cap is 1).
	next, err := client.SubscribeKvEvents(ctx, &kvpb.SubscribeKvEventsRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := next.Recv(); err != nil {
		t.Fatalf("a new stream after the cut-off: %v", err)
	}
	// Reading again, the idle client finds the status after what was
	// already on its way.
	for {
		_, err := idle.Recv()
		if err == nil {
			continue
		}
		if status.Code(err) != codes.ResourceExhausted || !strings.Contains(err.Error(), "read nothing") {
			t.Fatalf("the stalled stream ended with %v, want RESOURCE_EXHAUSTED saying why", err)
		}
		break
	}
	if errors.Is(ctx.Err(), context.DeadlineExceeded) {
		t.Fatal("test deadline")
	}
}
