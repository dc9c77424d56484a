package relayd

import (
	"context"
	"encoding/json"
	"log/slog"
	"net"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"

	"github.com/kvrelay/kvrelay/proto/kvpb"
	"github.com/kvrelay/kvrelay/testkit/logbuf"
)

// TestStopCancelsTheLoadPollBeforeClosingItsConnection: a GetLoads read in
// flight when the daemon stops is cancelled, not failed on a closed
// connection and logged as a load-source failure.
func TestStopCancelsTheLoadPollBeforeClosingItsConnection(t *testing.T) {
	// The upstream answers the first GetLoads and holds every later one
	// until its caller goes away.
	var calls atomic.Int64
	held := make(chan struct{}, 1)
	upstream := grpc.NewServer(grpc.UnknownServiceHandler(func(_ any, stream grpc.ServerStream) error {
		if err := stream.RecvMsg(&kvpb.VllmGetLoadsRequest{}); err != nil {
			return err
		}
		if calls.Add(1) == 1 {
			return stream.SendMsg(&kvpb.VllmGetLoadsResponse{Loads: []*kvpb.VllmSchedulerLoad{{DpRank: 0, NumRunningReqs: 2}}})
		}
		select {
		case held <- struct{}{}:
		default:
		}
		<-stream.Context().Done()
		return stream.Context().Err()
	}))
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go func() { _ = upstream.Serve(ln) }()
	defer upstream.Stop()
	// Nothing publishes on the events endpoint: the relay dials it and
	// waits, which is all this test needs of it.
	quiet, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	quietAddr := quiet.Addr().String()
	quiet.Close()

	rs, err := Resolve([]RelayConfig{{
		Engine: "vllm", Listen: "127.0.0.1:0", Upstream: ln.Addr().String(), LoadSource: "getloads", LoadInterval: "20ms",
		KVEventsConfig: json.RawMessage(`{"enable_kv_cache_events": true, "endpoint": "tcp://` + quietAddr + `"}`),
	}})
	if err != nil {
		t.Fatal(err)
	}
	logs := &logbuf.Buffer{}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- Run(ctx, Options{Relays: rs, Logger: slog.New(slog.NewTextHandler(logs, nil))}) }()
	select {
	case <-held:
	case err := <-done:
		t.Fatalf("the daemon stopped before its second load poll: %v\n%s", err, logs.String())
	case <-time.After(30 * time.Second):
		t.Fatalf("no second GetLoads within 30 s:\n%s", logs.String())
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("Run: %v", err)
	}
	if strings.Contains(logs.String(), "engine load source unreadable") {
		t.Fatalf("stopping logged a load-source failure:\n%s", logs.String())
	}
	if !strings.Contains(logs.String(), "engine load source readable") {
		t.Fatalf("the first poll was not read:\n%s", logs.String())
	}
}
