// Package testrelay starts, for a test, the real parts a gateway-side test
// sits behind: a simulated vLLM engine publishing over ZeroMQ on loopback,
// a kvrelay relay subscribed to every rank, and the relay's gRPC server.
// Each part can be stopped and started again on its own, so tests can kill
// a relay or a server and bring it back on the same address.
//
// It is used by the gateway's and natsevents' end-to-end tests; the relay
// package's own tests start their relays themselves.
package testrelay

import (
	"cmp"
	"context"
	"fmt"
	"log/slog"
	"net"
	"slices"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrelay/kvrelay/engines/vllm"
	"github.com/kvrelay/kvrelay/gateway/index"
	"github.com/kvrelay/kvrelay/internal/freeport"
	"github.com/kvrelay/kvrelay/relay"
	"github.com/kvrelay/kvrelay/relay/server"
	"github.com/kvrelay/kvrelay/sim"
	"github.com/kvrelay/kvrelay/sim/prefixcache"
)

// patience bounds each wait; the waits poll and return as soon as their
// condition holds, so a loaded machine only makes a failure slower to
// report.
const patience = 30 * time.Second

// StartEngine starts a simulated vLLM engine with dpSize ranks, block size
// 16 and capacityBlocks blocks per rank, publishing on free loopback TCP
// ports (TCP, not inproc: zmq4's inproc transport panics under load). It is
// closed when the test ends.
func StartEngine(t testing.TB, dpSize, capacityBlocks int) *sim.Engine {
	t.Helper()
	live := freeport.ForTest(t, 2*dpSize)
	ctx, cancel := context.WithCancel(context.Background())
	eng, err := sim.Start(ctx, sim.Options{
		Engine: "vllm", DPSize: dpSize, BlockSize: 16, CapacityBlocks: capacityBlocks,
		KVEventsConfig: fmt.Sprintf(`{"enable_kv_cache_events": true, "endpoint": "tcp://*:%d", "replay_endpoint": "tcp://*:%d"}`, live, live+dpSize),
	})
	if err != nil {
		cancel()
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cancel()
		_ = eng.Close()
	})
	return eng
}

// StartRelay starts a fresh relay (no history, no record) on eng's ranks
// and waits until it is connected to every one. stop ends it and waits
// for its Run to return; the caller owns calling it (before the engine's
// cleanup runs).
func StartRelay(t testing.TB, eng *sim.Engine, dpSize int) (rel *relay.Relay, stop func()) {
	t.Helper()
	return StartRelayRegistered(t, eng, dpSize, nil)
}

// StartRelayRegistered is StartRelay with the relay's metrics in reg, so a
// test can count the subscriptions (and snapshots) the relay served.
func StartRelayRegistered(t testing.TB, eng *sim.Engine, dpSize int, reg prometheus.Registerer) (rel *relay.Relay, stop func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	rel, err := relay.New(relay.Config{Engine: vllm.Engine, KV: eng.Config(), DPSize: dpSize, Logger: slog.New(slog.DiscardHandler), Registerer: reg})
	if err != nil {
		cancel()
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { defer close(done); _ = rel.Run(ctx) }()
	stop = func() { cancel(); <-done }
	if !waitFor(rel.Ready) {
		stop()
		t.Fatalf("relay not connected to its %d ranks after %v", dpSize, patience)
	}
	return rel, stop
}

// Serve serves rel's SubscribeKvEvents on addr ("127.0.0.1:0" for a fresh
// port; a previous server's address to come back on it, retried while the
// old socket lingers) and returns the address it listens on. stop ends the
// server and waits for Serve to return.
func Serve(t testing.TB, rel *relay.Relay, addr string) (listening string, stop func()) {
	t.Helper()
	return ServeWithLoad(t, rel, addr, nil)
}

// ServeWithLoad is Serve with the engine's load source stamping the
// stream (nil: none).
func ServeWithLoad(t testing.TB, rel *relay.Relay, addr string, load server.LoadSource) (listening string, stop func()) {
	t.Helper()
	svc := server.RelayService(vllm.Engine, rel)
	if load != nil {
		svc.Load = load
	}
	srv, err := server.New(server.Options{Logger: slog.New(slog.DiscardHandler), Services: []server.Service{svc}})
	if err != nil {
		t.Fatal(err)
	}
	var lis net.Listener
	if !waitFor(func() bool {
		lis, err = net.Listen("tcp", addr)
		return err == nil
	}) {
		t.Fatalf("listen on %s: %v", addr, err)
	}
	done := make(chan struct{})
	go func() { defer close(done); _ = srv.Serve(lis) }()
	return lis.Addr().String(), func() { srv.Stop(); <-done }
}

// EngineLive is e's true live set in the index's terms, in the order of
// index.LiveSet, for exactness checks against a gateway's index.
func EngineLive(e *sim.Engine) []index.LiveBlock {
	var out []index.LiveBlock
	for _, rl := range e.LiveSet() {
		for _, b := range rl.Blocks {
			tier := index.TierDevice
			if b.Tier == prefixcache.Host {
				tier = index.TierHost
			}
			out = append(out, index.LiveBlock{Rank: int32(rl.Rank), Tier: tier, EngineHash: b.Hash, Copies: b.Copies})
		}
	}
	slices.SortFunc(out, func(a, b index.LiveBlock) int {
		return cmp.Or(cmp.Compare(a.Rank, b.Rank), cmp.Compare(a.Tier, b.Tier), cmp.Compare(a.EngineHash, b.EngineHash))
	})
	return out
}

func waitFor(cond func() bool) bool {
	deadline := time.Now().Add(patience)
	for !cond() {
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(5 * time.Millisecond)
	}
	return true
}
