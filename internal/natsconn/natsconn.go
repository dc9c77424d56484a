// Package natsconn turns kvrelay's NATS authentication and TLS settings
// (flags, or the keys of serve --config's "nats" block) into nats.go
// options, for every component that connects: the relay's
// JetStream sink (serve --nats), the gateway's placement sharing (gateway
// --nats) and its JetStream event source (--nats-events).
//
// Secrets never come from the command line: a password or token is read
// from a file (or the environment), a user JWT and seed from a .creds
// file, an nkey from its seed file. Every file is read again at each
// connection attempt, so a rotated credential or certificate takes effect
// at the next reconnect without a restart (the nkey's public key is the
// one exception: it is read once, the seed at each signature).
//
// A connection refused for a credential or a certificate is logged once
// as an error naming the cause, and again only when the cause changes or
// after a connection succeeded; the client keeps retrying meanwhile
// (IgnoreAuthErrorAbort: a fixed credential file is picked up without a
// restart).
package natsconn

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"flag"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"strings"
	"sync"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nkeys"

	"github.com/kvrelay/kvrelay/internal/natslog"
)

// Environment variables a password or token may come from instead of a
// file.
const (
	EnvPassword = "KVRELAY_NATS_PASSWORD"
	EnvToken    = "KVRELAY_NATS_TOKEN"
)

// Config is how to authenticate and encrypt a NATS connection. The zero
// Config connects in clear without credentials.
type Config struct {
	// Creds is a .creds file (user JWT and nkey seed, decentralized auth).
	Creds string
	// NKeySeed is an nkey user seed file.
	NKeySeed string
	// User is the user name of user/password auth; the password comes
	// from PasswordFile or $KVRELAY_NATS_PASSWORD.
	User         string
	PasswordFile string
	// TokenFile holds a token; else $KVRELAY_NATS_TOKEN when set.
	TokenFile string
	// CA is the PEM file of the CAs the server's certificate is checked
	// against; Cert and Key a client certificate (mTLS). Any of them turns
	// TLS on.
	CA, Cert, Key string
	// Names are what errors and refusal logs call each setting; the zero
	// Names is FlagNames (a --config file's block uses KeyNames).
	Names Names
	// Getenv replaces os.Getenv (tests).
	Getenv func(string) string
}

// Names are what an error calls each setting of a Config: the flag or the
// config key an operator corrects.
type Names struct {
	Creds, NKeySeed, User, PasswordFile, TokenFile, CA, Cert, Key string
}

// FlagNames are the --nats-… flags AddFlags registers.
var FlagNames = Names{
	Creds: "--nats-creds", NKeySeed: "--nats-nkey-seed", User: "--nats-user", PasswordFile: "--nats-password-file",
	TokenFile: "--nats-token-file", CA: "--nats-tls-ca", Cert: "--nats-tls-cert", Key: "--nats-tls-key",
}

// KeyNames are the keys of a config file's block whose path is prefix
// (say "nats."): creds, nkey_seed, user, password_file, token_file and
// tls.ca, tls.cert, tls.key.
func KeyNames(prefix string) Names {
	return Names{
		Creds: prefix + "creds", NKeySeed: prefix + "nkey_seed", User: prefix + "user", PasswordFile: prefix + "password_file",
		TokenFile: prefix + "token_file", CA: prefix + "tls.ca", Cert: prefix + "tls.cert", Key: prefix + "tls.key",
	}
}

func (c *Config) names() Names {
	if c.Names == (Names{}) {
		return FlagNames
	}
	return c.Names
}

