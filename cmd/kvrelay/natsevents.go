package main

import (
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrelay/kvrelay/gateway/membership"
	"github.com/kvrelay/kvrelay/internal/natsconn"
	"github.com/kvrelay/kvrelay/internal/natslog"
	"github.com/kvrelay/kvrelay/natsevents"
	"github.com/kvrelay/kvrelay/relayd"
)

// serveNATSFlags are kvrelay serve's JetStream sink flags (--nats …).
type serveNATSFlags struct {
	url, stream, worker, subjects *string
	aliveEvery                    *time.Duration
	member                        *string
	auth                          *natsconn.Config
}

// eventSubjectsUsage is --nats-events-subject-prefix's, the same on both
// sides: a stream per model group needs its own prefix, because JetStream
// refuses two streams whose subjects overlap.
const eventSubjectsUsage = "the subjects' prefix: <prefix>.<worker>.<rank>; relays and gateways of one stream use the same, and each stream (one per model group, say) needs its own"

func addServeNATSFlags(fs *flag.FlagSet) *serveNATSFlags {
	return &serveNATSFlags{
		url:        fs.String("nats", "", "also publish every relayed batch to a JetStream stream on this NATS server (nats://HOST:4222[,…]), for gateways started with --nats-events; NATS down never holds the relay up"),
		stream:     fs.String("nats-stream", natsevents.DefaultStream, "with --nats: the JetStream stream (created with 1h retention and a 10m duplicate window if missing); snapshots go to the object store <stream>_SNAPSHOTS"),
		subjects:   fs.String("nats-events-subject-prefix", natsevents.DefaultSubjectPrefix, "with --nats: "+eventSubjectsUsage),
		aliveEvery: fs.Duration("nats-alive-every", natsevents.DefaultAliveEvery, "with --nats: how often the sink announces itself (core NATS, <prefix>-alive.<worker>, not stored); a gateway moves a worker whose sink is silent for 3 intervals to its gRPC stream; 1ms to 1m, 0: never (a gateway then cannot tell a dead sink from an idle engine)"),
		member:     fs.String("nats-member", "", "with --nats: announce this engine to gateways started with --workers-from-nats, in the gateway's --worker syntax: grpc://HOST:PORT[,model=M][,service=S] as they reach this relay's --listen; the engine joins the fleet when its relay starts and leaves when it stops"),
		auth:       natsconn.AddFlags(fs),
		worker:     fs.String("nats-worker", "", "with --nats: the name this engine's batches go under (subject kvrelay.events.<name>.<rank>); gateways name the worker the same (default HOSTNAME:PORT of --listen, what a gateway's grpc://HOSTNAME:PORT worker looks up)"),
	}
}

// check refuses a bad combination before anything starts (forConfig
// does it for a serve --config).
func (f *serveNATSFlags) check() error {
	if *f.url == "" {
		if *f.worker != "" {
			return errors.New("--nats-worker needs --nats")
		}
		if *f.member != "" {
			return errors.New("--nats-member needs --nats")
		}
		if *f.stream != natsevents.DefaultStream {
			return errors.New("--nats-stream needs --nats")
		}
		if *f.subjects != natsevents.DefaultSubjectPrefix {
			return errors.New("--nats-events-subject-prefix needs --nats")
		}
		if *f.aliveEvery != natsevents.DefaultAliveEvery {
			return errors.New("--nats-alive-every needs --nats")
		}
		return checkNATSAuth(*f.url, f.auth)
	}
	if err := checkNATSAuth(*f.url, f.auth); err != nil {
		return err
	}
	if err := checkAliveEvery(*f.aliveEvery); err != nil {
		return fmt.Errorf("--nats-alive-every %s: %w", *f.aliveEvery, err)
	}
	if *f.member != "" {
		if err := checkMember(*f.member, *f.aliveEvery, "--nats-alive-every"); err != nil {
			return fmt.Errorf("--nats-member: %w", err)
		}
	}
	return nil
}

// checkAliveEvery refuses an announcement interval the gateways cannot
// follow.
func checkAliveEvery(d time.Duration) error {
	if d < 0 || d > time.Minute || (d > 0 && d < time.Millisecond) {
		return errors.New("want 0 (off) or 1ms to 1m")
	}
	return nil
}

