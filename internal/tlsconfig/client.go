package tlsconfig

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/url"
	"strconv"
	"strings"

	"google.golang.org/grpc/credentials"
)

// Client is the TLS settings of a connection kvrelay makes.
type Client struct {
	// CA is a PEM bundle that verifies the server; empty: the system roots.
	CA string `json:"ca"`
	// Cert and Key are the client certificate for servers that ask for one.
	Cert string `json:"cert"`
	Key  string `json:"key"`
	// ServerName overrides the name the server certificate must carry
	// (default: the host of the address).
	ServerName string `json:"server_name"`
}

// Set reports whether any setting is given.
func (c Client) Set() bool { return c != Client{} }

// Check validates the combination of settings without reading files.
func (c Client) Check() error {
	if (c.Cert == "") != (c.Key == "") {
		return errNoKey
	}
	return nil
}

// Dialer is a built client-side TLS. The CA bundle and the client
// certificate are re-read when their files change (checked at each
// handshake) or on Reload, so a rotated trust bundle (SPIFFE bundles rotate)
// applies to the next connection.
type Dialer struct {
	roots *reloadable[*x509.CertPool] // nil: system roots
	pair  *reloadable[*tls.Certificate]
	name  string
}

// NewDialer loads c's files.
func NewDialer(c Client, log *slog.Logger) (*Dialer, error) {
	if err := c.Check(); err != nil {
		return nil, err
	}
	if log == nil {
		log = slog.Default()
	}
	d := &Dialer{name: c.ServerName}
	if c.CA != "" {
		var err error
		d.roots, err = newReloadable(log, func() {}, func() (*x509.CertPool, error) {
			return loadPool(c.CA)
		}, c.CA)
		if err != nil {
			return nil, err
		}
	}
	if c.Cert != "" {
		var err error
		d.pair, err = newReloadable(log, func() {}, func() (*tls.Certificate, error) {
			return loadKeyPair(c.Cert, c.Key)
		}, c.Cert, c.Key)
		if err != nil {
			return nil, err
		}
	}
	return d, nil
}

// TLSConfig is the client's tls.Config with the CA bundle in service now;
// the client certificate is looked up at each handshake.
func (d *Dialer) TLSConfig() *tls.Config {
	cfg := &tls.Config{MinVersion: tls.VersionTLS12, ServerName: d.name}
	if d.roots != nil {
		cfg.RootCAs = d.roots.current()
	}
	if d.pair != nil {
		cfg.GetClientCertificate = func(*tls.CertificateRequestInfo) (*tls.Certificate, error) {
			return d.pair.current(), nil
		}
	}
	return cfg
}

// Credentials are the gRPC transport credentials. Each handshake builds its
// TLS config anew, so it verifies with the CA bundle in service at that
// moment (standard verification; nothing is skipped).
func (d *Dialer) Credentials() credentials.TransportCredentials {
	return &dialerCreds{TransportCredentials: credentials.NewTLS(d.TLSConfig()), d: d}
}

type dialerCreds struct {
	credentials.TransportCredentials // Info, and the server side (unused)
	d                                *Dialer
}

func (c *dialerCreds) ClientHandshake(ctx context.Context, authority string, raw net.Conn) (net.Conn, credentials.AuthInfo, error) {
	return credentials.NewTLS(c.d.TLSConfig()).ClientHandshake(ctx, authority, raw)
}

func (c *dialerCreds) Clone() credentials.TransportCredentials {
	return &dialerCreds{TransportCredentials: c.TransportCredentials.Clone(), d: c.d}
}

// Reload re-reads the CA bundle and the client certificate now (SIGHUP).
func (d *Dialer) Reload() error {
	var errs []error
	if d.roots != nil {
		if err := d.roots.reload(); err != nil {
			errs = append(errs, err)
		}
	}
	if d.pair != nil {
		if err := d.pair.reload(); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// ParseTarget reads a gRPC address: HOST:PORT or grpc://HOST:PORT (plaintext)
// or grpcs://HOST:PORT (TLS).
func ParseTarget(v string) (addr string, useTLS bool, err error) {
	addr = v
	if scheme, rest, ok := strings.Cut(v, "://"); ok {
		switch scheme {
		case "grpc", "grpcs":
		default:
			return "", false, fmt.Errorf("%q: scheme %q: want grpc:// or grpcs://", v, scheme)
		}
		u, err := url.Parse(v)
		if err != nil {
			return "", false, fmt.Errorf("%q: %w", v, err)
		}
		if u.Path != "" || u.RawQuery != "" || u.User != nil || u.Fragment != "" || u.Host != rest {
			return "", false, fmt.Errorf("%q: want %s://HOST:PORT with nothing after the port", v, scheme)
		}
		addr, useTLS = u.Host, scheme == "grpcs"
	}
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return "", false, fmt.Errorf("%q: want HOST:PORT, grpc://HOST:PORT or grpcs://HOST:PORT: %w", v, err)
	}
	if n, perr := strconv.ParseUint(port, 10, 16); host == "" || perr != nil || n == 0 {
		return "", false, fmt.Errorf("%q: want HOST:PORT with a host and a port from 1 to 65535", v)
	}
	return addr, useTLS, nil
}

// errClientTLSWithoutTLS is returned when TLS client files are given for a
// plaintext target: silently ignoring them would leave the operator believing
// the connection is encrypted.
var errClientTLSWithoutTLS = errors.New("TLS client settings are given but the address is plaintext (use grpcs://HOST:PORT)")

// ClientFor returns the credentials for a target: nil for plaintext, an error
// when TLS settings come with a plaintext target.
func ClientFor(c Client, useTLS bool, log *slog.Logger) (*Dialer, error) {
	if !useTLS {
		if c.Set() {
			return nil, errClientTLSWithoutTLS
		}
		return nil, nil
	}
	return NewDialer(c, log)
}
