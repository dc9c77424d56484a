package server

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"sort"
	"strings"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"
)

// ProxyOptions configure the forwarding of calls kvrelay does not serve.
type ProxyOptions struct {
	// Credentials per engine name dial that engine's upstream; nil (or a
	// missing entry) dials in plaintext.
	Credentials map[string]credentials.TransportCredentials
	// ExtraServices per engine name are further full service names (e.g.
	// "smg.worker.v1.WorkerControl") forwarded to that engine's upstream,
	// besides the engine's own service.
	ExtraServices map[string][]string
	// DropAuthorization removes the caller's authorization metadata instead
	// of passing it on (for engines that do not check API keys themselves
	// and should not see the gateway's).
	DropAuthorization bool
}

// proxy forwards the calls of an engine's own service that kvrelay does not
// serve itself (everything but SubscribeKvEvents) to the engine's own gRPC
// servicer, so a gateway's worker URL can point at kvrelay. Only the engine's
// service (and any extra services configured) is forwarded: kvrelay must not
// turn a loopback-only servicer's other services into network services.
type proxy struct {
	upstreams         map[string]*grpc.ClientConn // full service name → conn
	dropAuthorization bool
}

// streamDesc describes every proxied call as bidirectional: a frame pump
// does not need to know the call's real shape.
var streamDesc = &grpc.StreamDesc{ServerStreams: true, ClientStreams: true}

// conn is the upstream for a "/package.Service/Method" name, nil if the
// service is not forwarded.
func (p *proxy) conn(fullMethod string) *grpc.ClientConn {
	svc := strings.TrimPrefix(fullMethod, "/")
	i := strings.LastIndex(svc, "/")
	if i < 0 {
		return nil
	}
	return p.upstreams[svc[:i]]
}

// droppedMetadata never reaches the upstream: the transport's own headers
// (grpc sets them again), HTTP hop-by-hop headers, cookies (a browser-style
// credential no engine servicer uses), and forwarding headers a caller could
// forge (kvrelay sets x-forwarded-for from the connection itself).
var droppedMetadata = []string{
	":authority", "content-type", "user-agent", "grpc-timeout", "te",
	"connection", "keep-alive", "proxy-connection", "proxy-authorization", "proxy-authenticate",
	"transfer-encoding", "upgrade", "trailer", "host",
	"cookie", "cookie2",
	"forwarded", "x-forwarded-for", "x-forwarded-host", "x-forwarded-proto", "x-real-ip",
	"x-forwarded-client-cert",
}

// outgoingMetadata is what the upstream sees of the caller's metadata.
func (p *proxy) outgoingMetadata(ctx context.Context) metadata.MD {
	md, _ := metadata.FromIncomingContext(ctx)
	out := md.Copy()
	for _, k := range droppedMetadata {
		delete(out, k)
	}
	if p.dropAuthorization {
		delete(out, "authorization")
	}
	pr, ok := peer.FromContext(ctx)
	if !ok {
		return out
	}
	if host, _, err := net.SplitHostPort(pr.Addr.String()); err == nil {
		out.Set("x-forwarded-for", host)
	}
	// A verified client certificate's identity, in the form Envoy and
	// Istio use, so an engine can tell gateways apart.
	if info, ok := pr.AuthInfo.(credentials.TLSInfo); ok && len(info.State.VerifiedChains) > 0 && len(info.State.VerifiedChains[0]) > 0 {
		leaf := info.State.VerifiedChains[0][0]
		var parts []string
		parts = append(parts, fmt.Sprintf("Subject=%q", leaf.Subject.String()))
		for _, u := range leaf.URIs {
			parts = append(parts, "URI="+u.String())
		}
		for _, d := range leaf.DNSNames {
			parts = append(parts, "DNS="+d)
		}
		out.Set("x-forwarded-client-cert", strings.Join(parts, ";"))
	}
	return out
}

func (p *proxy) handle(_ any, serverStream grpc.ServerStream) error {
	method, ok := grpc.MethodFromServerStream(serverStream)
	if !ok {
		return status.Error(codes.Internal, "proxy: the call has no method name")
	}
	cc := p.conn(method)
	if cc == nil {
		return status.Errorf(codes.Unimplemented, "unknown method %s: kvrelay serves SubscribeKvEvents and forwards only the engine's own service (%s)", method, p.services())
	}
	// The incoming context carries the caller's deadline.
	ctx, cancel := context.WithCancel(serverStream.Context())
	defer cancel()
	ctx = metadata.NewOutgoingContext(ctx, p.outgoingMetadata(ctx))

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

// services lists the forwarded services, for error messages.
func (p *proxy) services() string {
	names := make([]string, 0, len(p.upstreams))
	for n := range p.upstreams {
		names = append(names, n)
	}
	sort.Strings(names)
	return strings.Join(names, ", ")
}

// upstreamStatus keeps the upstream's status code and message; a transport
// failure to reach the upstream surfaces as UNAVAILABLE.
func upstreamStatus(err error) error {
	if s, ok := status.FromError(err); ok {
		return s.Err()
	}
	return status.Errorf(codes.Unavailable, "upstream: %v", err)
}
