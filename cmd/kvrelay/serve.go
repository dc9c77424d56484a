package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"math"
	"os"
	"runtime"
	"strconv"
	"time"

	"github.com/kvrelay/kvrelay/internal/procs"
	"github.com/kvrelay/kvrelay/internal/tlsconfig"
	"github.com/kvrelay/kvrelay/internal/webserve"
	"github.com/kvrelay/kvrelay/relay/zmqsource"
	"github.com/kvrelay/kvrelay/relayd"
)

func init() {
	register("serve", "relay an engine's KV events to gateways over gRPC", runServe)
}

// engineLimits are the engine-socket flags, checked before they become
// relayd.EngineLimits.
type engineLimits relayd.EngineLimits

func runServe(ctx context.Context, args []string, _ io.Reader, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("serve", flag.ContinueOnError)
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
	fs.Int64Var(&lim.MaxMessageBytes, "max-message-bytes", zmqsource.DefaultMaxMessageBytes,
		"largest ZeroMQ message (all frames) or frame accepted from an engine; a peer declaring more is disconnected before anything is allocated")
	fs.Int64Var(&lim.QueueBytes, "zmq-queue-bytes", zmqsource.DefaultQueueBytes,
		"bytes each rank's incoming queue may hold (besides the engine's hwm in messages); at least --max-message-bytes")
	fs.IntVar(&lim.ReplayMaxBatches, "replay-max-batches", 0, "replies one replay may bring (0: twice the engine's buffer_steps)")
	fs.Int64Var(&lim.ReplayMaxBytes, "replay-max-bytes", zmqsource.DefaultReplayMaxBytes, "payload bytes one replay may bring")
	fs.DurationVar(&lim.ReplayMaxTime, "replay-max-time", zmqsource.DefaultReplayMaxTime, "time one replay may take in all")
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
	engineMetricsURL := fs.String("engine-metrics-url", "", "the engine's HTTP server, read for its load per DP rank: a base URL tries SGLang's /v1/loads, then /metrics (vLLM, SGLang); a URL ending in /metrics or /v1/loads reads only that")
	loadSource := fs.String("load-source", "auto", "where each batch's engine load comes from: auto (--engine-metrics-url when given, else the --upstream servicer's GetLoads), getloads, http or off")
	loadInterval := fs.Duration("load-interval", 0, "how often the load source is read (0: 250ms)")
	loadMaxAge := fs.Duration("load-max-age", 0, "a load record older than this is no longer stamped on batches (0: 5s)")
	gomaxprocs := fs.String("gomaxprocs", "", "processors the Go runtime runs goroutines on: adaptive (the default, unless $GOMAXPROCS is set): one while the process uses under 0.3 of a core (checked every 100 ms) and its goroutines do not queue, Go's count above it (a relay at an engine's pacing spends less CPU waking up with one; docs/bench/log/2026-12-06-relay-adaptive-default.md); go: Go's own ($GOMAXPROCS, else the CPUs the process may use); or a count N")
	limits := addServerLimitFlags(fs)
	natsSink := addServeNATSFlags(fs)
	if code, stop := parseFlags(fs, args, stdout, stderr); stop {
		return code
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(stderr, "kvrelay serve: unexpected argument %q\n", fs.Arg(0))
		return 2
	}

	var file relayd.File
	var sink relayd.NATSSink
	publishersMoved := false // discovery put the upstream's host in wildcard endpoints
	if *configPath != "" {
		set := map[string]bool{}
		var given []string
		fs.Visit(func(f *flag.Flag) { set[f.Name] = true; given = append(given, f.Name) })
		for _, single := range []string{"engine", "kv-events-config", "dp-size", "listen", "upstream", "history-batches", "history-bytes", "replay-timeout",
			"tls-cert", "tls-key", "tls-client-ca", "tls-allow", "reflection", "upstream-tls-ca", "upstream-tls-cert", "upstream-tls-key",
			"upstream-tls-server-name", "upstream-service", "upstream-drop-authorization", "allow-unknown-config-keys",
			"report-mode-full", "suppress-reannounced-stores", "engine-metrics-url", "load-source", "load-interval", "load-max-age"} {
			if set[single] {
				fmt.Fprintf(stderr, "kvrelay serve: --%s cannot be combined with --config (put it in the file)\n", single)
				return 2
			}
		}
		f, err := relayd.ReadFile(*configPath)
		if err != nil {
			fmt.Fprintf(stderr, "kvrelay serve: %v\n", err)
			return 2
		}
		file = f
		if sink, err = natsSink.forConfig(file, given); err != nil {
			fmt.Fprintf(stderr, "kvrelay serve: %v\n", err)
			return 2
		}
		// A setting the file and the command line both give is refused,
		// as the nats block's are: one of the two would be silently lost.
		for _, both := range []struct {
			flag, key string
			file      *string
			value     string
		}{
			{"metrics-listen", "metrics_listen", &file.MetricsListen, *metricsListen},
			{"log-level", "log_level", &file.LogLevel, *logLevel},
			{"log-format", "log_format", &file.LogFormat, *logFormat},
			{"web.config.file", "web_config_file", &file.WebConfigFile, *webConfig},
		} {
			switch {
			case *both.file == "":
				*both.file = both.value
			case set[both.flag]:
				fmt.Fprintf(stderr, "kvrelay serve: --%s cannot be combined with %s in --config %s (give it in one place)\n", both.flag, both.key, *configPath)
				return 2
			}
		}
	} else {
		if err := natsSink.check(); err != nil {
			fmt.Fprintf(stderr, "kvrelay serve: %v\n", err)
			return 2
		}
		if *engineName == "" {
			fmt.Fprintln(stderr, "kvrelay serve: --engine is required (or --config)")
			return 2
		}
		if *dpSize < 1 {
			fmt.Fprintf(stderr, "kvrelay serve: --dp-size %d: want at least 1\n", *dpSize)
			return 2
		}
		if *kvConfig == "" && *upstream != "" {
			set := map[string]bool{}
			fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
			learned, code := learnFromUpstream(ctx, *engineName, *upstream, upstreamTLS, *dpSize, set["dp-size"], stderr)
			if code != 0 {
				return code
			}
			*kvConfig, *dpSize, publishersMoved = learned.kvConfig, learned.dpSize, learned.moved
		}
		if *kvConfig == "" {
			fmt.Fprintln(stderr, "kvrelay serve: --kv-events-config is required (the JSON the engine was started with), or --upstream of an SGLang or TokenSpeed servicer that advertises it")
			return 2
		}
		raw, _ := json.Marshal(*kvConfig)
		file = relayd.File{
			MetricsListen: *metricsListen, LogLevel: *logLevel, LogFormat: *logFormat, WebConfigFile: *webConfig,
			Relays: []relayd.RelayConfig{{
				Name: *engineName, Engine: *engineName, KVEventsConfig: raw, DPSize: *dpSize,
				Listen: *listen, Upstream: *upstream, HistoryBatches: *historyBatches,
				HistoryBytes: *historyBytes, ReplayTimeout: replayTimeout.String(),
				TLS: listenTLS, Reflection: *reflectionMode, UpstreamTLS: upstreamTLS,
				UpstreamServices: upstreamServices, UpstreamDropAuthorization: *upstreamDropAuth,
				AllowUnknownConfigKeys: *allowUnknownKeys,
				ReportModeFull:         *reportModeFull, SuppressReannounced: *suppressReannounced,
				PublishersOnUpstreamHost: publishersMoved,
				EngineMetricsURL:         *engineMetricsURL, LoadSource: *loadSource,
				LoadInterval: durationKey(*loadInterval), LoadMaxAge: durationKey(*loadMaxAge),
				NATSWorker: *natsSink.worker, NATSMember: *natsSink.member,
			}},
		}
		sink = natsSink.options()
	}
	log, err := newLogger(stderr, file.LogLevel, file.LogFormat)
	if err != nil {
		fmt.Fprintf(stderr, "kvrelay serve: %v\n", err)
		return 2
	}
	relays, err := relayd.Resolve(file.Relays)
	if err != nil {
		fmt.Fprintf(stderr, "kvrelay serve: %v\n", err)
		return 2
	}
	if _, err := sink.WorkerNames(relays); err != nil {
		fmt.Fprintf(stderr, "kvrelay serve: %v\n", err)
		return 2
	}
	if sink.URL != "" {
		// A credential or certificate file that cannot be read fails now,
		// naming its flag or key, not once the relays run.
		if _, err := sink.NATSOptions(slog.New(slog.DiscardHandler)); err != nil {
			fmt.Fprintf(stderr, "kvrelay serve: %v\n", err)
			return 2
		}
	}
	if err := webserve.CheckConfig(file.WebConfigFile); err != nil {
		fmt.Fprintf(stderr, "kvrelay serve: %v\n", err)
		return 2
	}
	if err := lim.check(); err != nil {
		fmt.Fprintf(stderr, "kvrelay serve: %v\n", err)
		return 2
	}
	if err := limits.validate(); err != nil {
		fmt.Fprintf(stderr, "kvrelay serve: %v\n", err)
		return 2
	}
	stopProcs, err := startProcs(ctx, *gomaxprocs, log)
	if err != nil {
		fmt.Fprintf(stderr, "kvrelay serve: %v\n", err)
		return 2
	}
	defer stopProcs()
	err = relayd.Run(ctx, relayd.Options{
		Relays: relays, MetricsListen: file.MetricsListen, WebConfigFile: file.WebConfigFile,
		EngineLimits: relayd.EngineLimits(lim), ServerLimits: limits.Limits, RecordMaxEntries: limits.RecordMaxEntries,
		NATS: sink, Logger: log,
	})
	if err != nil {
		log.Error("kvrelay serve failed", "err", err)
		return 1
	}
	return 0
}

