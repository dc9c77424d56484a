package httpapi

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/goleak"

	"github.com/kvrelay/kvrelay/gateway"
	"github.com/kvrelay/kvrelay/gateway/monitor"
	"github.com/kvrelay/kvrelay/testkit/apiclient"
	"github.com/kvrelay/kvrelay/testkit/kvstream"
)

// httpRig is the HTTP API over a running gateway with two fake engines.
type httpRig struct {
	a, b *kvstream.Engine
	g    *gateway.Gateway
	srv  *httptest.Server
	idA  string
	idB  string
}

func newHTTPRig(t *testing.T) *httpRig { return newHTTPRigWith(t, true) }

func newHTTPRigWith(t *testing.T, noPlacements bool) *httpRig {
	t.Helper()
	a, b := kvstream.Start(t), kvstream.Start(t)
	reg := prometheus.NewRegistry()
	idA, idB := "grpc://"+a.Addr, "grpc://"+b.Addr
	g, err := gateway.New(gateway.Config{
		Workers: []gateway.Worker{
			{ID: idA, Addr: a.Addr, Model: "llama"},
			{ID: idB, Addr: b.Addr, Model: "llama"},
		},
		Registerer: reg,
		// The rig's tests are about the event path and the loads; the
		// routes they poll with would otherwise place their prompts.
		NoPlacements: noPlacements,
	})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = g.Run(ctx) }()
	srv := httptest.NewServer(NewHandler(g, reg, slog.New(slog.DiscardHandler), DefaultLimits))
	t.Cleanup(func() {
		srv.Close()
		cancel()
		<-done
	})
	return &httpRig{a: a, b: b, g: g, srv: srv, idA: idA, idB: idB}
}

