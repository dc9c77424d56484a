package tlsconfig

import (
	"context"
	"crypto/x509"
	"fmt"
	"log/slog"
	"strings"
	"unicode/utf8"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"
)

// identityKind is the part of a client certificate an allow-list entry names.
type identityKind int

const (
	kindCN  identityKind = iota // subject common name
	kindDNS                     // a DNS SAN
	kindURI                     // a URI SAN (SPIFFE IDs are URI SANs)
)

// allowEntry is one parsed allow-list entry.
type allowEntry struct {
	kind   identityKind
	value  string
	prefix bool // a URI ending in "/*": anything under that path
}

// AllowList is a parsed list of client identities. A certificate is allowed
// when any entry matches it.
type AllowList []allowEntry

// ParseAllowList reads entries of the forms
//
//	spiffe://TRUST-DOMAIN/PATH   a SPIFFE ID (URI SAN), exactly
//	spiffe://TRUST-DOMAIN/ns/*   any SPIFFE ID under that path
//	uri:URI                      any other URI SAN, exactly ("/*" as above)
//	dns:NAME                     a DNS SAN, exactly (case-insensitive)
//	cn:NAME                      the subject common name, exactly
func ParseAllowList(entries []string) (AllowList, error) {
	out := make(AllowList, 0, len(entries))
	for _, raw := range entries {
		e := strings.TrimSpace(raw)
		var entry allowEntry
		switch {
		case strings.HasPrefix(e, "spiffe://"):
			entry = allowEntry{kind: kindURI, value: e}
		case strings.HasPrefix(e, "uri:"):
			entry = allowEntry{kind: kindURI, value: strings.TrimPrefix(e, "uri:")}
		case strings.HasPrefix(e, "dns:"):
			entry = allowEntry{kind: kindDNS, value: strings.ToLower(strings.TrimPrefix(e, "dns:"))}
		case strings.HasPrefix(e, "cn:"):
			entry = allowEntry{kind: kindCN, value: strings.TrimPrefix(e, "cn:")}
		default:
			return nil, fmt.Errorf("allow-list entry %q: want spiffe://…, uri:URI, dns:NAME or cn:NAME", raw)
		}
		if entry.kind == kindURI && strings.HasSuffix(entry.value, "/*") {
			entry.prefix = true
			entry.value = strings.TrimSuffix(entry.value, "*")
		}
		if strings.Contains(entry.value, "*") {
			return nil, fmt.Errorf("allow-list entry %q: \"*\" is only allowed as a URI's last path segment (spiffe://domain/path/*)", raw)
		}
		if !utf8.ValidString(entry.value) {
			// Certificates carry identities as UTF-8 (or ASCII): such an
			// entry could never match, so it is a configuration mistake.
			return nil, fmt.Errorf("allow-list entry %q: not valid UTF-8", raw)
		}
		if entry.value == "" || entry.value == "spiffe://" || entry.value == "/" {
			return nil, fmt.Errorf("allow-list entry %q: empty identity", raw)
		}
		out = append(out, entry)
	}
	return out, nil
}

// Permits reports whether cert carries an allowed identity.
func (a AllowList) Permits(cert *x509.Certificate) bool {
	for _, e := range a {
		switch e.kind {
		case kindCN:
			if cert.Subject.CommonName == e.value {
				return true
			}
		case kindDNS:
			for _, n := range cert.DNSNames {
				if strings.ToLower(n) == e.value {
					return true
				}
			}
		case kindURI:
			for _, u := range cert.URIs {
				s := u.String()
				if s == e.value || (e.prefix && strings.HasPrefix(s, e.value)) {
					return true
				}
			}
		}
	}
	return false
}

// Identity describes a certificate's names for logs and error messages.
func Identity(cert *x509.Certificate) string {
	parts := []string{"cn:" + cert.Subject.CommonName}
	for _, n := range cert.DNSNames {
		parts = append(parts, "dns:"+n)
	}
	for _, u := range cert.URIs {
		parts = append(parts, u.String())
	}
	return strings.Join(parts, " ")
}

// guard refuses calls from identities outside the allow-list. It runs per
// call, not per handshake, so the refusal is a gRPC status the client can
// read (PERMISSION_DENIED) rather than a broken connection.
type guard struct {
	allow   AllowList
	refused prometheus.Counter
	log     *slog.Logger
}

func (g *guard) check(ctx context.Context, method string) error {
	leaf, ok := verifiedLeaf(ctx)
	if !ok {
		g.refused.Inc()
		return status.Error(codes.PermissionDenied, "kvrelay: this listener allows only listed client identities, and the call carries no verified client certificate")
	}
	if !g.allow.Permits(leaf) {
		g.refused.Inc()
		id := Identity(leaf)
		g.log.Warn("client refused: identity not on the allow-list", "identity", id, "method", method)
		return status.Errorf(codes.PermissionDenied, "kvrelay: client identity %q is not on this listener's allow-list", id)
	}
	return nil
}

func (g *guard) unary(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	if err := g.check(ctx, info.FullMethod); err != nil {
		return nil, err
	}
	return handler(ctx, req)
}

func (g *guard) stream(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
	if err := g.check(ss.Context(), info.FullMethod); err != nil {
		return err
	}
	return handler(srv, ss)
}

func tlsInfo(ctx context.Context) (credentials.TLSInfo, bool) {
	p, ok := peer.FromContext(ctx)
	if !ok || p.AuthInfo == nil {
		return credentials.TLSInfo{}, false
	}
	info, ok := p.AuthInfo.(credentials.TLSInfo)
	return info, ok
}
