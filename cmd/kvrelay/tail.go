package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"strings"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protojson"

	"github.com/kvrelay/kvrelay/internal/tlsconfig"
	"github.com/kvrelay/kvrelay/proto/kvpb"
)

func init() {
	register("tail", "subscribe to a relay (or an SMG servicer) and print its batches", runTail)
}

// subscribeFunc opens SubscribeKvEvents on one of the three service names.
type subscribeFunc func(ctx context.Context, cc *grpc.ClientConn, req *kvpb.SubscribeKvEventsRequest) (grpc.ServerStreamingClient[kvpb.KvEventBatch], error)

var tailServices = map[string]subscribeFunc{
	"vllm": func(ctx context.Context, cc *grpc.ClientConn, req *kvpb.SubscribeKvEventsRequest) (grpc.ServerStreamingClient[kvpb.KvEventBatch], error) {
		return kvpb.NewVllmEngineClient(cc).SubscribeKvEvents(ctx, req)
	},
	"sglang": func(ctx context.Context, cc *grpc.ClientConn, req *kvpb.SubscribeKvEventsRequest) (grpc.ServerStreamingClient[kvpb.KvEventBatch], error) {
		return kvpb.NewSglangSchedulerClient(cc).SubscribeKvEvents(ctx, req)
	},
	"tokenspeed": func(ctx context.Context, cc *grpc.ClientConn, req *kvpb.SubscribeKvEventsRequest) (grpc.ServerStreamingClient[kvpb.KvEventBatch], error) {
		return kvpb.NewTokenSpeedSchedulerClient(cc).SubscribeKvEvents(ctx, req)
	},
}

func runTail(ctx context.Context, args []string, _ io.Reader, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("tail", flag.ContinueOnError)
	addr := fs.String("addr", "", "relay or servicer address HOST:PORT, or grpcs://HOST:PORT for TLS")
	service := fs.String("service", "vllm", "service flavour: vllm, sglang or tokenspeed")
	from := fs.Uint64("from", 0, "last sequence already applied (0: the relay's whole state)")
	asJSON := fs.Bool("json", false, "print each batch as one JSON line")
	limit := fs.Int("n", 0, "stop after this many batches (0: until the stream ends)")
	var clientTLS tlsconfig.Client
	tlsconfig.RegisterClientFlags(fs, "tls-", "the relay", &clientTLS)
	if code, stop := parseFlags(fs, args, stdout, stderr); stop {
		return code
	}
	if *addr == "" {
		fmt.Fprintln(stderr, "kvrelay tail: --addr is required")
		return 2
	}
	open, ok := tailServices[*service]
	if !ok {
		fmt.Fprintf(stderr, "kvrelay tail: --service %q: want vllm, sglang or tokenspeed\n", *service)
		return 2
	}
	target, useTLS, err := tlsconfig.ParseTarget(*addr)
	if err != nil {
		fmt.Fprintf(stderr, "kvrelay tail: --addr: %v\n", err)
		return 2
	}
	creds := insecure.NewCredentials()
	dialer, err := tlsconfig.ClientFor(clientTLS, useTLS, nil)
	if err != nil {
		fmt.Fprintf(stderr, "kvrelay tail: --tls-*: %v\n", err)
		return 2
	}
	if dialer != nil {
		creds = dialer.Credentials()
	}
	cc, err := grpc.NewClient(target, grpc.WithTransportCredentials(creds))
	if err != nil {
		fmt.Fprintf(stderr, "kvrelay tail: --addr %q: %v\n", *addr, err)
		return 2
	}
	defer cc.Close()
	stream, err := open(ctx, cc, &kvpb.SubscribeKvEventsRequest{StartSequenceNumber: *from})
	if err != nil {
		st := status.Convert(err)
		fmt.Fprintf(stderr, "stream ended: %s: %s\n", st.Code(), st.Message())
		return 1
	}
	n := 0
	for {
		b, err := stream.Recv()
		if err != nil {
			if errors.Is(err, io.EOF) {
				fmt.Fprintln(stderr, "stream ended: OK")
				return 0
			}
			st := status.Convert(err)
			if ctx.Err() != nil {
				fmt.Fprintln(stderr, "stream ended: interrupted")
				return 0
			}
			fmt.Fprintf(stderr, "stream ended: %s: %s\n", st.Code(), st.Message())
			return 1
		}
		if *asJSON {
			line, err := protojson.MarshalOptions{}.Marshal(b)
			if err != nil {
				fmt.Fprintf(stderr, "kvrelay tail: encode batch: %v\n", err)
				return 1
			}
			fmt.Fprintf(stdout, "%s\n", line)
		} else {
			fmt.Fprintln(stdout, summarizeBatch(b))
		}
		n++
		if *limit > 0 && n >= *limit {
			return 0
		}
	}
}

// summarizeBatch is the one-line human form of a batch.
func summarizeBatch(b *kvpb.KvEventBatch) string {
	var stored, blocks, removed, cleared int
	for _, ev := range b.GetEvents() {
		switch {
		case ev.GetStored() != nil:
			stored++
			blocks += len(ev.GetStored().GetBlocks())
		case ev.GetRemoved() != nil:
			removed += len(ev.GetRemoved().GetBlockHashes())
		case ev.GetCleared() != nil:
			cleared++
		}
	}
	var sb strings.Builder
	fmt.Fprintf(&sb, "seq=%d", b.GetSequenceNumber())
	if b.DpRank != nil {
		fmt.Fprintf(&sb, " rank=%d", b.GetDpRank())
	}
	fmt.Fprintf(&sb, " ts=%.3f stores=%d blocks=%d removed=%d cleared=%d", b.GetTimestamp(), stored, blocks, removed, cleared)
	if s := b.GetSnapshot(); s != nil {
		fmt.Fprintf(&sb, " snapshot=%d/%d live_blocks=%d unknown_before=%d", s.GetIndex()+1, s.GetCount(), s.GetBlocks(), s.GetUnknownBefore())
	}
	if l := b.GetLoad(); l != nil && l.GetLoadOnly() {
		sb.WriteString(" load_only")
	}
	return sb.String()
}
