package httpapi

import (
	"log/slog"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrelay/kvrelay/gateway"
	"github.com/kvrelay/kvrelay/testkit/kvstream"
)

// TestGatewayHTTPRefusalsOfExtraRoutesCounted: the routes a caller adds
// to the API's listener (the membership admin API, which answers 403 to
// anyone while the listener is unprotected) are refusals of the API too:
// each is counted by its code, once. The API's own refusals are counted
// once, not again by the wrapper, and a status that is no refusal
// (/readyz's 503 while no stream is open) is not counted.
func TestGatewayHTTPRefusalsOfExtraRoutesCounted(t *testing.T) {
	verifyNoLeaks(t)
	e := kvstream.Start(t)
	reg := prometheus.NewRegistry()
	g, err := gateway.New(gateway.Config{Workers: []gateway.Worker{{ID: "w", Addr: e.Addr, Model: "m"}}, Registerer: reg})
	if err != nil {
		t.Fatal(err)
	}
	admin := func(mux *http.ServeMux) {
		mux.HandleFunc("POST /v1/workers", func(w http.ResponseWriter, r *http.Request) {
			http.Error(w, "the admin API needs a protected listener", http.StatusForbidden)
		})
		mux.HandleFunc("DELETE /v1/workers", func(w http.ResponseWriter, r *http.Request) {
			w.WriteHeader(http.StatusOK)
		})
	}
	srv := httptest.NewServer(NewHandler(g, reg, slog.New(slog.DiscardHandler), Limits{MaxTokens: 10, MaxInFlight: 4, ReadTimeout: 30 * time.Second}, admin))
	defer srv.Close()
	cl := apiClient(t)
	do := func(method, path, body string) int { return status(t, cl, request(t, method, srv.URL+path, body)) }
	for _, c := range []struct {
		method, path, body string
		code               int
	}{
		{"POST", "/v1/workers", `{"worker":"grpc://h:1"}`, 403},
		{"POST", "/v1/workers", `{"worker":"grpc://h:1"}`, 403},
		{"DELETE", "/v1/workers", `{"worker":"grpc://h:1"}`, 200},
		{"POST", "/v1/route", `{"model":`, 400},
		{"PUT", "/v1/workers", ``, 405},
		{"GET", "/v2/nothing", ``, 404},
	} {
		if code := do(c.method, c.path, c.body); code != c.code {
			t.Fatalf("%s %s: %d, want %d", c.method, c.path, code, c.code)
		}
	}
	do("GET", "/readyz", ``) // 503 or 200: a status, not a refusal
	for code, want := range map[string]float64{"403": 2, "400": 1, "405": 1, "404": 1, "200": 0, "503": 0} {
		if got := rejected(t, reg, code); got != want {
			t.Errorf("rejected{code=%s} = %v, want %v", code, got, want)
		}
	}
}
