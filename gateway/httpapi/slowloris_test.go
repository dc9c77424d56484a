package httpapi

import (
	"bufio"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrelay/kvrelay/gateway"
	"github.com/kvrelay/kvrelay/testkit/kvstream"
	"github.com/kvrelay/kvrelay/testkit/logbuf"
)

// slowUpload is one slow-loris upload over its own TCP connection from
// the loopback address ip: headers announcing a 1 MB body, then a byte of
// it every 100 ms (10 B/s) until the server answers. It returns the
// status (-1: the connection ended without one) and how long the upload
// was held.
func slowUpload(t *testing.T, addr, ip string) (code int, held time.Duration, msg string) {
	d := &net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(ip)}}
	c, err := d.Dial("tcp", addr)
	if err != nil {
		t.Error(err)
		return -1, 0, ""
	}
	defer c.Close()
	start := time.Now()
	answered := make(chan struct{})
	go func() {
		defer close(answered)
		_ = c.SetReadDeadline(time.Now().Add(time.Minute))
		resp, err := http.ReadResponse(bufio.NewReader(c), nil)
		if err != nil {
			code = -1
			return
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		code, msg = resp.StatusCode, string(b)
	}()
	if _, err := fmt.Fprintf(c, "POST /v1/route HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000000\r\n\r\n{\"model\":\"m\",\"token_ids\":["); err != nil {
		<-answered
		return code, time.Since(start), msg
	}
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	for {
		select {
		case <-answered:
			return code, time.Since(start), msg
		case <-tick.C:
			_, _ = c.Write([]byte("1"))
		}
	}
}

