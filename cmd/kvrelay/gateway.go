package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"net"
	"os"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"google.golang.org/grpc/credentials"

	"github.com/kvrelay/kvrelay/gateway"
	"github.com/kvrelay/kvrelay/gateway/httpapi"
	"github.com/kvrelay/kvrelay/gateway/index"
	"github.com/kvrelay/kvrelay/gateway/membership"
	"github.com/kvrelay/kvrelay/gateway/monitor"
	"github.com/kvrelay/kvrelay/gateway/partitionsync"
	"github.com/kvrelay/kvrelay/gateway/picker"
	"github.com/kvrelay/kvrelay/gateway/placement"
	"github.com/kvrelay/kvrelay/gateway/placementsync"
	"github.com/kvrelay/kvrelay/internal/buildinfo"
	"github.com/kvrelay/kvrelay/internal/exposure"
	"github.com/kvrelay/kvrelay/internal/natsconn"
	"github.com/kvrelay/kvrelay/internal/reload"
	"github.com/kvrelay/kvrelay/internal/tlsconfig"
	"github.com/kvrelay/kvrelay/internal/webserve"
)

func init() {
	register("gateway", "route requests to the worker caching their prefix (HTTP), from the workers' KV events", runGateway)
}

// workerFlags collects repeated --worker values.
type workerFlags []gateway.Worker

func (w *workerFlags) String() string { return fmt.Sprint(len(*w), " workers") }

func (w *workerFlags) Set(v string) error {
	wk, err := parseWorker(v)
	if err != nil {
		return err
	}
	*w = append(*w, wk)
	return nil
}

// parseWorker reads one --worker: membership.Syntax, the syntax of every
// source of workers.
func parseWorker(v string) (gateway.Worker, error) { return membership.ParseWorker(v) }

