package membership

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strconv"
	"strings"
	"time"

	"github.com/kvrelay/kvrelay/gateway"
	"github.com/kvrelay/kvrelay/gateway/monitor"
)

// A DNS source follows a name re-resolved on an interval, so a StatefulSet
// or Deployment of engines behind a Kubernetes headless Service is followed
// without the Kubernetes API: NAME:PORT resolves A/AAAA records (one
// worker per address, all on PORT); srv+NAME resolves SRV records (one
// worker per target and port).
//
// A lookup that fails, answers nothing (NXDOMAIN, an empty answer) or
// answers more records than the cap keeps the last good list: a DNS outage
// or a Service with no ready pod for a moment must not empty the fleet.
// Scaling to zero is then done by the other sources (or a restart).

// DefaultDNSInterval is how often the name is resolved again: Kubernetes'
// DNS caches for 5 s by default (CoreDNS's cache plugin, headless records'
// 5 s TTL).
const DefaultDNSInterval = 5 * time.Second

// DNSSpec is one name to follow.
type DNSSpec struct {
	// Name is the name to resolve; SRV resolves SRV records
	// (_grpc._tcp.NAME or any name that has them).
	Name string
	SRV  bool
	// Port is the workers' port with A/AAAA (unused with SRV).
	Port int
	// Model and Service are every resolved worker's; TLS makes them grpcs://.
	Model   string
	Service monitor.Service
	TLS     bool
}

// DNSSyntax is the form of --worker-dns.
const DNSSyntax = "NAME:PORT or srv+NAME, then [,model=M][,service=vllm|sglang|tokenspeed][,tls=true]"

// ParseDNSSpec reads one --worker-dns value in DNSSyntax.
func ParseDNSSpec(v string) (DNSSpec, error) {
	parts := strings.Split(v, ",")
	target := strings.TrimSpace(parts[0])
	sp := DNSSpec{Model: gateway.DefaultModel, Service: monitor.ServiceVLLM}
	if name, ok := strings.CutPrefix(target, "srv+"); ok {
		sp.SRV, sp.Name = true, name
	} else {
		host, port, err := net.SplitHostPort(target)
		if err != nil {
			return DNSSpec{}, fmt.Errorf("%q: want %s", v, DNSSyntax)
		}
		p, err := strconv.Atoi(port)
		if err != nil || p < 1 || p > 65535 {
			return DNSSpec{}, fmt.Errorf("%q: port %q: want 1..65535", v, port)
		}
		sp.Name, sp.Port = host, p
	}
	if sp.Name == "" || strings.ContainsAny(sp.Name, "/ \t") {
		return DNSSpec{}, fmt.Errorf("%q: want %s", v, DNSSyntax)
	}
	for _, opt := range parts[1:] {
		key, val, ok := strings.Cut(strings.TrimSpace(opt), "=")
		if !ok || val == "" {
			return DNSSpec{}, fmt.Errorf("%q: option %q is not key=value", v, opt)
		}
		switch key {
		case "model":
			sp.Model = val
		case "service":
			svc, err := monitor.ParseService(val)
			if err != nil {
				return DNSSpec{}, fmt.Errorf("%q: %w", v, err)
			}
			sp.Service = svc
		case "tls":
			b, err := strconv.ParseBool(val)
			if err != nil {
				return DNSSpec{}, fmt.Errorf("%q: tls=%q: want true or false", v, val)
			}
			sp.TLS = b
		default:
			return DNSSpec{}, fmt.Errorf("%q: unknown option %q (want model, service or tls)", v, key)
		}
	}
	return sp, nil
}

// DNSOptions configures a DNSWatcher.
type DNSOptions struct {
	Specs []DNSSpec
	// Interval is the time between two resolutions; 0 = DefaultDNSInterval.
	Interval time.Duration
	// Server, if set, is the DNS server (HOST:PORT) asked instead of the
	// system's; Timeout bounds one resolution (0 = 5 s).
	Server  string
	Timeout time.Duration
}

