package main

import (
	"context"
	"fmt"
	"strings"
	"testing"

	"github.com/kvrelay/kvrelay/internal/freeport"
	"github.com/kvrelay/kvrelay/testkit/apiclient"
	"github.com/kvrelay/kvrelay/testkit/logbuf"
)

// A gateway worker given the wrong service (service=sglang against a vLLM
// relay) is named on both sides: the relay's UNIMPLEMENTED says what it
// serves, the gateway shows that in /v1/workers as a disabled worker and
// keeps asking; tail --service sglang prints the same message.
func TestServiceMismatchIsNamedOnBothSides(t *testing.T) {
	verifyNoLeaks(t)
	port := freeport.ForTest(t, 1) // nothing publishes: the relay serves all the same
	grpcAddr, gwAddr := freeAddr(t), freeAddr(t)
	relay := runInBackground(t, "serve", "--engine", "vllm", "--kv-events-config",
		fmt.Sprintf(`{"enable_kv_cache_events": true, "endpoint": "tcp://*:%d"}`, port),
		"--listen", grpcAddr, "--metrics-listen", "")
	gw := runInBackground(t, "gateway", "--worker", "grpc://"+grpcAddr+",service=sglang", "--listen", gwAddr, "--max-backoff", "200ms")

	const served = "serves SubscribeKvEvents as vllm (vllm.grpc.engine.VllmEngine)"
	waitHTTP(t, "http://"+gwAddr+"/v1/workers", func(b string) bool {
		return strings.Contains(b, `"state":"disabled"`) && strings.Contains(b, served)
	})
	// Asked again, not given up on: the failures counter keeps rising.
	metric := func() string {
		for _, line := range strings.Split(apiclient.Get(t, "http://"+gwAddr+"/metrics"), "\n") {
			if strings.Contains(line, `reason="unimplemented"`) && !strings.HasPrefix(line, "#") {
				return line
			}
		}
		return ""
	}
	first := metric()
	waitHTTP(t, "http://"+gwAddr+"/metrics", func(string) bool { m := metric(); return m != "" && m != first })
	if !strings.Contains(gw.stderr.String(), "does not serve KV events under this service") {
		t.Errorf("the gateway did not log the mismatch:\n%s", gw.stderr.String())
	}

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var out, errOut logbuf.Buffer
	code := dispatch(ctx, []string{"tail", "--addr", grpcAddr, "--service", "sglang"}, strings.NewReader(""), &out, &errOut)
	if code != 1 || !strings.Contains(errOut.String(), "Unimplemented") || !strings.Contains(errOut.String(), served) {
		t.Errorf("tail --service sglang: exit %d, stderr %q", code, errOut.String())
	}
	gw.stop(t)
	relay.stop(t)
}
