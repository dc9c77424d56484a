package tlsconfig

import (
	"crypto/tls"
	"testing"

	"github.com/kvrelay/kvrelay/testkit/testpki"
)

// BenchmarkHandshakeCheck is what each TLS handshake pays to notice a
// rotation: stat the certificate and key, compare, hand out the pair.
func BenchmarkHandshakeCheck(b *testing.B) {
	dir := b.TempDir()
	ca := testpki.NewCA(b, "bench CA")
	files := ca.Issue(b, testpki.Leaf{CommonName: "relay", Server: true}).WriteFiles(b, dir, "server")
	l, err := NewListener(Server{Cert: files.Cert, Key: files.Key}, "bench", nil, nil)
	if err != nil {
		b.Fatal(err)
	}
	getConfig := l.TLSConfig().GetConfigForClient
	b.ReportAllocs()
	for b.Loop() {
		if _, err := getConfig(&tls.ClientHelloInfo{}); err != nil {
			b.Fatal(err)
		}
	}
}
