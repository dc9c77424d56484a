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
	"github.com/kvrelay/kvrelay/internal/buildinfo"
	"github.com/kvrelay/kvrelay/internal/tlsconfig"
	"github.com/kvrelay/kvrelay/relay"
	"github.com/kvrelay/kvrelay/relay/server"
	"github.com/kvrelay/kvrelay/relay/zmqsource"
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
	MetricsListen string `json:"metrics_listen"`
	LogLevel      string `json:"log_level"`
	LogFormat     string `json:"log_format"`
	// WebConfigFile is the metrics listener's exporter-toolkit web config
	// (TLS, basic auth).
	WebConfigFile string        `json:"web_config_file"`
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
	// TLS secures the listener (every relay on one listener gives the same).
	TLS tlsconfig.Server `json:"tls"`
	// Reflection is auto (on for a loopback listener), on or off.
	Reflection string `json:"reflection"`
	// UpstreamTLS applies to a grpcs:// upstream.
	UpstreamTLS tlsconfig.Client `json:"upstream_tls"`
	// UpstreamServices are services forwarded besides the engine's own.
	UpstreamServices          []string `json:"upstream_services"`
	UpstreamDropAuthorization bool     `json:"upstream_drop_authorization"`
	// AllowUnknownConfigKeys accepts kv_events_config keys the engine does
	// not read (a config shared with other engines), with a warning.
	AllowUnknownConfigKeys bool `json:"allow_unknown_config_keys"`
	// ReportModeFull and SuppressReannounced: see --report-mode-full and
	// --suppress-reannounced-stores.
	ReportModeFull      bool `json:"report_mode_full"`
	SuppressReannounced bool `json:"suppress_reannounced_stores"`
	// publishersOnUpstreamHost: discovery replaced the engine's wildcard
	// bind hosts by the upstream's host (publishersOnHost); the engine
	// binds them all the same.
	publishersOnUpstreamHost bool
}

// resolvedRelay is a relayConfig checked and parsed.
type resolvedRelay struct {
	relayConfig
	engine        engines.Engine
	kv            engines.Config
	replayTimeout time.Duration
	upstreamAddr  string // HOST:PORT of Upstream
	upstreamTLS   bool
	// unknownKeys is the refused-key error CheckKeys gave, kept as a start
	// warning when AllowUnknownConfigKeys is on.
	unknownKeys error
	limits      engineLimits
}

// engineLimits bound what an engine's sockets can make a relay hold; the
// flags apply to every relay of the process (zero: relay.Config's defaults).
type engineLimits struct {
	maxMessageBytes, queueBytes, replayMaxBytes int64
	replayMaxBatches                            int
	replayMaxTime                               time.Duration
}

