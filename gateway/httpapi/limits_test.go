package httpapi

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrelay/kvrelay/gateway"
	"github.com/kvrelay/kvrelay/gateway/monitor"
	"github.com/kvrelay/kvrelay/testkit/apiclient"
	"github.com/kvrelay/kvrelay/testkit/kvstream"
)

// limitedGateway serves the gateway's HTTP API with lim through
// Serve (the real server settings) on loopback.
func limitedGateway(t *testing.T, lim Limits, workers ...gateway.Worker) (url string, g *gateway.Gateway) {
	t.Helper()
	url, g, _ = servedGateway(t, gateway.Config{Workers: workers}, lim, slog.New(slog.DiscardHandler))
	return url, g
}

// servedGateway is limitedGateway with a gateway config and a log, also
// returning the registry.
func servedGateway(t *testing.T, cfg gateway.Config, lim Limits, log *slog.Logger) (url string, g *gateway.Gateway, reg *prometheus.Registry) {
	t.Helper()
	reg = prometheus.NewRegistry()
	cfg.Monitor = monitor.Options{InitialBackoff: 20 * time.Millisecond, MaxBackoff: 50 * time.Millisecond}
	cfg.Registerer = reg
	g, err := gateway.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return serveAPI(t, log, g, reg, "", lim), g, reg
}

// serveAPI runs Serve for g with webConfig and lim on a loopback listener
// until the test ends, and returns the API's URL.
func serveAPI(t *testing.T, log *slog.Logger, g *gateway.Gateway, reg *prometheus.Registry, webConfig string, lim Limits) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- Serve(ctx, log, g, reg, ln, webConfig, lim) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Serve: %v", err)
		}
	})
	return "http://" + ln.Addr().String()
}

// apiClient is a client on a transport of its own, whose idle connections
// are closed when the test ends.
func apiClient(t *testing.T) *http.Client {
	tr := &http.Transport{}
	t.Cleanup(tr.CloseIdleConnections)
	return &http.Client{Transport: tr}
}

// request is a request of method to url with body.
func request(t *testing.T, method, url, body string) *http.Request {
	t.Helper()
	req, err := http.NewRequest(method, url, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	return req
}

// status sends req on cl and returns the answer's status; the answer's
// body is read to its end and dropped.
func status(t *testing.T, cl *http.Client, req *http.Request) int {
	t.Helper()
	resp, err := cl.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	return resp.StatusCode
}

func TestGatewayHTTPBoundsAndMessages(t *testing.T) {
	verifyNoLeaks(t)
	e := kvstream.Start(t)
	id := "grpc://" + e.Addr
	lim := Limits{MaxTokens: 1000, MaxInFlight: 4, ReadTimeout: 30 * time.Second}
	url, _ := limitedGateway(t, lim, gateway.Worker{ID: id, Addr: e.Addr, Model: "m"})

	big := `{"model":"m","token_ids":[` + strings.Repeat("1,", int(lim.bodyLimit()/2)) + `1]}`
	many := `{"model":"m","token_ids":[` + strings.Repeat("1,", lim.MaxTokens) + `1]}`
	tests := []struct {
		name, body string
		code       int
		want       string
	}{
		{"body over the bound", big, http.StatusRequestEntityTooLarge, "--max-request-tokens"},
		{"more tokens than the bound", many, http.StatusRequestEntityTooLarge, "1001 tokens"},
		{"a string for the token array", `{"model":"m","token_ids":"abc"}`, http.StatusBadRequest, `"token_ids": want an array, got string`},
		{"a negative token id", `{"model":"m","token_ids":[1,-2]}`, http.StatusBadRequest, `"token_ids.1": want an integer 0..4294967295, got number -2`},
		{"an array for the body", `[1]`, http.StatusBadRequest, "want a JSON object, got array"},
		{"a syntax error", `{"model":}`, http.StatusBadRequest, "invalid character"},
		{"within the bounds", `{"model":"m","token_ids":[1,2,3]}`, http.StatusOK, ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			code, out := apiclient.Post(t, url+"/v1/route", tt.body)
			msg, _ := out["error"].(string)
			if code != tt.code || !strings.Contains(msg, tt.want) {
				t.Fatalf("%d %q, want %d with %q", code, msg, tt.code, tt.want)
			}
			for _, internal := range []string{"Go struct", "Go value", "routeRequest", "main.", "uint32"} {
				if strings.Contains(msg, internal) {
					t.Fatalf("the message %q shows Go internals (%q)", msg, internal)
				}
			}
		})
	}
}