// honestRoutes sends /v1/route requests from 127.0.0.1 one after another,
// at least min of them and then until stop closes (nil: no more), counting
// the answers by status.
func honestRoutes(t *testing.T, url string, min int, stop <-chan struct{}) map[int]int {
	tr := &http.Transport{}
	defer tr.CloseIdleConnections()
	cl := &http.Client{Transport: tr, Timeout: 30 * time.Second}
	got := map[int]int{}
	for sent := 0; ; sent++ {
		if sent >= min {
			if stop == nil {
				return got
			}
			select {
			case <-stop:
				return got
			default:
			}
		}
		resp, err := cl.Post(url+"/v1/route", "application/json", strings.NewReader(`{"model":"m","token_ids":[1,2,3]}`))
		if err != nil {
			t.Error(err)
			return got
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		got[resp.StatusCode]++
		if resp.StatusCode != http.StatusOK {
			time.Sleep(10 * time.Millisecond) // as told by Retry-After, but sooner
		}
	}
}

// TestGatewayHTTPMinUploadRateEndsSlowUploads: 64 slow-loris uploads of
// 10 B/s against --min-upload-rate 4,096 B/s (issue 29: 64 slow uploads
// held every slot, and every /v1/route got 503, for 27 s). From one client
// address they hold its 8 slots until the rate cuts them and every honest
// route of another client gets 200; from 64 addresses they take all 64
// slots, and the rate frees them about UploadGrace in, not after
// --http-read-timeout (30 s). Every slow upload ends with 408 naming the
// flag (or 503 when it found no slot), and each is counted in
// kvrelay_gateway_http_rejected_total.
func TestGatewayHTTPMinUploadRateEndsSlowUploads(t *testing.T) {
	for _, tc := range []struct {
		name    string
		clients int // distinct addresses the 64 uploads come from
	}{{"one client", 1}, {"64 clients", 64}} {
		t.Run(tc.name, func(t *testing.T) {
			verifyNoLeaks(t)
			e := kvstream.Start(t)
			lim := Limits{MaxTokens: 1 << 20, MaxInFlight: 64, ReadTimeout: 30 * time.Second, MinUploadRate: DefaultMinUploadRate}
			var logs logbuf.Buffer
			url, _, reg := servedGateway(t, gateway.Config{Workers: []gateway.Worker{{ID: "w", Addr: e.Addr, Model: "m"}}}, lim, slog.New(slog.NewTextHandler(&logs, nil)))
			addr := strings.TrimPrefix(url, "http://")
			if probe, err := (&net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(fmt.Sprintf("127.0.0.%d", 1+tc.clients))}}).Dial("tcp", addr); err != nil {
				// Linux routes all of 127/8 to loopback; other systems
				// need the addresses aliased.
				t.Skipf("cannot send from %d loopback addresses here: %v", tc.clients, err)
			} else {
				probe.Close()
			}
			// Routing works before the flood.
			if got := honestRoutes(t, url, 1, nil); got[http.StatusOK] == 0 {
				t.Fatalf("no route before the flood: %v", got)
			}

			const uploads = 64
			type result struct {
				code int
				held time.Duration
				msg  string
			}
			results := make(chan result, uploads)
			start := time.Now()
			var wg sync.WaitGroup
			for i := range uploads {
				ip := fmt.Sprintf("127.0.0.%d", 2+i%tc.clients)
				wg.Add(1)
				go func() {
					defer wg.Done()
					code, held, msg := slowUpload(t, addr, ip)
					results <- result{code, held, msg}
				}()
			}
			stop := make(chan struct{})
			var honest map[int]int
			honestDone := make(chan struct{})
			go func() { defer close(honestDone); honest = honestRoutes(t, url, 1, stop) }()
			wg.Wait()
			allEnded := time.Since(start)
			close(stop)
			<-honestDone
			close(results)

			codes := map[int]int{}
			var cut []time.Duration
			for r := range results {
				codes[r.code]++
				switch r.code {
				case http.StatusRequestTimeout:
					cut = append(cut, r.held)
					if !strings.Contains(r.msg, "--min-upload-rate") {
						t.Errorf("a 408 that does not name --min-upload-rate: %s", r.msg)
					}
				case http.StatusServiceUnavailable:
				default:
					t.Errorf("a slow upload ended %d (%s), want 408 or 503", r.code, r.msg)
				}
			}
			sort.Slice(cut, func(i, j int) bool { return cut[i] < cut[j] })
			if len(cut) == 0 {
				t.Fatal("no slow upload was cut by the rate")
			}
			// The rate, not --http-read-timeout, ended them: the last one
			// well before the read timeout.
			if last := cut[len(cut)-1]; last >= lim.ReadTimeout/2 {
				t.Errorf("the last slow upload was held %v; the rate should cut it at about %v, far before the read timeout %v", last, UploadGrace, lim.ReadTimeout)
			}
			if tc.clients == 1 {
				// One client holds its 8 slots at most: every honest
				// route of another client is served.
				if len(cut) > uploads/8+uploads/8 {
					t.Errorf("%d uploads of one client got a slot, want about its %d", len(cut), uploads/8)
				}
				for code, n := range honest {
					if code != http.StatusOK {
						t.Errorf("%d honest routes got %d while one client's uploads were held", n, code)
					}
				}
			}
			// Routing is back once they ended.
			if got := honestRoutes(t, url, 1, nil); got[http.StatusOK] == 0 || len(got) != 1 {
				t.Errorf("routes after the slow uploads ended: %v, want 200 only", got)
			}
			refused := rejected(t, reg, "408") + rejected(t, reg, "503")
			want := float64(codes[http.StatusRequestTimeout] + codes[http.StatusServiceUnavailable] + honest[http.StatusServiceUnavailable])
			if refused != want {
				t.Errorf("kvrelay_gateway_http_rejected_total{408,503} = %v, want %v (every refusal)", refused, want)
			}
			if n := strings.Count(logs.String(), "HTTP request rejected: 408"); n > 5 {
				t.Errorf("%d log lines for %d uploads cut, want at most 5", n, len(cut))
			}
			t.Logf("%d slow uploads from %d address(es): %v; cut by the rate after %v (first) .. %v (last); all ended %v in; honest routes meanwhile %v",
				uploads, tc.clients, codes, cut[0].Round(time.Millisecond), cut[len(cut)-1].Round(time.Millisecond), allEnded.Round(time.Millisecond), honest)
		})
	}
}

