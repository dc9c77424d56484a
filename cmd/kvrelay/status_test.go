package main

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/kvrelay/kvrelay/internal/freeport"
	"github.com/kvrelay/kvrelay/testkit/kvstream"
)

func runStatusCmd(t *testing.T, args ...string) (int, string, string) {
	t.Helper()
	var out, errOut bytes.Buffer
	code := dispatch(context.Background(), append([]string{"status"}, args...), strings.NewReader(""), &out, &errOut)
	return code, out.String(), errOut.String()
}

// waitHTTP waits until url answers 200 and cond holds on its body.
func waitHTTP(t *testing.T, url string, cond func(string) bool) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for {
		resp, err := http.Get(url)
		if err == nil {
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK && cond(string(b)) {
				return
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s never answered as wanted (last error %v)", url, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// kvrelay status ADDR on a gateway shows its workers as a table, each
// stream's state and cursors, and --json keeps the machine form.
func TestStatusShowsAGatewaysWorkers(t *testing.T) {
	verifyNoLeaks(t)
	e := kvstream.Start(t)
	addr := freeAddr(t)
	gw := runInBackground(t, "gateway", "--worker", "grpc://"+e.Addr+",model=llama", "--listen", addr)
	e.Batches <- kvstream.StoreTokens(7, 16, kvstream.SeqTokens(1, 32))
	waitHTTP(t, "http://"+addr+"/v1/workers", func(b string) bool { return strings.Contains(b, `"index_blocks":2`) })

	code, out, errOut := runStatusCmd(t, addr)
	if code != 0 {
		t.Fatalf("exit %d: %s", code, errOut)
	}
	for _, want := range []string{"WORKER", "grpc://" + e.Addr, "llama", "vllm", "streaming", "0:7"} {
		if !strings.Contains(out, want) {
			t.Errorf("table lacks %q:\n%s", want, out)
		}
	}
	code, out, _ = runStatusCmd(t, "--json", "http://"+addr+"/v1/workers")
	if code != 0 || !strings.Contains(out, `"workers"`) || !strings.Contains(out, `"index_blocks": 2`) {
		t.Errorf("--json: exit %d:\n%s", code, out)
	}
	gw.stop(t)
}

// On a relay's metrics address it shows the relays and each rank's
// endpoint, connection, cursor and holes.
func TestStatusShowsARelaysRanks(t *testing.T) {
	verifyNoLeaks(t)
	port := freeport.ForTest(t, 2) // nothing publishes there: the ranks wait
	grpcAddr, httpAddr := freeAddr(t), freeAddr(t)
	cfg := fmt.Sprintf(`{"enable_kv_cache_events": true, "endpoint": "tcp://*:%d"}`, port)
	srv := runInBackground(t, "serve", "--engine", "vllm", "--kv-events-config", cfg, "--dp-size", "2",
		"--listen", grpcAddr, "--metrics-listen", httpAddr)
	waitHTTP(t, "http://"+httpAddr+"/debug/status", func(string) bool { return true })

	code, out, errOut := runStatusCmd(t, httpAddr)
	if code != 0 {
		t.Fatalf("exit %d: %s", code, errOut)
	}
	for _, want := range []string{
		"RELAY", "SUBSCRIBERS", "HOLES",
		fmt.Sprintf("tcp://127.0.0.1:%d", port), fmt.Sprintf("tcp://127.0.0.1:%d", port+1),
	} {
		if !strings.Contains(out, want) {
			t.Errorf("table lacks %q:\n%s", want, out)
		}
	}
	code, out, _ = runStatusCmd(t, "--json", httpAddr)
	if code != 0 || !strings.Contains(out, `"ranks"`) {
		t.Errorf("--json: exit %d:\n%s", code, out)
	}
	srv.stop(t)
}

func TestStatusNamesWhatIsWrong(t *testing.T) {
	if code, _, errOut := runStatusCmd(t); code != 2 || !strings.Contains(errOut, "want one ADDR or URL") {
		t.Errorf("no address: exit %d, %q", code, errOut)
	}
	if code, _, errOut := runStatusCmd(t, "ftp://h:1"); code != 2 || !strings.Contains(errOut, "http(s)://") {
		t.Errorf("ftp: exit %d, %q", code, errOut)
	}
	// An HTTP server that is neither a relay nor a gateway.
	srv := httptest.NewServer(http.NotFoundHandler())
	defer srv.Close()
	if code, _, errOut := runStatusCmd(t, srv.URL); code != 1 || !strings.Contains(errOut, "serves neither /debug/status") {
		t.Errorf("neither: exit %d, %q", code, errOut)
	}
}
