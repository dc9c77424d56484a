package discover

import (
	"context"
	"errors"
	"net"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/emptypb"
	"google.golang.org/protobuf/types/known/structpb"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// serverInfo encodes a GetServerInfoResponse as SMG's SglangScheduler and
// TokenSpeedScheduler servicers send it: server_args (1) a Struct, then
// fields kvrelay does not read (3 active_requests, 7 the version string).
func serverInfo(t testing.TB, args map[string]any) []byte {
	t.Helper()
	var b []byte
	if args != nil {
		s, err := structpb.NewStruct(args)
		if err != nil {
			t.Fatal(err)
		}
		raw, err := proto.Marshal(s)
		if err != nil {
			t.Fatal(err)
		}
		b = protowire.AppendTag(b, 1, protowire.BytesType)
		b = protowire.AppendBytes(b, raw)
	}
	b = protowire.AppendTag(b, 3, protowire.VarintType)
	b = protowire.AppendVarint(b, 7)
	b = protowire.AppendTag(b, 7, protowire.BytesType)
	b = protowire.AppendString(b, "0.5.23")
	return b
}

// serveInfo runs a gRPC server on loopback whose service answers
// GetServerInfo with resp; it returns a client connection to it.
func serveInfo(t *testing.T, service string, resp []byte) *grpc.ClientConn {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer()
	srv.RegisterService(&grpc.ServiceDesc{
		ServiceName: service,
		HandlerType: (*any)(nil),
		Methods: []grpc.MethodDesc{{
			MethodName: "GetServerInfo",
			Handler: func(_ any, _ context.Context, dec func(any) error, _ grpc.UnaryServerInterceptor) (any, error) {
				var req emptypb.Empty
				if err := dec(&req); err != nil {
					return nil, err
				}
				out := &emptypb.Empty{}
				out.ProtoReflect().SetUnknown(resp)
				return out, nil
			},
		}},
	}, struct{}{})
	go func() { _ = srv.Serve(lis) }()
	conn, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = conn.Close()
		srv.Stop()
	})
	return conn
}

func TestFromServerInfo(t *testing.T) {
	const cfg = `{"publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5657"}`
	tests := []struct {
		name    string
		engine  string
		service string
		args    map[string]any
		want    Publishers
		wantErr string
	}{
		{name: "sglang", engine: "sglang", service: "sglang.grpc.scheduler.SglangScheduler",
			args: map[string]any{"kv_events_config": cfg, "dp_size": 2, "model_path": "m"},
			want: Publishers{KVEventsConfig: cfg, DPSize: 2}},
		{name: "tokenspeed", engine: "tokenspeed", service: "tokenspeed.grpc.scheduler.TokenSpeedScheduler",
			args: map[string]any{"kv_events_config": cfg, "dp_size": 4},
			want: Publishers{KVEventsConfig: cfg, DPSize: 4}},
		{name: "events off", engine: "sglang", service: "sglang.grpc.scheduler.SglangScheduler",
			args: map[string]any{"kv_events_config": nil}, want: Publishers{DPSize: 1}},
		{name: "no dp_size", engine: "sglang", service: "sglang.grpc.scheduler.SglangScheduler",
			args: map[string]any{"kv_events_config": cfg}, want: Publishers{KVEventsConfig: cfg, DPSize: 1}},
		{name: "dp_size zero", engine: "sglang", service: "sglang.grpc.scheduler.SglangScheduler",
			args: map[string]any{"kv_events_config": cfg, "dp_size": 0}, wantErr: "dp_size 0"},
		{name: "dp_size fraction", engine: "sglang", service: "sglang.grpc.scheduler.SglangScheduler",
			args: map[string]any{"kv_events_config": cfg, "dp_size": 1.5}, wantErr: "dp_size 1.5"},
		{name: "dp_size text", engine: "sglang", service: "sglang.grpc.scheduler.SglangScheduler",
			args: map[string]any{"kv_events_config": cfg, "dp_size": "2"}, wantErr: "dp_size 2"},
		{name: "dp_size huge", engine: "sglang", service: "sglang.grpc.scheduler.SglangScheduler",
			args: map[string]any{"kv_events_config": cfg, "dp_size": 1e12}, wantErr: "want a whole number in 1..1024"},
		{name: "config not text", engine: "sglang", service: "sglang.grpc.scheduler.SglangScheduler",
			args: map[string]any{"kv_events_config": map[string]any{"publisher": "zmq"}}, wantErr: "want a JSON string"},
		{name: "no server_args", engine: "sglang", service: "sglang.grpc.scheduler.SglangScheduler",
			wantErr: "no server_args"},
		{name: "wrong service", engine: "sglang", service: "tokenspeed.grpc.scheduler.TokenSpeedScheduler",
			args: map[string]any{"kv_events_config": cfg}, wantErr: "Unimplemented"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			conn := serveInfo(t, tc.service, serverInfo(t, tc.args))
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			got, err := FromServerInfo(ctx, conn, tc.engine)
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("got %+v, %v; want an error containing %q", got, err, tc.wantErr)
				}
				return
			}
			if err != nil || got != tc.want {
				t.Fatalf("got %+v, %v; want %+v", got, err, tc.want)
			}
		})
	}
}

// vLLM's servicer advertises no endpoints: refused without a call.
func TestFromServerInfoRefusesVLLM(t *testing.T) {
	_, err := FromServerInfo(context.Background(), refusingConn{t}, "vllm")
	if !errors.Is(err, ErrNotAdvertised) || !strings.Contains(err.Error(), "--kv-events-config") {
		t.Fatalf("vllm: %v; want ErrNotAdvertised naming --kv-events-config", err)
	}
}

type refusingConn struct{ t *testing.T }

func (c refusingConn) Invoke(context.Context, string, any, any, ...grpc.CallOption) error {
	c.t.Error("vllm discovery called the servicer")
	return status.Error(codes.Unimplemented, "")
}

func (c refusingConn) NewStream(context.Context, *grpc.StreamDesc, string, ...grpc.CallOption) (grpc.ClientStream, error) {
	c.t.Error("vllm discovery opened a stream")
	return nil, status.Error(codes.Unimplemented, "")
}

// The response is peer input: any bytes give an answer or an error.
func FuzzServerArgs(f *testing.F) {
	f.Add(serverInfo(f, map[string]any{"kv_events_config": "{}", "dp_size": 3}))
	f.Add(serverInfo(f, nil))
	f.Add([]byte{0x0a, 0x80})
	f.Fuzz(func(t *testing.T, b []byte) {
		args, err := serverArgs(b)
		if err != nil {
			return
		}
		p, err := fromServerArgs(args)
		if err == nil && (p.DPSize < 1 || p.DPSize > maxDPSize) {
			t.Fatalf("accepted dp_size %d", p.DPSize)
		}
	})
}
