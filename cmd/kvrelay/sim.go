package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"slices"
	"strings"
	"time"

	"github.com/kvrelay/kvrelay/sim"
	"github.com/kvrelay/kvrelay/sim/workload"
)

func init() {
	register("sim", "simulate an engine's KV-event publisher (prefix cache + chat workload), for demos and tests", runSim)
}

func runSim(ctx context.Context, args []string, _ io.Reader, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("sim", flag.ContinueOnError)
	engine := fs.String("engine", "", "engine to simulate: vllm, sglang or tokenspeed")
	kvConfig := fs.String("kv-events-config", "", "the engine's --kv-events-config JSON (events must be enabled)")
	dpSize := fs.Int("dp-size", 1, "data-parallel ranks; rank r publishes on port+r and replays on replay port+r")
	wireGen := fs.String("wire", "", "wire generation (default: the engine's newest; vllm: map|array12|array6, sglang: map|array7|array6, tokenspeed: array5)")
	rate := fs.Float64("rate", 10, "built-in workload requests per second (0: serve only POST /request and /run)")
	stepInterval := fs.Duration("step-interval", 50*time.Millisecond, "scheduler step period; requests due in one period share a step")
	capacity := fs.Int("capacity-blocks", 1024, "device prefix-cache capacity per rank, in blocks")
	hostCapacity := fs.Int("host-capacity-blocks", 0, "host-tier capacity per rank, in blocks (0: no host tier)")
	blockSize := fs.Int("block-size", 16, "tokens per block")
	seed := fs.Uint64("seed", 1, "workload seed")
	systemPrompts := fs.Int("system-prompts", workload.Defaults.SystemPrompts, "distinct shared system prompts")
	systemPromptTokens := fs.Int("system-prompt-tokens", workload.Defaults.SystemPromptTokens, "tokens per system prompt")
	sessions := fs.Int("sessions", workload.Defaults.Sessions, "concurrently active chats")
	turns := fs.Int("turns", workload.Defaults.Turns, "requests per chat")
	tokensPerTurn := fs.Int("tokens-per-turn", workload.Defaults.TokensPerTurn, "tokens each turn adds")
	control := fs.String("control", "", "HTTP address for the control endpoint (/live, /fault, /healthz, /stats, /request, /run) and the engine's load (/metrics; SGLang also /v1/loads), the URL for serve --engine-metrics-url; empty: none")
	dropEvery := fs.Int("drop-every", 0, "drop every Nth batch per rank from the live stream, keeping it for replay (0: none)")
	truncateReplay := fs.Int("truncate-replay", -1, "cut replay reply streams after N messages, end marker included (-1: off)")
	logLevel := fs.String("log-level", "info", "debug, info, warn or error")
	logFormat := fs.String("log-format", "text", "text or json")
	if code, stop := parseFlags(fs, args, stdout, stderr); stop {
		return code
	}
	fail := func(format string, a ...any) int {
		fmt.Fprintf(stderr, "kvrelay sim: "+format+"\n", a...)
		return 2
	}
	gens := sim.WireGenerations(*engine)
	switch {
	case fs.NArg() > 0:
		return fail("unexpected argument %q", fs.Arg(0))
	case *engine == "":
		return fail("--engine is required (vllm, sglang or tokenspeed)")
	case len(gens) == 0:
		return fail("--engine %q: want vllm, sglang or tokenspeed", *engine)
	case *wireGen != "" && !slices.Contains(gens, *wireGen):
		return fail("--wire %q: engine %s has %s", *wireGen, *engine, strings.Join(gens, ", "))
	case *kvConfig == "":
		return fail("--kv-events-config is required (e.g. '{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\", \"endpoint\": \"tcp://*:5557\", \"replay_endpoint\": \"tcp://*:5558\"}')")
	case *dpSize < 1:
		return fail("--dp-size must be ≥ 1, got %d", *dpSize)
	case *rate < 0:
		return fail("--rate must be ≥ 0, got %v", *rate)
	case *stepInterval <= 0:
		return fail("--step-interval must be positive, got %v", *stepInterval)
	case *capacity < 1:
		return fail("--capacity-blocks must be ≥ 1, got %d", *capacity)
	case *hostCapacity < 0:
		return fail("--host-capacity-blocks must be ≥ 0, got %d", *hostCapacity)
	case *blockSize < 1:
		return fail("--block-size must be ≥ 1, got %d", *blockSize)
	case *systemPrompts < 1, *systemPromptTokens < 1, *sessions < 1, *turns < 1, *tokensPerTurn < 1:
		return fail("--system-prompts, --system-prompt-tokens, --sessions, --turns and --tokens-per-turn must be ≥ 1")
	case *dropEvery < 0:
		return fail("--drop-every must be ≥ 0, got %d", *dropEvery)
	}
	cfg, err := sim.ParseKVEventsConfig(*engine, *kvConfig)
	if err != nil {
		return fail("--kv-events-config: %v", err)
	}
	if !cfg.Enabled {
		return fail("--kv-events-config leaves %s's events disabled (publisher %q); enable them as the engine requires", *engine, cfg.Publisher)
	}
	log, err := newLogger(stderr, *logLevel, *logFormat)
	if err != nil {
		return fail("%v", err)
	}
	e, err := sim.Start(ctx, sim.Options{
		Engine: *engine, KVEventsConfig: *kvConfig, DPSize: *dpSize, Wire: *wireGen,
		BlockSize: *blockSize, CapacityBlocks: *capacity, HostCapacityBlocks: *hostCapacity,
		Workload: workload.Config{Seed: *seed, SystemPrompts: *systemPrompts, SystemPromptTokens: *systemPromptTokens,
			Sessions: *sessions, Turns: *turns, TokensPerTurn: *tokensPerTurn},
		DropEvery: *dropEvery, ControlAddr: *control, Logger: log,
	})
	if err != nil {
		fmt.Fprintf(stderr, "kvrelay sim: %v\n", err)
		return 1
	}
	defer e.Close()
	if *truncateReplay >= 0 {
		if err := e.Fault(sim.Fault{Kind: sim.FaultTruncateReplay, N: *truncateReplay}); err != nil {
			fmt.Fprintf(stderr, "kvrelay sim: %v\n", err)
			return 1
		}
	}
	for _, ep := range e.Endpoints() {
		log.Info("rank endpoints", "rank", ep.Rank, "live", ep.Live, "replay", ep.Replay)
	}
	if addr := e.ControlAddr(); addr != "" {
		log.Info("control endpoint listening", "addr", addr)
	}
	if err := e.Run(ctx, *rate, *stepInterval, 10*time.Second); err != nil {
		fmt.Fprintf(stderr, "kvrelay sim: %v\n", err)
		return 1
	}
	return 0
}