// checkMember refuses a member a gateway cannot parse, or one that is
// never announced (aliveSetting 0).
func checkMember(member string, aliveEvery time.Duration, aliveSetting string) error {
	if _, err := membership.ParseWorker(member); err != nil {
		return err
	}
	if aliveEvery == 0 {
		return fmt.Errorf("it is announced, which %s 0 turns off", aliveSetting)
	}
	return nil
}

// options are the flags' sink settings for relayd.Options; the single
// relay's name and member are its RelayConfig's (worker, member).
func (f *serveNATSFlags) options() relayd.NATSSink {
	return sinkSettings(*f.url, *f.stream, *f.subjects, *f.aliveEvery, f.auth)
}

// sinkSettings are the sink's settings from flags or from the block, auth
// connecting it.
func sinkSettings(url, stream, subjects string, aliveEvery time.Duration, auth *natsconn.Config) relayd.NATSSink {
	return relayd.NATSSink{URL: url, Stream: stream, SubjectPrefix: subjects, AliveEvery: aliveEvery,
		NATSOptions: func(log *slog.Logger) ([]nats.Option, error) { return natsAuthOptions(url, auth, log) }}
}

// forConfig is the sink of a serve --config: the file's "nats" block, or,
// when it has none, the --nats… flags; giving both is refused, naming the
// flag (set: the names of the flags given). Each relay's nats_worker and
// nats_member are checked against it, naming the relay and the key.
func (f *serveNATSFlags) forConfig(file relayd.File, set []string) (relayd.NATSSink, error) {
	if *f.worker != "" {
		return relayd.NATSSink{}, errors.New("--nats-worker cannot be combined with --config: it names one relay (give each relay its nats_worker in the file)")
	}
	if *f.member != "" {
		return relayd.NATSSink{}, errors.New("--nats-member cannot be combined with --config: it announces one relay (give each relay its nats_member in the file)")
	}
	sink, aliveSetting := f.options(), "--nats-alive-every"
	if file.NATS == nil {
		if err := f.check(); err != nil {
			return relayd.NATSSink{}, err
		}
	} else {
		for _, name := range set {
			if strings.HasPrefix(name, "nats") {
				return relayd.NATSSink{}, fmt.Errorf("--%s cannot be combined with the \"nats\" block of --config: the block is the sink's whole setting (put it there; README: NATS options)", name)
			}
		}
		var err error
		if sink, err = natsBlock(file.NATS); err != nil {
			return relayd.NATSSink{}, err
		}
		aliveSetting = "nats.alive_every"
	}
	for i, r := range file.Relays {
		where := fmt.Sprintf("relay %d", i)
		if r.Name != "" {
			where = fmt.Sprintf("relay %q", r.Name)
		}
		if sink.URL == "" {
			if r.NATSWorker != "" || r.NATSMember != "" {
				return relayd.NATSSink{}, fmt.Errorf("%s: nats_worker and nats_member need a \"nats\" block with a url in --config (or --nats)", where)
			}
			continue
		}
		if r.NATSMember != "" {
			if err := checkMember(r.NATSMember, sink.AliveEvery, aliveSetting); err != nil {
				return relayd.NATSSink{}, fmt.Errorf("%s: nats_member: %w", where, err)
			}
		}
	}
	return sink, nil
}

// natsBlock checks --config's "nats" block (ReadFile refused its
// secrets), naming the keys, and returns its sink.
func natsBlock(n *relayd.NATSConfig) (relayd.NATSSink, error) {
	if n.URL == "" {
		return relayd.NATSSink{}, errors.New("nats.url is required: the \"nats\" block turns the JetStream sink on")
	}
	stream, subjects, aliveEvery := n.Stream, n.EventsSubjectPrefix, natsevents.DefaultAliveEvery
	if stream == "" {
		stream = natsevents.DefaultStream
	}
	if subjects == "" {
		subjects = natsevents.DefaultSubjectPrefix
	}
	if n.AliveEvery != "" {
		d, err := time.ParseDuration(n.AliveEvery)
		if err != nil {
			return relayd.NATSSink{}, fmt.Errorf("nats.alive_every %q: not a duration (say \"1s\"; \"0s\": never)", n.AliveEvery)
		}
		if err := checkAliveEvery(d); err != nil {
			return relayd.NATSSink{}, fmt.Errorf("nats.alive_every %q: %w", n.AliveEvery, err)
		}
		aliveEvery = d
	}
	auth := &natsconn.Config{
		Creds: n.Creds, NKeySeed: n.NKeySeed, User: n.User, PasswordFile: n.PasswordFile, TokenFile: n.TokenFile,
		CA: n.TLS.CA, Cert: n.TLS.Cert, Key: n.TLS.Key, Names: natsconn.KeyNames("nats."),
	}
	if err := auth.Check(); err != nil {
		return relayd.NATSSink{}, err
	}
	return sinkSettings(n.URL, stream, subjects, aliveEvery, auth), nil
}

