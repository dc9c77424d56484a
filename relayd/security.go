package relayd

import (
	"fmt"
	"log/slog"
	"reflect"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/kvrelay/kvrelay/internal/exposure"
	"github.com/kvrelay/kvrelay/internal/reload"
	"github.com/kvrelay/kvrelay/internal/tlsconfig"
	"github.com/kvrelay/kvrelay/relay/server"
)

// listenerSecurity is what one gRPC listener gets from its relays' TLS,
// reflection and upstream settings.
type listenerSecurity struct {
	serverOptions []grpc.ServerOption
	proxy         server.ProxyOptions
	reflection    bool
	reloaders     []reload.Reloader
}

// secureListener builds the TLS of the listener at addr shared by relays.
// Settings that belong to the listener must agree across its relays.
func secureListener(log *slog.Logger, addr string, relays []Relay, m *tlsconfig.Metrics) (listenerSecurity, error) {
	var out listenerSecurity
	first := relays[0]
	for _, r := range relays[1:] {
		switch {
		case !reflect.DeepEqual(r.TLS, first.TLS):
			return out, fmt.Errorf("listener %s: relays %q and %q give different TLS settings; one listener has one", addr, first.Name, r.Name)
		case r.Reflection != first.Reflection:
			return out, fmt.Errorf("listener %s: relays %q and %q give different reflection settings", addr, first.Name, r.Name)
		case r.UpstreamDropAuthorization != first.UpstreamDropAuthorization:
			return out, fmt.Errorf("listener %s: relays %q and %q give different upstream_drop_authorization", addr, first.Name, r.Name)
		}
	}
	if first.TLS.Enabled() {
		l, err := tlsconfig.NewListener(first.TLS, addr, m, log)
		if err != nil {
			return out, fmt.Errorf("listener %s: TLS: %w", addr, err)
		}
		out.serverOptions = l.GRPCServerOptions()
		out.reloaders = append(out.reloaders, l)
		log.Info("gRPC listener uses TLS", "listen", addr, "client_certificates", l.MutualTLS(), "allowed_identities", len(first.TLS.Allow))
	}
	exposure.WarnIfExposed(log, "grpc", addr, first.TLS.Enabled())
	switch first.Reflection {
	case "on":
		out.reflection = true
	case "auto", "":
		out.reflection = exposure.IsLoopback(addr)
	}
	out.proxy.DropAuthorization = first.UpstreamDropAuthorization
	for _, r := range relays {
		if r.Upstream == "" {
			continue
		}
		if len(r.UpstreamServices) > 0 {
			if out.proxy.ExtraServices == nil {
				out.proxy.ExtraServices = map[string][]string{}
			}
			out.proxy.ExtraServices[r.Engine.Name] = r.UpstreamServices
		}
		if !r.upstreamTLS {
			if !exposure.IsLoopback(r.upstreamAddr) {
				log.Warn("the upstream is not on loopback and is dialed without TLS: forwarded calls and their authorization cross the network in the clear (use grpcs://)",
					"relay", r.Name, "upstream", r.upstreamAddr)
			}
			continue
		}
		creds, d, err := UpstreamCredentials(true, r.UpstreamTLS, log)
		if err != nil {
			return out, fmt.Errorf("relay %q: upstream TLS: %w", r.Name, err)
		}
		if out.proxy.Credentials == nil {
			out.proxy.Credentials = map[string]credentials.TransportCredentials{}
		}
		out.proxy.Credentials[r.Engine.Name] = creds
		out.reloaders = append(out.reloaders, d)
	}
	return out, nil
}

// UpstreamCredentials are what the engine's servicer is dialled with, by the
// proxy and by discovery alike: TLS from settings for a grpcs:// upstream
// (the Dialer re-reads rotated files; nil for plaintext), plaintext
// otherwise.
func UpstreamCredentials(useTLS bool, settings tlsconfig.Client, log *slog.Logger) (credentials.TransportCredentials, *tlsconfig.Dialer, error) {
	if !useTLS {
		return insecure.NewCredentials(), nil, nil
	}
	d, err := tlsconfig.NewDialer(settings, log)
	if err != nil {
		return nil, nil, err
	}
	return d.Credentials(), d, nil
}