// rejected is kvrelay_gateway_http_rejected_total{code} in reg.
func rejected(t *testing.T, reg *prometheus.Registry, code string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != "kvrelay_gateway_http_rejected_total" {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "code" && l.GetValue() == code {
					return m.GetCounter().GetValue()
				}
			}
		}
	}
	return 0
}

// TestGatewayHTTPRejectionsCountedAndThrottled: every refusal the API
// makes is counted by its code, and a flood of bad requests yields a few
// log lines per code, not one each.
func TestGatewayHTTPRejectionsCountedAndThrottled(t *testing.T) {
	verifyNoLeaks(t)
	e := kvstream.Start(t)
	lim := Limits{MaxTokens: 10, MaxInFlight: 4, ReadTimeout: 30 * time.Second}
	var logs logbuf.Buffer
	url, _, reg := servedGateway(t, gateway.Config{Workers: []gateway.Worker{{ID: "w", Addr: e.Addr, Model: "m"}}}, lim, slog.New(slog.NewTextHandler(&logs, nil)))
	cl := apiClient(t)
	do := func(method, path, body string) int { return status(t, cl, request(t, method, url+path, body)) }
	const flood = 200
	for range flood {
		if code := do("POST", "/v1/route", `{"model":`); code != http.StatusBadRequest {
			t.Fatalf("bad JSON: %d", code)
		}
	}
	for _, c := range []struct {
		method, path, body string
		code               int
	}{
		{"POST", "/v1/route", `{"model":"m","token_ids":[1,2,3,4,5,6,7,8,9,10,11]}`, http.StatusRequestEntityTooLarge},
		{"POST", "/v1/route", `{"model":"nope","token_ids":[1]}`, http.StatusNotFound},
		{"POST", "/v1/done", `{"request_id":12345}`, http.StatusNotFound},
		{"GET", "/v1/nothing", ``, http.StatusNotFound},
		{"GET", "/v1/route", ``, http.StatusMethodNotAllowed},
		{"POST", "/v1/route", `{"model":"m","token_ids":[1]}`, http.StatusOK},
	} {
		if code := do(c.method, c.path, c.body); code != c.code {
			t.Fatalf("%s %s: %d, want %d", c.method, c.path, code, c.code)
		}
	}
	for code, want := range map[string]float64{"400": flood, "413": 1, "404": 3, "405": 1, "503": 0, "200": 0} {
		if got := rejected(t, reg, code); got != want {
			t.Errorf("rejected{code=%s} = %v, want %v", code, got, want)
		}
	}
	if n := strings.Count(logs.String(), `msg="HTTP request rejected: 400 Bad Request"`); n < 1 || n > 5 {
		t.Errorf("%d log lines for %d bad requests, want 1..5", n, flood)
	}
	if !strings.Contains(logs.String(), `msg="HTTP request rejected: 405 Method Not Allowed"`) {
		t.Errorf("the 405 is not logged:\n%s", logs.String())
	}
}