func TestGatewayHTTPCapsRequestsInFlight(t *testing.T) {
	verifyNoLeaks(t)
	e := kvstream.Start(t)
	lim := Limits{MaxTokens: 1000, MaxInFlight: 1, ReadTimeout: 30 * time.Second}
	url, _ := limitedGateway(t, lim, gateway.Worker{ID: "w", Addr: e.Addr, Model: "m"})
	// One request whose body is still arriving holds the only slot.
	body, feed := io.Pipe()
	held := make(chan int, 1)
	go func() {
		resp, err := http.Post(url+"/v1/route", "application/json", body)
		if err != nil {
			held <- -1
			return
		}
		resp.Body.Close()
		held <- resp.StatusCode
	}()
	if _, err := feed.Write([]byte(`{"model":"m",`)); err != nil {
		t.Fatal(err)
	}
	// Poll until the held request is inside the handler: then the next is refused.
	deadline := time.Now().Add(20 * time.Second)
	for {
		resp, err := http.Post(url+"/v1/route", "application/json", strings.NewReader(`{"model":"m","token_ids":[1]}`))
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode == http.StatusServiceUnavailable {
			if resp.Header.Get("Retry-After") == "" {
				t.Fatal("a refused request is not told when to retry")
			}
			break
		}
		select {
		case code := <-held:
			// Not the bound's failure: the request meant to hold the
			// slot is gone (seen once under a loaded -race run).
			t.Fatalf("the request holding the slot ended before the bound was seen (%d)", code)
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("requests beyond --max-inflight-requests still served (%d)", resp.StatusCode)
		}
		time.Sleep(10 * time.Millisecond)
	}
	_, _ = feed.Write([]byte(`"token_ids":[1]}`))
	_ = feed.Close()
	if code := <-held; code != http.StatusOK {
		t.Fatalf("the held request ended %d", code)
	}
}

