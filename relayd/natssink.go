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

// NATSSink is serve's JetStream sink (--nats …, or --config's "nats"
// block): one per relay, each under its relay's NATSWorker and announcing
// its NATSMember. An empty URL is off.
type NATSSink struct {
	URL, Stream, SubjectPrefix string
	// AliveEvery: 0 never announces (natsevents.SinkOptions reads 0 as its
	// default; this does not).
	AliveEvery time.Duration
	// NATSOptions, when set, gives the connection's authentication and TLS
	// options (cmd/kvrelay's --nats-creds …, internal/natsconn), for the
	// sink's logger.
	NATSOptions func(*slog.Logger) ([]nats.Option, error)
}

// WorkerNames are the names the relays' sinks publish under, by relay
// name: a relay's NATSWorker, else HOSTNAME:PORT of its listen address,
// what a gateway's grpc://HOSTNAME:PORT worker looks up. Two relays under
// one name would mix their streams on the same subjects (two relays on
// one listener do, by default), so that is refused, naming both. Run
// checks it; serve asks first, to refuse the file before it starts.
func (f NATSSink) WorkerNames(relays []Relay) (map[string]string, error) {
	names := map[string]string{}
	if f.URL == "" {
		return names, nil
	}
	host, _ := os.Hostname()
	by := map[string]string{} // worker name -> relay
	for _, rc := range relays {
		if !rc.KV.Enabled {
			continue // no stream, no sink
		}
		name := rc.NATSWorker
		if name == "" {
			_, port, err := net.SplitHostPort(rc.Listen)
			if err != nil {
				return nil, fmt.Errorf("relay %q: naming its NATS worker after its listen address %s: %w", rc.Name, rc.Listen, err)
			}
			name = net.JoinHostPort(host, port)
		}
		if other, ok := by[name]; ok {
			return nil, fmt.Errorf("relays %q and %q would both publish to NATS as worker %q: give each its own nats_worker", other, rc.Name, name)
		}
		by[name] = rc.Name
		names[rc.Name] = name
	}
	return names, nil
}

// start runs one sink for the relay rc (rel: its running relay) under the
// name given until ctx ends; wg tracks it. loads, if not nil, is the
// relay's load source: the sink publishes its records beside the stream.
// The sink's metrics carry the relay label, as the relay's own do.
func (f NATSSink) start(ctx context.Context, wg *sync.WaitGroup, log *slog.Logger, reg prometheus.Registerer, rc Relay, name string, rel *relay.Relay, loads *load.Poller) error {
	if f.URL == "" || rel == nil {
		return nil
	}
	aliveEvery := f.AliveEvery
	if aliveEvery == 0 {
		aliveEvery = -1 // off; SinkOptions reads 0 as the default
	}
	sinkLog := log.With("component", "natsevents", "relay", rc.Name, "worker", name)
	var nopts []nats.Option
	if f.NATSOptions != nil {
		var err error
		if nopts, err = f.NATSOptions(sinkLog); err != nil {
			return fmt.Errorf("relay %q: NATS: %w", rc.Name, err)
		}
	}
	opts := natsevents.SinkOptions{
		URL: f.URL, Stream: f.Stream, SubjectPrefix: f.SubjectPrefix, Worker: name, AliveEvery: aliveEvery, Member: rc.NATSMember,
		Registerer: prometheus.WrapRegistererWith(prometheus.Labels{"relay": rc.Name}, reg),
		Logger:     sinkLog, NATSOptions: nopts,
	}
	if loads != nil {
		opts.Loads = natsevents.PollerLoads(loads)
	}
	sink, err := natsevents.NewSink(rel, opts)
	if err != nil {
		return fmt.Errorf("relay %q: NATS sink: %w", rc.Name, err)
	}
	log.Info("publishing to JetStream", "relay", rc.Name, "nats", natslog.RedactURL(f.URL), "stream", f.Stream, "worker", name,
		"subjects", f.SubjectPrefix+"."+natsevents.WorkerToken(name)+".<rank>")
	wg.Add(1)
	go func() {
		defer wg.Done()
		defer sink.Close()
		_ = sink.Run(ctx)
	}()
	return nil
}
