// Package tlsconfig builds kvrelay's TLS: server certificates for the gRPC
// listeners (with optional client certificates and an allow-list of client
// identities), client certificates and CA bundles for the connections kvrelay
// makes, and live reloading of every file involved.
//
// Certificates reload without a restart: each handshake stats the files (two
// or three stat calls; handshakes are rare, streams are long) and re-reads
// them when one changed, and Reload (on SIGHUP) re-reads them unconditionally.
// A file that does not load is logged naming it and the previous certificate
// stays in service. Connections already open keep the certificate they were
// made with.
//
// cmd/kvrelay uses this package; relay/server only receives the resulting
// grpc.ServerOption values.
package tlsconfig

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"log/slog"
	"net"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
)

// Server is one listener's TLS settings, as flags or a config file give them.
type Server struct {
	// Cert and Key are PEM files. Both empty: plaintext.
	Cert string `json:"cert"`
	Key  string `json:"key"`
	// ClientCA, when set, is a PEM bundle; every client must then present a
	// certificate it signed (mutual TLS).
	ClientCA string `json:"client_ca"`
	// Allow lists the client identities allowed to call (see ParseAllowList);
	// empty allows every client with a valid certificate. Needs ClientCA.
	Allow []string `json:"allow"`
}

// Enabled reports whether TLS is asked for.
func (s Server) Enabled() bool { return s.Cert != "" || s.Key != "" }

// Check validates the combination of settings without reading files.
func (s Server) Check() error {
	switch {
	case !s.Enabled() && s.ClientCA != "":
		return errors.New("a client CA needs a server certificate and key (tls cert, tls key)")
	case !s.Enabled() && len(s.Allow) > 0:
		return errors.New("an allow-list needs TLS with a client CA")
	case (s.Cert == "") != (s.Key == ""):
		return errNoKey
	case len(s.Allow) > 0 && s.ClientCA == "":
		return errors.New("an allow-list needs a client CA: without client certificates there is no identity to check")
	}
	_, err := ParseAllowList(s.Allow)
	return err
}

// Metrics count what the TLS listeners refuse and the reloads that failed.
type Metrics struct {
	refused        *prometheus.CounterVec
	reloadFailures *prometheus.CounterVec
}

// Refusal reasons, the reason label of kvrelay_tls_refused_total.
const (
	ReasonHandshake          = "tls_handshake"         // not TLS, an untrusted or expired certificate, ...
	ReasonNoClientCert       = "no_client_certificate" // mTLS listener, client sent none
	ReasonIdentityNotAllowed = "identity_not_allowed"  // valid certificate, not on the allow-list
)

// NewMetrics registers kvrelay_tls_* on reg (nil: unregistered).
func NewMetrics(reg prometheus.Registerer) (*Metrics, error) {
	m := &Metrics{
		refused: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvrelay_tls_refused_total",
			Help: "Connections or calls a TLS listener refused, by reason (tls_handshake, no_client_certificate, identity_not_allowed).",
		}, []string{"listener", "reason"}),
		reloadFailures: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvrelay_tls_reload_failures_total",
			Help: "Certificate or CA files that changed but did not load; the previous ones stayed in service.",
		}, []string{"listener"}),
	}
	if reg != nil {
		for _, c := range []prometheus.Collector{m.refused, m.reloadFailures} {
			if err := reg.Register(c); err != nil {
				return nil, fmt.Errorf("tlsconfig: register metrics: %w", err)
			}
		}
	}
	return m, nil
}

// Listener is a built server-side TLS for one listener.
type Listener struct {
	name    string
	pair    *reloadable[*tls.Certificate]
	cas     *reloadable[*x509.CertPool] // nil: no client certificates asked
	allow   AllowList
	metrics *Metrics
	log     *slog.Logger
}

// errNoClientCertificate is what VerifyConnection answers a client that sent
// no certificate to an mTLS listener; the handshake wrapper counts it apart.
var errNoClientCertificate = errors.New("tls: this listener requires a client certificate")

