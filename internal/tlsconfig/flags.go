package tlsconfig

import (
	"flag"
	"strings"
)

// RegisterServerFlags adds --tls-cert, --tls-key, --tls-client-ca and
// --tls-allow (repeatable or comma-separated) for a gRPC listener.
func RegisterServerFlags(fs *flag.FlagSet, s *Server) {
	fs.StringVar(&s.Cert, "tls-cert", "", "PEM server certificate for the gRPC listener (with --tls-key; empty: plaintext)")
	fs.StringVar(&s.Key, "tls-key", "", "PEM key of --tls-cert")
	fs.StringVar(&s.ClientCA, "tls-client-ca", "", "PEM CA bundle; when set, clients must present a certificate it signed (mTLS)")
	fs.Func("tls-allow", "client identity allowed under mTLS: spiffe://…, uri:URI, dns:NAME or cn:NAME (repeat or comma-separate; empty: any client the CA signed)", func(v string) error {
		for _, e := range strings.Split(v, ",") {
			if e = strings.TrimSpace(e); e != "" {
				s.Allow = append(s.Allow, e)
			}
		}
		return nil
	})
}

// RegisterClientFlags adds --PREFIXca, --PREFIXcert, --PREFIXkey and
// --PREFIXserver-name; what names the peer in the help.
func RegisterClientFlags(fs *flag.FlagSet, prefix, what string, c *Client) {
	fs.StringVar(&c.CA, prefix+"ca", "", "PEM CA bundle that verifies "+what+" over grpcs:// (empty: system roots)")
	fs.StringVar(&c.Cert, prefix+"cert", "", "PEM client certificate presented to "+what+" (with --"+prefix+"key)")
	fs.StringVar(&c.Key, prefix+"key", "", "PEM key of --"+prefix+"cert")
	fs.StringVar(&c.ServerName, prefix+"server-name", "", "name "+what+"'s certificate must carry (default: the address's host)")
}