func TestGatewayHTTPEndsABodyThatTricklesIn(t *testing.T) {
	verifyNoLeaks(t)
	e := kvstream.Start(t)
	lim := Limits{MaxTokens: 1000, MaxInFlight: 4, ReadTimeout: 300 * time.Millisecond}
	url, _ := limitedGateway(t, lim, gateway.Worker{ID: "w", Addr: e.Addr, Model: "m"})
	conn, err := net.Dial("tcp", strings.TrimPrefix(url, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	fmt.Fprintf(conn, "POST /v1/route HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{")
	// Send nothing more. The server must give up on the body by itself.
	_ = conn.SetReadDeadline(time.Now().Add(30 * time.Second))
	resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
	if err == nil {
		resp.Body.Close()
		if resp.StatusCode < 400 {
			t.Fatalf("a request whose body never came answered %d", resp.StatusCode)
		}
		return
	}
	if ne, ok := err.(net.Error); ok && ne.Timeout() {
		t.Fatal("the server still waits for the body: no read timeout")
	}
	// The server closed the connection: the request was ended.
}

func TestGatewayHealthAndReadiness(t *testing.T) {
	verifyNoLeaks(t)
	e := kvstream.Start(t)
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	down := lis.Addr().String()
	_ = lis.Close()
	url, g := limitedGateway(t, DefaultLimits,
		gateway.Worker{ID: "up", Addr: e.Addr, Model: "a"},
		gateway.Worker{ID: "down", Addr: down, Model: "b"})
	get := func(path string) int {
		resp, err := http.Get(url + path)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	if code := get("/healthz"); code != http.StatusOK {
		t.Fatalf("/healthz %d", code)
	}
	// Model b has no worker streaming: not ready.
	eventually := time.Now().Add(20 * time.Second)
	for g.Workers()[0].State != monitor.StateStreaming && g.Workers()[1].State != monitor.StateStreaming {
		if time.Now().After(eventually) {
			t.Fatal("no stream opened")
		}
		time.Sleep(10 * time.Millisecond)
	}
	if code := get("/readyz"); code != http.StatusServiceUnavailable {
		t.Fatalf("/readyz %d with model b unreachable", code)
	}
	if err := g.RemoveWorker("down"); err != nil {
		t.Fatal(err)
	}
	for get("/readyz") != http.StatusOK {
		if time.Now().After(eventually) {
			t.Fatal("/readyz never became ready with every model streaming")
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestGatewayHTTPSlowClientHoldsItsOwnSlotsOnly: a client whose uploads
// trickle in (slow loris) holds at most its per-client slots; its next
// request is refused while another client's are served (issue 29: 64 slow
// uploads from one client once took every slot).
func TestGatewayHTTPSlowClientHoldsItsOwnSlotsOnly(t *testing.T) {
	verifyNoLeaks(t)
	e := kvstream.Start(t)
	lim := Limits{MaxTokens: 1000, MaxInFlight: 8, MaxInFlightPerClient: 2, ReadTimeout: 30 * time.Second}
	url, _ := limitedGateway(t, lim, gateway.Worker{ID: "w", Addr: e.Addr, Model: "m"})
	from := func(ip string) *http.Client {
		d := &net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(ip)}}
		tr := &http.Transport{DialContext: d.DialContext}
		t.Cleanup(tr.CloseIdleConnections)
		return &http.Client{Transport: tr}
	}
	loris, other := from("127.0.0.1"), from("127.0.0.2")

	// The slow client starts uploads and never finishes them (until the end).
	var feeds []*io.PipeWriter
	held := make(chan int, 8)
	for range 6 {
		body, feed := io.Pipe()
		feeds = append(feeds, feed)
		go func() {
			resp, err := loris.Post(url+"/v1/route", "application/json", body)
			if err != nil {
				held <- -1
				return
			}
			resp.Body.Close()
			held <- resp.StatusCode
		}()
		go func() { _, _ = feed.Write([]byte(`{"model":"m",`)) }()
	}
	// Four of the six are refused at once: two hold the client's slots.
	refused := 0
	deadline := time.Now().Add(20 * time.Second)
	for refused < 4 {
		select {
		case code := <-held:
			if code != http.StatusServiceUnavailable {
				t.Fatalf("a slow upload past the per-client bound ended %d, want 503", code)
			}
			refused++
		case <-time.After(time.Until(deadline)):
			t.Fatalf("%d of the slow client's uploads refused, want 4", refused)
		}
	}
	// Another client is served meanwhile.
	for i := range 5 {
		resp, err := other.Post(url+"/v1/route", "application/json", strings.NewReader(`{"model":"m","token_ids":[1,2,3]}`))
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("request %d of another client: %d while the slow one holds its slots", i, resp.StatusCode)
		}
	}
	for _, f := range feeds {
		_, _ = f.Write([]byte(`"token_ids":[1]}`))
		_ = f.Close()
	}
	for range 2 {
		if code := <-held; code != http.StatusOK {
			t.Fatalf("a held upload ended %d once complete", code)
		}
	}
}

// TestGatewayHTTPLoadValuesBounded: a reported count past MaxReportedLoad
// (issue 29: MaxInt64 was taken) is refused, naming the bound, and the
// worker's load is left as it was.
func TestGatewayHTTPLoadValuesBounded(t *testing.T) {
	verifyNoLeaks(t)
	e := kvstream.Start(t)
	url, g := limitedGateway(t, DefaultLimits, gateway.Worker{ID: "w", Addr: e.Addr, Model: "m"})
	for _, tc := range []struct {
		body string
		code int
		want string
	}{
		{`{"loads":{"w":9223372036854775807}}`, http.StatusBadRequest, fmt.Sprintf("≤ %d", MaxReportedLoad)},
		{fmt.Sprintf(`{"loads":{"w":%d}}`, MaxReportedLoad+1), http.StatusBadRequest, fmt.Sprintf("≤ %d", MaxReportedLoad)},
		{`{"loads":{"w":-1}}`, http.StatusBadRequest, "≥ 0"},
		{fmt.Sprintf(`{"loads":{"w":%d}}`, MaxReportedLoad), http.StatusOK, ""},
	} {
		code, out := apiclient.Post(t, url+"/v1/load", tc.body)
		msg, _ := out["error"].(string)
		if code != tc.code || !strings.Contains(msg, tc.want) {
			t.Errorf("%s: %d %q, want %d with %q", tc.body, code, msg, tc.code, tc.want)
		}
	}
	for _, ws := range g.Workers() {
		if ws.ID == "w" && ws.Inflight != MaxReportedLoad {
			t.Errorf("w's load %d, want the accepted %d", ws.Inflight, MaxReportedLoad)
		}
	}
}

// TestGatewayHTTPReportedLoadExpires: a count posted to /v1/load is gone
// from /v1/workers (and from routing) once --reported-load-ttl passes
// without a new report.
func TestGatewayHTTPReportedLoadExpires(t *testing.T) {
	verifyNoLeaks(t)
	e := kvstream.Start(t)
	const ttl = 300 * time.Millisecond
	url, g, _ := servedGateway(t, gateway.Config{Workers: []gateway.Worker{{ID: "w", Addr: e.Addr, Model: "m"}}, ReportedLoadTTL: ttl}, DefaultLimits, slog.New(slog.DiscardHandler))
	if code, out := apiclient.Post(t, url+"/v1/load", fmt.Sprintf(`{"loads":{"w":%d}}`, MaxReportedLoad)); code != http.StatusOK {
		t.Fatalf("/v1/load: %d %v", code, out)
	}
	posted := time.Now()
	reported := func() int {
		var ws Workers
		if err := json.Unmarshal([]byte(apiclient.Get(t, url+"/v1/workers")), &ws); err != nil {
			t.Fatal(err)
		}
		for _, w := range ws.Workers {
			if w.ID == "w" {
				return w.Reported
			}
		}
		t.Fatal("no worker w")
		return 0
	}
	if n := reported(); n != MaxReportedLoad && time.Since(posted) < ttl {
		t.Fatalf("reported %d right after the post", n)
	}
	deadline := time.Now().Add(20 * time.Second)
	for reported() != 0 {
		if time.Now().After(deadline) {
			t.Fatalf("the reported count still there %v after the post (TTL %v)", time.Since(posted), ttl)
		}
		time.Sleep(10 * time.Millisecond)
	}
	if took := time.Since(posted); took < ttl {
		t.Errorf("gone after %v, before the TTL %v", took, ttl)
	}
	for _, ws := range g.Workers() {
		if ws.Inflight != 0 {
			t.Errorf("%s in flight %d after the report expired, want its tracked 0", ws.ID, ws.Inflight)
		}
	}
}

// TestServeEndsWhenTheGatewayStops: a gateway whose Run fails early (here:
// it is already running) must not go on serving an API nothing keeps
// true: Serve shuts the HTTP server down and returns Run's error.
func TestServeEndsWhenTheGatewayStops(t *testing.T) {
	verifyNoLeaks(t)
	reg := prometheus.NewRegistry()
	g, err := gateway.New(gateway.Config{Registerer: reg})
	if err != nil {
		t.Fatal(err)
	}
	// A Run that has ended (its context already done) leaves the gateway
	// run once: Serve's own Run fails at once.
	ended, end := context.WithCancel(context.Background())
	end()
	if err := g.Run(ended); err != nil {
		t.Fatalf("the first Run: %v", err)
	}

	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- Serve(ctx, slog.New(slog.DiscardHandler), g, reg, ln, "", Limits{}) }()
	select {
	case err := <-done:
		if err == nil || !strings.Contains(err.Error(), "Run called twice") {
			t.Fatalf("Serve = %v, want Run's error", err)
		}
	case <-time.After(30 * time.Second):
		cancel()
		<-done
		t.Fatal("Serve went on serving after the gateway's Run failed")
	}
	if c, err := net.Dial("tcp", ln.Addr().String()); err == nil {
		c.Close()
		t.Fatal("the HTTP listener still accepts after Serve returned")
	}
}
