package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/kvrelay/kvrelay/engines"
	"github.com/kvrelay/kvrelay/engines/sglang"
	"github.com/kvrelay/kvrelay/engines/tokenspeed"
	"github.com/kvrelay/kvrelay/engines/vllm"
	"github.com/kvrelay/kvrelay/proto/kvpb"
	"github.com/kvrelay/kvrelay/relay"
	"github.com/kvrelay/kvrelay/relay/server"
)

func init() {
	register("serve", "relay an engine's KV events to gateways over gRPC", runServe)
}

// engineByName maps --engine values to engine descriptions.
func engineByName(name string) (engines.Engine, error) {
	switch name {
	case "vllm":
		return vllm.Engine, nil
	case "sglang":
		return sglang.Engine, nil
	case "tokenspeed":
		return tokenspeed.Engine, nil
	}
	return engines.Engine{}, fmt.Errorf("unknown engine %q (want vllm, sglang or tokenspeed)", name)
}

// serveFile is the --config file: several relays, on one listener or several.
type serveFile struct {
	MetricsListen string        `json:"metrics_listen"`
	LogLevel      string        `json:"log_level"`
	LogFormat     string        `json:"log_format"`
	Relays        []relayConfig `json:"relays"`
}

// relayConfig is one relay. KVEventsConfig is the exact JSON the engine got,
// as a JSON object or as a string holding it.
type relayConfig struct {
	Name           string          `json:"name"`
	Engine         string          `json:"engine"`
	KVEventsConfig json.RawMessage `json:"kv_events_config"`
	DPSize         int             `json:"dp_size"`
	Listen         string          `json:"listen"`
	Upstream       string          `json:"upstream"`
	HistoryBatches int             `json:"history_batches"`
	HistoryBytes   int64           `json:"history_bytes"`
	ReplayTimeout  string          `json:"replay_timeout"`
}

// resolvedRelay is a relayConfig checked and parsed.
type resolvedRelay struct {
	relayConfig
	engine        engines.Engine
	kv            engines.Config
	replayTimeout time.Duration
}

func runServe(ctx context.Context, args []string, _ io.Reader, _, stderr io.Writer) int {
	fs := flag.NewFlagSet("serve", flag.ContinueOnError)
	fs.SetOutput(stderr)
	configPath := fs.String("config", "", "JSON file describing several relays (see README); excludes the single-relay flags")
	engineName := fs.String("engine", "", "engine: vllm, sglang or tokenspeed")
	kvConfig := fs.String("kv-events-config", "", "the --kv-events-config JSON the engine was started with")
	dpSize := fs.Int("dp-size", 1, "data-parallel ranks the engine runs (one publisher each)")
	listen := fs.String("listen", "127.0.0.1:50051", "gRPC listen address")
	upstream := fs.String("upstream", "", "the engine's own gRPC servicer HOST:PORT; other RPCs are forwarded there")
	metricsListen := fs.String("metrics-listen", "127.0.0.1:9464", "HTTP address for /metrics and /debug/status (empty: off)")
	historyBatches := fs.Int("history-batches", 0, "history bound in batches (0: $SMG_KV_EVENT_HISTORY_BATCHES or 10000)")
	historyBytes := fs.Int64("history-bytes", 0, "history bound in bytes (0: $SMG_KV_EVENT_HISTORY_BYTES or 256 MiB)")
	replayTimeout := fs.Duration("replay-timeout", 5*time.Second, "wait for each replay reply from the engine")
	logLevel := fs.String("log-level", "info", "debug, info, warn or error")
	logFormat := fs.String("log-format", "text", "text or json")
	limits := addServerLimitFlags(fs)
	if err := fs.Parse(args); err != nil {
		return 2
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(stderr, "kvrelay serve: unexpected argument %q\n", fs.Arg(0))
		return 2
	}

	var file serveFile
	if *configPath != "" {
		set := map[string]bool{}
		fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
		for _, single := range []string{"engine", "kv-events-config", "dp-size", "listen", "upstream", "history-batches", "history-bytes", "replay-timeout"} {
			if set[single] {
				fmt.Fprintf(stderr, "kvrelay serve: --%s cannot be combined with --config (put it in the file)\n", single)
				return 2
			}
		}
		f, err := readServeFile(*configPath)
		if err != nil {
			fmt.Fprintf(stderr, "kvrelay serve: %v\n", err)
			return 2
		}
		file = f
		if file.MetricsListen == "" {
			file.MetricsListen = *metricsListen
		}
		if file.LogLevel == "" {
			file.LogLevel = *logLevel
		}
		if file.LogFormat == "" {
			file.LogFormat = *logFormat
		}
	} else {
		if *engineName == "" {
			fmt.Fprintln(stderr, "kvrelay serve: --engine is required (or --config)")
			return 2
		}
		if *dpSize < 1 {
			fmt.Fprintf(stderr, "kvrelay serve: --dp-size %d: want at least 1\n", *dpSize)
			return 2
		}
		if *kvConfig == "" {
			fmt.Fprintln(stderr, "kvrelay serve: --kv-events-config is required (the JSON the engine was started with)")
			return 2
		}
		raw, _ := json.Marshal(*kvConfig)
		file = serveFile{
			MetricsListen: *metricsListen, LogLevel: *logLevel, LogFormat: *logFormat,
			Relays: []relayConfig{{
				Name: *engineName, Engine: *engineName, KVEventsConfig: raw, DPSize: *dpSize,
				Listen: *listen, Upstream: *upstream, HistoryBatches: *historyBatches,
				HistoryBytes: *historyBytes, ReplayTimeout: replayTimeout.String(),
			}},
		}
	}
	log, err := newLogger(stderr, file.LogLevel, file.LogFormat)
	if err != nil {
		fmt.Fprintf(stderr, "kvrelay serve: %v\n", err)
		return 2
	}
	relays, err := resolveRelays(file.Relays)
	if err != nil {
		fmt.Fprintf(stderr, "kvrelay serve: %v\n", err)
		return 2
	}
	if err := limits.validate(); err != nil {
		fmt.Fprintf(stderr, "kvrelay serve: %v\n", err)
		return 2
	}
	if err := serve(ctx, log, file.MetricsListen, relays, *limits); err != nil {
		log.Error("kvrelay serve failed", "err", err)
		return 1
	}
	return 0
}

