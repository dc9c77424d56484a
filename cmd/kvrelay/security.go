package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"reflect"
	"syscall"

	"github.com/prometheus/exporter-toolkit/web"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/kvrelay/kvrelay/internal/tlsconfig"
	"github.com/kvrelay/kvrelay/relay/server"
)

// This file holds what serve and gateway share about TLS: the HTTP listeners'
// web config (exporter-toolkit, as Prometheus exporters do), reloads on
// SIGHUP, and the warning for plaintext listeners off loopback.

// isLoopback reports whether a listen address only accepts local peers.
// An empty host or a wildcard address listens on every interface.
func isLoopback(addr string) bool {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return false
	}
	if host == "localhost" {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}

// warnIfExposed logs a warning for a plaintext listener reachable from the
// network: anyone who reaches it reads the engines' block hashes and token ids.
func warnIfExposed(log *slog.Logger, what, addr string, secured bool) {
	if !secured && !isLoopback(addr) {
		log.Warn("listener is not on loopback and has no TLS: any peer that reaches it can read and call it; set TLS (and client certificates) or bind to 127.0.0.1",
			"listener", what, "listen", addr)
	}
}

// checkWebConfig reads a --web.config.file now, so a bad file stops the
// start instead of the first scrape.
func checkWebConfig(path string) error {
	if path == "" {
		return nil
	}
	if err := web.Validate(path); err != nil {
		return fmt.Errorf("--web.config.file %s: %w", path, err)
	}
	return nil
}

// serveHTTP serves srv on lis with the web config's TLS and basic auth; the
// file is read again at each TLS handshake, so certificates rotate without a
// restart.
func serveHTTP(srv *http.Server, lis net.Listener, webConfig string, log *slog.Logger) error {
	err := web.Serve(lis, srv, &web.FlagConfig{WebConfigFile: &webConfig}, log)
	if errors.Is(err, http.ErrServerClosed) {
		return nil
	}
	return err
}

// reloader is a TLS setting whose files can be re-read.
type reloader interface {
	Reload() error
}

// reloadOnHangup re-reads every reloader's files on SIGHUP until ctx ends; a
// file that does not load is logged and the previous one stays in service.
// The returned channel closes when it has stopped listening.
func reloadOnHangup(ctx context.Context, log *slog.Logger, all []reloader) <-chan struct{} {
	done := make(chan struct{})
	if len(all) == 0 {
		close(done)
		return done
	}
	hup := make(chan os.Signal, 1)
	signal.Notify(hup, syscall.SIGHUP)
	go func() {
		defer close(done)
		defer signal.Stop(hup)
		for {
			select {
			case <-ctx.Done():
				return
			case <-hup:
				failed := 0
				for _, r := range all {
					if err := r.Reload(); err != nil {
						failed++
						log.Error("SIGHUP: certificate reload failed; the previous files stay in service", "err", err)
					}
				}
				log.Info("SIGHUP: certificates reloaded", "settings", len(all), "failed", failed)
			}
		}
	}()
	return done
}

// grpcListenerSecurity is what one `serve` gRPC listener gets from its
// relays' TLS, reflection and upstream settings.
type grpcListenerSecurity struct {
	serverOptions []grpc.ServerOption
	proxy         server.ProxyOptions
	reflection    bool
	reloaders     []reloader
}

// listenerSecurity builds the TLS of the listener at addr shared by relays.
// Settings that belong to the listener must agree across its relays.
func listenerSecurity(log *slog.Logger, addr string, relays []resolvedRelay, m *tlsconfig.Metrics) (grpcListenerSecurity, error) {
	var out grpcListenerSecurity
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
	warnIfExposed(log, "grpc", addr, first.TLS.Enabled())
	switch first.Reflection {
	case "on":
		out.reflection = true
	case "auto", "":
		out.reflection = isLoopback(addr)
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
			out.proxy.ExtraServices[r.engine.Name] = r.UpstreamServices
		}
		if !r.upstreamTLS {
			if !isLoopback(r.upstreamAddr) {
				log.Warn("the upstream is not on loopback and is dialed without TLS: forwarded calls and their authorization cross the network in the clear (use grpcs://)",
					"relay", r.Name, "upstream", r.upstreamAddr)
			}
			continue
		}
		creds, d, err := upstreamCredentials(true, r.UpstreamTLS, log)
		if err != nil {
			return out, fmt.Errorf("relay %q: upstream TLS: %w", r.Name, err)
		}
		if out.proxy.Credentials == nil {
			out.proxy.Credentials = map[string]credentials.TransportCredentials{}
		}
		out.proxy.Credentials[r.engine.Name] = creds
		out.reloaders = append(out.reloaders, d)
	}
	return out, nil
}

// upstreamCredentials are what the engine's servicer is dialled with, by the
// proxy and by discovery alike: TLS from settings for a grpcs:// upstream
// (the Dialer re-reads rotated files; nil for plaintext), plaintext
// otherwise.
func upstreamCredentials(useTLS bool, settings tlsconfig.Client, log *slog.Logger) (credentials.TransportCredentials, *tlsconfig.Dialer, error) {
	if !useTLS {
		return insecure.NewCredentials(), nil, nil
	}
	d, err := tlsconfig.NewDialer(settings, log)
	if err != nil {
		return nil, nil, err
	}
	return d.Credentials(), d, nil
}
