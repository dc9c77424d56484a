package relayd

import (
	"context"
	"fmt"
	"log/slog"
	"net/http"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"

	"github.com/kvrelay/kvrelay/engines/load"
	"github.com/kvrelay/kvrelay/internal/natslog"
	"github.com/kvrelay/kvrelay/internal/reload"
)

// LoadSettings are a relay's checked load-source settings.
type LoadSettings struct {
	// Kind is "getloads" (the upstream servicer), "http" (URL) or "" (no
	// load on the stream).
	Kind     string
	URL      string
	Interval time.Duration
	MaxAge   time.Duration
}

// resolveLoad checks c's load settings and picks the source.
func resolveLoad(c RelayConfig) (LoadSettings, error) {
	var s LoadSettings
	var err error
	if c.LoadInterval != "" {
		if s.Interval, err = time.ParseDuration(c.LoadInterval); err != nil {
			return s, fmt.Errorf("load-interval %q: %w", c.LoadInterval, err)
		} else if s.Interval <= 0 {
			return s, fmt.Errorf("load-interval %q is not a positive duration", c.LoadInterval)
		}
	}
	if c.LoadMaxAge != "" {
		if s.MaxAge, err = time.ParseDuration(c.LoadMaxAge); err != nil {
			return s, fmt.Errorf("load-max-age %q: %w", c.LoadMaxAge, err)
		} else if s.MaxAge <= 0 {
			return s, fmt.Errorf("load-max-age %q is not a positive duration", c.LoadMaxAge)
		}
	}
	switch c.LoadSource {
	case "", "auto":
		switch {
		case c.EngineMetricsURL != "":
			s.Kind = "http"
		case c.Upstream != "":
			s.Kind = "getloads"
		}
	case "http":
		if c.EngineMetricsURL == "" {
			return s, fmt.Errorf("load-source http needs engine-metrics-url")
		}
		s.Kind = "http"
	case "getloads":
		if c.Upstream == "" {
			return s, fmt.Errorf("load-source getloads needs an upstream (the engine's servicer)")
		}
		s.Kind = "getloads"
	case "off":
	default:
		return s, fmt.Errorf("load-source %q: want auto, getloads, http or off", c.LoadSource)
	}
	if s.Kind == "http" {
		// Fail at start on a URL the reader cannot use.
		if _, err := load.NewHTTP(nil, c.EngineMetricsURL); err != nil {
			return s, err
		}
		s.URL = c.EngineMetricsURL
	}
	return s, nil
}

// startLoad builds rc's load poller and runs it under wg until ctx ends; nil
// when the relay reads no load. The GetLoads source dials the upstream as
// the proxy does (its own connection: a poll never queues behind a
// gateway's call).
func startLoad(ctx context.Context, wg *sync.WaitGroup, log *slog.Logger, reg prometheus.Registerer, rc Relay, dial grpcDial) (*load.Poller, func(), error) {
	var (
		fetcher load.Fetcher
		closer  = func() {}
		err     error
	)
	switch rc.Load.Kind {
	case "":
		return nil, closer, nil
	case "http":
		// The engine's server is local; a client of its own keeps a slow
		// engine from holding connections another client needs.
		fetcher, err = load.NewHTTP(&http.Client{Transport: http.DefaultTransport.(*http.Transport).Clone()}, rc.Load.URL)
	case "getloads":
		var cc *grpc.ClientConn
		cc, err = dial(rc)
		if err == nil {
			closer = func() { _ = cc.Close() }
			fetcher, err = load.NewGetLoads(cc, rc.Engine.ServiceName)
		}
	}
	if err != nil {
		closer()
		return nil, nil, fmt.Errorf("relay %q: load source: %w", rc.Name, err)
	}
	p, err := load.NewPoller(load.Options{
		Fetcher: fetcher, Interval: rc.Load.Interval, MaxAge: rc.Load.MaxAge,
		Logger:     log.With("relay", rc.Name),
		Registerer: prometheus.WrapRegistererWith(prometheus.Labels{"relay": rc.Name}, reg),
	})
	if err != nil {
		closer()
		return nil, nil, fmt.Errorf("relay %q: %w", rc.Name, err)
	}
	log.Info("reading the engine's load", "relay", rc.Name, "source", rc.Load.Kind, "url", natslog.Redact(rc.Load.URL), "upstream", rc.Upstream)
	wg.Add(1)
	go func() {
		defer wg.Done()
		_ = p.Run(ctx)
	}()
	return p, closer, nil
}

// grpcDial dials a relay's upstream servicer.
type grpcDial func(rc Relay) (*grpc.ClientConn, error)

// dialUpstream dials rc's upstream with the credentials the proxy uses. A
// TLS dialer joins reloaders, so SIGHUP rotates this connection's
// certificates as it does the proxy's.
func dialUpstream(log *slog.Logger, reloaders *[]reload.Reloader) grpcDial {
	return func(rc Relay) (*grpc.ClientConn, error) {
		creds, d, err := UpstreamCredentials(rc.upstreamTLS, rc.UpstreamTLS, log)
		if err != nil {
			return nil, err
		}
		if d != nil {
			*reloaders = append(*reloaders, d)
		}
		return grpc.NewClient(rc.upstreamAddr, grpc.WithTransportCredentials(creds))
	}
}
