package server

import (
	"fmt"

	"google.golang.org/grpc/encoding"
	_ "google.golang.org/grpc/encoding/proto" // registers the proto codec this one delegates to
	"google.golang.org/grpc/mem"
)

// frame is an undecoded gRPC message: the proxy moves frames between the
// gateway and the engine's servicer without knowing their types, and the
// SubscribeKvEvents handler sends batches the relay encoded once for all
// subscribers.
type frame struct {
	payload []byte
	// suffix is sent right after payload as part of the same message: a
	// subscriber's own fields (its load record) appended to the shared
	// encoding without copying it.
	suffix []byte
}

// passthroughCodec is the proto codec for typed messages and a byte pipe for
// frames. A gRPC server has one codec for every service, and kvrelay sends
// both typed messages and pre-encoded ones, so one codec must do both.
type passthroughCodec struct {
	proto encoding.CodecV2
}

func newPassthroughCodec() *passthroughCodec {
	return &passthroughCodec{proto: encoding.GetCodecV2("proto")}
}

func (c *passthroughCodec) Name() string { return "proto" }

func (c *passthroughCodec) Marshal(v any) (mem.BufferSlice, error) {
	if f, ok := v.(*frame); ok {
		// SliceBuffer does not return its bytes to a pool when freed, so
		// the transport may hold the relay's shared encoding without a copy.
		if len(f.suffix) > 0 {
			return mem.BufferSlice{mem.SliceBuffer(f.payload), mem.SliceBuffer(f.suffix)}, nil
		}
		return mem.BufferSlice{mem.SliceBuffer(f.payload)}, nil
	}
	return c.proto.Marshal(v)
}

func (c *passthroughCodec) Unmarshal(data mem.BufferSlice, v any) error {
	if f, ok := v.(*frame); ok {
		f.payload = data.Materialize()
		return nil
	}
	if v == nil {
		return fmt.Errorf("passthrough codec: nil message")
	}
	return c.proto.Unmarshal(data, v)
}
