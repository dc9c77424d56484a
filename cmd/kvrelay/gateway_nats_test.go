package main

import (
	"context"
	"io"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/kvrelay/kvrelay/testkit/apiclient"
	"github.com/kvrelay/kvrelay/testkit/kvstream"
	"github.com/kvrelay/kvrelay/testkit/logbuf"
	"github.com/kvrelay/kvrelay/testkit/testnats"
)

// TestGatewayNATSSharesLoadByDefault: two `kvrelay gateway --nats` replicas
// see each other as load-sharing peers without any other flag; a third with
// --nats-share-load=false shares placements only and is nobody's peer.
func TestGatewayNATSSharesLoadByDefault(t *testing.T) {
	verifyNoLeaks(t)
	ns := testnats.Start(t, testnats.Config{NoJetStream: true})
	e := kvstream.Start(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()

	start := func(extra ...string) (addr string, exit chan int) {
		var stderr logbuf.Buffer
		exit = make(chan int, 1)
		args := append([]string{"gateway", "--worker", "grpc://" + e.Addr + ",model=m",
			"--listen", "127.0.0.1:0", "--nats", ns.URL()}, extra...)
		go func() { exit <- dispatch(ctx, args, nil, io.Discard, &stderr) }()
		addrRE := regexp.MustCompile(`gateway listening\"? addr=(\S+)`)
		deadline := time.Now().Add(10 * time.Second)
		for {
			if m := addrRE.FindStringSubmatch(stderr.String()); m != nil {
				return m[1], exit
			}
			if time.Now().After(deadline) {
				t.Fatalf("no listening line in %q", stderr.String())
			}
			time.Sleep(5 * time.Millisecond)
		}
	}
	a, exitA := start()
	b, exitB := start()
	c, exitC := start("--nats-share-load=false")

	deadline := time.Now().Add(10 * time.Second)
	for _, addr := range []string{a, b} {
		for !strings.Contains(apiclient.Get(t, "http://"+addr+"/metrics"), "kvrelay_gateway_nats_peers 1") {
			if time.Now().After(deadline) {
				t.Fatalf("%s never counted its peer", addr)
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	if m := apiclient.Get(t, "http://"+c+"/metrics"); strings.Contains(m, "kvrelay_gateway_nats_peers") || !strings.Contains(m, "kvrelay_gateway_nats_connected") {
		t.Errorf("--nats-share-load=false: load metrics present or placement metrics missing")
	}
	cancel()
	for _, exit := range []chan int{exitA, exitB, exitC} {
		select {
		case code := <-exit:
			if code != 0 {
				t.Errorf("exit %d", code)
			}
		case <-time.After(10 * time.Second):
			t.Fatal("gateway did not stop")
		}
	}
}
