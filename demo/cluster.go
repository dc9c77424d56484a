package demo

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrelay/kvrelay/engines"
	"github.com/kvrelay/kvrelay/engines/load"
	"github.com/kvrelay/kvrelay/engines/sglang"
	"github.com/kvrelay/kvrelay/engines/vllm"
	"github.com/kvrelay/kvrelay/gateway"
	"github.com/kvrelay/kvrelay/gateway/index"
	"github.com/kvrelay/kvrelay/gateway/monitor"
	"github.com/kvrelay/kvrelay/gateway/picker"
	"github.com/kvrelay/kvrelay/internal/freeport"
	"github.com/kvrelay/kvrelay/relay"
	"github.com/kvrelay/kvrelay/relay/server"
	"github.com/kvrelay/kvrelay/sim"
	"github.com/kvrelay/kvrelay/sim/workload"
)

// Fleet shape. Two engines of different flavours show that one gateway index
// serves both: it keys blocks by token content, not by engine hash.
const (
	dpSize = 2
	model  = "demo"
	// blockSize is what both engines and the gateway cut prompts with.
	blockSize = 16
	// bufferSteps is each rank's replay ring. It must outlast the run so a
	// relay started late (the relay-restart fault) can prime from sequence 0;
	// a ring that wrapped would leave it blocks it never heard of.
	bufferSteps = 50_000
	// historyBatches is the relays' history window. It is kept small on
	// purpose: a fresh gateway then cannot be served the history from
	// sequence 0 and gets a snapshot, the path the gateway-restart fault
	// exercises.
	historyBatches = 128
)

// engineKind is one engine flavour in the fleet.
type engineKind struct {
	name    string
	engine  engines.Engine
	service monitor.Service
	// enable is the config key that turns the engine's events on.
	enable string
}

var fleet = []engineKind{
	{name: "vllm", engine: vllm.Engine, service: monitor.ServiceVLLM, enable: `"enable_kv_cache_events": true, "publisher": "zmq"`},
	{name: "sglang", engine: sglang.Engine, service: monitor.ServiceSGLang, enable: `"publisher": "zmq"`},
	// A second SGLang engine: overlap decay compares holders' reported
	// backlogs, and only SGLang reports one (vLLM's /metrics has no queued
	// token figure), so the decay check needs two.
	{name: "sglang", engine: sglang.Engine, service: monitor.ServiceSGLang, enable: `"publisher": "zmq"`},
}

// runIDs keep in-process (inproc) endpoint names unique when one process runs
// the demo more than once (tests).
var runIDs atomic.Uint64

// worker is one engine as the gateway sees it: the live simulated engine, its
// relay and gRPC server (restartable on the same port), the proxy the gateway
// reaches it through, and the round-robin arm's identical twin engine.
type worker struct {
	id     string // gateway worker ID, e.g. "A-vllm"
	kind   engineKind
	eng    *sim.Engine // served by kvrelay routing, relayed
	shadow *sim.Engine // served by round-robin routing; nobody subscribes
	log    *slog.Logger

	relayAddr string // fixed after the first relay start
	proxy     *proxy
	// load reads the live engine's HTTP server (/v1/loads, else /metrics)
	// for every relay incarnation, as serve --engine-metrics-url does.
	load       *load.Poller
	loadStop   context.CancelFunc
	loadDone   chan struct{}
	loadClient *http.Client

	// The current relay incarnation.
	rel      *relay.Relay
	srv      *server.Server
	stopRun  context.CancelFunc
	runDone  chan struct{}
	relayReg *prometheus.Registry
	// regs holds every incarnation's registry, so counters survive a
	// relay restart in the totals.
	regs []*prometheus.Registry
}

// engineLoad is the simulated scheduler behind the engines' load: a
// request decodes for decodeSteps steps (as the gateway's in-flight count
// assumes), and prefill is fast enough that the comparison's traffic
// (about 30 requests of a few hundred uncached tokens per rank and second)
// never queues; only the load checks' traffic does.
var engineLoad = sim.LoadModel{
	MaxRunning: 16, PrefillTokensPerSecond: 16_384, OutputTokens: 8,
	DecodeTokensPerSecond: 8 / (decodeSteps * stepInterval).Seconds(),
}

