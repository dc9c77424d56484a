package main

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/kvrelay/kvrelay/gateway"
)

func TestWorkersSharingAnAddressAreNamedByService(t *testing.T) {
	parse := func(vs ...string) []gateway.Worker {
		var out []gateway.Worker
		for _, v := range vs {
			w, err := parseWorker(v)
			if err != nil {
				t.Fatal(err)
			}
			out = append(out, w)
		}
		return out
	}
	tests := []struct {
		name    string
		in      []gateway.Worker
		want    []string
		wantErr string
	}{
		{"distinct addresses keep their names", parse("grpc://h:1", "grpc://h:2,service=sglang"), []string{"grpc://h:1", "grpc://h:2"}, ""},
		{"one address, two services", parse("grpc://h:1,service=vllm", "grpc://h:1,service=sglang,model=x"), []string{"grpc://h:1/vllm", "grpc://h:1/sglang"}, ""},
		{"one address, one service twice", parse("grpc://h:1", "grpc://h:1,service=vllm"), nil, "given twice"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := nameWorkers(tt.in)
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("err %v, want %q", err, tt.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			for i, w := range got {
				if w.ID != tt.want[i] {
					t.Fatalf("worker %d named %q, want %q", i, w.ID, tt.want[i])
				}
			}
			// The gateway takes them.
			if _, err := gateway.New(gateway.Config{Workers: got}); err != nil {
				t.Fatalf("gateway.New: %v", err)
			}
		})
	}
}

// TestGatewayHTTPHardeningFlagErrors: the upload-rate and reported-load
// flags are checked before anything starts.
func TestGatewayHTTPHardeningFlagErrors(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--min-upload-rate", "-1"}, "--min-upload-rate must be a rate ≥ 0"},
		{[]string{"--min-upload-rate", "NaN"}, "--min-upload-rate must be a rate ≥ 0"},
		{[]string{"--min-upload-rate", "+Inf"}, "--min-upload-rate must be a rate ≥ 0"},
		{[]string{"--reported-load-ttl", "0s"}, "--reported-load-ttl must be positive"},
		{[]string{"--reported-load-ttl", "-1m"}, "--reported-load-ttl must be positive"},
	} {
		t.Run(strings.Join(tc.args, " "), func(t *testing.T) {
			var stdout, stderr bytes.Buffer
			args := append([]string{"gateway", "--worker", "grpc://127.0.0.1:1", "--listen", "127.0.0.1:0"}, tc.args...)
			if code := dispatch(context.Background(), args, nil, &stdout, &stderr); code != 2 {
				t.Errorf("exit code %d, want 2 (stderr %q)", code, stderr.String())
			}
			if !strings.Contains(stderr.String(), tc.want) {
				t.Errorf("stderr %q does not contain %q", stderr.String(), tc.want)
			}
		})
	}
}

// TestGatewayCommandTakesTheHTTPHardeningFlags: --min-upload-rate and
// --reported-load-ttl reach the running gateway: a trickled body is cut
// with a 408 naming the flag, and a posted load is gone from /v1/workers
// after its TTL.
func TestGatewayCommandTakesTheHTTPHardeningFlags(t *testing.T) {
	addr, _ := startGatewayCmd(t, "--worker", "grpc://127.0.0.1:1,model=m", "--min-upload-rate", "100000", "--reported-load-ttl", "200ms")
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	start := time.Now()
	if _, err := fmt.Fprintf(c, "POST /v1/route HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000\r\n\r\n{"); err != nil {
		t.Fatal(err)
	}
	_ = c.SetReadDeadline(time.Now().Add(time.Minute))
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusRequestTimeout || !strings.Contains(string(body), "--min-upload-rate") {
		t.Errorf("a stalled body: %d %s, want 408 naming --min-upload-rate", resp.StatusCode, body)
	}
	t.Logf("the stalled body was cut after %v", time.Since(start).Round(time.Millisecond))

	resp, err = http.Post("http://"+addr+"/v1/load", "application/json", strings.NewReader(`{"loads":{"grpc://127.0.0.1:1":7}}`))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("/v1/load: %d", resp.StatusCode)
	}
	waitHTTP(t, "http://"+addr+"/v1/workers", func(s string) bool { return strings.Contains(s, `"reported_inflight":0`) })
}
