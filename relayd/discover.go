package relayd

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/status"

	"github.com/kvrelay/kvrelay/engines/discover"
)

// DiscoverTimeout bounds how long serve waits for the engine's servicer to
// answer GetServerInfo: an engine loading a model starts its servicer late.
const DiscoverTimeout = 2 * time.Minute

// DiscoverPublishers asks the engine's servicer at upstream (HOST:PORT,
// dialled with creds) for its --kv-events-config and dp_size, retrying each
// second while it is not up (saying so once on progress). Errors that retrying cannot fix (vLLM
// advertises nothing, a malformed answer) end it at once.
func DiscoverPublishers(ctx context.Context, engine, upstream string, creds credentials.TransportCredentials, timeout time.Duration, progress io.Writer) (discover.Publishers, error) {
	conn, err := grpc.NewClient(upstream, grpc.WithTransportCredentials(creds))
	if err != nil {
		return discover.Publishers{}, fmt.Errorf("upstream %q: %w", upstream, err)
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	for attempt := 1; ; attempt++ {
		callCtx, callCancel := context.WithTimeout(ctx, 10*time.Second)
		p, err := discover.FromServerInfo(callCtx, conn, engine)
		callCancel()
		if err == nil || errors.Is(err, discover.ErrNotAdvertised) || !retryable(err) {
			return p, err
		}
		if attempt == 1 {
			fmt.Fprintf(progress, "kvrelay serve: waiting for the engine's servicer at %s: %v\n", upstream, err)
		}
		select {
		case <-ctx.Done():
			return discover.Publishers{}, fmt.Errorf("no answer from the engine's servicer at %s within %v: %w", upstream, timeout, err)
		case <-time.After(time.Second):
		}
	}
}

// retryable: the servicer is not up yet (or was too slow), as opposed to an
// answer that a second try would repeat.
func retryable(err error) bool {
	switch status.Code(errors.Unwrap(err)) {
	case codes.Unavailable, codes.DeadlineExceeded:
		return true
	}
	return false
}

// PublishersOnHost rewrites a --kv-events-config learned from the engine's
// servicer at host so that endpoints binding every interface (tcp://*:P,
// 0.0.0.0, ::) are dialled at host. Such an endpoint says where the engine
// listens, not where to reach it: a relay on the engine's host reaches it on
// loopback (engines.ConnectEndpoint), but one whose --upstream is another
// host would dial its own. Other endpoints are kept as the engine gave
// them. It returns the config and what it changed ("endpoint A -> B").
func PublishersOnHost(kvConfig, host string) (string, []string, error) {
	var obj map[string]json.RawMessage
	if err := json.Unmarshal([]byte(kvConfig), &obj); err != nil {
		return "", nil, fmt.Errorf("kv-events-config: %w", err)
	}
	var changed []string
	for _, key := range []string{"endpoint", "replay_endpoint"} {
		raw, ok := obj[key]
		if !ok {
			continue
		}
		var ep string
		if err := json.Unmarshal(raw, &ep); err != nil {
			continue // not a string: the engine's own parser names the problem
		}
		moved, ok := endpointOnHost(ep, host)
		if !ok {
			continue
		}
		obj[key], _ = json.Marshal(moved) // a string always encodes
		changed = append(changed, fmt.Sprintf("%s %s -> %s", key, ep, moved))
	}
	if len(changed) == 0 {
		return kvConfig, nil, nil
	}
	out, err := json.Marshal(obj)
	if err != nil {
		return "", nil, fmt.Errorf("kv-events-config: %w", err)
	}
	return string(out), changed, nil
}

// endpointOnHost is a tcp:// endpoint that binds every interface with its
// host replaced by host; ok is false for any other endpoint.
func endpointOnHost(endpoint, host string) (string, bool) {
	rest, ok := strings.CutPrefix(endpoint, "tcp://")
	if !ok {
		return "", false
	}
	i := strings.LastIndex(rest, ":")
	if i < 0 {
		return "", false
	}
	switch rest[:i] {
	case "*", "0.0.0.0", "::", "[::]":
		return "tcp://" + net.JoinHostPort(host, rest[i+1:]), true
	}
	return "", false
}
