package membership

import (
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"
	"time"
)

func TestAdminAPI(t *testing.T) {
	s, g, _ := newSet(t, Options{MaxWorkers: 3, DrainTimeout: time.Hour})
	if err := s.Replace(SourceStatic, workers(t, "grpc://127.0.0.1:1")); err != nil {
		t.Fatal(err)
	}
	mux := http.NewServeMux()
	RegisterAdmin(mux, s)
	srv := httptest.NewServer(mux)
	defer srv.Close()
	call := func(method, path, body string) (int, string) {
		t.Helper()
		req, err := http.NewRequest(method, srv.URL+path, strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	for _, tc := range []struct {
		name, method, path, body string
		code                     int
		says                     string
	}{
		{"add", "POST", "/v1/workers", `{"worker": "grpc://127.0.0.1:2,model=default,service=sglang"}`, 201, `"added":"grpc://127.0.0.1:2"`},
		{"add again", "POST", "/v1/workers", `{"worker": "grpc://127.0.0.1:2,service=sglang"}`, 409, "listed twice"},
		{"malformed address", "POST", "/v1/workers", `{"worker": "127.0.0.1:3"}`, 400, "want grpc://HOST:PORT"},
		{"no port", "POST", "/v1/workers", `{"worker": "grpc://127.0.0.1"}`, 400, "want grpc://HOST:PORT"},
		{"another service", "POST", "/v1/workers", `{"worker": "grpc://127.0.0.1:1,service=sglang"}`, 409, "another model or service"},
		{"not JSON", "POST", "/v1/workers", `grpc://127.0.0.1:3`, 400, "not that JSON object"},
		{"no worker", "POST", "/v1/workers", `{}`, 400, `is required`},
		{"unknown field", "POST", "/v1/workers", `{"worker": "grpc://h:1", "weight": 2}`, 400, "not that JSON object"},
		{"too big", "POST", "/v1/workers", `{"worker": "` + strings.Repeat("x", 5000) + `"}`, 413, "over 4096 bytes"},
		{"third", "POST", "/v1/workers", `{"worker": "grpc://127.0.0.1:3"}`, 201, "added"},
		{"over the cap", "POST", "/v1/workers", `{"worker": "grpc://127.0.0.1:4"}`, 507, "over the cap"},
		{"remove a static worker", "DELETE", "/v1/workers", `{"worker": "grpc://127.0.0.1:1"}`, 409, "listed by another source (static)"},
		{"remove unknown", "DELETE", "/v1/workers", `{"worker": "grpc://127.0.0.1:9"}`, 404, "not a member"},
		{"remove", "DELETE", "/v1/workers", `{"worker": "grpc://127.0.0.1:3"}`, 200, `"removed":"grpc://127.0.0.1:3"`},
		{"drain unknown", "POST", "/v1/workers/drain", `{"worker": "grpc://127.0.0.1:9"}`, 404, "not a member"},
		{"drain", "POST", "/v1/workers/drain", `{"worker": "grpc://127.0.0.1:2"}`, 202, "draining"},
	} {
		code, body := call(tc.method, tc.path, tc.body)
		if code != tc.code || !strings.Contains(body, tc.says) {
			t.Errorf("%s: %d %s, want %d saying %q", tc.name, code, body, tc.code, tc.says)
		}
	}
	// The drained worker had nothing in flight and only the admin API
	// listed it: it leaves.
	eventually(t, "the drained worker leaves", func() bool {
		return slices.Equal(gatewayWorkers(g), []string{"grpc://127.0.0.1:1"})
	})
	// Draining a worker another source lists keeps it, drained, until the
	// admin API adds it again.
	if code, body := call("POST", "/v1/workers/drain", `{"worker": "grpc://127.0.0.1:1"}`); code != 202 {
		t.Fatalf("drain static: %d %s", code, body)
	}
	eventually(t, "the static worker drained", func() bool { return g.Draining("grpc://127.0.0.1:1") })
	if got := gatewayWorkers(g); !slices.Equal(got, []string{"grpc://127.0.0.1:1"}) {
		t.Fatalf("a drained static worker left: %v", got)
	}
	if code, body := call("POST", "/v1/workers", `{"worker": "grpc://127.0.0.1:1"}`); code != 201 {
		t.Fatalf("add back: %d %s", code, body)
	}
	if g.Draining("grpc://127.0.0.1:1") {
		t.Fatal("added back, still draining")
	}
}

func TestRefusedAdminAPI(t *testing.T) {
	mux := http.NewServeMux()
	RefuseAdmin(mux, "no --web.config.file")
	srv := httptest.NewServer(mux)
	defer srv.Close()
	resp, err := http.Post(srv.URL+"/v1/workers", "application/json", strings.NewReader(`{"worker": "grpc://h:1"}`))
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 403 || !strings.Contains(string(b), "no --web.config.file") {
		t.Fatalf("%d %s", resp.StatusCode, b)
	}
}