// DNSWatcher follows DNS names into a Set as SourceDNS.
type DNSWatcher struct {
	set  *Set
	opts DNSOptions
	res  *net.Resolver
	// lastLists is the last list applied, per spec in order.
	lastLists [][]gateway.Worker
}

// WatchDNS resolves the names once into set (a failure is logged and
// counted, not fatal: DNS may come up after the gateway); Run follows them.
func WatchDNS(set *Set, opts DNSOptions) (*DNSWatcher, error) {
	if len(opts.Specs) == 0 {
		return nil, errors.New("membership: no DNS name to follow")
	}
	if opts.Interval <= 0 {
		opts.Interval = DefaultDNSInterval
	}
	if opts.Timeout <= 0 {
		opts.Timeout = 5 * time.Second
	}
	d := &DNSWatcher{set: set, opts: opts, res: net.DefaultResolver}
	if opts.Server != "" {
		server := opts.Server
		d.res = &net.Resolver{PreferGo: true, Dial: func(ctx context.Context, network, _ string) (net.Conn, error) {
			var dl net.Dialer
			return dl.DialContext(ctx, network, server)
		}}
	}
	d.refresh(context.Background())
	return d, nil
}

// Run resolves the names every interval until ctx ends.
func (d *DNSWatcher) Run(ctx context.Context) {
	t := time.NewTicker(d.opts.Interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		d.refresh(ctx)
	}
}

// refresh resolves every spec; one that fails keeps its last good
// answer while the others move on.
func (d *DNSWatcher) refresh(ctx context.Context) {
	lists := make([][]gateway.Worker, len(d.opts.Specs))
	changed := false
	for i, sp := range d.opts.Specs {
		ws, err := d.resolve(ctx, sp)
		if err != nil {
			d.set.Reject(SourceDNS, err)
			lists[i] = d.lastOf(i)
			continue
		}
		lists[i] = ws
		changed = true
	}
	if !changed {
		return
	}
	var all []gateway.Worker
	for _, l := range lists {
		all = append(all, l...)
	}
	if err := d.set.Replace(SourceDNS, all); err != nil {
		return // counted and logged by Replace
	}
	d.lastLists = lists
}

func (d *DNSWatcher) lastOf(i int) []gateway.Worker {
	if i < len(d.lastLists) {
		return d.lastLists[i]
	}
	return nil
}

// resolve answers one spec's workers.
func (d *DNSWatcher) resolve(ctx context.Context, sp DNSSpec) ([]gateway.Worker, error) {
	ctx, cancel := context.WithTimeout(ctx, d.opts.Timeout)
	defer cancel()
	var addrs []string
	if sp.SRV {
		_, srvs, err := d.res.LookupSRV(ctx, "", "", sp.Name)
		if err != nil {
			return nil, fmt.Errorf("dns: SRV %s: %w", sp.Name, err)
		}
		for _, s := range srvs {
			addrs = append(addrs, net.JoinHostPort(strings.TrimSuffix(s.Target, "."), strconv.Itoa(int(s.Port))))
		}
	} else {
		ips, err := d.res.LookupHost(ctx, sp.Name)
		if err != nil {
			return nil, fmt.Errorf("dns: %s: %w", sp.Name, err)
		}
		for _, ip := range ips {
			addrs = append(addrs, net.JoinHostPort(ip, strconv.Itoa(sp.Port)))
		}
	}
	if len(addrs) == 0 {
		return nil, fmt.Errorf("dns: %s answered no records", sp.Name)
	}
	if len(addrs) > d.set.opts.MaxWorkers {
		return nil, fmt.Errorf("dns: %s answered %d records: %w of %d", sp.Name, len(addrs), ErrTooMany, d.set.opts.MaxWorkers)
	}
	scheme := "grpc://"
	if sp.TLS {
		scheme = "grpcs://"
	}
	seen := make(map[string]bool, len(addrs))
	out := make([]gateway.Worker, 0, len(addrs))
	for _, a := range addrs {
		if seen[a] {
			continue // an address twice in one answer is one worker
		}
		seen[a] = true
		out = append(out, gateway.Worker{ID: scheme + a, Addr: a, Model: sp.Model, Service: sp.Service})
	}
	return out, nil
}
