package tlsconfig

import (
	"strings"
	"testing"

	"github.com/kvrelay/kvrelay/testkit/testpki"
)

// FuzzParseAllowList: any entry is accepted or refused with an error naming
// it, never a panic; an accepted entry matches a certificate carrying exactly
// that identity.
func FuzzParseAllowList(f *testing.F) {
	for _, s := range []string{"spiffe://td/ns/a", "spiffe://td/ns/*", "uri:https://x/y", "dns:Example.org", "cn:gw", "cn:", "*", "spiffe://", "uri:/*", "dns:a*b"} {
		f.Add(s)
	}
	ca := testpki.NewCA(f, "fuzz CA")
	f.Fuzz(func(t *testing.T, entry string) {
		a, err := ParseAllowList([]string{entry})
		if err != nil {
			if !strings.Contains(err.Error(), "allow-list entry") {
				t.Fatalf("error %q does not name the entry", err)
			}
			return
		}
		if len(a) != 1 {
			t.Fatalf("%q parsed to %d entries", entry, len(a))
		}
		e := a[0]
		if e.kind != kindCN || strings.ContainsAny(e.value, "\x00") {
			return // URI and DNS identities need valid certificate syntax to issue
		}
		cert := ca.Issue(t, testpki.Leaf{CommonName: e.value}).Cert
		if cert.Subject.CommonName == e.value && !a.Permits(cert) {
			t.Fatalf("%q does not permit a certificate with CN %q", entry, e.value)
		}
	})
}

// FuzzParseTarget: an accepted target has a host and a port; nothing panics.
func FuzzParseTarget(f *testing.F) {
	for _, s := range []string{"h:1", "grpc://h:1", "grpcs://[::1]:9", "grpcs://h", "grpcs://u@h:1", "grpc://h:1/x", ":1", ""} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		addr, _, err := ParseTarget(s)
		if err != nil {
			return
		}
		if addr == "" || strings.Contains(addr, "://") {
			t.Fatalf("%q parsed to address %q", s, addr)
		}
	})
}