// TestGatewayHTTPFullAnswersASlowClientAtOnce: when every slot is held, a
// new POST whose small body trickles in gets its 503 at once and its
// connection closed. Without "Connection: close" net/http reads the rest
// of a body under 256 KiB before it writes the answer, and with it, after
// the answer and before it closes: either way a slow client at the cap
// held a connection until --http-read-timeout.
func TestGatewayHTTPFullAnswersASlowClientAtOnce(t *testing.T) {
	verifyNoLeaks(t)
	e := kvstream.Start(t)
	// No upload rate: the held uploads keep their slots until the test
	// closes them. MaxInFlight 8 gives each address one slot.
	lim := Limits{MaxTokens: 1 << 20, MaxInFlight: 8, ReadTimeout: 20 * time.Second}
	url, _, _ := servedGateway(t, gateway.Config{Workers: []gateway.Worker{{ID: "w", Addr: e.Addr, Model: "m"}}}, lim, slog.New(slog.DiscardHandler))
	addr := strings.TrimPrefix(url, "http://")
	dialFrom := func(ip string) net.Conn {
		c, err := (&net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(ip)}}).Dial("tcp", addr)
		if err != nil {
			t.Skipf("cannot send from %s here: %v", ip, err)
		}
		t.Cleanup(func() { c.Close() })
		return c
	}
	// A POST whose 1,000-byte body stops after its first bytes.
	stalled := func(c net.Conn) {
		if _, err := fmt.Fprintf(c, "POST /v1/route HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"model\":\"m\","); err != nil {
			t.Fatal(err)
		}
	}
	holders := make([]net.Conn, lim.MaxInFlight)
	for i := range holders {
		holders[i] = dialFrom(fmt.Sprintf("127.0.0.%d", 2+i))
		stalled(holders[i])
	}
	// Every slot is held once an honest route is refused for the cap. An
	// honest route in flight when a holder arrives takes that holder's
	// slot, and the holder is refused and closed: such a holder is
	// replaced, so the slots fill on a machine of any speed.
	deadline := time.Now().Add(30 * time.Second)
	for got := honestRoutes(t, url, 1, nil); got[http.StatusServiceUnavailable] == 0; got = honestRoutes(t, url, 1, nil) {
		if time.Now().After(deadline) {
			t.Fatalf("the held uploads never filled the %d slots: %v", lim.MaxInFlight, got)
		}
		for i, c := range holders {
			_ = c.SetReadDeadline(time.Now().Add(time.Millisecond))
			var b [1]byte
			_, err := c.Read(b[:])
			if ne, ok := err.(net.Error); ok && ne.Timeout() {
				continue // still held
			}
			holders[i] = dialFrom(fmt.Sprintf("127.0.0.%d", 2+i))
			stalled(holders[i])
		}
		time.Sleep(10 * time.Millisecond)
	}
	// A new client finds the gateway full; 127.0.0.2 finds its own slot
	// taken (the per-client bound is checked first).
	for _, ip := range []string{fmt.Sprintf("127.0.0.%d", 2+lim.MaxInFlight), "127.0.0.2"} {
		refusedAtOnce(t, dialFrom(ip), stalled, lim.ReadTimeout)
	}
}

// refusedAtOnce sends a stalled POST on c and checks that it is answered
// 503 and its connection closed well before readTimeout.
func refusedAtOnce(t *testing.T, c net.Conn, stalled func(net.Conn), readTimeout time.Duration) {
	t.Helper()
	start := time.Now()
	stalled(c)
	_ = c.SetReadDeadline(time.Now().Add(readTimeout + 10*time.Second))
	br := bufio.NewReader(c)
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		t.Fatalf("no answer to a POST at the cap: %v", err)
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	took := time.Since(start)
	if resp.StatusCode != http.StatusServiceUnavailable {
		t.Fatalf("a POST at the cap from %s: %d, want 503", c.LocalAddr(), resp.StatusCode)
	}
	if took >= readTimeout/2 {
		t.Errorf("the 503 at the cap took %v: the server read the slow body first (read timeout %v)", took, readTimeout)
	}
	if !resp.Close {
		t.Errorf("the 503 at the cap keeps the connection open (Connection: %q)", resp.Header.Get("Connection"))
	}
	if _, err := br.ReadByte(); err != io.EOF {
		t.Errorf("after the 503 at the cap the connection is still open: %v", err)
	}
	closed := time.Since(start)
	if closed >= readTimeout/2 {
		t.Errorf("the connection answered 503 at the cap closed after %v: the server read the slow body first (read timeout %v)", closed, readTimeout)
	}
	t.Logf("%s: 503 after %v, connection closed after %v", c.LocalAddr(), took.Round(time.Millisecond), closed.Round(time.Millisecond))
}
