package main

import (
	"bytes"
	"context"
	"io"
	"net/http"
	"regexp"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/kvrelay/kvrelay/gateway"
	"github.com/kvrelay/kvrelay/gateway/monitor"
	"github.com/kvrelay/kvrelay/testkit/apiclient"
	"github.com/kvrelay/kvrelay/testkit/kvstream"
	"github.com/kvrelay/kvrelay/testkit/logbuf"
)

func TestParseWorker(t *testing.T) {
	tests := []struct {
		in      string
		want    gateway.Worker
		wantErr string
	}{
		{in: "grpc://10.0.0.1:50051", want: gateway.Worker{ID: "grpc://10.0.0.1:50051", Addr: "10.0.0.1:50051", Service: monitor.ServiceVLLM, Model: "default"}},
		{in: "grpc://w:1,model=llama,service=sglang", want: gateway.Worker{ID: "grpc://w:1", Addr: "w:1", Service: monitor.ServiceSGLang, Model: "llama"}},
		{in: "grpc://[::1]:7,service=tokenspeed", want: gateway.Worker{ID: "grpc://[::1]:7", Addr: "[::1]:7", Service: monitor.ServiceTokenSpeed, Model: "default"}},
		{in: "grpcs://w:1,model=llama", want: gateway.Worker{ID: "grpcs://w:1", Addr: "w:1", Service: monitor.ServiceVLLM, Model: "llama"}},
		{in: "grpcs://w", wantErr: "HOST:PORT"},
		{in: "10.0.0.1:50051", wantErr: "grpc://"},
		{in: "http://w:1", wantErr: "grpc://"},
		{in: "grpc://w", wantErr: "HOST:PORT"},
		{in: "grpc://w:1/x", wantErr: "nothing after"},
		{in: "grpc://w:1,model", wantErr: "key=value"},
		{in: "grpc://w:1,service=trtllm", wantErr: "unknown service"},
		{in: "grpc://w:1,color=red", wantErr: "unknown option"},
	}
	for _, tt := range tests {
		got, err := parseWorker(tt.in)
		if tt.wantErr != "" {
			if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
				t.Errorf("%s: err %v, want one mentioning %q", tt.in, err, tt.wantErr)
			}
			continue
		}
		if err != nil || got != tt.want {
			t.Errorf("%s: got %+v, %v; want %+v", tt.in, got, err, tt.want)
		}
	}
}

func TestGatewayBadFlags(t *testing.T) {
	tests := []struct {
		args []string
		want string
	}{
		{[]string{}, "--worker is required"},
		{[]string{"--workers-from-nats"}, "--workers-from-nats needs --nats"},
		{[]string{"--worker-file", "/nonexistent/workers"}, "--worker-file: worker file"},
		{[]string{"--worker-dns", "engines"}, "want NAME:PORT or srv+NAME"},
		{[]string{"--worker", "grpc://a:1", "--max-workers", "0"}, "--max-workers"},
		{[]string{"--worker", "grpc://a:1", "--drain-timeout", "0s"}, "--drain-timeout"},
		{[]string{"--worker", "nope"}, "-worker"},
		{[]string{"--worker", "grpc://a:1", "--worker", "grpc://a:1"}, "--worker"},
		{[]string{"--worker", "grpc://a:1", "--subscribe-deadline", "0s"}, "--subscribe-deadline"},
		{[]string{"--worker", "grpc://a:1", "--max-backoff", "1ms"}, "--max-backoff"},
		{[]string{"--worker", "grpc://a:1", "--block-size", "-1"}, "--block-size"},
		{[]string{"--worker", "grpc://a:1", "--spill-rel-threshold", "NaN"}, "--spill-rel-threshold"},
		{[]string{"--worker", "grpc://a:1", "--selection-temperature", "-1"}, "--selection-temperature"},
		{[]string{"--worker", "grpc://a:1", "--overlap-decay", "-1"}, "--overlap-decay"},
		{[]string{"--worker", "grpc://a:1", "--overlap-decay", "+Inf"}, "--overlap-decay"},
		{[]string{"--worker", "grpc://a:1", "--overload-token-usage-threshold", "1.5"}, "--overload-token-usage-threshold"},
		{[]string{"--worker", "grpc://a:1", "--balance-token-usage-threshold", "0"}, "--balance-token-usage-threshold"},
		{[]string{"--worker", "grpc://a:1", "--inflight-timeout", "0s"}, "--inflight-timeout"},
		{[]string{"--worker", "grpc://a:1", "--placement-weight", "1.5"}, "--placement-weight"},
		{[]string{"--worker", "grpc://a:1", "--placement-weight", "NaN"}, "--placement-weight"},
		{[]string{"--worker", "grpc://a:1", "--placement-ttl", "0s"}, "--placement-ttl"},
		{[]string{"--worker", "grpc://a:1", "--placement-max-entries", "0"}, "--placement-max-entries"},
		{[]string{"--worker", "grpc://a:1", "--nats-subject-prefix", "a.*"}, "--nats-subject-prefix"},
		{[]string{"--worker", "grpc://a:1", "--nats-subject-prefix", "a."}, "--nats-subject-prefix"},
		{[]string{"--worker", "grpc://a:1", "--partitions", "4"}, "--partitions needs --nats"},
		{[]string{"--worker", "grpc://a:1", "--partitions", "-1"}, "--partitions must be"},
		{[]string{"--worker", "grpc://a:1", "--partitions", "257", "--nats", "nats://127.0.0.1:1"}, "--partitions must be"},
		{[]string{"--worker", "grpc://a:1", "--partitions", "4", "--partition", "4", "--nats", "nats://127.0.0.1:1"}, "--partition must be 0..3"},
		{[]string{"--worker", "grpc://a:1", "--partitions", "4", "--partition", "-1", "--nats", "nats://127.0.0.1:1"}, "--partition must be 0..3"},
		{[]string{"--worker", "grpc://a:1", "--partition", "1"}, "--partition needs --partitions"},
		{[]string{"--worker", "grpc://a:1", "--partitions", "4", "--nats", "nats://127.0.0.1:1", "--partition-deadline", "0s"}, "--partition-deadline"},
		{[]string{"--worker", "grpc://a:1", "--partitions", "4", "--nats", "nats://127.0.0.1:1", "--partition-subject-prefix", "a.>"}, "--partition-subject-prefix"},
		{[]string{"--worker", "grpc://a:1", "--partitions", "4", "--nats", "nats://127.0.0.1:1", "--partition-join-wait", "-1s"}, "--partition-join-wait must be ≥ 0"},
		{[]string{"--worker", "grpc://a:1", "--partition-join-wait", "1s"}, "--partition-join-wait needs --partitions"},
		{[]string{"--worker", "grpc://a:1", "--log-level", "loud"}, "--log-level"},
		{[]string{"--worker", "grpc://a:1", "--listen", "nonsense"}, "--listen"},
		{[]string{"--worker", "grpc://a:1", "extra"}, "unexpected argument"},
		{[]string{"--bogus"}, "bogus"},
	}
	for _, tt := range tests {
		var stderr bytes.Buffer
		code := dispatch(context.Background(), append([]string{"gateway"}, tt.args...), nil, io.Discard, &stderr)
		if code != 2 {
			t.Errorf("%v: exit %d, want 2", tt.args, code)
		}
		if !strings.Contains(stderr.String(), tt.want) {
			t.Errorf("%v: stderr %q does not mention %q", tt.args, stderr.String(), tt.want)
		}
	}
}

