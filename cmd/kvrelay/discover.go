package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/status"

	"github.com/kvrelay/kvrelay/engines/discover"
)

// discoverTimeout bounds how long serve waits for the engine's servicer to
// answer GetServerInfo: an engine loading a model starts its servicer late.
const discoverTimeout = 2 * time.Minute

// discoverPublishers asks the engine's servicer at upstream (HOST:PORT,
// dialled with creds) for its --kv-events-config and dp_size, retrying each
// second while it is not up. Errors that retrying cannot fix (vLLM
// advertises nothing, a malformed answer) end it at once.
func discoverPublishers(ctx context.Context, engine, upstream string, creds credentials.TransportCredentials, timeout time.Duration, stderr io.Writer) (discover.Publishers, error) {
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
			fmt.Fprintf(stderr, "kvrelay serve: waiting for the engine's servicer at %s: %v\n", upstream, err)
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
