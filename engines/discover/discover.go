// Package discover learns an engine's KV-event publishers from the engine's
// own gRPC servicer (kvrelay serve --upstream), so an operator need not
// paste the --kv-events-config JSON the engine was started with.
//
// What each engine's servicer tells, read in the releases (December 2026):
//
//   - SGLang and TokenSpeed: GetServerInfo (SMG's SglangScheduler and
//     TokenSpeedScheduler services, field 1 server_args, a
//     google.protobuf.Struct of the engine's ServerArgs) carries
//     kv_events_config, the JSON the engine parsed, and dp_size, the number
//     of publishers (one per attention-DP rank). The endpoints then follow
//     from the engine's own rules (port + rank), as from a pasted config.
//   - vLLM: GetServerInfo (VllmEngine) carries data_parallel_size and
//     block_size but no KV-event endpoints, and with tcp://*:0 (vLLM #55844)
//     the ports exist only inside the engine process
//     (ZmqEventPublisher.get_publisher_config, engine.get_kv_event_sources).
//     Discovery refuses vLLM with an error that says so.
package discover

import (
	"context"
	"errors"
	"fmt"
	"math"

	"google.golang.org/grpc"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/emptypb"
	"google.golang.org/protobuf/types/known/structpb"
)

// Publishers is what a servicer advertised.
type Publishers struct {
	// KVEventsConfig is the engine's --kv-events-config JSON; "" when the
	// engine publishes no KV events.
	KVEventsConfig string
	// DPSize is the number of publishers (ranks).
	DPSize int
}

// ErrNotAdvertised means the engine's servicer does not tell its
// publishers' endpoints.
var ErrNotAdvertised = errors.New("the engine's servicer does not advertise its KV-event publishers")

// serverInfoMethods are the GetServerInfo methods whose response has the
// engine's ServerArgs as a Struct in field 1.
var serverInfoMethods = map[string]string{
	"sglang":     "/sglang.grpc.scheduler.SglangScheduler/GetServerInfo",
	"tokenspeed": "/tokenspeed.grpc.scheduler.TokenSpeedScheduler/GetServerInfo",
}

// maxDPSize bounds an advertised rank count (kvrelay serve's own limit).
const maxDPSize = 1024

// FromServerInfo asks the engine's servicer on conn for its publishers.
func FromServerInfo(ctx context.Context, conn grpc.ClientConnInterface, engine string) (Publishers, error) {
	method, ok := serverInfoMethods[engine]
	if !ok {
		if engine == "vllm" {
			return Publishers{}, fmt.Errorf("vllm: %w (VllmEngine.GetServerInfo has no KV-event endpoints; pass --kv-events-config, with explicit ports rather than tcp://*:0)", ErrNotAdvertised)
		}
		return Publishers{}, fmt.Errorf("engine %q: %w", engine, ErrNotAdvertised)
	}
	// GetServerInfoRequest is empty; the response is read field by field
	// from an Empty's unknown fields, so no engine proto is compiled in
	// for one Struct.
	var resp emptypb.Empty
	if err := conn.Invoke(ctx, method, &emptypb.Empty{}, &resp); err != nil {
		return Publishers{}, fmt.Errorf("%s: %w", method, err)
	}
	args, err := serverArgs(resp.ProtoReflect().GetUnknown())
	if err != nil {
		return Publishers{}, fmt.Errorf("%s: %w", method, err)
	}
	return fromServerArgs(args)
}

// serverArgs finds field 1 (server_args, a Struct) in a GetServerInfoResponse.
func serverArgs(b []byte) (*structpb.Struct, error) {
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			return nil, fmt.Errorf("response: %w", protowire.ParseError(n))
		}
		b = b[n:]
		if num == 1 && typ == protowire.BytesType {
			v, n := protowire.ConsumeBytes(b)
			if n < 0 {
				return nil, fmt.Errorf("server_args: %w", protowire.ParseError(n))
			}
			var s structpb.Struct
			if err := proto.Unmarshal(v, &s); err != nil {
				return nil, fmt.Errorf("server_args: %w", err)
			}
			return &s, nil
		}
		n = protowire.ConsumeFieldValue(num, typ, b)
		if n < 0 {
			return nil, fmt.Errorf("response field %d: %w", num, protowire.ParseError(n))
		}
		b = b[n:]
	}
	return nil, errors.New("response has no server_args (field 1)")
}

func fromServerArgs(args *structpb.Struct) (Publishers, error) {
	fields := args.GetFields()
	var p Publishers
	switch v := fields["kv_events_config"].GetKind().(type) {
	case nil, *structpb.Value_NullValue:
		// Not set: the engine publishes nothing.
	case *structpb.Value_StringValue:
		p.KVEventsConfig = v.StringValue
	default:
		return Publishers{}, fmt.Errorf("server_args.kv_events_config is a %T, want a JSON string", v)
	}
	p.DPSize = 1
	if v, ok := fields["dp_size"]; ok {
		n, isNum := v.GetKind().(*structpb.Value_NumberValue)
		if !isNum || n.NumberValue != math.Trunc(n.NumberValue) || n.NumberValue < 1 || n.NumberValue > maxDPSize {
			return Publishers{}, fmt.Errorf("server_args.dp_size %v: want a whole number in 1..%d", v.AsInterface(), maxDPSize)
		}
		p.DPSize = int(n.NumberValue)
	}
	return p, nil
}
