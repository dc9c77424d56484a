package webserve

import (
	"os"
	"path/filepath"
	"testing"
)

func TestAuthenticates(t *testing.T) {
	for _, tc := range []struct {
		name, config string
		want         bool
		err          bool
	}{
		{"basic auth", "basic_auth_users:\n  ops: $2y$10$abc\n", true, false},
		{"client certificates required", "tls_server_config:\n  cert_file: c\n  key_file: k\n  client_auth_type: RequireAndVerifyClientCert\n", true, false},
		{"TLS without client certificates", "tls_server_config:\n  cert_file: c\n  key_file: k\n", false, false},
		{"client certificates only asked for", "tls_server_config:\n  client_auth_type: VerifyClientCertIfGiven\n", false, false},
		{"empty", "", false, false},
		{"not YAML", "basic_auth_users: [\n", false, true},
	} {
		path := filepath.Join(t.TempDir(), "web.yml")
		if err := os.WriteFile(path, []byte(tc.config), 0o600); err != nil {
			t.Fatal(err)
		}
		got, err := Authenticates(path)
		if got != tc.want || (err != nil) != tc.err {
			t.Errorf("%s: %v, %v; want %v, error %v", tc.name, got, err, tc.want, tc.err)
		}
	}
	if got, err := Authenticates(""); got || err != nil {
		t.Errorf("no config: %v, %v", got, err)
	}
	if _, err := Authenticates(filepath.Join(t.TempDir(), "missing")); err == nil {
		t.Error("a missing file is not an error")
	}
}
