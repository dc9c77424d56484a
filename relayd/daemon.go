// Package relayd is the process `kvrelay serve` runs: relays for one or
// more engines, the gRPC listeners serving them (relays that share a listen
// address share a server), the optional JetStream sink per relay, and the
// HTTP endpoint with /metrics, /healthz and /debug/status. It owns their
// start order and their shutdown order; cmd/kvrelay only turns flags and a
// --config file into Options.
//
// It sits above natsevents (the sink is one more subscriber of a relay),
// which is why it is placed above both in layers_test.go.
package relayd

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/kvrelay/kvrelay/engines"
	"github.com/kvrelay/kvrelay/engines/load"
	"github.com/kvrelay/kvrelay/internal/buildinfo"
	"github.com/kvrelay/kvrelay/internal/exposure"
	"github.com/kvrelay/kvrelay/internal/reload"
	"github.com/kvrelay/kvrelay/internal/sdnotify"
	"github.com/kvrelay/kvrelay/internal/tlsconfig"
	"github.com/kvrelay/kvrelay/internal/webserve"
	"github.com/kvrelay/kvrelay/relay"
	"github.com/kvrelay/kvrelay/relay/server"
)

// EngineLimits bound what an engine's sockets can make a relay hold; they
// apply to every relay of the process (zero: relay.Config's defaults).
type EngineLimits struct {
	MaxMessageBytes, QueueBytes, ReplayMaxBytes int64
	ReplayMaxBatches                            int
	ReplayMaxTime                               time.Duration
}

// Options are a checked `serve`: relays from Resolve and process-wide
// settings.
type Options struct {
	Relays []Relay
	// MetricsListen is the HTTP address of /metrics, /healthz and
	// /debug/status ("" : off); WebConfigFile its exporter-toolkit config.
	MetricsListen, WebConfigFile string
	EngineLimits                 EngineLimits
	// ServerLimits apply to every listener (each counts its own
	// subscribers).
	ServerLimits server.Limits
	// RecordMaxEntries caps each rank's live-block record (negative: no
	// cap, as relay.Config spells it).
	RecordMaxEntries int
	// NATS, when its URL is set, publishes every relay's stream to
	// JetStream, each under its relay's NATSWorker.
	NATS   NATSSink
	Logger *slog.Logger
}

// logEndpoints says at start where each rank of rc is dialled, and warns
// about configurations the engine accepts but that leave kvrelay nothing to
// connect to.
func logEndpoints(log *slog.Logger, rc Relay) {
	if rc.UnknownKeys != nil {
		log.Warn("kv-events-config has a key the engine does not read; accepted (allow_unknown_config_keys)",
			"relay", rc.Name, "engine", rc.Engine.Name, "problem", rc.UnknownKeys.Error())
	}
	if !rc.PublishersOnUpstreamHost && !engines.PublisherBinds(rc.KV.Endpoint) {
		log.Warn("the engine will connect its publisher to this endpoint instead of binding it, so nothing listens there for kvrelay: "+
			engines.BindRule+"; use tcp://*:PORT",
			"relay", rc.Name, "endpoint", rc.KV.Endpoint)
	}
	eps, err := engines.PublisherEndpoints(rc.KV, rc.DPSize)
	if err != nil {
		return // Resolve already refused such a configuration
	}
	for _, ep := range eps {
		replay := ep.Replay
		if replay == "" {
			replay = "none"
		}
		log.Info("rank endpoints", "relay", rc.Name, "rank", ep.Rank, "publisher", ep.Live, "replay", replay)
	}
}

// warnReportModeDigests: with report mode "full" and the re-announcements
// left in the stream, the relay's live digest takes them for no change, so
// a gateway that counts them as copies (SMG's index, kvrelay gateway
// without --report-mode-full) never agrees with the digest and resyncs at
// every check.
func warnReportModeDigests(log *slog.Logger, rc Relay) {
	if rc.ReportModeFull && !rc.SuppressReannounced {
		log.Warn("report mode \"full\" with re-announced stores left in the stream: gateways must apply the same rule "+
			"(kvrelay gateway --report-mode-full) or their digests will diverge from this relay's and they resync at every check; "+
			"for copy-counting gateways (SMG) use --suppress-reannounced-stores", "relay", rc.Name)
	}
}