// AddFlags registers the flags under their --nats-… names and returns the
// Config they fill.
func AddFlags(fs *flag.FlagSet) *Config {
	c := &Config{}
	fs.StringVar(&c.Creds, "nats-creds", "", "with --nats: a NATS .creds file (user JWT and nkey seed), read again at each connection")
	fs.StringVar(&c.NKeySeed, "nats-nkey-seed", "", "with --nats: an nkey user seed file")
	fs.StringVar(&c.User, "nats-user", "", "with --nats: user name; the password comes from --nats-password-file or $"+EnvPassword+" (never from the URL, which ps and logs show)")
	fs.StringVar(&c.PasswordFile, "nats-password-file", "", "with --nats-user: a file holding the password, read again at each connection")
	fs.StringVar(&c.TokenFile, "nats-token-file", "", "with --nats: a file holding a token, read again at each connection (or $"+EnvToken+")")
	fs.StringVar(&c.CA, "nats-tls-ca", "", "with --nats: PEM CAs to verify the NATS server's certificate with (turns TLS on)")
	fs.StringVar(&c.Cert, "nats-tls-cert", "", "with --nats: client certificate (PEM) for mutual TLS; with --nats-tls-key")
	fs.StringVar(&c.Key, "nats-tls-key", "", "with --nats-tls-cert: its private key (PEM)")
	return c
}

func (c *Config) getenv(k string) string {
	if c.Getenv != nil {
		return c.Getenv(k)
	}
	return os.Getenv(k)
}

// Set reports whether any authentication or TLS setting is given.
func (c *Config) Set() bool {
	return c.Creds != "" || c.NKeySeed != "" || c.User != "" || c.PasswordFile != "" || c.TokenFile != "" ||
		c.CA != "" || c.Cert != "" || c.Key != "" || c.getenv(EnvToken) != ""
}

// Check refuses a combination that cannot authenticate, naming the flags
// (or keys: Names).
func (c *Config) Check() error {
	k := c.names()
	n := 0
	for _, set := range []bool{c.Creds != "", c.NKeySeed != "", c.User != "", c.TokenFile != "" || c.getenv(EnvToken) != ""} {
		if set {
			n++
		}
	}
	switch {
	case n > 1:
		return fmt.Errorf("%s, %s, %s and %s (or $%s) are alternatives: give one", k.Creds, k.NKeySeed, k.User, k.TokenFile, EnvToken)
	case c.PasswordFile != "" && c.User == "":
		return fmt.Errorf("%s needs %s", k.PasswordFile, k.User)
	case c.User != "" && c.PasswordFile == "" && c.getenv(EnvPassword) == "":
		return fmt.Errorf("%s needs %s or $%s", k.User, k.PasswordFile, EnvPassword)
	case (c.Cert == "") != (c.Key == ""):
		return fmt.Errorf("%s and %s go together", k.Cert, k.Key)
	}
	return nil
}