func runServe(ctx context.Context, args []string, _ io.Reader, _, stderr io.Writer) int {
	fs := flag.NewFlagSet("serve", flag.ContinueOnError)
	fs.SetOutput(stderr)
	configPath := fs.String("config", "", "JSON file describing several relays (see README); excludes the single-relay flags")
	engineName := fs.String("engine", "", "engine: vllm, sglang or tokenspeed")
	kvConfig := fs.String("kv-events-config", "", "the --kv-events-config JSON the engine was started with (SGLang, TokenSpeed: learned from --upstream when omitted)")
	dpSize := fs.Int("dp-size", 1, "data-parallel ranks the engine runs (one publisher each)")
	listen := fs.String("listen", "127.0.0.1:50061", "gRPC listen address (not 50051: that is the engines' usual gRPC port, often the --upstream)")
	upstream := fs.String("upstream", "", "the engine's own gRPC servicer HOST:PORT; other RPCs are forwarded there")
	metricsListen := fs.String("metrics-listen", "127.0.0.1:9464", "HTTP address for /metrics, /healthz and /debug/status (empty: off)")
	historyBatches := fs.Int("history-batches", 0, "history bound in batches (0: $SMG_KV_EVENT_HISTORY_BATCHES or 10000)")
	historyBytes := fs.Int64("history-bytes", 0, "history bound in bytes (0: $SMG_KV_EVENT_HISTORY_BYTES or 256 MiB)")
	replayTimeout := fs.Duration("replay-timeout", 5*time.Second, "wait for each replay reply from the engine")
	var lim engineLimits
	fs.Int64Var(&lim.maxMessageBytes, "max-message-bytes", zmqsource.DefaultMaxMessageBytes,
		"largest ZeroMQ message (all frames) or frame accepted from an engine; a peer declaring more is disconnected before anything is allocated")
	fs.Int64Var(&lim.queueBytes, "zmq-queue-bytes", zmqsource.DefaultQueueBytes,
		"bytes each rank's incoming queue may hold (besides the engine's hwm in messages); at least --max-message-bytes")
	fs.IntVar(&lim.replayMaxBatches, "replay-max-batches", 0, "replies one replay may bring (0: twice the engine's buffer_steps)")
	fs.Int64Var(&lim.replayMaxBytes, "replay-max-bytes", zmqsource.DefaultReplayMaxBytes, "payload bytes one replay may bring")
	fs.DurationVar(&lim.replayMaxTime, "replay-max-time", zmqsource.DefaultReplayMaxTime, "time one replay may take in all")
	reportModeFull := fs.Bool("report-mode-full", false,
		"the engine's requests may ask for vLLM's kv_cache_report_mode \"full\": the record takes their re-announced prefix-cache hits for no change (see README)")
	suppressReannounced := fs.Bool("suppress-reannounced-stores", false,
		"leave vLLM's report-mode \"full\" re-announcements of prefix-cache hits out of the stream, for gateways that count copies per store (SMG's); off: the stream is the engine's, batch for batch")
	logLevel := fs.String("log-level", "info", "debug, info, warn or error")
	logFormat := fs.String("log-format", "text", "text or json")
	var listenTLS tlsconfig.Server
	tlsconfig.RegisterServerFlags(fs, &listenTLS)
	reflectionMode := fs.String("reflection", "auto", "gRPC server reflection: auto (on when --listen is loopback), on or off")
	var upstreamTLS tlsconfig.Client
	tlsconfig.RegisterClientFlags(fs, "upstream-tls-", "the upstream", &upstreamTLS)
	var upstreamServices []string
	fs.Func("upstream-service", "a full gRPC service name forwarded to --upstream besides the engine's own (repeat)", func(v string) error {
		upstreamServices = append(upstreamServices, v)
		return nil
	})
	upstreamDropAuth := fs.Bool("upstream-drop-authorization", false, "do not pass callers' authorization metadata to --upstream")
	webConfig := fs.String("web.config.file", "", "exporter-toolkit web config (tls_server_config, basic_auth_users) for --metrics-listen")
	allowUnknownKeys := fs.Bool("allow-unknown-config-keys", false, "accept --kv-events-config keys this engine does not read (a config shared with other engines); default: refuse them")
	limits := addServerLimitFlags(fs)
	natsSink := addServeNATSFlags(fs)
	if err := fs.Parse(args); err != nil {
		return flagExitCode(err)
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(stderr, "kvrelay serve: unexpected argument %q\n", fs.Arg(0))
		return 2
	}
	if err := natsSink.check(*configPath != ""); err != nil {
		fmt.Fprintf(stderr, "kvrelay serve: %v\n", err)
		return 2
	}

	var file serveFile
	publishersMoved := false // discovery put the upstream's host in wildcard endpoints
	if *configPath != "" {
		set := map[string]bool{}
		fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
		for _, single := range []string{"engine", "kv-events-config", "dp-size", "listen", "upstream", "history-batches", "history-bytes", "replay-timeout",
			"tls-cert", "tls-key", "tls-client-ca", "tls-allow", "reflection", "upstream-tls-ca", "upstream-tls-cert", "upstream-tls-key",
			"upstream-tls-server-name", "upstream-service", "upstream-drop-authorization", "allow-unknown-config-keys",
			"report-mode-full", "suppress-reannounced-stores"} {
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
		if file.WebConfigFile == "" {
			file.WebConfigFile = *webConfig
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
		if *kvConfig == "" && *upstream != "" {
			// The engine's servicer tells its config and rank count; it is
			// dialled as the proxy dials it (grpcs:// with the upstream TLS
			// settings).
			addr, useTLS, err := parseUpstream(*upstream, upstreamTLS)
			if err != nil {
				fmt.Fprintf(stderr, "kvrelay serve: %v\n", err)
				return 2
			}
			creds, _, err := upstreamCredentials(useTLS, upstreamTLS, nil)
			if err != nil {
				fmt.Fprintf(stderr, "kvrelay serve: upstream TLS: %v\n", err)
				return 2
			}
			pubs, err := discoverPublishers(ctx, *engineName, addr, creds, discoverTimeout, stderr)
			if err != nil {
				fmt.Fprintf(stderr, "kvrelay serve: no --kv-events-config, and the engine's servicer did not give one: %v\n", err)
				return 2
			}
			if pubs.KVEventsConfig == "" {
				fmt.Fprintf(stderr, "kvrelay serve: the engine at %s publishes no KV events (its kv_events_config is unset)\n", *upstream)
				return 2
			}
			set := map[string]bool{}
			fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
			if set["dp-size"] && *dpSize != pubs.DPSize {
				fmt.Fprintf(stderr, "kvrelay serve: --dp-size %d, but the engine at %s runs %d publishers\n", *dpSize, *upstream, pubs.DPSize)
				return 2
			}
			*kvConfig, *dpSize = pubs.KVEventsConfig, pubs.DPSize
			fmt.Fprintf(stderr, "kvrelay serve: learned from %s: --kv-events-config '%s' --dp-size %d\n", *upstream, *kvConfig, *dpSize)
			if !isLoopback(addr) {
				// The engine runs at the upstream's host: a wildcard bind
				// is reached there, not on this host.
				host, _, _ := net.SplitHostPort(addr)
				moved, changed, err := publishersOnHost(*kvConfig, host)
				if err != nil {
					fmt.Fprintf(stderr, "kvrelay serve: the engine at %s advertised an unreadable config: %v\n", *upstream, err)
					return 2
				}
				if len(changed) > 0 {
					*kvConfig, publishersMoved = moved, true
					fmt.Fprintf(stderr, "kvrelay serve: the engine binds its publishers on every interface; dialling them at the upstream's host: %s\n", strings.Join(changed, ", "))
				}
			}
		}
		if *kvConfig == "" {
			fmt.Fprintln(stderr, "kvrelay serve: --kv-events-config is required (the JSON the engine was started with), or --upstream of an SGLang or TokenSpeed servicer that advertises it")
			return 2
		}
		raw, _ := json.Marshal(*kvConfig)
		file = serveFile{
			MetricsListen: *metricsListen, LogLevel: *logLevel, LogFormat: *logFormat, WebConfigFile: *webConfig,
			Relays: []relayConfig{{
				Name: *engineName, Engine: *engineName, KVEventsConfig: raw, DPSize: *dpSize,
				Listen: *listen, Upstream: *upstream, HistoryBatches: *historyBatches,
				HistoryBytes: *historyBytes, ReplayTimeout: replayTimeout.String(),
				TLS: listenTLS, Reflection: *reflectionMode, UpstreamTLS: upstreamTLS,
				UpstreamServices: upstreamServices, UpstreamDropAuthorization: *upstreamDropAuth,
				AllowUnknownConfigKeys: *allowUnknownKeys,
				ReportModeFull:         *reportModeFull, SuppressReannounced: *suppressReannounced,
				publishersOnUpstreamHost: publishersMoved,
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
	if err := checkWebConfig(file.WebConfigFile); err != nil {
		fmt.Fprintf(stderr, "kvrelay serve: %v\n", err)
		return 2
	}
	if err := lim.check(); err != nil {
		fmt.Fprintf(stderr, "kvrelay serve: %v\n", err)
		return 2
	}
	for i := range relays {
		relays[i].limits = lim
	}
	if err := limits.validate(); err != nil {
		fmt.Fprintf(stderr, "kvrelay serve: %v\n", err)
		return 2
	}
	if err := serve(ctx, log, file.MetricsListen, file.WebConfigFile, relays, *limits, natsSink); err != nil {
		log.Error("kvrelay serve failed", "err", err)
		return 1
	}
	return 0
}

func (l engineLimits) check() error {
	switch {
	case l.maxMessageBytes <= 0:
		return fmt.Errorf("--max-message-bytes %d: want a positive size", l.maxMessageBytes)
	case l.queueBytes < l.maxMessageBytes:
		return fmt.Errorf("--zmq-queue-bytes %d: want at least --max-message-bytes (%d), or the largest message never fits", l.queueBytes, l.maxMessageBytes)
	case l.replayMaxBatches < 0:
		return fmt.Errorf("--replay-max-batches %d: want 0 (twice buffer_steps) or more", l.replayMaxBatches)
	case l.replayMaxBytes <= 0:
		return fmt.Errorf("--replay-max-bytes %d: want a positive size", l.replayMaxBytes)
	case l.replayMaxTime <= 0:
		return fmt.Errorf("--replay-max-time %v: want a positive duration", l.replayMaxTime)
	}
	return nil
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
		var unknownKeys error
		if obj, _, err := engines.ParseConfigObject(text); err == nil {
			unknownKeys = obj.CheckKeys(eng.ConfigKeys)
		}
		if unknownKeys != nil && !c.AllowUnknownConfigKeys {
			return nil, fmt.Errorf("%s: kv-events-config: %w; %s does not read it (allow such keys with --allow-unknown-config-keys, or allow_unknown_config_keys in --config)", where, unknownKeys, eng.Name)
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
		upstreamAddr, upstreamTLS, err := parseUpstream(c.Upstream, c.UpstreamTLS)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", where, err)
		}
		if (len(c.UpstreamServices) > 0 || c.UpstreamDropAuthorization) && c.Upstream == "" {
			return nil, fmt.Errorf("%s: upstream services and authorization settings need an upstream", where)
		}
		if err := c.TLS.Check(); err != nil {
			return nil, fmt.Errorf("%s: TLS: %w", where, err)
		}
		switch c.Reflection {
		case "":
			c.Reflection = "auto"
		case "auto", "on", "off":
		default:
			return nil, fmt.Errorf("%s: reflection %q: want auto, on or off", where, c.Reflection)
		}
		if c.HistoryBatches < 0 {
			return nil, fmt.Errorf("%s: history-batches %d is negative", where, c.HistoryBatches)
		}
		if c.HistoryBytes < 0 {
			return nil, fmt.Errorf("%s: history-bytes %d is negative", where, c.HistoryBytes)
		}
		if c.SuppressReannounced && !c.ReportModeFull {
			return nil, fmt.Errorf("%s: suppress-reannounced-stores needs report-mode-full (the record tells re-announcements apart)", where)
		}
		timeout := 5 * time.Second
		if c.ReplayTimeout != "" {
			timeout, err = time.ParseDuration(c.ReplayTimeout)
			if err != nil || timeout <= 0 {
				return nil, fmt.Errorf("%s: replay-timeout %q is not a positive duration", where, c.ReplayTimeout)
			}
		}
		if kv.Enabled {
			// Fail now, not at the first connect, on endpoints no rank can
			// use or that two ranks' sockets would share.
			if err := engines.CheckEndpoints(kv, c.DPSize); err != nil {
				return nil, fmt.Errorf("%s: kv-events-config: %w", where, err)
			}
		}
		out = append(out, resolvedRelay{relayConfig: c, engine: eng, kv: kv, replayTimeout: timeout, upstreamAddr: upstreamAddr, upstreamTLS: upstreamTLS, unknownKeys: unknownKeys})
	}
	return out, nil
}

// parseUpstream reads an upstream target (HOST:PORT, grpc:// or grpcs://;
// "" is none) and checks its TLS settings, which need grpcs://.
func parseUpstream(upstream string, settings tlsconfig.Client) (addr string, useTLS bool, err error) {
	if upstream != "" {
		addr, useTLS, err = tlsconfig.ParseTarget(upstream)
		if err != nil {
			return "", false, fmt.Errorf("upstream: %w", err)
		}
	}
	if err := settings.Check(); err != nil {
		return "", false, fmt.Errorf("upstream TLS: %w", err)
	}
	if !useTLS && settings.Set() {
		return "", false, fmt.Errorf("upstream TLS settings are given but upstream %q is plaintext (use grpcs://HOST:PORT)", upstream)
	}
	return addr, useTLS, nil
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

// logEndpoints says at start where each rank of rc is dialled, and warns
// about configurations the engine accepts but that leave kvrelay nothing to
// connect to.
func logEndpoints(log *slog.Logger, rc resolvedRelay) {
	if rc.unknownKeys != nil {
		log.Warn("kv-events-config has a key the engine does not read; accepted (allow_unknown_config_keys)",
			"relay", rc.Name, "engine", rc.engine.Name, "problem", rc.unknownKeys.Error())
	}
	if !rc.publishersOnUpstreamHost && !engines.PublisherBinds(rc.kv.Endpoint) {
		log.Warn("the engine will connect its publisher to this endpoint instead of binding it, so nothing listens there for kvrelay: "+
			"the engines bind only an endpoint with a wildcard (tcp://*:PORT), an IPv6 \"::\" or ipc://; use tcp://*:PORT",
			"relay", rc.Name, "endpoint", rc.kv.Endpoint)
	}
	eps, err := engines.PublisherEndpoints(rc.kv, rc.DPSize)
	if err != nil {
		return // resolveRelays already refused such a configuration
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
func warnReportModeDigests(log *slog.Logger, rc resolvedRelay) {
	if rc.ReportModeFull && !rc.SuppressReannounced {
		log.Warn("report mode \"full\" with re-announced stores left in the stream: gateways must apply the same rule "+
			"(kvrelay gateway --report-mode-full) or their digests will diverge from this relay's and they resync at every check; "+
			"for copy-counting gateways (SMG) use --suppress-reannounced-stores", "relay", rc.Name)
	}
}

// serve runs the relays, their gRPC listeners and the HTTP endpoint until ctx
// ends, then shuts down in order: stop accepting, end streams, stop relays.
func serve(ctx context.Context, log *slog.Logger, metricsListen, webConfig string, relays []resolvedRelay, limits serverLimitFlags, natsSink *serveNATSFlags) error {
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}), buildinfo.Read().Collector())
	tlsMetrics, err := tlsconfig.NewMetrics(reg)
	if err != nil {
		return err
	}
	var reloaders []reloader // certificates SIGHUP re-reads

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
		logEndpoints(log, rc)
		warnReportModeDigests(log, rc)
		r, err := relay.New(relay.Config{
			Engine:              rc.engine,
			KV:                  rc.kv,
			DPSize:              rc.DPSize,
			HistoryBatches:      rc.HistoryBatches,
			HistoryBytes:        rc.HistoryBytes,
			ReplayTimeout:       rc.replayTimeout,
			MaxMessageBytes:     rc.limits.maxMessageBytes,
			QueueBytes:          rc.limits.queueBytes,
			ReplayMaxBatches:    rc.limits.replayMaxBatches,
			ReplayMaxBytes:      rc.limits.replayMaxBytes,
			ReplayMaxTime:       rc.limits.replayMaxTime,
			ReportModeFull:      rc.ReportModeFull,
			SuppressReannounced: rc.SuppressReannounced,
			// Negative: no cap, which relay.Config spells the same way.
			RecordMaxEntries: limits.RecordMaxEntries,
			Logger:           log,     // the relay adds its "relay" key itself
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
		var cfgs []resolvedRelay
		for _, r := range byListen[addr] {
			cfgs = append(cfgs, r.cfg)
		}
		security, err := listenerSecurity(log, addr, cfgs, tlsMetrics)
		if err != nil {
			closeAll()
			return err
		}
		reloaders = append(reloaders, security.reloaders...)
		for _, r := range byListen[addr] {
			svc := server.Service{Engine: r.cfg.engine} // events off: UNIMPLEMENTED
			if r.relay != nil {
				svc = server.RelayService(r.cfg.engine, r.relay)
			}
			services = append(services, svc)
			if r.cfg.Upstream != "" {
				upstreams[r.cfg.engine.Name] = r.cfg.upstreamAddr
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
			Limits: limits.Limits,
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
		if err := natsSink.start(runCtx, &wg, log, reg, r.relay, r.cfg.Listen); err != nil {
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
			if err := serveHTTP(httpSrv, lis, webConfig, log); err != nil {
				errs <- fmt.Errorf("http %s: %w", metricsListen, err)
			}
		}()
		warnIfExposed(log, "metrics", metricsListen, webConfig != "")
		log.Info("serving /metrics and /debug/status", "listen", lis.Addr().String())
	}

	hupDone := reloadOnHangup(runCtx, log, reloaders)
	defer func() { cancel(); <-hupDone }()
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