// NewListener loads cfg's files. name labels metrics and logs (the listen
// address). A nil Metrics counts nothing.
func NewListener(cfg Server, name string, m *Metrics, log *slog.Logger) (*Listener, error) {
	if err := cfg.Check(); err != nil {
		return nil, err
	}
	if !cfg.Enabled() {
		return nil, errors.New("tlsconfig: no certificate configured")
	}
	if m == nil {
		m, _ = NewMetrics(nil)
	}
	if log == nil {
		log = slog.Default()
	}
	log = log.With("listener", name)
	allow, _ := ParseAllowList(cfg.Allow) // checked above
	l := &Listener{name: name, allow: allow, metrics: m, log: log}
	failed := func() { m.reloadFailures.WithLabelValues(name).Inc() }
	var err error
	l.pair, err = newReloadable(log, failed, func() (*tls.Certificate, error) {
		return loadKeyPair(cfg.Cert, cfg.Key)
	}, cfg.Cert, cfg.Key)
	if err != nil {
		return nil, err
	}
	if cfg.ClientCA != "" {
		l.cas, err = newReloadable(log, failed, func() (*x509.CertPool, error) {
			return loadPool(cfg.ClientCA)
		}, cfg.ClientCA)
		if err != nil {
			return nil, err
		}
	}
	return l, nil
}

// MutualTLS reports whether clients must present a certificate.
func (l *Listener) MutualTLS() bool { return l.cas != nil }

// Reload re-reads every file now (SIGHUP). On error the previous files stay
// in service and the error names the file.
func (l *Listener) Reload() error {
	var errs []error
	if err := l.pair.reload(); err != nil {
		errs = append(errs, err)
	}
	if l.cas != nil {
		if err := l.cas.reload(); err != nil {
			errs = append(errs, err)
		}
	}
	if err := errors.Join(errs...); err != nil {
		l.metrics.reloadFailures.WithLabelValues(l.name).Inc()
		return fmt.Errorf("listener %s: %w", l.name, err)
	}
	return nil
}

// TLSConfig is the listener's tls.Config: every handshake gets the
// certificate and client CAs in service at that moment.
func (l *Listener) TLSConfig() *tls.Config {
	return &tls.Config{
		MinVersion: tls.VersionTLS12,
		GetConfigForClient: func(*tls.ClientHelloInfo) (*tls.Config, error) {
			cfg := &tls.Config{
				MinVersion:   tls.VersionTLS12,
				Certificates: []tls.Certificate{*l.pair.current()},
			}
			if l.cas != nil {
				// Verify a certificate if sent, and refuse its absence in
				// VerifyConnection: the refusal is then told apart from a
				// bad certificate in the metrics.
				cfg.ClientAuth = tls.VerifyClientCertIfGiven
				cfg.ClientCAs = l.cas.current()
				cfg.VerifyConnection = func(cs tls.ConnectionState) error {
					if len(cs.PeerCertificates) == 0 {
						return errNoClientCertificate
					}
					return nil
				}
			}
			return cfg, nil
		},
	}
}

// GRPCServerOptions are the credentials and, with an allow-list, the
// interceptors that refuse other identities with PERMISSION_DENIED.
func (l *Listener) GRPCServerOptions() []grpc.ServerOption {
	opts := []grpc.ServerOption{grpc.Creds(&countingCreds{TransportCredentials: credentials.NewTLS(l.TLSConfig()), l: l})}
	if len(l.allow) > 0 {
		g := &guard{allow: l.allow, refused: l.metrics.refused.WithLabelValues(l.name, ReasonIdentityNotAllowed), log: l.log}
		opts = append(opts, grpc.ChainUnaryInterceptor(g.unary), grpc.ChainStreamInterceptor(g.stream))
	}
	return opts
}

// countingCreds counts failed handshakes by reason; grpc-go itself only logs
// them.
type countingCreds struct {
	credentials.TransportCredentials
	l *Listener
}

func (c *countingCreds) ServerHandshake(raw net.Conn) (net.Conn, credentials.AuthInfo, error) {
	conn, info, err := c.TransportCredentials.ServerHandshake(raw)
	if err != nil {
		reason := ReasonHandshake
		if errors.Is(err, errNoClientCertificate) {
			reason = ReasonNoClientCert
		}
		c.l.metrics.refused.WithLabelValues(c.l.name, reason).Inc()
		c.l.log.Debug("TLS handshake refused", "peer", raw.RemoteAddr().String(), "reason", reason, "err", err)
	}
	return conn, info, err
}

func (c *countingCreds) Clone() credentials.TransportCredentials {
	return &countingCreds{TransportCredentials: c.TransportCredentials.Clone(), l: c.l}
}

// verifiedLeaf is the client certificate of a verified mTLS connection.
func verifiedLeaf(ctx context.Context) (*x509.Certificate, bool) {
	info, ok := tlsInfo(ctx)
	if !ok || len(info.State.VerifiedChains) == 0 || len(info.State.VerifiedChains[0]) == 0 {
		return nil, false
	}
	return info.State.VerifiedChains[0][0], true
}