func readServeFile(path string) (serveFile, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return serveFile{}, fmt.Errorf("--config: %w", err)
	}
	dec := json.NewDecoder(strings.NewReader(string(data)))
	dec.DisallowUnknownFields()
	var f serveFile
	if err := dec.Decode(&f); err != nil {
		return serveFile{}, fmt.Errorf("--config %s: %w", path, err)
	}
	if len(f.Relays) == 0 {
		return serveFile{}, fmt.Errorf("--config %s: \"relays\" is empty", path)
	}
	return f, nil
}

func resolveRelays(cfgs []relayConfig) ([]resolvedRelay, error) {
	names := map[string]bool{}
	out := make([]resolvedRelay, 0, len(cfgs))
	for i, c := range cfgs {
		where := fmt.Sprintf("relay %d", i)
		if c.Name != "" {
			where = fmt.Sprintf("relay %q", c.Name)
		}
		eng, err := engineByName(c.Engine)
		if err != nil {
			return nil, fmt.Errorf("%s: engine: %w", where, err)
		}
		if c.Name == "" {
			c.Name = c.Engine
		}
		if names[c.Name] {
			return nil, fmt.Errorf("%s: name is used twice", where)
		}
		names[c.Name] = true
		text, err := kvConfigText(c.KVEventsConfig)
		if err != nil {
			return nil, fmt.Errorf("%s: kv_events_config: %w", where, err)
		}
		kv, err := eng.ParseConfig(text)
		if err != nil {
			return nil, fmt.Errorf("%s: kv-events-config: %w", where, err)
		}
		if c.DPSize == 0 {
			c.DPSize = 1
		}
		if c.DPSize < 1 || c.DPSize > 1024 {
			return nil, fmt.Errorf("%s: dp-size %d is out of range (1..1024)", where, c.DPSize)
		}
		if c.Listen == "" {
			return nil, fmt.Errorf("%s: listen is required", where)
		}
		if _, _, err := net.SplitHostPort(c.Listen); err != nil {
			return nil, fmt.Errorf("%s: listen %q: %w", where, c.Listen, err)
		}
		if c.Upstream != "" {
			if _, _, err := net.SplitHostPort(c.Upstream); err != nil {
				return nil, fmt.Errorf("%s: upstream %q: %w", where, c.Upstream, err)
			}
		}
		if c.HistoryBatches < 0 {
			return nil, fmt.Errorf("%s: history-batches %d is negative", where, c.HistoryBatches)
		}
		if c.HistoryBytes < 0 {
			return nil, fmt.Errorf("%s: history-bytes %d is negative", where, c.HistoryBytes)
		}
		timeout := 5 * time.Second
		if c.ReplayTimeout != "" {
			timeout, err = time.ParseDuration(c.ReplayTimeout)
			if err != nil || timeout <= 0 {
				return nil, fmt.Errorf("%s: replay-timeout %q is not a positive duration", where, c.ReplayTimeout)
			}
		}
		if kv.Enabled {
			// Fail now, not at the first connect, on endpoints no rank can use.
			for rank := 0; rank < c.DPSize; rank++ {
				if _, err := engines.ConnectEndpoint(kv.Endpoint, rank); err != nil {
					return nil, fmt.Errorf("%s: endpoint for rank %d: %w", where, rank, err)
				}
				if kv.ReplayEndpoint != "" {
					if _, err := engines.ConnectEndpoint(kv.ReplayEndpoint, rank); err != nil {
						return nil, fmt.Errorf("%s: replay_endpoint for rank %d: %w", where, rank, err)
					}
				}
			}
		}
		out = append(out, resolvedRelay{relayConfig: c, engine: eng, kv: kv, replayTimeout: timeout})
	}
	return out, nil
}