func simOptions(kind engineKind, kvConfig string, wl workload.Config, capacity int, log *slog.Logger) sim.Options {
	return sim.Options{
		Engine: kind.name, KVEventsConfig: kvConfig, DPSize: dpSize, BlockSize: blockSize,
		CapacityBlocks: capacity, Workload: wl, Logger: log, Load: engineLoad, ModelName: model,
	}
}

// startEngine starts the live engine on TCP: rank r publishes on base+r and
// replays on base+dpSize+r. The engines bind only wildcard hosts (a concrete
// host means connect), so the sockets bind "*" as a real engine's would; the
// relay dials them on 127.0.0.1.
func startEngine(ctx context.Context, kind engineKind, wl workload.Config, capacity int, log *slog.Logger) (*sim.Engine, error) {
	var lastErr error
	for attempt := 0; attempt < 5; attempt++ {
		base, err := freeport.Range(2 * dpSize)
		if err != nil {
			return nil, err
		}
		cfg := fmt.Sprintf(`{%s, "endpoint": "tcp://*:%d", "replay_endpoint": "tcp://*:%d", "buffer_steps": %d}`,
			kind.enable, base, base+dpSize, bufferSteps)
		opts := simOptions(kind, cfg, wl, capacity, log)
		opts.ControlAddr = "127.0.0.1:0" // its HTTP server: the load endpoints
		e, err := sim.Start(ctx, opts)
		if err == nil {
			return e, nil
		}
		lastErr = err
	}
	return nil, fmt.Errorf("start simulated %s: %w", kind.name, lastErr)
}

// startShadow starts the round-robin arm's twin: same engine, same cache,
// publishing in-process to nobody (its events are not what is measured).
func startShadow(ctx context.Context, kind engineKind, id string, wl workload.Config, capacity int, run uint64, log *slog.Logger) (*sim.Engine, error) {
	cfg := fmt.Sprintf(`{%s, "endpoint": "inproc://kvrelay-demo-%d-rr-%s"}`, kind.enable, run, id)
	e, err := sim.Start(ctx, simOptions(kind, cfg, wl, capacity, log))
	if err != nil {
		return nil, fmt.Errorf("start round-robin twin of %s: %w", kind.name, err)
	}
	return e, nil
}