// TestGatewayCommand runs `kvrelay gateway` itself: it routes a repeated
// prompt to the worker that cached it, and stops cleanly when its context
// ends.
func TestGatewayCommand(t *testing.T) {
	verifyNoLeaks(t)
	e1, e2 := kvstream.Start(t), kvstream.Start(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var stderr logbuf.Buffer
	exit := make(chan int, 1)
	go func() {
		exit <- dispatch(ctx, []string{"gateway",
			"--worker", "grpc://" + e1.Addr + ",model=m",
			"--worker", "grpc://" + e2.Addr + ",model=m,service=vllm",
			"--listen", "127.0.0.1:0", "--log-level", "debug",
		}, nil, io.Discard, &stderr)
	}()
	addrRE := regexp.MustCompile(`gateway listening\"? addr=(\S+)`)
	var addr string
	deadline := time.Now().Add(10 * time.Second)
	for addr == "" {
		if m := addrRE.FindStringSubmatch(stderr.String()); m != nil {
			addr = m[1]
		} else if time.Now().After(deadline) {
			t.Fatalf("no listening line in %q", stderr.String())
		} else {
			time.Sleep(5 * time.Millisecond)
		}
	}
	prompt := kvstream.SeqTokens(7, 48)
	e2.Batches <- kvstream.StoreTokens(1, 16, prompt)
	// Wait on the index, not by routing: every route places the prompt.
	for !strings.Contains(apiclient.Get(t, "http://"+addr+"/v1/workers"), `"index_blocks":3`) {
		if time.Now().After(deadline) {
			t.Fatal("e2's blocks never indexed")
		}
		time.Sleep(10 * time.Millisecond)
	}
	_, out := apiclient.Post(t, "http://"+addr+"/v1/route", `{"model":"m","token_ids":`+apiclient.TokensJSON(prompt)+`}`)
	if out["worker"] != "grpc://"+e2.Addr || out["reason"] != "event_hit" {
		t.Fatalf("route %v", out)
	}
	cancel()
	select {
	case code := <-exit:
		if code != 0 {
			t.Errorf("exit %d; stderr %s", code, stderr.String())
		}
	case <-time.After(10 * time.Second):
		t.Fatal("gateway did not stop")
	}
	if !strings.Contains(stderr.String(), "gateway stopped") {
		t.Errorf("no clean stop in %q", stderr.String())
	}
}

// verifyNoLeaks checks, after every cleanup of the test (cleanups run last
// registered first), that the test left no goroutine behind. The package
// has no TestMain of its own to run goleak from.
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

// FuzzParseWorker: any --worker value gets a worker or an error, never a
// panic, and an accepted one round-trips to its ID.
func FuzzParseWorker(f *testing.F) {
	for _, s := range []string{"grpc://h:1", "grpc://h:1,model=m,service=sglang", "grpc://[::1]:9", "grpc://h:1,", "grpc://:1", "grpc://h:1,model=a=b", "grpcs://h:1,model=m"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		w, err := parseWorker(s)
		if err != nil {
			return
		}
		if w.Addr == "" || (w.ID != "grpc://"+w.Addr && w.ID != "grpcs://"+w.Addr) || w.Model == "" {
			t.Fatalf("%q parsed to %+v", s, w)
		}
		if _, err := monitor.ParseService(string(w.Service)); err != nil {
			t.Fatalf("%q: service %q", s, w.Service)
		}
	})
}