// kvConfigText accepts the engine's JSON as an object or as a string.
func kvConfigText(raw json.RawMessage) (string, error) {
	if len(raw) == 0 {
		return "", errors.New("missing")
	}
	var s string
	if err := json.Unmarshal(raw, &s); err == nil {
		return s, nil
	}
	return string(raw), nil
}

func newLogger(w io.Writer, level, format string) (*slog.Logger, error) {
	var lv slog.Level
	if err := lv.UnmarshalText([]byte(level)); err != nil {
		return nil, fmt.Errorf("--log-level %q: %w", level, err)
	}
	opts := &slog.HandlerOptions{Level: lv}
	switch format {
	case "text":
		return slog.New(slog.NewTextHandler(w, opts)), nil
	case "json":
		return slog.New(slog.NewJSONHandler(w, opts)), nil
	}
	return nil, fmt.Errorf("--log-format %q: want text or json", format)
}

// serve runs the relays, their gRPC listeners and the HTTP endpoint until ctx
// ends, then shuts down in order: stop accepting, end streams, stop relays.
func serve(ctx context.Context, log *slog.Logger, metricsListen string, relays []resolvedRelay, limits serverLimitFlags) error {
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))

	runCtx, cancel := context.WithCancel(ctx)
	defer cancel()

	type running struct {
		cfg   resolvedRelay
		relay *relay.Relay // nil when the engine's events are off
	}
	var all []running
	for _, rc := range relays {
		if !rc.kv.Enabled {
			log.Warn("engine events are off in its config; SubscribeKvEvents will answer UNIMPLEMENTED",
				"relay", rc.Name, "publisher", rc.kv.Publisher)
			all = append(all, running{cfg: rc})
			continue
		}
		r, err := relay.New(relay.Config{
			Engine:         rc.engine,
			KV:             rc.kv,
			DPSize:         rc.DPSize,
			HistoryBatches: rc.HistoryBatches,
			HistoryBytes:   rc.HistoryBytes,
			ReplayTimeout:  rc.replayTimeout,
			// Negative: no cap, which relay.Config spells the same way.
			RecordMaxEntries: limits.RecordMaxEntries,
			Logger:           log.With("relay", rc.Name),
			Instance:         rc.Name, // the relay label on its metrics
			Registerer:       reg,
		})
		if err != nil {
			return fmt.Errorf("relay %q: %w", rc.Name, err)
		}
		all = append(all, running{cfg: rc, relay: r})
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
		for _, r := range byListen[addr] {
			svc := server.Service{Engine: r.cfg.engine}
			if r.relay != nil {
				rel := r.relay
				svc.Subscribe = func(ctx context.Context, req *kvpb.SubscribeKvEventsRequest) (server.Stream, error) {
					return rel.Subscribe(ctx, req)
				}
				svc.Ready = rel.Ready
			}
			services = append(services, svc)
			if r.cfg.Upstream != "" {
				upstreams[r.cfg.engine.Name] = r.cfg.Upstream
			}
		}
		// Every listener's series carry a listener label when there are
		// several: one metric name must have one label set.
		var srvReg prometheus.Registerer = reg
		if len(order) > 1 {
			srvReg = prometheus.WrapRegistererWith(prometheus.Labels{"listener": addr}, reg)
		}
		srv, err := server.New(server.Options{Services: services, Upstreams: upstreams, Logger: log, Registerer: srvReg, Limits: limits.Limits})
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
	if metricsListen != "" {
		mux := http.NewServeMux()
		mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{
			ErrorLog: slog.NewLogLogger(log.Handler(), slog.LevelError), ErrorHandling: promhttp.ContinueOnError,
		}))
		mux.HandleFunc("/debug/status", func(w http.ResponseWriter, _ *http.Request) {
			out := map[string]any{}
			for _, r := range all {
				if r.relay == nil {
					out[r.cfg.Name] = map[string]any{"engine": r.cfg.Engine, "enabled": false}
					continue
				}
				out[r.cfg.Name] = map[string]any{"engine": r.cfg.Engine, "enabled": true, "listen": r.cfg.Listen, "status": r.relay.Status()}
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
		lis, err := net.Listen("tcp", metricsListen)
		if err != nil {
			cancel()
			closeAll()
			wg.Wait()
			return fmt.Errorf("--metrics-listen %s: %w", metricsListen, err)
		}
		httpSrv = &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
		go func() {
			if err := httpSrv.Serve(lis); err != nil && !errors.Is(err, http.ErrServerClosed) {
				errs <- fmt.Errorf("http %s: %w", metricsListen, err)
			}
		}()
		log.Info("serving /metrics and /debug/status", "listen", lis.Addr().String())
	}

	if err := sdNotify("READY=1"); err != nil {
		log.Warn("systemd notify failed", "err", err)
	}
	// The watchdog is petted only while every relay's state lock can be
	// taken: a deadlocked relay stops the pets and systemd restarts us.
	go runWatchdog(runCtx, func() bool {
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
	_ = sdNotify("STOPPING=1")
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