func runGateway(ctx context.Context, args []string, _ io.Reader, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("gateway", flag.ContinueOnError)
	var workers workerFlags
	fs.Var(&workers, "worker", "a worker: grpc://HOST:PORT[,model=M][,service=vllm|sglang|tokenspeed] (repeat per worker; model defaults to \"default\", service to vllm)")
	listen := fs.String("listen", "127.0.0.1:8090", "HTTP address for /v1/route, /v1/done, /v1/load, /v1/workers and /metrics")
	deadline := fs.Duration("subscribe-deadline", monitor.DefaultSubscribeDeadline, "abandon a subscribe call the worker does not answer within this")
	maxBackoff := fs.Duration("max-backoff", monitor.DefaultMaxBackoff, "reconnect backoff cap (it starts at 100ms)")
	blockSize := fs.Int("block-size", 0, "request block size; 0 learns it from the workers' events (16 until then)")
	indexTTL := fs.Duration("index-ttl", 0, "evict index entries unused for this long (0: off)")
	indexMax := fs.Int("index-max-entries", 0, "bound on index entries per model, pruned to 90% every 30s (0: off)")
	spillAbs := fs.Float64("spill-abs-threshold", picker.DefaultAbsThreshold, "a holder spills above mean+this in-flight requests (and the relative threshold)")
	spillRel := fs.Float64("spill-rel-threshold", picker.DefaultRelThreshold, "a holder spills above mean×this in-flight requests (and the absolute threshold)")
	temperature := fs.Float64("selection-temperature", 0, "0 picks the deepest overlap; >0 draws among overlap depths")
	overlapDecay := fs.Float64("overlap-decay", 0, "de-rank a holder by its engine's waiting-prefill backlog: overlap ÷ (1 + this × backlog in request lengths); 0: off")
	overloadUsage := fs.Float64("overload-token-usage-threshold", picker.DefaultTokenUsageThreshold, "suspend cache affinity while the hottest engine's KV token usage is above this (1.0: off)")
	balanceUsage := fs.Float64("balance-token-usage-threshold", picker.DefaultTokenUsageThreshold, "suspend cache affinity while engines' KV token usages spread (hottest − coldest) by more than this (1.0: off)")
	placementWeight := fs.Float64("placement-weight", placement.DefaultWeight, "score a block the gateway routed to a worker, before its engine reports it, as this fraction of a reported one (0: placements off)")
	placementTTL := fs.Duration("placement-ttl", placement.DefaultTTL, "forget a placement the engine has not confirmed after this")
	placementMax := fs.Int("placement-max-entries", placement.DefaultMaxEntries, "bound on placements (blocks × workers) per model; the oldest of the source holding the most (this replica, or one peer replica) go first")
	natsURL := fs.String("nats", "", "share placements with the other gateway replicas through this NATS server (nats://HOST:4222[,…]); without it, each replica keeps its own")
	natsShareLoad := fs.Bool("nats-share-load", true, "with --nats, also share each replica's tracked in-flight counts (requests routed with \"track\": true and not done) and add the other replicas' to its own; false shares placements only, and the replicas that did not route to a prefix's holder then see it idle")
	natsSubject := fs.String("nats-subject-prefix", placementsync.DefaultSubjectPrefix, "NATS subject prefix of the placements (one subject per model under it); replicas sharing placements use the same")
	natsEvents := addGatewayNATSEventsFlags(fs)
	partitions := fs.Int("partitions", 0, "with --nats: the tier is split into this many partitions (2.."+fmt.Sprint(gateway.MaxPartitions)+"): each replica subscribes only to the workers rendezvous hashing gives its --partition and asks the other partitions for the rest over NATS, with the same answer as a full replica; 0 or 1: every replica subscribes to every worker (docs/partitioned-tier.md)")
	partition := fs.Int("partition", 0, "with --partitions: this replica's partition, 0..partitions-1 (run k replicas of each for availability)")
	partitionDeadline := fs.Duration("partition-deadline", partitionsync.DefaultDeadline, "with --partitions: how long a route waits for the other partitions; a partition later than this is left out of that route (its workers at zero overlap) and counted in kvrelay_gateway_scatter_missing_total")
	partitionJoinWait := fs.Duration("partition-join-wait", partitionsync.DefaultJoinWait, "with --partitions: while another replica answers its partition, a started replica answers the partition's lookups (and /readyz says ready) only once each of its own workers has delivered its state (snapshot or first batch) or is unreachable, or after this, whichever comes first (counted in kvrelay_gateway_partition_joins_total{how=\"timed_out\"}); alone, it answers at once; 0 always answers at once")
	partitionSubject := fs.String("partition-subject-prefix", partitionsync.DefaultSubjectPrefix, "with --partitions: NATS subject prefix of the tier's lookups (<prefix>.lookup.<partitions>.<partition>); tiers of different --partitions may share a prefix (they never take each other's lookups)")
	memberSrc := addMemberFlags(fs)
	loadPoll := fs.Duration("load-poll-interval", gateway.DefaultLoadPollInterval, "ask a worker whose stream pushes no engine load for it with GetLoads this often (floor 1s, as SMG's gateway); negative: never")
	natsAuth := natsconn.AddFlags(fs)
	inflightTimeout := fs.Duration("inflight-timeout", gateway.DefaultInflightTimeout, `a request routed with "track": true stops counting as in flight after this if /v1/done never names it`)
	reportedTTL := fs.Duration("reported-load-ttl", gateway.DefaultReportedLoadTTL, `a count reported by /v1/load (or a route's "loads") is dropped when not reported again within this: the worker's load is then its tracked requests alone`)
	reportModeFull := fs.Bool("report-mode-full", false,
		"the workers' requests may ask for vLLM's kv_cache_report_mode \"full\": a re-announced prefix-cache hit adds no copy, the rule of kvrelay serve --report-mode-full; use it behind relays that relay the stream faithfully (no --suppress-reannounced-stores), or the digests diverge (see README)")
	maxRecv := fs.Int("max-recv-msg-bytes", monitor.DefaultMaxRecvMsgBytes, "largest gRPC message accepted from a worker; at least the relay's --max-send-msg-bytes")
	var lim httpapi.Limits
	fs.IntVar(&lim.MaxTokens, "max-request-tokens", httpapi.DefaultLimits.MaxTokens, "token ids one /v1/route request may carry; bounds the body size too (413 above)")
	fs.IntVar(&lim.MaxInFlight, "max-inflight-requests", httpapi.DefaultLimits.MaxInFlight, "/v1/route and /v1/load requests handled at once; more get 503 with Retry-After")
	fs.DurationVar(&lim.ReadTimeout, "http-read-timeout", httpapi.DefaultLimits.ReadTimeout, "time to read a whole request, body included")
	fs.Float64Var(&lim.MinUploadRate, "min-upload-rate", httpapi.DefaultLimits.MinUploadRate, "least average rate (bytes/s) a POST body must arrive at, counted after its first 2 s; slower gets 408 and the connection closed (0: none)")
	logLevel := fs.String("log-level", "info", "debug, info, warn or error")
	logFormat := fs.String("log-format", "text", "text or json")
	var workerTLS tlsconfig.Client
	tlsconfig.RegisterClientFlags(fs, "worker-tls-", "grpcs:// workers", &workerTLS)
	webConfig := fs.String("web.config.file", "", "exporter-toolkit web config (tls_server_config, basic_auth_users) for --listen")
	if code, stop := parseFlags(fs, args, stdout, stderr); stop {
		return code
	}
	fail := func(format string, a ...any) int {
		fmt.Fprintf(stderr, "kvrelay gateway: "+format+"\n", a...)
		return 2
	}
	switch {
	case fs.NArg() > 0:
		return fail("unexpected argument %q", fs.Arg(0))
	case len(workers) == 0 && !memberSrc.dynamic() && *webConfig == "" && !*memberSrc.adminOpen:
		return fail("--worker is required (grpc://HOST:PORT[,model=M][,service=S], once per worker), or another source of workers: --worker-file, --worker-dns, --workers-from-nats or the admin API")
	case *deadline <= 0:
		return fail("--subscribe-deadline must be positive, got %v", *deadline)
	case *maxBackoff < monitor.DefaultInitialBackoff:
		return fail("--max-backoff must be at least %v, got %v", monitor.DefaultInitialBackoff, *maxBackoff)
	case *blockSize < 0:
		return fail("--block-size must be ≥ 0, got %d", *blockSize)
	case *indexTTL < 0:
		return fail("--index-ttl must be ≥ 0, got %v", *indexTTL)
	case *indexMax < 0:
		return fail("--index-max-entries must be ≥ 0, got %d", *indexMax)
	case !(*spillAbs >= 0):
		return fail("--spill-abs-threshold must be ≥ 0, got %v", *spillAbs)
	case !(*spillRel >= 0):
		return fail("--spill-rel-threshold must be ≥ 0, got %v", *spillRel)
	case !(*temperature >= 0) || math.IsInf(*temperature, 0):
		return fail("--selection-temperature must be finite and ≥ 0, got %v", *temperature)
	case !(*overlapDecay >= 0) || math.IsInf(*overlapDecay, 0):
		return fail("--overlap-decay must be finite and ≥ 0, got %v", *overlapDecay)
	case !(*overloadUsage > 0 && *overloadUsage <= 1):
		return fail("--overload-token-usage-threshold must be in (0, 1], got %v", *overloadUsage)
	case !(*balanceUsage > 0 && *balanceUsage <= 1):
		return fail("--balance-token-usage-threshold must be in (0, 1], got %v", *balanceUsage)
	case !(*placementWeight >= 0 && *placementWeight <= 1):
		return fail("--placement-weight must be in [0, 1], got %v", *placementWeight)
	case *placementTTL <= 0:
		return fail("--placement-ttl must be positive, got %v", *placementTTL)
	case *placementMax <= 0:
		return fail("--placement-max-entries must be positive, got %d", *placementMax)
	case *natsSubject == "" || strings.ContainsAny(*natsSubject, " *>") || strings.HasPrefix(*natsSubject, ".") || strings.HasSuffix(*natsSubject, "."):
		return fail("--nats-subject-prefix must be dot-separated subject tokens without wildcards, got %q", *natsSubject)
	case *inflightTimeout <= 0:
		return fail("--inflight-timeout must be positive, got %v", *inflightTimeout)
	case *reportedTTL <= 0:
		return fail("--reported-load-ttl must be positive, got %v", *reportedTTL)
	case *maxRecv < 4<<20:
		return fail("--max-recv-msg-bytes must be at least 4194304 (gRPC's default), got %d", *maxRecv)
	case lim.MaxTokens < 1 || lim.MaxTokens > httpapi.MaxRequestTokensCap:
		return fail("--max-request-tokens must be 1..%d, got %d", httpapi.MaxRequestTokensCap, lim.MaxTokens)
	case lim.MaxInFlight < 1:
		return fail("--max-inflight-requests must be at least 1, got %d", lim.MaxInFlight)
	case lim.ReadTimeout <= 0:
		return fail("--http-read-timeout must be positive, got %v", lim.ReadTimeout)
	case lim.MinUploadRate < 0 || math.IsNaN(lim.MinUploadRate) || math.IsInf(lim.MinUploadRate, 0):
		return fail("--min-upload-rate must be a rate ≥ 0 in bytes/s, got %v", lim.MinUploadRate)
	}
	if err := checkNATSAuth(*natsURL, natsAuth); err != nil {
		return fail("%v", err)
	}
	if err := checkPartitionFlags(fs, *natsURL, *partitions, *partition, *partitionDeadline, *partitionJoinWait, *partitionSubject); err != nil {
		return fail("%v", err)
	}
	if err := natsEvents.check(*natsURL); err != nil {
		return fail("%v", err)
	}
	if err := memberSrc.check(*natsURL); err != nil {
		return fail("%v", err)
	}
	log, err := newLogger(stderr, *logLevel, *logFormat)
	if err != nil {
		return fail("%v", err)
	}
	var reloaders []reload.Reloader
	anyTLS := false
	for _, w := range workers {
		anyTLS = anyTLS || strings.HasPrefix(w.ID, "grpcs://")
	}
	var workerCreds credentials.TransportCredentials // for grpcs:// workers of every source
	switch {
	case anyTLS || (workerTLS.Set() && memberSrc.dynamic()):
		d, err := tlsconfig.NewDialer(workerTLS, log)
		if err != nil {
			return fail("--worker-tls-*: %v", err)
		}
		for i := range workers {
			if strings.HasPrefix(workers[i].ID, "grpcs://") {
				workers[i].Credentials = d.Credentials()
			}
		}
		workerCreds = d.Credentials()
		reloaders = append(reloaders, d)
	case workerTLS.Set():
		return fail("--worker-tls-* are set but no --worker is grpcs:// (and no other source of workers)")
	}
	if err := webserve.CheckConfig(*webConfig); err != nil {
		return fail("%v", err)
	}
	named, err := nameWorkers(workers)
	if err != nil {
		return fail("--worker: %v", err)
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}), buildinfo.Read().Collector())
	mopts := monitor.Options{SubscribeDeadline: *deadline, MaxBackoff: *maxBackoff, MaxRecvMsgBytes: *maxRecv}
	// --nats-events: the workers' events from JetStream, each worker on
	// its gRPC stream while that cannot be exact.
	events, err := natsEvents.source(*natsURL, natsAuth, log, reg)
	if err != nil {
		return fail("%v", err)
	}
	if events != nil {
		defer events.Close()
		mopts.OpenStream = events.Open
	}
	g, err := gateway.New(gateway.Config{
		Workers: named,
		Monitor: mopts,
		Index:   index.Options{BlockSize: *blockSize, TTL: *indexTTL, MaxEntries: *indexMax, ReportModeFull: *reportModeFull},
		Picker: picker.Config{
			AbsThreshold: *spillAbs, RelThreshold: *spillRel, Temperature: *temperature,
			OverlapDecay: *overlapDecay, OverloadTokenUsage: *overloadUsage, BalanceTokenUsage: *balanceUsage,
		},
		InflightTimeout: *inflightTimeout, ReportedLoadTTL: *reportedTTL, LoadPollInterval: *loadPoll,
		Placements:   placement.Options{Weight: *placementWeight, TTL: *placementTTL, MaxEntries: *placementMax},
		NoPlacements: *placementWeight == 0,
		Partitions:   *partitions, Partition: *partition,
		Registerer: reg,
		Logger:     log,
	})
	if err != nil {
		// The flags above are checked; what is left is the worker list
		// (a worker given twice).
		return fail("--worker: %v", err)
	}
	// The other sources of workers: read once now (a file that does not
	// parse stops the start), followed while the gateway runs.
	mem, err := memberSrc.start(g, named, workerTLSPrepare(workerCreds), *natsURL, natsAuth, *natsEvents.subjects, *webConfig, reg, log)
	if err != nil {
		return fail("%v", err)
	}
	memCtx, memCancel := context.WithCancel(ctx)
	memWait := mem.run(memCtx)
	defer func() { memCancel(); memWait(); mem.close() }()
	ln, err := net.Listen("tcp", *listen)
	if err != nil {
		return fail("--listen %s: %v", *listen, err)
	}
	// With --placement-weight 0 there are no placements to share (the
	// gateway publishes none and ignores its peers'): --nats then serves
	// --nats-events and, with --nats-share-load, the in-flight counts.
	if *natsURL != "" && (*placementWeight > 0 || *natsShareLoad) {
		// It does not wait for the server: an unreachable one is retried
		// while the gateway routes on its own placements.
		host, _ := os.Hostname()
		syncLog := log.With("component", "placementsync")
		auth, err := natsAuthOptions(*natsURL, natsAuth, syncLog)
		if err != nil {
			ln.Close()
			return fail("%v", err)
		}
		opts := placementsync.Options{
			URL: *natsURL, Name: "kvrelay-gateway@" + host, SubjectPrefix: *natsSubject,
			Registerer: reg, Logger: syncLog, NATSOptions: auth,
		}
		if *natsShareLoad {
			opts.Load = g
		}
		share, err := placementsync.Start(g, opts)
		if err != nil {
			ln.Close()
			return fail("--nats: %v", err)
		}
		defer share.Close()
		g.SetPlacementPublisher(share)
	}
	if *partitions > 1 {
		// The tier's lookups: answered for this partition, asked of the
		// others by every route. Like the placements, it does not wait for
		// the server; until it is reached, routes see this partition only.
		host, _ := os.Hostname()
		tierLog := log.With("component", "partitionsync")
		auth, err := natsAuthOptions(*natsURL, natsAuth, tierLog)
		if err != nil {
			ln.Close()
			return fail("%v", err)
		}
		joinWait := *partitionJoinWait
		if joinWait == 0 {
			joinWait = -1 // partitionsync: at once
		}
		tier, err := partitionsync.Start(g, partitionsync.Options{
			URL: *natsURL, Name: fmt.Sprintf("kvrelay-gateway@%s/partition-%d", host, *partition), SubjectPrefix: *partitionSubject,
			Deadline: *partitionDeadline, JoinWait: joinWait, Registerer: reg, Logger: tierLog, NATSOptions: auth,
		})
		if err != nil {
			ln.Close()
			return fail("--partitions: %v", err)
		}
		defer tier.Close()
		g.SetScatterer(tier)
		log.Info("partitioned tier", "partition", *partition, "partitions", *partitions, "subjects", partitionsync.LookupSubject(*partitionSubject, *partitions, *partition))
	}
	exposure.WarnIfExposed(log, "gateway", *listen, *webConfig != "")
	hupCtx, hupCancel := context.WithCancel(ctx)
	hupDone := reload.OnHangup(hupCtx, log, reloaders)
	defer func() { hupCancel(); <-hupDone }()
	if err := httpapi.Serve(ctx, log, g, reg, ln, *webConfig, lim, mem.admin); err != nil {
		log.Error("gateway failed", "err", err)
		return 1
	}
	return 0
}

