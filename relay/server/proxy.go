package server

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strings"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
)

// proxy forwards every RPC kvrelay does not serve itself to an engine's own
// gRPC servicer, so a gateway's worker URL can point at kvrelay. Calls are
// routed by the service's proto package (vllm.*, sglang.*, tokenspeed.*);
// with a single upstream, everything unknown goes there.
type proxy struct {
	upstreams map[string]*grpc.ClientConn // proto package prefix → conn
	fallback  *grpc.ClientConn            // used when exactly one upstream exists
}

// streamDesc describes every proxied call as bidirectional: a frame pump
// does not need to know the call's real shape.
var streamDesc = &grpc.StreamDesc{ServerStreams: true, ClientStreams: true}

func (p *proxy) conn(fullMethod string) *grpc.ClientConn {
	svc := strings.TrimPrefix(fullMethod, "/")
	if i := strings.LastIndex(svc, "/"); i >= 0 {
		svc = svc[:i]
	}
	for pkg, cc := range p.upstreams {
		if strings.HasPrefix(svc, pkg+".") {
			return cc
		}
	}
	return p.fallback
}

func (p *proxy) handle(_ any, serverStream grpc.ServerStream) error {
	method, ok := grpc.MethodFromServerStream(serverStream)
	if !ok {
		return status.Error(codes.Internal, "proxy: the call has no method name")
	}
	cc := p.conn(method)
	if cc == nil {
		return status.Errorf(codes.Unimplemented, "unknown method %s: kvrelay serves SubscribeKvEvents and has no upstream for this service", method)
	}
	// The incoming context carries the caller's deadline; its metadata is
	// re-sent as outgoing metadata, minus the transport's own pseudo-headers.
	ctx, cancel := context.WithCancel(serverStream.Context())
	defer cancel()
	md, _ := metadata.FromIncomingContext(ctx)
	out := md.Copy()
	for _, k := range []string{":authority", "content-type", "user-agent", "grpc-timeout", "te"} {
		delete(out, k)
	}
	ctx = metadata.NewOutgoingContext(ctx, out)

	clientStream, err := cc.NewStream(ctx, streamDesc, method, grpc.ForceCodecV2(newPassthroughCodec()))
	if err != nil {
		return upstreamStatus(err)
	}

	// Requests flow up in their own goroutine; responses flow down here.
	go func() {
		for {
			f := &frame{}
			if err := serverStream.RecvMsg(f); err != nil {
				if errors.Is(err, io.EOF) {
					_ = clientStream.CloseSend()
				} else {
					cancel() // the caller went away: abandon the upstream call
				}
				return
			}
			if err := clientStream.SendMsg(f); err != nil {
				// The upstream's own status comes out of RecvMsg below.
				return
			}
		}
	}()

	headerSent := false
	for {
		f := &frame{}
		err := clientStream.RecvMsg(f)
		if !headerSent {
			if hdr, herr := clientStream.Header(); herr == nil && hdr.Len() > 0 {
				if err := serverStream.SendHeader(hdr); err != nil {
					return fmt.Errorf("proxy %s: send header: %w", method, err)
				}
			}
			headerSent = true
		}
		if err != nil {
			serverStream.SetTrailer(clientStream.Trailer())
			// The request pump ends by itself once this handler returns and
			// the server stream closes; waiting for it here could block on a
			// caller that keeps its side open.
			if errors.Is(err, io.EOF) {
				return nil
			}
			return upstreamStatus(err)
		}
		if err := serverStream.SendMsg(f); err != nil {
			return err
		}
	}
}

// upstreamStatus keeps the upstream's status code and message; a transport
// failure to reach the upstream surfaces as UNAVAILABLE.
func upstreamStatus(err error) error {
	if s, ok := status.FromError(err); ok {
		return s.Err()
	}
	return status.Errorf(codes.Unavailable, "upstream: %v", err)
}
