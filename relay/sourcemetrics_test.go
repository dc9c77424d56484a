package relay

import (
	"context"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/kvrelay/kvrelay/engines"
	"github.com/kvrelay/kvrelay/engines/vllm"
	"github.com/kvrelay/kvrelay/testkit/enginepeer"
	"github.com/kvrelay/kvrelay/testkit/zmtppeer"
)

// Issue 13.11: messages the ZeroMQ subscriber skips before admission (wrong
// frame count, unreadable sequence frame) change a metric, over real
// sockets, and so do its other counters.
func TestMalformedLiveMessagesAreCounted(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a Python peer")
	}
	peer := enginepeer.Start(t, enginepeer.Options{Engine: enginepeer.VLLM, NoReplay: true})
	reg := prometheus.NewRegistry()
	r, err := New(Config{
		Engine:     vllm.Engine,
		KV:         engines.Config{Enabled: true, Endpoint: peer.PubEndpoint(0), BufferSteps: 10_000},
		DPSize:     1,
		Logger:     quietLogger(),
		Registerer: reg,
	})
	if err != nil {
		t.Fatal(err)
	}
	l := runRelay(t, r)
	l.waitFor("the rank connected", r.Ready)
	// The subscription reaches the publisher some time after the connection
	// (slow joiner): publish until one batch is relayed.
	deadline := time.Now().Add(20 * time.Second)
	relayed := func() bool {
		r.mu.Lock()
		defer r.mu.Unlock()
		return r.ranks[0].hasCursor
	}
	for !relayed() {
		if time.Now().After(deadline) {
			t.Fatal("nothing relayed")
		}
		if _, err := peer.Publish(0, enginepeer.Stored(nil, []int64{1, 2}, enginepeer.I64(1))); err != nil {
			t.Fatal(err)
		}
		time.Sleep(20 * time.Millisecond)
	}
	for _, frames := range [][][]byte{
		{[]byte("kv"), make([]byte, 8)},                     // 2 frames
		{[]byte("kv")},                                      // 1 frame
		{[]byte("kv"), {}, {0x93}},                          // an empty sequence frame
		{[]byte("kv"), {1, 0, 0, 0, 0, 0, 0, 0, 0}, {0x93}}, // a sequence over 64 bits
	} {
		if err := peer.SendRaw(0, frames...); err != nil {
			t.Fatal(err)
		}
	}
	const want = `
# HELP kvrelay_zmq_malformed_messages_total Live messages skipped before admission, by reason: frames (fewer than 3), sequence (unreadable sequence frame).
# TYPE kvrelay_zmq_malformed_messages_total counter
kvrelay_zmq_malformed_messages_total{engine="vllm",rank="0",reason="frames",relay="vllm"} 2
kvrelay_zmq_malformed_messages_total{engine="vllm",rank="0",reason="sequence",relay="vllm"} 2
`
	l.waitFor("the malformed messages counted", func() bool {
		return testutil.GatherAndCompare(reg, strings.NewReader(want), "kvrelay_zmq_malformed_messages_total") == nil
	})
	for _, name := range []string{"kvrelay_zmq_messages_received_total", "kvrelay_zmq_queue_dropped_total", "kvrelay_zmq_queue_bytes",
		"kvrelay_zmq_reconnects_total", "kvrelay_zmq_oversized_messages_total"} {
		if n, err := testutil.GatherAndCount(reg, name); err != nil || n == 0 {
			t.Errorf("%s: %d series, %v", name, n, err)
		}
	}
}

// Issue 13.2 at the relay: a peer on the engine's ports that passes the
// handshake as its PUB and as its replay ROUTER and declares a 1 TiB frame
// is refused on both sockets, counted, and redialed; the relay runs on.
func TestAPeerDeclaringAHugeFrameIsRefusedAndCounted(t *testing.T) {
	huge := zmtppeer.Frame(zmtppeer.FlagLong, nil, 1<<40)
	pub := zmtppeer.Start(t, "PUB", func(c net.Conn) error {
		_, err := c.Write(huge)
		return err
	})
	router := zmtppeer.Start(t, "ROUTER", func(c net.Conn) error {
		for i := 0; i < 2; i++ { // the request: "" and the start sequence
			if _, err := zmtppeer.ReadFrame(c); err != nil {
				return err
			}
		}
		_, err := c.Write(append(zmtppeer.Frame(zmtppeer.FlagMore, []byte{}, 0), huge...))
		return err
	})
	reg := prometheus.NewRegistry()
	r, err := New(Config{
		Engine:     vllm.Engine,
		KV:         engines.Config{Enabled: true, Endpoint: pub.Endpoint, ReplayEndpoint: router.Endpoint, BufferSteps: 10_000},
		DPSize:     1,
		PrimeRetry: 10 * time.Millisecond,
		Logger:     quietLogger(),
		Registerer: reg,
	})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Error(err)
		}
	}()
	value := func(socket string) float64 {
		mfs, err := reg.Gather()
		if err != nil {
			t.Fatal(err)
		}
		for _, mf := range mfs {
			if mf.GetName() != "kvrelay_zmq_oversized_messages_total" {
				continue
			}
			for _, m := range mf.GetMetric() {
				for _, lp := range m.GetLabel() {
					if lp.GetName() == "socket" && lp.GetValue() == socket {
						return m.GetCounter().GetValue()
					}
				}
			}
		}
		return 0
	}
	// Redials back off, so allow for a loaded machine.
	for deadline := time.Now().Add(30 * time.Second); !(value("live") >= 2 && value("replay") >= 2 && pub.Accepted() >= 3); {
		if time.Now().After(deadline) {
			t.Fatalf("timed out: %v live and %v replay refusals, %d connections", value("live"), value("replay"), pub.Accepted())
		}
		time.Sleep(10 * time.Millisecond)
	}
	select {
	case err := <-done:
		t.Fatalf("the relay stopped: %v", err)
	default:
	}
}
