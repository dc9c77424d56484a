package relayd

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"os"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrelay/kvrelay/engines/load"
	"github.com/kvrelay/kvrelay/internal/natslog"
	"github.com/kvrelay/kvrelay/natsevents"
	"github.com/kvrelay/kvrelay/relay"
)

// NATSSink is serve's JetStream sink (--nats …); an empty URL is off.
type NATSSink struct {
	URL, Stream, SubjectPrefix string
	// Worker names the engine's batches; "" names it HOSTNAME:PORT of the
	// relay's listen address, what a gateway's grpc://HOSTNAME:PORT worker
	// looks up.
	Worker string
	// AliveEvery: 0 never announces (natsevents.SinkOptions reads 0 as its
	// default; this does not).
	AliveEvery time.Duration
	// Member, if set, is announced with every announcement: how gateways
	// taking their workers from NATS route to this engine (--nats-member).
	Member string
	// NATSOptions, when set, gives the connection's authentication and TLS
	// options (cmd/kvrelay's --nats-creds …, internal/natsconn), for the
	// sink's logger.
	NATSOptions func(*slog.Logger) ([]nats.Option, error)
}

// start runs one sink for the relay until ctx ends; wg tracks it. loads,
// if not nil, is the relay's load source: the sink publishes its records
// beside the stream.
func (f NATSSink) start(ctx context.Context, wg *sync.WaitGroup, log *slog.Logger, reg prometheus.Registerer, rel *relay.Relay, listen string, loads *load.Poller) error {
	if f.URL == "" || rel == nil {
		return nil
	}
	name := f.Worker
	if name == "" {
		host, _ := os.Hostname()
		_, port, err := net.SplitHostPort(listen)
		if err != nil {
			return fmt.Errorf("--nats: naming the worker after --listen %s: %w", listen, err)
		}
		name = net.JoinHostPort(host, port)
	}
	aliveEvery := f.AliveEvery
	if aliveEvery == 0 {
		aliveEvery = -1 // off; SinkOptions reads 0 as the default
	}
	sinkLog := log.With("component", "natsevents", "worker", name)
	var nopts []nats.Option
	if f.NATSOptions != nil {
		var err error
		if nopts, err = f.NATSOptions(sinkLog); err != nil {
			return err
		}
	}
	opts := natsevents.SinkOptions{
		URL: f.URL, Stream: f.Stream, SubjectPrefix: f.SubjectPrefix, Worker: name, Registerer: reg, AliveEvery: aliveEvery, Member: f.Member,
		Logger: sinkLog, NATSOptions: nopts,
	}
	if loads != nil {
		opts.Loads = natsevents.PollerLoads(loads)
	}
	sink, err := natsevents.NewSink(rel, opts)
	if err != nil {
		return fmt.Errorf("--nats: %w", err)
	}
	log.Info("publishing to JetStream", "nats", natslog.Redact(f.URL), "stream", f.Stream, "worker", name,
		"subjects", f.SubjectPrefix+"."+natsevents.WorkerToken(name)+".<rank>")
	wg.Add(1)
	go func() {
		defer wg.Done()
		defer sink.Close()
		_ = sink.Run(ctx)
	}()
	return nil
}
