package httpapi

import (
	"fmt"
	"log/slog"
	"net/http"
	"os"
	"path/filepath"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/crypto/bcrypt"

	"github.com/kvrelay/kvrelay/gateway"
	"github.com/kvrelay/kvrelay/testkit/kvstream"
)

// TestGatewayHTTPBasicAuthCoversEveryEndpoint: with a web config's
// basic_auth_users, every endpoint, the writes first, answers 401 without
// the password and serves with it. The 401s come from the web config's
// handler, before the API's: kvrelay_gateway_http_rejected_total does not
// count them (the README says so).
func TestGatewayHTTPBasicAuthCoversEveryEndpoint(t *testing.T) {
	verifyNoLeaks(t)
	e := kvstream.Start(t)
	hash, err := bcrypt.GenerateFromPassword([]byte("s3cret"), bcrypt.MinCost)
	if err != nil {
		t.Fatal(err)
	}
	cfg := filepath.Join(t.TempDir(), "web.yml")
	if err := os.WriteFile(cfg, []byte(fmt.Sprintf("basic_auth_users:\n  ops: %s\n", hash)), 0o600); err != nil {
		t.Fatal(err)
	}
	reg := prometheus.NewRegistry()
	g, err := gateway.New(gateway.Config{Workers: []gateway.Worker{{ID: "w", Addr: e.Addr, Model: "m"}}, Registerer: reg})
	if err != nil {
		t.Fatal(err)
	}
	url := serveAPI(t, slog.New(slog.DiscardHandler), g, reg, cfg, DefaultLimits)
	cl := apiClient(t)
	call := func(method, path, body, user, pass string) int {
		req := request(t, method, url+path, body)
		if user != "" {
			req.SetBasicAuth(user, pass)
		}
		return status(t, cl, req)
	}
	for _, c := range []struct{ method, path, body string }{
		{"POST", "/v1/route", `{"model":"m","token_ids":[1,2,3]}`},
		{"POST", "/v1/load", `{"loads":{"w":1}}`},
		{"POST", "/v1/done", `{"request_id":1}`},
		{"GET", "/v1/workers", ``},
		{"GET", "/metrics", ``},
		{"GET", "/healthz", ``},
		{"GET", "/readyz", ``},
	} {
		if code := call(c.method, c.path, c.body, "", ""); code != http.StatusUnauthorized {
			t.Errorf("%s %s without credentials: %d, want 401", c.method, c.path, code)
		}
		if code := call(c.method, c.path, c.body, "ops", "wrong"); code != http.StatusUnauthorized {
			t.Errorf("%s %s with a wrong password: %d, want 401", c.method, c.path, code)
		}
		if code := call(c.method, c.path, c.body, "ops", "s3cret"); code == http.StatusUnauthorized {
			t.Errorf("%s %s with the password: 401", c.method, c.path)
		}
	}
	if n := rejected(t, reg, "401"); n != 0 {
		t.Errorf("rejected{code=401} = %v: the web config's refusals reach the API after all; say so in the README", n)
	}
}
