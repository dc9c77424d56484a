package main

import (
	"context"
	"fmt"
	"io"
	"net"
	"strings"

	"github.com/kvrelay/kvrelay/internal/exposure"
	"github.com/kvrelay/kvrelay/internal/tlsconfig"
	"github.com/kvrelay/kvrelay/relayd"
)

// learned is what serve takes from the engine's servicer when no
// --kv-events-config is given.
type learned struct {
	kvConfig string
	dpSize   int
	moved    bool // wildcard binds are dialled at the upstream's host
}

// learnFromUpstream asks the engine's servicer for its config and rank
// count, dialled as the proxy dials it (grpcs:// with the upstream TLS
// settings), and says on stderr what it learned. A non-zero code is the
// exit code, its reason already printed.
func learnFromUpstream(ctx context.Context, engine, upstream string, upstreamTLS tlsconfig.Client, dpSize int, dpSizeSet bool, stderr io.Writer) (learned, int) {
	addr, useTLS, err := relayd.ParseUpstream(upstream, upstreamTLS)
	if err != nil {
		fmt.Fprintf(stderr, "kvrelay serve: %v\n", err)
		return learned{}, 2
	}
	creds, _, err := relayd.UpstreamCredentials(useTLS, upstreamTLS, nil)
	if err != nil {
		fmt.Fprintf(stderr, "kvrelay serve: upstream TLS: %v\n", err)
		return learned{}, 2
	}
	pubs, err := relayd.DiscoverPublishers(ctx, engine, addr, creds, relayd.DiscoverTimeout, stderr)
	if err != nil {
		fmt.Fprintf(stderr, "kvrelay serve: no --kv-events-config, and the engine's servicer did not give one: %v\n", err)
		return learned{}, 2
	}
	if pubs.KVEventsConfig == "" {
		fmt.Fprintf(stderr, "kvrelay serve: the engine at %s publishes no KV events (its kv_events_config is unset)\n", upstream)
		return learned{}, 2
	}
	if dpSizeSet && dpSize != pubs.DPSize {
		fmt.Fprintf(stderr, "kvrelay serve: --dp-size %d, but the engine at %s runs %d publishers\n", dpSize, upstream, pubs.DPSize)
		return learned{}, 2
	}
	out := learned{kvConfig: pubs.KVEventsConfig, dpSize: pubs.DPSize}
	fmt.Fprintf(stderr, "kvrelay serve: learned from %s: --kv-events-config '%s' --dp-size %d\n", upstream, out.kvConfig, out.dpSize)
	if !exposure.IsLoopback(addr) {
		// The engine runs at the upstream's host: a wildcard bind is
		// reached there, not on this host.
		host, _, _ := net.SplitHostPort(addr)
		moved, changed, err := relayd.PublishersOnHost(out.kvConfig, host)
		if err != nil {
			fmt.Fprintf(stderr, "kvrelay serve: the engine at %s advertised an unreadable config: %v\n", upstream, err)
			return learned{}, 2
		}
		if len(changed) > 0 {
			out.kvConfig, out.moved = moved, true
			fmt.Fprintf(stderr, "kvrelay serve: the engine binds its publishers on every interface; dialling them at the upstream's host: %s\n", strings.Join(changed, ", "))
		}
	}
	return out, 0
}
