// Package webserve serves the binary's HTTP listeners (the relay's metrics,
// the gateway's API) with an exporter-toolkit web config, as Prometheus
// exporters do: TLS and basic auth from one file, read again at each TLS
// handshake so certificates rotate without a restart.
package webserve

import (
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"

	"github.com/prometheus/exporter-toolkit/web"
)

// CheckConfig reads a --web.config.file now, so a bad file stops the start
// instead of the first scrape. An empty path is no config.
func CheckConfig(path string) error {
	if path == "" {
		return nil
	}
	if err := web.Validate(path); err != nil {
		return fmt.Errorf("--web.config.file %s: %w", path, err)
	}
	return nil
}

// Serve serves srv on lis with the web config's TLS and basic auth (none
// when webConfig is empty). A server shut down returns nil.
func Serve(srv *http.Server, lis net.Listener, webConfig string, log *slog.Logger) error {
	err := web.Serve(lis, srv, &web.FlagConfig{WebConfigFile: &webConfig}, log)
	if errors.Is(err, http.ErrServerClosed) {
		return nil
	}
	return err
}
