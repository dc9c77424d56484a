// Package natslog routes nats.go's asynchronous errors to a slog logger.
//
// Without an error handler of its own, nats.go writes them (a slow
// consumer, a write on a broken connection) straight to stderr, past slog
// and --log-format json. Every NATS connection kvrelay makes takes
// AsyncErrors.
package natslog

import (
	"log/slog"

	"github.com/nats-io/nats.go"
)

// AsyncErrors is the nats.Option that logs the connection's asynchronous
// errors to log, with the subject when one subscription is concerned; an
// error's text is redacted (RedactError).
func AsyncErrors(log *slog.Logger) nats.Option {
	return nats.ErrorHandler(func(_ *nats.Conn, sub *nats.Subscription, err error) {
		if sub != nil {
			log.Warn("nats: asynchronous error", "err", RedactError(err), "subject", sub.Subject)
			return
		}
		log.Warn("nats: asynchronous error", "err", RedactError(err))
	})
}