func (l engineLimits) check() error {
	switch {
	case l.MaxMessageBytes <= 0:
		return fmt.Errorf("--max-message-bytes %d: want a positive size", l.MaxMessageBytes)
	case l.QueueBytes < l.MaxMessageBytes:
		return fmt.Errorf("--zmq-queue-bytes %d: want at least --max-message-bytes (%d), or the largest message never fits", l.QueueBytes, l.MaxMessageBytes)
	case l.ReplayMaxBatches < 0:
		return fmt.Errorf("--replay-max-batches %d: want 0 (twice buffer_steps) or more", l.ReplayMaxBatches)
	case l.ReplayMaxBytes <= 0:
		return fmt.Errorf("--replay-max-bytes %d: want a positive size", l.ReplayMaxBytes)
	case l.ReplayMaxTime <= 0:
		return fmt.Errorf("--replay-max-time %v: want a positive duration", l.ReplayMaxTime)
	}
	return nil
}

// procsMode reads --gomaxprocs: "go" (leave Go's count alone), "adaptive",
// or a fixed count n. Empty is the default: adaptive, unless the operator
// set $GOMAXPROCS, which is then kept as Go keeps it.
func procsMode(value string, getenv func(string) string) (mode string, n int, err error) {
	switch value {
	case "":
		if getenv("GOMAXPROCS") != "" {
			return "go", 0, nil
		}
		return "adaptive", 0, nil
	case "go", "adaptive":
		return value, 0, nil
	}
	n, err = strconv.Atoi(value)
	if err != nil || n < 1 {
		return "", 0, fmt.Errorf("--gomaxprocs %q: want adaptive, go, or a count of at least 1", value)
	}
	return "fixed", n, nil
}

// startProcs applies --gomaxprocs: a count now, or the adaptive controller
// until the returned stop is called.
func startProcs(ctx context.Context, value string, log *slog.Logger) (stop func(), err error) {
	mode, n, err := procsMode(value, os.Getenv)
	if err != nil {
		return nil, err
	}
	switch mode {
	case "go":
		return func() {}, nil
	case "fixed":
		runtime.GOMAXPROCS(n)
		return func() {}, nil
	}
	ctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	// Debug, not Info: as the default, a relay whose load comes and goes
	// switches every few tens of seconds.
	a := procs.Adaptive{OnChange: func(n int, cpu float64) {
		log.Debug("gomaxprocs changed", "procs", n, "cpu_per_second", math.Round(cpu*1000)/1000)
	}}
	go func() {
		defer close(done)
		a.Run(ctx)
	}()
	return func() { cancel(); <-done }, nil
}

// durationKey is a duration flag as its config key: "" for 0 (the default).
func durationKey(d time.Duration) string {
	if d == 0 {
		return ""
	}
	return d.String()
}
