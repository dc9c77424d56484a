// Package kvstream is a worker's SubscribeKvEvents on a real gRPC server on
// loopback, streaming whatever batches a test pushes: the gateway's side of
// a relay, without a relay, for tests of the gateway's HTTP API and command.
package kvstream

import (
	"net"
	"testing"

	"google.golang.org/grpc"

	"github.com/kvrelay/kvrelay/proto/kvpb"
)

// Engine serves vLLM's SubscribeKvEvents at Addr; each batch sent on
// Batches goes to the one subscriber reading at that moment. Every
// subscribe request is offered on Requests (dropped when nobody reads and
// the buffer is full), so a test can check what a client asked for.
type Engine struct {
	kvpb.UnimplementedVllmEngineServer
	Addr     string
	Batches  chan *kvpb.KvEventBatch
	Requests chan *kvpb.SubscribeKvEventsRequest
}

// Start serves an Engine until the test ends.
func Start(t testing.TB, opts ...grpc.ServerOption) *Engine {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	e := &Engine{Addr: lis.Addr().String(), Batches: make(chan *kvpb.KvEventBatch, 16), Requests: make(chan *kvpb.SubscribeKvEventsRequest, 16)}
	srv := grpc.NewServer(opts...)
	kvpb.RegisterVllmEngineServer(srv, e)
	go func() { _ = srv.Serve(lis) }()
	t.Cleanup(srv.Stop)
	return e
}

// SubscribeKvEvents sends the headers at once, then what the test pushes.
func (e *Engine) SubscribeKvEvents(req *kvpb.SubscribeKvEventsRequest, stream grpc.ServerStreamingServer[kvpb.KvEventBatch]) error {
	select {
	case e.Requests <- req:
	default:
	}
	if err := stream.SendHeader(nil); err != nil {
		return err
	}
	for {
		select {
		case b := <-e.Batches:
			if err := stream.Send(b); err != nil {
				return err
			}
		case <-stream.Context().Done():
			return nil
		}
	}
}

// StoreTokens is a batch storing toks as full blocks of blockSize.
func StoreTokens(seq uint64, blockSize int, toks []uint32) *kvpb.KvEventBatch {
	s := &kvpb.KvBlocksStored{}
	for i := 0; i+blockSize <= len(toks); i += blockSize {
		s.Blocks = append(s.Blocks, &kvpb.KvBlock{BlockHash: int64(1 + i), TokenIds: toks[i : i+blockSize], BlockSize: int32(blockSize)})
	}
	return &kvpb.KvEventBatch{SequenceNumber: seq, Events: []*kvpb.KvCacheEvent{{Data: &kvpb.KvCacheEvent_Stored{Stored: s}}}}
}

// SeqTokens is n consecutive token ids from base.
func SeqTokens(base, n int) []uint32 {
	out := make([]uint32, n)
	for i := range out {
		out[i] = uint32(base + i)
	}
	return out
}