func TestGatewayHTTP(t *testing.T) {
	verifyNoLeaks(t)
	r := newHTTPRig(t)
	prompt := kvstream.SeqTokens(100, 64)
	r.b.Batches <- kvstream.StoreTokens(1, 16, prompt)
	deadline := time.Now().Add(10 * time.Second)
	var out map[string]any
	for {
		var code int
		code, out = apiclient.Post(t, r.srv.URL+"/v1/route", `{"model":"llama","token_ids":`+apiclient.TokensJSON(prompt)+`}`)
		if code != http.StatusOK {
			t.Fatalf("route: %d %v", code, out)
		}
		if out["reason"] == "event_hit" || time.Now().After(deadline) {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	if out["worker"] != r.idB || out["reason"] != "event_hit" || out["block_size"] != float64(16) {
		t.Fatalf("route answer %v", out)
	}
	if m, _ := out["matched_blocks"].(map[string]any); m[r.idB] != float64(4) {
		t.Errorf("matched_blocks %v", out["matched_blocks"])
	}

	// Loads in the body are recorded and steer the choice: B is far over
	// the fleet mean, so the request spills to A.
	code, out := apiclient.Post(t, r.srv.URL+"/v1/route", `{"model":"llama","token_ids":`+apiclient.TokensJSON(prompt)+`,"loads":{"`+r.idB+`":400,"`+r.idA+`":0}}`)
	if code != 200 || out["worker"] != r.idA || out["reason"] != "event_spill" {
		t.Errorf("spill: %d %v", code, out)
	}
	// A separate load report brings B back under the gate.
	code, out = apiclient.Post(t, r.srv.URL+"/v1/load", `{"loads":{"`+r.idB+`":1}}`)
	if code != 200 || out["accepted"] != float64(1) {
		t.Errorf("load: %d %v", code, out)
	}
	code, out = apiclient.Post(t, r.srv.URL+"/v1/route", `{"model":"llama","token_ids":`+apiclient.TokensJSON(prompt)+`}`)
	if code != 200 || out["worker"] != r.idB {
		t.Errorf("after load report: %d %v", code, out)
	}

	bad := []struct {
		path, body string
		code       int
		want       string
	}{
		{"/v1/route", `{"model":"llama"`, 400, "bad JSON"},
		{"/v1/route", ``, 400, "empty body"},
		{"/v1/route", `{"model":"llama"}`, 400, "token_ids"},
		{"/v1/route", `{"model":"llama","token_ids":[1,-2]}`, 400, "bad JSON"},
		{"/v1/route", `{"model":"llama","token_ids":[4294967296]}`, 400, "bad JSON"},
		{"/v1/route", `{"model":"llama","token_ids":"abc"}`, 400, "bad JSON"},
		{"/v1/route", `{"model":"llama","token_ids":[1]} {}`, 400, "trailing"},
		{"/v1/route", `{"model":"llama","token_ids":[1],"loads":{"grpc://nope:1":1}}`, 400, "unknown worker"},
		{"/v1/route", `{"model":"llama","token_ids":[1],"loads":{"` + r.idA + `":-1}}`, 400, "≥ 0"},
		{"/v1/route", `{"model":"mistral","token_ids":[1]}`, 404, "unknown model"},
		{"/v1/load", `{}`, 400, "loads"},
		{"/v1/load", `{"loads":{"x":1}}`, 400, "unknown worker"},
		{"/v1/load", `[1]`, 400, "bad JSON"},
	}
	for _, tt := range bad {
		code, out := apiclient.Post(t, r.srv.URL+tt.path, tt.body)
		msg, _ := out["error"].(string)
		if code != tt.code || !strings.Contains(msg, tt.want) {
			t.Errorf("%s %s: %d %q, want %d mentioning %q", tt.path, tt.body, code, msg, tt.code, tt.want)
		}
	}

	// Workers: stream state and cursor.
	resp, err := http.Get(r.srv.URL + "/v1/workers")
	if err != nil {
		t.Fatal(err)
	}
	var workers struct {
		Workers []gateway.WorkerStatus `json:"workers"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&workers); err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if len(workers.Workers) != 2 {
		t.Fatalf("workers %+v", workers)
	}
	for _, w := range workers.Workers {
		if w.State != monitor.StateStreaming || w.Model != "llama" {
			t.Errorf("worker %+v", w)
		}
		if w.ID == r.idB && (len(w.Ranks) != 1 || w.Ranks[0].Cursor != 1 || w.IndexBlocks != 4 || w.Inflight != 1) {
			t.Errorf("worker B %+v", w)
		}
	}

	// Metrics.
	resp, err = http.Get(r.srv.URL + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	for _, name := range []string{"kvrelay_gateway_batches_total", "kvrelay_gateway_subscriptions_total", "kvrelay_gateway_route_decisions_total", "kvrelay_gateway_index_blocks"} {
		if !bytes.Contains(body, []byte(name)) {
			t.Errorf("/metrics lacks %s", name)
		}
	}

	// Wrong method.
	resp, err = http.Get(r.srv.URL + "/v1/route")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusMethodNotAllowed {
		t.Errorf("GET /v1/route: %d", resp.StatusCode)
	}

	// No workers left for the model: 503.
	for _, id := range []string{r.idA, r.idB} {
		if err := r.g.RemoveWorker(id); err != nil {
			t.Fatal(err)
		}
	}
	code, out = apiclient.Post(t, r.srv.URL+"/v1/route", `{"model":"llama","token_ids":[1,2,3]}`)
	if code != http.StatusServiceUnavailable {
		t.Errorf("no workers: %d %v", code, out)
	}
}

// TestGatewayHTTPTracked: a tracked route counts in its worker's in-flight
// load until POST /v1/done names it.
func TestGatewayHTTPTracked(t *testing.T) {
	verifyNoLeaks(t)
	r := newHTTPRig(t)
	routed := func() map[string]int {
		out := map[string]int{}
		for _, w := range r.g.Workers() {
			out[w.ID] = w.Routed
		}
		return out
	}
	code, out := apiclient.Post(t, r.srv.URL+"/v1/route", `{"model":"llama","token_ids":[1,2,3],"track":true}`)
	id, _ := out["request_id"].(float64)
	if code != http.StatusOK || id == 0 {
		t.Fatalf("tracked route: %d %v", code, out)
	}
	worker, _ := out["worker"].(string)
	if got := routed(); got[worker] != 1 {
		t.Errorf("routed in flight %v after a tracked route to %s", got, worker)
	}
	if _, out := apiclient.Post(t, r.srv.URL+"/v1/route", `{"model":"llama","token_ids":[1,2,3]}`); out["request_id"] != nil {
		t.Errorf("untracked route answered with an id: %v", out)
	}
	done := fmt.Sprintf(`{"request_id":%d}`, uint64(id))
	if code, out := apiclient.Post(t, r.srv.URL+"/v1/done", done); code != http.StatusOK || out["completed"] != true {
		t.Errorf("done: %d %v", code, out)
	}
	if got := routed(); got[worker] != 0 {
		t.Errorf("routed in flight %v after done", got)
	}
	bad := []struct {
		body string
		code int
		want string
	}{
		{done, http.StatusNotFound, "unknown or completed request"},
		{`{}`, http.StatusBadRequest, "request_id"},
		{`{"request_id":-1}`, http.StatusBadRequest, "bad JSON"},
		{`{"request_id":"7"}`, http.StatusBadRequest, "bad JSON"},
	}
	for _, tt := range bad {
		code, out := apiclient.Post(t, r.srv.URL+"/v1/done", tt.body)
		msg, _ := out["error"].(string)
		if code != tt.code || !strings.Contains(msg, tt.want) {
			t.Errorf("/v1/done %s: %d %q, want %d mentioning %q", tt.body, code, msg, tt.code, tt.want)
		}
	}
}

// verifyNoLeaks checks, after every cleanup of the test (cleanups run last
// registered first), that the test left no goroutine behind.
func verifyNoLeaks(t *testing.T) {
	opt := goleak.IgnoreCurrent()
	t.Cleanup(func() {
		// http.Get's keep-alive connections idle in the shared default
		// transport's pool until it closes them: the pool's, not a leak
		// of the test (a leaked request still shows as an active one).
		http.DefaultClient.CloseIdleConnections()
		goleak.VerifyNone(t, opt)
	})
}

// FuzzRouteBody: any /v1/route body gets a JSON answer with a status the API
// documents, never a panic.
func FuzzRouteBody(f *testing.F) {
	for _, s := range []string{
		`{"model":"m","token_ids":[1,2,3]}`,
		`{"model":"m","token_ids":[],"loads":{"grpc://h:1":3}}`,
		`{"model":"x","token_ids":[1]}`,
		`{"token_ids":null}`,
		`{"model":"m","token_ids":[1],"lora_name":"a","cache_salt":"b"}`,
		`[`, ``,
	} {
		f.Add([]byte(s))
	}
	g, err := gateway.New(gateway.Config{Workers: []gateway.Worker{{ID: "grpc://h:1", Addr: "h:1", Model: "m"}}})
	if err != nil {
		f.Fatal(err)
	}
	h := NewHandler(g, prometheus.NewRegistry(), slog.New(slog.DiscardHandler), DefaultLimits)
	f.Fuzz(func(t *testing.T, body []byte) {
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, httptest.NewRequest(http.MethodPost, "/v1/route", bytes.NewReader(body)))
		switch rec.Code {
		case http.StatusOK, http.StatusBadRequest, http.StatusNotFound, http.StatusServiceUnavailable, http.StatusRequestEntityTooLarge:
		default:
			t.Fatalf("status %d for %q", rec.Code, body)
		}
		var out map[string]any
		if err := json.Unmarshal(rec.Body.Bytes(), &out); err != nil {
			t.Fatalf("answer is not JSON: %q", rec.Body.String())
		}
		if rec.Code == http.StatusOK && out["worker"] != "grpc://h:1" {
			t.Fatalf("routed to %v", out["worker"])
		}
	})
}

// TestGatewayHTTPPlacements: a prompt routed before any event is routed
// again to the same worker (placement_hit), by token ids or, for a client
// without a tokenizer, by text; a body with neither is a 400.
func TestGatewayHTTPPlacements(t *testing.T) {
	verifyNoLeaks(t)
	r := newHTTPRigWith(t, false)
	system := strings.Repeat("Be brief. ", 40)
	for _, body := range []string{
		`{"model":"llama","token_ids":` + apiclient.TokensJSON(kvstream.SeqTokens(500, 64)) + `,"track":true}`,
		`{"model":"llama","text":"` + system + `","track":true}`,
	} {
		code, first := apiclient.Post(t, r.srv.URL+"/v1/route", body)
		if code != 200 || first["reason"] != "no_overlap" {
			t.Fatalf("first route: %d %v", code, first)
		}
		code, again := apiclient.Post(t, r.srv.URL+"/v1/route", body)
		if code != 200 || again["reason"] != "placement_hit" || again["worker"] != first["worker"] {
			t.Errorf("second route: %d %v, want placement_hit on %v", code, again, first["worker"])
		}
	}
	code, out := apiclient.Post(t, r.srv.URL+"/v1/route", `{"model":"llama"}`)
	if code != 400 || !strings.Contains(fmt.Sprint(out), `"text"`) {
		t.Errorf("neither token_ids nor text: %d %v", code, out)
	}
}
