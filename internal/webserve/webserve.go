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
	"os"
	"time"

	"github.com/prometheus/exporter-toolkit/web"
	"go.yaml.in/yaml/v3"

	"github.com/kvrelay/kvrelay/internal/logthrottle"
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

// DefaultReadHeaderTimeout is how long Serve gives a client to send a
// request's headers when srv sets no ReadHeaderTimeout: a client that
// opens connections and sends nothing holds each this long.
const DefaultReadHeaderTimeout = 10 * time.Second

// Serve serves srv on lis with the web config's TLS and basic auth (none
// when webConfig is empty). A server shut down returns nil. Unless srv
// sets them, it takes DefaultReadHeaderTimeout and an ErrorLog that
// writes to log, throttled (logthrottle.ErrorLog), so a flood of bad TLS
// handshakes or malformed requests yields a few lines a minute.
func Serve(srv *http.Server, lis net.Listener, webConfig string, log *slog.Logger) error {
	if srv.ReadHeaderTimeout == 0 {
		srv.ReadHeaderTimeout = DefaultReadHeaderTimeout
	}
	if srv.ErrorLog == nil {
		srv.ErrorLog = logthrottle.ErrorLog(log, slog.LevelWarn)
	}
	err := web.Serve(lis, srv, &web.FlagConfig{WebConfigFile: &webConfig}, log)
	if errors.Is(err, http.ErrServerClosed) {
		return nil
	}
	return err
}

// Authenticates reports whether a web config makes every caller prove who
// it is: basic_auth_users, or client certificates required and verified
// (tls_server_config.client_auth_type RequireAndVerifyClientCert). An
// empty path does not. Routes that change what the process does (the
// gateway's membership admin API) are served only then, unless the
// operator says otherwise.
func Authenticates(path string) (bool, error) {
	if path == "" {
		return false, nil
	}
	b, err := os.ReadFile(path)
	if err != nil {
		return false, fmt.Errorf("--web.config.file: %w", err)
	}
	var c struct {
		TLS struct {
			ClientAuth string `yaml:"client_auth_type"`
		} `yaml:"tls_server_config"`
		Users map[string]string `yaml:"basic_auth_users"`
	}
	if err := yaml.Unmarshal(b, &c); err != nil {
		return false, fmt.Errorf("--web.config.file %s: %w", path, err)
	}
	return len(c.Users) > 0 || c.TLS.ClientAuth == "RequireAndVerifyClientCert", nil
}
