package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc/credentials"

	"github.com/kvrelay/kvrelay/gateway"
	"github.com/kvrelay/kvrelay/gateway/membership"
	"github.com/kvrelay/kvrelay/internal/natsconn"
	"github.com/kvrelay/kvrelay/internal/webserve"
	"github.com/kvrelay/kvrelay/natsevents"
)

// memberFlags are kvrelay gateway's membership sources beside --worker.
type memberFlags struct {
	file         *string
	fileInterval *time.Duration
	dns          []membership.DNSSpec
	dnsInterval  *time.Duration
	dnsServer    *string
	fromNATS     *bool
	adminOpen    *bool
	maxWorkers   *int
	drainTimeout *time.Duration
}

func addMemberFlags(fs *flag.FlagSet) *memberFlags {
	m := &memberFlags{}
	m.file = fs.String("worker-file", "", "follow a file of workers, one a line in --worker's syntax (# comments), re-read when it changes: a ConfigMap or any orchestrator writes it")
	m.fileInterval = fs.Duration("worker-file-interval", membership.DefaultFileInterval, "how often --worker-file is checked for a change")
	fs.Func("worker-dns", "follow a DNS name: NAME:PORT (A/AAAA, e.g. an engines' headless Service) or srv+NAME (SRV), then [,model=M][,service=S][,tls=true] (repeat)", func(v string) error {
		sp, err := membership.ParseDNSSpec(v)
		if err != nil {
			return err
		}
		m.dns = append(m.dns, sp)
		return nil
	})
	m.dnsInterval = fs.Duration("worker-dns-interval", membership.DefaultDNSInterval, "how often --worker-dns names are resolved again")
	m.dnsServer = fs.String("worker-dns-server", "", "HOST:PORT of the DNS server for --worker-dns (default: the system's resolver)")
	m.fromNATS = fs.Bool("workers-from-nats", false, "with --nats: take workers from the relays' announcements (kvrelay serve --nats-member); a relay silent for 10 of its intervals leaves")
	m.adminOpen = fs.Bool("admin-api-unprotected", false, "serve the membership admin API (POST/DELETE /v1/workers, POST /v1/workers/drain) although --web.config.file asks no caller to authenticate (basic auth or client certificates); anyone reaching --listen can then redirect the traffic")
	m.maxWorkers = fs.Int("max-workers", membership.DefaultMaxWorkers, "cap on the workers of all sources together; an update going over it is refused whole")
	m.drainTimeout = fs.Duration("drain-timeout", membership.DefaultDrainTimeout, "a worker its sources dropped (or an operator drained) leaves when its tracked requests end, or after this")
	return m
}

// dynamic reports whether any source beside --worker is on.
func (m *memberFlags) dynamic() bool {
	return *m.file != "" || len(m.dns) > 0 || *m.fromNATS
}

func (m *memberFlags) check(natsURL string) error {
	switch {
	case *m.fromNATS && natsURL == "":
		return errors.New("--workers-from-nats needs --nats")
	case *m.maxWorkers < 1:
		return fmt.Errorf("--max-workers must be at least 1, got %d", *m.maxWorkers)
	case *m.drainTimeout <= 0:
		return fmt.Errorf("--drain-timeout must be positive, got %v", *m.drainTimeout)
	case *m.fileInterval <= 0 || *m.dnsInterval <= 0:
		return errors.New("--worker-file-interval and --worker-dns-interval must be positive")
	}
	return nil
}

// members is the running membership: the set and its followers.
type members struct {
	set     *membership.Set
	runners []func(context.Context)
	closers []func()
	// admin mounts the admin API, or its refusal.
	admin func(*http.ServeMux)
}

