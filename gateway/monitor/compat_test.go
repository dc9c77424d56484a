package monitor

import (
	"context"
	"net"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protodesc"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/types/descriptorpb"
	"google.golang.org/protobuf/types/dynamicpb"

	"github.com/kvrelay/kvrelay/proto/kvpb"
)

// oldRequestDescriptor is SubscribeKvEventsRequest as SMG defines it: no
// rank_cursors field. A server built from it is what "a relay that predates
// the field" means on the wire.
func oldRequestDescriptor(t *testing.T) protoreflect.MessageDescriptor {
	t.Helper()
	fd, err := protodesc.NewFile(&descriptorpb.FileDescriptorProto{
		Name:    proto.String("old/common.proto"),
		Package: proto.String("smg.grpc.common"),
		Syntax:  proto.String("proto3"),
		MessageType: []*descriptorpb.DescriptorProto{{
			Name: proto.String("SubscribeKvEventsRequest"),
			Field: []*descriptorpb.FieldDescriptorProto{{
				Name:     proto.String("start_sequence_number"),
				JsonName: proto.String("startSequenceNumber"),
				Number:   proto.Int32(1),
				Label:    descriptorpb.FieldDescriptorProto_LABEL_OPTIONAL.Enum(),
				Type:     descriptorpb.FieldDescriptorProto_TYPE_UINT64.Enum(),
			}},
		}},
	}, nil)
	if err != nil {
		t.Fatal(err)
	}
	return fd.Messages().ByName("SubscribeKvEventsRequest")
}

// TestOldServerIgnoresRankCursors runs a server whose request type lacks
// rank_cursors: it must parse the monitor's request, read
// start_sequence_number, and see the map only as unknown bytes.
func TestOldServerIgnoresRankCursors(t *testing.T) {
	md := oldRequestDescriptor(t)
	type seen struct {
		start   uint64
		unknown int
	}
	calls := make(chan seen, 4)
	desc := grpc.ServiceDesc{
		ServiceName: "vllm.grpc.engine.VllmEngine",
		HandlerType: (*any)(nil),
		Streams: []grpc.StreamDesc{{
			StreamName:    "SubscribeKvEvents",
			ServerStreams: true,
			Handler: func(_ any, stream grpc.ServerStream) error {
				req := dynamicpb.NewMessage(md)
				if err := stream.RecvMsg(req); err != nil {
					return err
				}
				start := req.Get(md.Fields().ByName("start_sequence_number")).Uint()
				calls <- seen{start: start, unknown: len(req.GetUnknown())}
				if start == 0 {
					for _, seq := range []uint64{10, 11} {
						r := int32(0)
						if err := stream.SendMsg(&kvpb.KvEventBatch{SequenceNumber: seq, DpRank: &r}); err != nil {
							return err
						}
					}
					r := int32(1)
					if err := stream.SendMsg(&kvpb.KvEventBatch{SequenceNumber: 4, DpRank: &r}); err != nil {
						return err
					}
					return nil // end the stream: the monitor resubscribes with its cursors
				}
				<-stream.Context().Done()
				return nil
			},
		}},
	}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer()
	srv.RegisterService(&desc, struct{}{})
	go func() { _ = srv.Serve(lis) }()
	defer srv.Stop()

	mon, err := New(fastOptions(prometheus.NewRegistry()))
	if err != nil {
		t.Fatal(err)
	}
	sink := newRecordingSink()
	if err := mon.Add(Worker{Addr: lis.Addr().String()}, sink); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = mon.Run(ctx) }()
	defer func() { cancel(); <-done }()

	sink.expect(t, "apply r0 s10", "apply r0 s11", "apply r1 s4")
	first := <-calls
	if first.start != 0 || first.unknown != 0 {
		t.Errorf("first call: %+v", first)
	}
	second := <-calls
	if second.start != 11 {
		t.Errorf("old server read start_sequence_number %d, want 11", second.start)
	}
	if second.unknown == 0 {
		t.Error("rank_cursors did not reach the old server as unknown field bytes")
	}
}
