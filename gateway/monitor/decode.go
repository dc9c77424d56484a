package monitor

import (
	"context"
	"fmt"

	"google.golang.org/grpc"
	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/proto"

	"github.com/kvrelay/kvrelay/proto/kvdec"
	"github.com/kvrelay/kvrelay/proto/kvpb"
)

// The monitor reads SubscribeKvEvents through grpc-go's generic stream with
// a codec of its own on the client side only: requests are marshalled as the
// generated client marshals them, and each response frame is decoded by
// kvdec into storage the stream reuses, instead of proto.Unmarshal building
// a message per block (a 1 M-block snapshot is 63 MB of frames; issue 19
// item 5). The server, the wire and the method names are unchanged.

// decodedBatch is the receive target of a call with batchCodec: the stream's
// decoder and the batch it last decoded (valid until the next Recv).
type decodedBatch struct {
	dec     kvdec.Decoder
	scratch []byte // a frame that grpc-go hands over in several buffers, joined
	batch   *kvpb.KvEventBatch
}

// keepScratch bounds the joined-frame buffer a stream keeps between frames.
const keepScratch = 1 << 20

// batchCodec marshals requests with protobuf and decodes responses into a
// *decodedBatch. Its name is empty so that the call's content-type stays
// "application/grpc", what the generated client sends (a named codec would
// make it "application/grpc+<name>").
type batchCodec struct{}

func (batchCodec) Name() string { return "" }

func (batchCodec) Marshal(v any) (mem.BufferSlice, error) {
	m, ok := v.(proto.Message)
	if !ok {
		return nil, fmt.Errorf("monitor codec: cannot marshal %T", v)
	}
	b, err := proto.Marshal(m)
	if err != nil {
		return nil, fmt.Errorf("monitor codec: %w", err)
	}
	return mem.BufferSlice{mem.SliceBuffer(b)}, nil
}

// Unmarshal decodes the frame while grpc-go still holds its buffers: the
// decoder copies what it keeps, so the frame needs no copy of its own unless
// it arrived in pieces.
func (batchCodec) Unmarshal(data mem.BufferSlice, v any) error {
	d, ok := v.(*decodedBatch)
	if !ok {
		return fmt.Errorf("monitor codec: cannot unmarshal into %T", v)
	}
	var frame []byte
	if len(data) == 1 {
		frame = data[0].ReadOnlyData()
	} else {
		d.scratch = d.scratch[:0]
		for _, buf := range data {
			d.scratch = append(d.scratch, buf.ReadOnlyData()...)
		}
		frame = d.scratch
	}
	b, err := d.dec.Decode(frame)
	if cap(d.scratch) > keepScratch {
		// The decoder copied what it keeps; one huge batch must not pin its
		// frame's size for the rest of the stream (as kvdec bounds its own).
		d.scratch = nil
	}
	if err != nil {
		d.batch = nil
		return err
	}
	d.batch = b
	return nil
}

// subscribeMethods are the SubscribeKvEvents methods of the three services.
var subscribeMethods = map[Service]string{
	ServiceVLLM:       kvpb.VllmEngine_SubscribeKvEvents_FullMethodName,
	ServiceSGLang:     kvpb.SglangScheduler_SubscribeKvEvents_FullMethodName,
	ServiceTokenSpeed: kvpb.TokenSpeedScheduler_SubscribeKvEvents_FullMethodName,
}

var subscribeStream = &grpc.StreamDesc{StreamName: "SubscribeKvEvents", ServerStreams: true}

// decodingStream is a SubscribeKvEvents call read through batchCodec.
type decodingStream struct {
	grpc.ClientStream
	in decodedBatch
}

// Recv returns the next batch; it is valid until the next Recv (the sink
// contract: Apply must not keep it).
func (s *decodingStream) Recv() (*kvpb.KvEventBatch, error) {
	if err := s.ClientStream.RecvMsg(&s.in); err != nil {
		return nil, err
	}
	return s.in.batch, nil
}

func clientFor(svc Service, cc grpc.ClientConnInterface) SubscribeFunc {
	method, ok := subscribeMethods[svc]
	if !ok {
		method = subscribeMethods[ServiceVLLM]
	}
	return func(ctx context.Context, req *kvpb.SubscribeKvEventsRequest) (BatchStream, error) {
		cs, err := cc.NewStream(ctx, subscribeStream, method, grpc.StaticMethod(), grpc.ForceCodecV2(batchCodec{}))
		if err != nil {
			return nil, err
		}
		if err := cs.SendMsg(req); err != nil {
			return nil, err
		}
		if err := cs.CloseSend(); err != nil {
			return nil, err
		}
		return &decodingStream{ClientStream: cs}, nil
	}
}