// start builds the Set over g (its static workers adopted), reads the
// file and the DNS names once, and connects the NATS watcher; run starts
// following them.
func (m *memberFlags) start(g *gateway.Gateway, static []gateway.Worker, prepare func(*gateway.Worker) error, natsURL string, natsAuth *natsconn.Config, natsEventsPrefix, webConfig string, reg prometheus.Registerer, log *slog.Logger) (*members, error) {
	set, err := membership.New(g, membership.Options{
		MaxWorkers: *m.maxWorkers, DrainTimeout: *m.drainTimeout, Prepare: prepare,
		Registerer: reg, Logger: log.With("component", "membership"),
	})
	if err != nil {
		return nil, err
	}
	out := &members{set: set, closers: []func(){set.Close}}
	fail := func(err error) (*members, error) {
		out.close()
		return nil, err
	}
	if err := set.Adopt(membership.SourceStatic, static); err != nil {
		return fail(fmt.Errorf("--worker: %w", err))
	}
	if *m.file != "" {
		fw, err := membership.WatchFile(set, *m.file, *m.fileInterval)
		if err != nil {
			return fail(fmt.Errorf("--worker-file: %w", err))
		}
		out.runners = append(out.runners, fw.Run)
	}
	if len(m.dns) > 0 {
		dw, err := membership.WatchDNS(set, membership.DNSOptions{Specs: m.dns, Interval: *m.dnsInterval, Server: *m.dnsServer})
		if err != nil {
			return fail(fmt.Errorf("--worker-dns: %w", err))
		}
		out.runners = append(out.runners, dw.Run)
	}
	if *m.fromNATS {
		nlog := log.With("component", "membership", "source", membership.SourceNATS)
		auth, err := natsAuthOptions(natsURL, natsAuth, nlog)
		if err != nil {
			return fail(fmt.Errorf("--workers-from-nats: %w", err))
		}
		mw, err := natsevents.WatchMembers(natsevents.MemberOptions{
			URL: natsURL, SubjectPrefix: natsEventsPrefix, MaxMembers: *m.maxWorkers, Logger: nlog, NATSOptions: auth, Registerer: reg,
			OnChange: func(specs []string) {
				// One relay announcing nonsense does not keep the others out.
				ws := make([]gateway.Worker, 0, len(specs))
				for _, sp := range specs {
					w, err := membership.ParseWorker(sp)
					if err != nil {
						nlog.Warn("a relay announces a member that does not parse; ignored", "member", sp, "err", err)
						continue
					}
					ws = append(ws, w)
				}
				_ = set.Replace(membership.SourceNATS, ws) // a refusal is logged and counted there
			},
		})
		if err != nil {
			return fail(fmt.Errorf("--workers-from-nats: %w", err))
		}
		out.closers = append(out.closers, mw.Close)
		out.runners = append(out.runners, mw.Run)
	}
	protected, err := webserve.Authenticates(webConfig)
	if err != nil {
		return fail(err)
	}
	switch {
	case protected:
		out.admin = func(mux *http.ServeMux) { membership.RegisterAdmin(mux, set) }
	case *m.adminOpen:
		log.Warn("the membership admin API is served without authentication (--admin-api-unprotected): anyone reaching the listener can add, drain and remove workers")
		out.admin = func(mux *http.ServeMux) { membership.RegisterAdmin(mux, set) }
	default:
		out.admin = func(mux *http.ServeMux) {
			membership.RefuseAdmin(mux, "the membership admin API needs a protected listener: --web.config.file with basic_auth_users or client_auth_type RequireAndVerifyClientCert (or --admin-api-unprotected)")
		}
	}
	return out, nil
}

// run follows the sources until ctx ends; the returned wait blocks until
// they stopped.
func (ms *members) run(ctx context.Context) (wait func()) {
	var wg sync.WaitGroup
	for _, r := range ms.runners {
		wg.Add(1)
		go func() { defer wg.Done(); r(ctx) }()
	}
	return wg.Wait
}

func (ms *members) close() {
	for i := len(ms.closers) - 1; i >= 0; i-- {
		ms.closers[i]()
	}
}

// workerTLSPrepare gives a grpcs:// worker of any source the workers' TLS
// credentials (nil: none configured, and such a worker is refused).
func workerTLSPrepare(creds credentials.TransportCredentials) func(*gateway.Worker) error {
	return func(w *gateway.Worker) error {
		if !strings.HasPrefix(w.ID, "grpcs://") {
			return nil
		}
		if creds == nil {
			return errors.New("a grpcs:// worker needs the workers' TLS: start the gateway with a grpcs:// --worker or --worker-tls-*")
		}
		w.Credentials = creds
		return nil
	}
}
