package bench

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net"
	"sync"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrelay/kvrelay/engines/vllm"
	"github.com/kvrelay/kvrelay/relay"
	"github.com/kvrelay/kvrelay/relay/server"
)

var quietLog = slog.New(slog.NewTextHandler(io.Discard, nil))

// servedRelay is a relay and its gRPC server inside the bench process.
type servedRelay struct {
	relay   *relay.Relay
	srv     *server.Server
	lis     net.Listener
	cancel  context.CancelFunc
	wg      sync.WaitGroup
	runErr  error
	address string
}

// serveRelay runs r and serves it on a loopback port until stop.
func serveRelay(ctx context.Context, r *relay.Relay) (*servedRelay, error) {
	srv, err := server.New(server.Options{
		Services: []server.Service{server.RelayService(vllm.Engine, r)},
		Logger:   quietLog, Registerer: prometheus.NewRegistry(),
	})
	if err != nil {
		return nil, fmt.Errorf("bench: server: %w", err)
	}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		srv.Stop()
		return nil, fmt.Errorf("bench: listen: %w", err)
	}
	ctx, cancel := context.WithCancel(ctx)
	s := &servedRelay{relay: r, srv: srv, lis: lis, cancel: cancel, address: lis.Addr().String()}
	s.wg.Go(func() { s.runErr = r.Run(ctx) })
	s.wg.Go(func() { _ = srv.Serve(lis) })
	return s, nil
}

func (s *servedRelay) addr() string { return s.address }
func (s *servedRelay) pid() int     { return 0 }

func (s *servedRelay) stop() {
	s.srv.Stop()
	s.cancel()
	s.wg.Wait()
}

// startInProcessRelay is kvrelay for the side-by-side run when no binary is
// given (go test): the same relay and server as `kvrelay serve`.
func startInProcessRelay(ctx context.Context, _ *environment, pub *publisher) (relayProc, error) {
	cfgJSON, _ := json.Marshal(map[string]any{
		"enable_kv_cache_events": true, "publisher": "zmq",
		"endpoint": pub.ranks[0].Pub, "replay_endpoint": pub.ranks[0].Replay,
	})
	kv, err := vllm.Engine.ParseConfig(string(cfgJSON))
	if err != nil {
		return nil, fmt.Errorf("bench: kv config: %w", err)
	}
	r, err := relay.New(relay.Config{Engine: vllm.Engine, KV: kv, DPSize: len(pub.ranks), Logger: quietLog})
	if err != nil {
		return nil, fmt.Errorf("bench: relay: %w", err)
	}
	return serveRelay(ctx, r)
}