// startRelay starts a relay and its gRPC server for w's engine. The first
// start picks a port; later starts (a relay restart) bind the same one, so
// the gateway's address stays valid.
func (w *worker) startRelay(ctx context.Context) error {
	reg := prometheus.NewRegistry()
	// A replay answer cut short has no end marker, so the relay learns it
	// was cut only when the reply timeout passes. On loopback replies take
	// microseconds, but a busy machine (tests under -race on two cores) can
	// stall one for a good fraction of a second, and a replay that times
	// out is a hole in the index; 2 s (the default is 5 s) keeps the
	// truncated-replay fault short without risking that.
	rel, err := relay.New(relay.Config{
		Engine: w.kind.engine, KV: w.eng.Config(), DPSize: dpSize,
		HistoryBatches: historyBatches, ReplayTimeout: 2 * time.Second, PrimeRetry: 200 * time.Millisecond,
		Logger: w.log.With("component", "relay"), Registerer: reg,
	})
	if err != nil {
		return fmt.Errorf("relay for %s: %w", w.id, err)
	}
	svc := server.RelayService(w.kind.engine, rel)
	svc.Load = w.load
	srv, err := server.New(server.Options{
		Services: []server.Service{svc},
		Logger:   w.log.With("component", "grpc"), Registerer: reg, ShutdownGrace: time.Second,
	})
	if err != nil {
		return fmt.Errorf("gRPC server for %s: %w", w.id, err)
	}
	addr := w.relayAddr
	if addr == "" {
		addr = "127.0.0.1:0"
	}
	var lis net.Listener
	for attempt := 0; ; attempt++ {
		lis, err = net.Listen("tcp", addr)
		if err == nil || attempt == 20 {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	if err != nil {
		srv.Stop()
		return fmt.Errorf("gRPC listener for %s: %w", w.id, err)
	}
	w.relayAddr = lis.Addr().String()
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan struct{})
	var both sync.WaitGroup
	both.Add(2)
	go func() {
		defer both.Done()
		if err := rel.Run(runCtx); err != nil {
			w.log.Error("relay stopped", "err", err)
		}
	}()
	go func() {
		defer both.Done()
		if err := srv.Serve(lis); err != nil {
			w.log.Error("gRPC server stopped", "err", err)
		}
	}()
	go func() { both.Wait(); close(done) }()
	w.rel, w.srv, w.stopRun, w.runDone, w.relayReg = rel, srv, stop, done, reg
	w.regs = append(w.regs, reg)
	return nil
}

// stopRelay ends the gateway's streams (UNAVAILABLE), then the relay.
func (w *worker) stopRelay() {
	if w.srv == nil {
		return
	}
	w.srv.Stop()
	w.stopRun()
	<-w.runDone
	w.rel, w.srv = nil, nil
}

// startLoad starts reading the live engine's load from its HTTP server.
func (w *worker) startLoad(ctx context.Context) error {
	w.loadClient = &http.Client{Transport: &http.Transport{}}
	f, err := load.NewHTTP(w.loadClient, "http://"+w.eng.ControlAddr())
	if err != nil {
		return fmt.Errorf("load source for %s: %w", w.id, err)
	}
	p, err := load.NewPoller(load.Options{Fetcher: f, Logger: w.log.With("component", "load")})
	if err != nil {
		return fmt.Errorf("load source for %s: %w", w.id, err)
	}
	lctx, stop := context.WithCancel(ctx)
	w.load, w.loadStop, w.loadDone = p, stop, make(chan struct{})
	go func() { defer close(w.loadDone); _ = p.Run(lctx) }()
	return nil
}

func (w *worker) close() {
	w.stopRelay()
	if w.loadStop != nil {
		w.loadStop()
		<-w.loadDone
		w.loadClient.CloseIdleConnections()
	}
	if w.proxy != nil {
		w.proxy.close()
	}
	if w.eng != nil {
		w.eng.Close()
	}
	if w.shadow != nil {
		w.shadow.Close()
	}
}

// gatewayRun is one incarnation of the in-process gateway.
type gatewayRun struct {
	gw   *gateway.Gateway
	reg  *prometheus.Registry
	stop context.CancelFunc
	done chan struct{}
}

func startGateway(ctx context.Context, workers []*worker, log *slog.Logger) (*gatewayRun, error) {
	var ws []gateway.Worker
	for _, w := range workers {
		ws = append(ws, gateway.Worker{ID: w.id, Addr: w.proxy.addr(), Service: w.kind.service, Model: model})
	}
	reg := prometheus.NewRegistry()
	gw, err := gateway.New(gateway.Config{
		Workers: ws,
		// Fast reconnects: the demo restarts things on purpose and should
		// not sit in a 5 s backoff.
		Monitor: monitor.Options{InitialBackoff: 50 * time.Millisecond, MaxBackoff: 500 * time.Millisecond},
		Index:   index.Options{BlockSize: blockSize, Logger: log.With("component", "index")},
		Picker: picker.Config{AbsThreshold: spillAbs, RelThreshold: spillRel,
			OverlapDecay: overlapDecay, OverloadTokenUsage: overloadUsage, BalanceTokenUsage: balanceUsage},
		Registerer: reg,
		Logger:     log.With("component", "gateway"),
	})
	if err != nil {
		return nil, fmt.Errorf("gateway: %w", err)
	}
	runCtx, stop := context.WithCancel(ctx)
	g := &gatewayRun{gw: gw, reg: reg, stop: stop, done: make(chan struct{})}
	go func() {
		defer close(g.done)
		if err := gw.Run(runCtx); err != nil {
			log.Error("gateway stopped", "err", err)
		}
	}()
	return g, nil
}

func (g *gatewayRun) close() {
	g.stop()
	<-g.done
}
