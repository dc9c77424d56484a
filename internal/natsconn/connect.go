package natsconn

import (
	"fmt"
	"log/slog"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvrelay/kvrelay/internal/natslog"
)

// Connect dials url with the options every kvrelay connection starts with
// (named name, reconnecting for ever every wait in the background, also
// when the server is unreachable at start, its asynchronous errors logged
// to log), then opts: the component's handlers, then the caller's
// (Config.Options). The error names url with its credentials redacted,
// and its own text, which may quote the URL, is redacted too.
func Connect(url, name string, wait time.Duration, log *slog.Logger, opts ...nats.Option) (*nats.Conn, error) {
	base := []nats.Option{
		nats.Name(name),
		nats.RetryOnFailedConnect(true),
		nats.MaxReconnects(-1),
		nats.ReconnectWait(wait),
		natslog.AsyncErrors(log),
	}
	nc, err := nats.Connect(url, append(base, opts...)...)
	if err != nil {
		return nil, fmt.Errorf("connect %s: %w", natslog.RedactURL(url), natslog.RedactError(err))
	}
	return nc, nil
}