// Run runs the relays, their gRPC listeners and the HTTP endpoint until ctx
// ends, then shuts down in order: stop accepting, end streams, stop relays.
func Run(ctx context.Context, o Options) error {
	log := o.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	workers, err := o.NATS.WorkerNames(o.Relays)
	if err != nil {
		return err
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}), buildinfo.Read().Collector())
	tlsMetrics, err := tlsconfig.NewMetrics(reg)
	if err != nil {
		return err
	}
	var reloaders []reload.Reloader // certificates SIGHUP re-reads

	runCtx, cancel := context.WithCancel(ctx)
	defer cancel()

	type running struct {
		cfg   Relay
		relay *relay.Relay // nil when the engine's events are off
		load  *load.Poller // nil without a load source
	}
	var all []running
	for _, rc := range o.Relays {
		if !rc.KV.Enabled {
			log.Warn("engine events are off in its config; SubscribeKvEvents will answer UNIMPLEMENTED",
				"relay", rc.Name, "publisher", rc.KV.Publisher)
			all = append(all, running{cfg: rc})
			continue
		}
		logEndpoints(log, rc)
		warnReportModeDigests(log, rc)
		r, err := relay.New(relay.Config{
			Engine:              rc.Engine,
			KV:                  rc.KV,
			DPSize:              rc.DPSize,
			HistoryBatches:      rc.HistoryBatches,
			HistoryBytes:        rc.HistoryBytes,
			ReplayTimeout:       rc.ReplayTimeout,
			MaxMessageBytes:     o.EngineLimits.MaxMessageBytes,
			QueueBytes:          o.EngineLimits.QueueBytes,
			ReplayMaxBatches:    o.EngineLimits.ReplayMaxBatches,
			ReplayMaxBytes:      o.EngineLimits.ReplayMaxBytes,
			ReplayMaxTime:       o.EngineLimits.ReplayMaxTime,
			ReportModeFull:      rc.ReportModeFull,
			SuppressReannounced: rc.SuppressReannounced,
			RecordMaxEntries:    o.RecordMaxEntries,
			Logger:              log,     // the relay adds its "relay" key itself
			Instance:            rc.Name, // the relay label on its metrics
			Registerer:          reg,
		})
		if err != nil {
			return fmt.Errorf("relay %q: %w", rc.Name, err)
		}
		all = append(all, running{cfg: rc, relay: r})
	}
	// Load pollers run beside the relays and stop after the streams that
	// read them; their connections close only once they have stopped, so
	// a poll in flight at shutdown is cancelled, not failed and logged.
	var loadWG sync.WaitGroup
	var closeConns []func()
	loadCtx, stopLoad := context.WithCancel(context.Background())
	defer func() {
		stopLoad()
		loadWG.Wait()
		for _, closeConn := range closeConns {
			closeConn()
		}
	}()
	for i := range all {
		if all[i].relay == nil {
			continue
		}
		p, closeConn, err := startLoad(loadCtx, &loadWG, log, reg, all[i].cfg, dialUpstream(log, &reloaders))
		if err != nil {
			return err
		}
		closeConns = append(closeConns, closeConn)
		all[i].load = p
	}

	// Relays sharing a listen address share one gRPC server.
	byListen := map[string][]running{}
	var order []string
	for _, r := range all {
		if _, ok := byListen[r.cfg.Listen]; !ok {
			order = append(order, r.cfg.Listen)
		}
		byListen[r.cfg.Listen] = append(byListen[r.cfg.Listen], r)
	}
	type listening struct {
		srv *server.Server
		lis net.Listener
	}
	var servers []listening
	// closeAll stops every server; listeners whose Serve never ran are
	// closed here, since only Serve would close them.
	serving := false
	closeAll := func() {
		for _, l := range servers {
			l.srv.Stop()
			if !serving {
				_ = l.lis.Close()
			}
		}
	}
	for _, addr := range order {
		var services []server.Service
		upstreams := map[string]string{}
		var cfgs []Relay
		for _, r := range byListen[addr] {
			cfgs = append(cfgs, r.cfg)
		}
		security, err := secureListener(log, addr, cfgs, tlsMetrics)
		if err != nil {
			closeAll()
			return err
		}
		reloaders = append(reloaders, security.reloaders...)
		for _, r := range byListen[addr] {
			svc := server.Service{Engine: r.cfg.Engine} // events off: UNIMPLEMENTED
			if r.relay != nil {
				svc = server.RelayService(r.cfg.Engine, r.relay)
			}
			if r.load != nil {
				svc.Load = r.load
			}
			services = append(services, svc)
			if r.cfg.Upstream != "" {
				upstreams[r.cfg.Engine.Name] = r.cfg.upstreamAddr
			}
		}
		// Every listener's series carry a listener label when there are
		// several: one metric name must have one label set.
		var srvReg prometheus.Registerer = reg
		if len(order) > 1 {
			srvReg = prometheus.WrapRegistererWith(prometheus.Labels{"listener": addr}, reg)
		}
		srv, err := server.New(server.Options{
			Services: services, Upstreams: upstreams, Logger: log, Registerer: srvReg,
			Proxy: security.proxy, ServerOptions: security.serverOptions, Reflection: security.reflection,
			Limits: o.ServerLimits,
		})
		if err != nil {
			closeAll()
			return fmt.Errorf("listener %s: %w", addr, err)
		}
		lis, err := net.Listen("tcp", addr)
		if err != nil {
			srv.Stop()
			closeAll()
			return fmt.Errorf("listen %s: %w", addr, err)
		}
		servers = append(servers, listening{srv: srv, lis: lis})
		log.Info("serving SubscribeKvEvents", "listen", lis.Addr().String(), "relays", len(byListen[addr]))
	}

	var wg sync.WaitGroup
	errs := make(chan error, len(all)+len(servers)+1)
	for _, r := range all {
		if r.relay == nil {
			continue
		}
		wg.Add(1)
		go func(r running) {
			defer wg.Done()
			if err := r.relay.Run(runCtx); err != nil && runCtx.Err() == nil {
				errs <- fmt.Errorf("relay %q: %w", r.cfg.Name, err)
			}
		}(r)
	}
	// The JetStream sink (--nats) is one more subscriber of its relay.
	for _, r := range all {
		if err := o.NATS.start(runCtx, &wg, log, reg, r.cfg, workers[r.cfg.Name], r.relay, r.load); err != nil {
			cancel()
			closeAll()
			wg.Wait()
			return err
		}
	}
	serving = true
	for _, l := range servers {
		wg.Add(1)
		go func(l listening) {
			defer wg.Done()
			if err := l.srv.Serve(l.lis); err != nil {
				errs <- fmt.Errorf("grpc %s: %w", l.lis.Addr(), err)
			}
		}(l)
	}

	var httpSrv *http.Server
	if o.MetricsListen != "" {
		mux := http.NewServeMux()
		mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{
			ErrorLog: slog.NewLogLogger(log.Handler(), slog.LevelError), ErrorHandling: promhttp.ContinueOnError,
		}))
		mux.HandleFunc("/debug/status", func(w http.ResponseWriter, _ *http.Request) {
			out := map[string]RelayStatus{}
			for _, r := range all {
				if r.relay == nil {
					out[r.cfg.Name] = RelayStatus{Engine: r.cfg.RelayConfig.Engine}
					continue
				}
				st := r.relay.Status()
				out[r.cfg.Name] = RelayStatus{Engine: r.cfg.RelayConfig.Engine, Enabled: true, Listen: r.cfg.Listen, Status: &st}
			}
			w.Header().Set("Content-Type", "application/json")
			enc := json.NewEncoder(w)
			enc.SetIndent("", "  ")
			_ = enc.Encode(out)
		})
		mux.HandleFunc("/healthz", func(w http.ResponseWriter, _ *http.Request) {
			for _, r := range all {
				if r.relay != nil && !r.relay.Ready() {
					http.Error(w, fmt.Sprintf("relay %q is not connected to every rank", r.cfg.Name), http.StatusServiceUnavailable)
					return
				}
			}
			_, _ = io.WriteString(w, "ok\n")
		})
		lis, err := net.Listen("tcp", o.MetricsListen)
		if err != nil {
			cancel()
			closeAll()
			wg.Wait()
			return fmt.Errorf("--metrics-listen %s: %w", o.MetricsListen, err)
		}
		httpSrv = &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
		go func() {
			if err := webserve.Serve(httpSrv, lis, o.WebConfigFile, log); err != nil {
				errs <- fmt.Errorf("http %s: %w", o.MetricsListen, err)
			}
		}()
		exposure.WarnIfExposed(log, "metrics", o.MetricsListen, o.WebConfigFile != "")
		log.Info("serving /metrics and /debug/status", "listen", lis.Addr().String())
	}

	hupDone := reload.OnHangup(runCtx, log, reloaders)
	defer func() { cancel(); <-hupDone }()
	if err := sdnotify.Notify("READY=1"); err != nil {
		log.Warn("systemd notify failed", "err", err)
	}
	// The watchdog is petted only while every relay's state lock can be
	// taken: a deadlocked relay stops the pets and systemd restarts us.
	go sdnotify.RunWatchdog(runCtx, func() bool {
		for _, r := range all {
			if r.relay != nil {
				_ = r.relay.Status()
			}
		}
		return true
	})

	var runErr error
	select {
	case <-ctx.Done():
		log.Info("shutting down")
	case runErr = <-errs:
		log.Error("shutting down after a failure", "err", runErr)
	}
	_ = sdnotify.Notify("STOPPING=1")
	// Streams end first (UNAVAILABLE, so gateways move on), then the relays.
	closeAll()
	cancel()
	if httpSrv != nil {
		sctx, scancel := context.WithTimeout(context.Background(), 2*time.Second)
		_ = httpSrv.Shutdown(sctx)
		scancel()
	}
	wg.Wait()
	return runErr
}