// Options returns the nats.go options for c; append them after a
// component's own (they wrap its connect callbacks rather than replace
// them). log receives the one error line per cause of a refused
// connection. Every file is checked once now, so a missing or unreadable
// one fails at start, naming the flag.
func (c *Config) Options(log *slog.Logger) ([]nats.Option, error) {
	if err := c.Check(); err != nil {
		return nil, err
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	k := c.names()
	var opts []nats.Option
	switch {
	case c.Creds != "":
		if _, err := os.Stat(c.Creds); err != nil {
			return nil, fileError(k.Creds, c.Creds, err)
		}
		opts = append(opts, nats.UserCredentials(c.Creds))
	case c.NKeySeed != "":
		if isSeed(c.NKeySeed) {
			// Not echoed: the error reaches stderr and the log.
			return nil, fmt.Errorf("%s: the value given is an nkey seed itself, not a file holding one: write it to a file readable by kvrelay alone and give its path", k.NKeySeed)
		}
		if _, err := os.Stat(c.NKeySeed); err != nil {
			return nil, fileError(k.NKeySeed, c.NKeySeed, err)
		}
		o, err := nats.NkeyOptionFromSeed(c.NKeySeed)
		if err != nil {
			return nil, fmt.Errorf("%s %s: %w", k.NKeySeed, c.NKeySeed, err)
		}
		opts = append(opts, o)
	case c.User != "":
		password := func() (string, error) {
			if c.PasswordFile == "" {
				return c.getenv(EnvPassword), nil
			}
			return readSecret(c.PasswordFile)
		}
		if _, err := password(); err != nil {
			return nil, fileError(k.PasswordFile, c.PasswordFile, err)
		}
		opts = append(opts, nats.UserInfoHandler(func() (string, string) {
			p, err := password()
			if err != nil {
				log.Error("nats: cannot read the password file; connecting without a password", "file", c.PasswordFile, "err", err)
			}
			return c.User, p
		}))
	case c.TokenFile != "" || c.getenv(EnvToken) != "":
		token := func() (string, error) {
			if c.TokenFile == "" {
				return c.getenv(EnvToken), nil
			}
			return readSecret(c.TokenFile)
		}
		if _, err := token(); err != nil {
			return nil, fileError(k.TokenFile, c.TokenFile, err)
		}
		opts = append(opts, nats.TokenHandler(func() string {
			t, err := token()
			if err != nil {
				log.Error("nats: cannot read the token file; connecting without a token", "file", c.TokenFile, "err", err)
			}
			return t
		}))
	}
	if c.CA != "" || c.Cert != "" {
		var certCB nats.TLSCertHandler
		var caCB nats.RootCAsHandler
		if c.Cert != "" {
			certCB = func() (tls.Certificate, error) {
				cert, err := tls.LoadX509KeyPair(c.Cert, c.Key)
				if err != nil {
					return tls.Certificate{}, fmt.Errorf("%s/%s: %w", k.Cert, k.Key, err)
				}
				return cert, nil
			}
		}
		if c.CA != "" {
			caCB = func() (*x509.CertPool, error) {
				pem, err := os.ReadFile(c.CA)
				if err != nil {
					return nil, fmt.Errorf("%s: %w", k.CA, err)
				}
				pool := x509.NewCertPool()
				if !pool.AppendCertsFromPEM(pem) {
					return nil, fmt.Errorf("%s %s: no PEM certificate in it", k.CA, c.CA)
				}
				return pool, nil
			}
		}
		// Both are called now (a bad file fails at start, naming its flag)
		// and then at every handshake (a renewed certificate is used at
		// the next connection).
		if certCB != nil {
			if _, err := certCB(); err != nil {
				return nil, err
			}
		}
		if caCB != nil {
			if _, err := caCB(); err != nil {
				return nil, err
			}
		}
		opts = append(opts, nats.ClientTLSConfig(certCB, caCB))
	}
	opts = append(opts, nats.IgnoreAuthErrorAbort(), k.failures(log))
	return opts, nil
}

// fileError is the error of setting name's file at path. A path without
// a directory that names no file is not printed: it may be the secret
// itself, given where its file goes (--nats-token-file "$TOKEN"), and the
// error reaches stderr and the log.
func fileError(name, path string, err error) error {
	if errors.Is(err, fs.ErrNotExist) && !strings.ContainsAny(path, `/\`) {
		return fmt.Errorf("%s: the value given names no file here (not shown: it may be the secret itself; give the path of the file holding it): %w", name, fs.ErrNotExist)
	}
	return fmt.Errorf("%s: %w", name, err)
}

// isSeed reports whether v is an nkey seed rather than the path of a file
// holding one (no such file, and it decodes as a seed).
func isSeed(v string) bool {
	if _, err := os.Stat(v); err == nil {
		return false
	}
	kp, err := nkeys.FromSeed([]byte(v))
	if err != nil {
		return false
	}
	kp.Wipe()
	return true
}

// readSecret reads a one-line secret file, without its line end.
func readSecret(path string) (string, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return "", err
	}
	s := strings.TrimRight(string(b), "\r\n")
	if s == "" {
		return "", fmt.Errorf("%s is empty", path)
	}
	return s, nil
}

// failures is the option that logs a refused connection once per cause:
// at ERROR, with the cause named (an authorization violation, an expired
// or untrusted certificate, a refused dial) in n's words, the URL in it
// redacted. It wraps the connect, reconnect and error callbacks set before
// it.
func (n Names) failures(log *slog.Logger) nats.Option {
	f := &failureLog{log: log, names: n}
	return func(o *nats.Options) error {
		prevErr, prevConn, prevReconn, prevAsync := o.ReconnectErrCB, o.ConnectedCB, o.ReconnectedCB, o.AsyncErrorCB
		o.ReconnectErrCB = func(nc *nats.Conn, err error) {
			f.report(err)
			if prevErr != nil {
				prevErr(nc, err)
			}
		}
		o.ConnectedCB = func(nc *nats.Conn) {
			f.reset()
			if prevConn != nil {
				prevConn(nc)
			}
		}
		o.ReconnectedCB = func(nc *nats.Conn) {
			f.reset()
			if prevReconn != nil {
				prevReconn(nc)
			}
		}
		o.AsyncErrorCB = func(nc *nats.Conn, sub *nats.Subscription, err error) {
			if isAuth(err) {
				f.report(err)
			}
			if prevAsync != nil {
				prevAsync(nc, sub, err)
			}
		}
		return nil
	}
}

type failureLog struct {
	log   *slog.Logger
	names Names
	mu    sync.Mutex
	last  string
}

func (f *failureLog) report(err error) {
	if err == nil {
		return
	}
	// Once per cause, not per text: the text of one cause varies from
	// attempt to attempt (ports, the side that noticed first).
	cause := f.names.cause(err)
	f.mu.Lock()
	same := cause == f.last
	f.last = cause
	f.mu.Unlock()
	if same {
		return
	}
	f.log.Error("nats: connection refused; retrying", "cause", cause, "err", natslog.Redact(err.Error()))
}

func (f *failureLog) reset() {
	f.mu.Lock()
	f.last = ""
	f.mu.Unlock()
}

func isAuth(err error) bool {
	return errors.Is(err, nats.ErrAuthorization) || errors.Is(err, nats.ErrAuthExpired) ||
		errors.Is(err, nats.ErrAuthRevoked) || errors.Is(err, nats.ErrAccountAuthExpired)
}

// cause names why a connection failed, in words an operator acts on,
// naming the settings as n does.
func (n Names) cause(err error) string {
	var unknownAuthority x509.UnknownAuthorityError
	var hostname x509.HostnameError
	var invalid x509.CertificateInvalidError
	var verify *tls.CertificateVerificationError
	var alert tls.AlertError
	switch {
	case errors.Is(err, nats.ErrAuthorization):
		return "credentials refused by the server (authorization violation): check " + n.Creds + ", " + n.NKeySeed + ", " + n.User + "/" + n.PasswordFile + " or " + n.TokenFile
	case errors.Is(err, nats.ErrAuthExpired), errors.Is(err, nats.ErrAccountAuthExpired):
		return "credentials expired"
	case errors.Is(err, nats.ErrAuthRevoked):
		return "credentials revoked"
	case errors.As(err, &unknownAuthority):
		return "the server's certificate is not signed by a CA in " + n.CA
	case errors.As(err, &hostname):
		return "the server's certificate does not name the host dialled"
	case errors.As(err, &invalid):
		return "the server's certificate is invalid (expired or not yet valid?)"
	case errors.As(err, &verify):
		return "the server's certificate failed verification"
	case errors.As(err, &alert), strings.Contains(err.Error(), "tls: "), strings.Contains(err.Error(), "tls error"):
		return "TLS handshake refused (a client certificate the server does not accept, or none given?)"
	case errors.Is(err, nats.ErrSecureConnRequired):
		return "the server requires TLS: give " + n.CA
	case errors.Is(err, nats.ErrSecureConnWanted):
		return "TLS asked for but the server does not offer it"
	case errors.Is(err, nats.ErrNoServers):
		return "no server reachable"
	}
	return "connection failed"
}