// gatewayNATSEventsFlags are kvrelay gateway's --nats-events flags.
type gatewayNATSEventsFlags struct {
	on       *bool
	stream   *string
	subjects *string
	names    map[string]string
}

func addGatewayNATSEventsFlags(fs *flag.FlagSet) *gatewayNATSEventsFlags {
	g := &gatewayNATSEventsFlags{names: map[string]string{}}
	g.on = fs.Bool("nats-events", false, "with --nats: build the index from the JetStream stream the workers' relays publish (kvrelay serve --nats) instead of dialling each worker's stream; a worker falls back to its gRPC stream while that cannot be exact (NATS down, no snapshot yet)")
	g.stream = fs.String("nats-stream", natsevents.DefaultStream, "with --nats-events: the JetStream stream the relays publish to")
	g.subjects = fs.String("nats-events-subject-prefix", natsevents.DefaultSubjectPrefix, "with --nats-events: "+eventSubjectsUsage)
	fs.Func("nats-worker-name", "with --nats-events: WORKER=NAME, the name a worker's relay publishes under (its --nats-worker) when it is not the worker's HOST:PORT (repeat)", func(v string) error {
		id, name, ok := cutLast(v, "=")
		if !ok || id == "" || name == "" {
			return fmt.Errorf("want WORKER=NAME, got %q", v)
		}
		g.names[id] = name
		return nil
	})
	return g
}

func cutLast(s, sep string) (before, after string, found bool) {
	for i := len(s) - len(sep); i >= 0; i-- {
		if s[i:i+len(sep)] == sep {
			return s[:i], s[i+len(sep):], true
		}
	}
	return s, "", false
}

func (g *gatewayNATSEventsFlags) check(natsURL string) error {
	if !*g.on {
		if len(g.names) > 0 {
			return errors.New("--nats-worker-name needs --nats-events")
		}
		if *g.subjects != natsevents.DefaultSubjectPrefix {
			return errors.New("--nats-events-subject-prefix needs --nats-events")
		}
		return nil
	}
	if natsURL == "" {
		return errors.New("--nats-events needs --nats")
	}
	return nil
}

// source connects the gateway's event source; nil when --nats-events is off.
func (g *gatewayNATSEventsFlags) source(natsURL string, auth *natsconn.Config, log *slog.Logger, reg prometheus.Registerer) (*natsevents.Source, error) {
	if !*g.on {
		return nil, nil
	}
	log = log.With("component", "natsevents")
	nopts, err := natsAuthOptions(natsURL, auth, log)
	if err != nil {
		return nil, err
	}
	src, err := natsevents.NewSource(natsevents.SourceOptions{
		URL: natsURL, Stream: *g.stream, SubjectPrefix: *g.subjects, Names: g.names, Registerer: reg,
		Logger: log, NATSOptions: nopts,
	})
	if err != nil {
		return nil, fmt.Errorf("--nats-events: %w", err)
	}
	return src, nil
}

// checkNATSAuth refuses authentication flags without a NATS URL, and a
// bad combination of them.
func checkNATSAuth(url string, auth *natsconn.Config) error {
	if url == "" {
		if auth.Set() {
			return errors.New("--nats-creds, --nats-nkey-seed, --nats-user, --nats-token-file and --nats-tls-* need --nats")
		}
		return nil
	}
	return auth.Check()
}

// natsAuthOptions are the connection options of auth for one component,
// which logs its refusals to log; a credential written in the URL is
// warned about (ps and the shell's history show it) but still used.
func natsAuthOptions(url string, auth *natsconn.Config, log *slog.Logger) ([]nats.Option, error) {
	if natslog.HasCredentials(url) {
		log.Warn("a credential in the --nats URL is visible in ps and shell history; use --nats-creds, --nats-nkey-seed, --nats-password-file or --nats-token-file", "nats", natslog.RedactURL(url))
	}
	// auth's errors name the flag or key at fault.
	return auth.Options(log)
}