// nameWorkers gives each worker its name. A worker is grpc://HOST:PORT; when
// several --worker entries share an address (one relay listener serving
// several engines' services, as the README's shared-listener setup does),
// each is named grpc://HOST:PORT/SERVICE so routing answers tell them apart.
// The same address and service twice is an error.
func nameWorkers(in []gateway.Worker) ([]gateway.Worker, error) {
	perAddr := map[string]int{}
	seen := map[string]bool{}
	for _, w := range in {
		key := w.Addr + "|" + string(w.Service)
		if seen[key] {
			return nil, fmt.Errorf("grpc://%s with service %s is given twice", w.Addr, w.Service)
		}
		seen[key] = true
		perAddr[w.Addr]++
	}
	out := make([]gateway.Worker, len(in))
	for i, w := range in {
		if perAddr[w.Addr] > 1 {
			scheme, _, _ := strings.Cut(w.ID, "://") // grpc or grpcs, as given
			w.ID = scheme + "://" + w.Addr + "/" + string(w.Service)
		}
		out[i] = w
	}
	return out, nil
}

// checkPartitionFlags refuses a partitioned tier's flags that make no
// sense, naming the flag.
func checkPartitionFlags(fs *flag.FlagSet, natsURL string, parts, own int, deadline, joinWait time.Duration, prefix string) error {
	set := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
	switch {
	case parts < 0 || parts > gateway.MaxPartitions:
		return fmt.Errorf("--partitions must be 0..%d, got %d", gateway.MaxPartitions, parts)
	case parts <= 1:
		for _, name := range []string{"partition", "partition-deadline", "partition-join-wait", "partition-subject-prefix"} {
			if set[name] {
				return fmt.Errorf("--%s needs --partitions (2 or more)", name)
			}
		}
		return nil
	case natsURL == "":
		return errors.New("--partitions needs --nats: the partitions answer each other's lookups over it")
	case own < 0 || own >= parts:
		return fmt.Errorf("--partition must be 0..%d (--partitions %d), got %d", parts-1, parts, own)
	case deadline <= 0:
		return fmt.Errorf("--partition-deadline must be positive, got %v", deadline)
	case joinWait < 0:
		return fmt.Errorf("--partition-join-wait must be ≥ 0, got %v", joinWait)
	case prefix == "" || strings.ContainsAny(prefix, " *>") || strings.HasPrefix(prefix, ".") || strings.HasSuffix(prefix, "."):
		return fmt.Errorf("--partition-subject-prefix must be dot-separated subject tokens without wildcards, got %q", prefix)
	}
	return nil
}
