// Package reload re-reads certificate files on SIGHUP, for every TLS setting
// of the process at once.
package reload

import (
	"context"
	"log/slog"
	"os"
	"os/signal"
	"syscall"
)

// Reloader is a TLS setting whose files can be re-read.
type Reloader interface {
	Reload() error
}

// OnHangup re-reads every reloader's files on SIGHUP until ctx ends; a file
// that does not load is logged and the previous one stays in service. The
// returned channel closes when it has stopped listening.
func OnHangup(ctx context.Context, log *slog.Logger, all []Reloader) <-chan struct{} {
	done := make(chan struct{})
	if len(all) == 0 {
		close(done)
		return done
	}
	hup := make(chan os.Signal, 1)
	signal.Notify(hup, syscall.SIGHUP)
	go func() {
		defer close(done)
		defer signal.Stop(hup)
		for {
			select {
			case <-ctx.Done():
				return
			case <-hup:
				failed := 0
				for _, r := range all {
					if err := r.Reload(); err != nil {
						failed++
						log.Error("SIGHUP: certificate reload failed; the previous files stay in service", "err", err)
					}
				}
				log.Info("SIGHUP: certificates reloaded", "settings", len(all), "failed", failed)
			}
		}
	}()
	return done
}
