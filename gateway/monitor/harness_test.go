package monitor

import (
	"context"
	"fmt"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kvrelay/kvrelay/proto/kvpb"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// waitFor bounds every wait in these tests: long enough for a loaded 2-core
// CI machine, and reached only when something is broken.
const waitFor = 10 * time.Second

// scriptedServer is a real gRPC server on loopback whose SubscribeKvEvents
// calls are handed to the test one by one, to answer as the scenario needs.
type scriptedServer struct {
	kvpb.UnimplementedVllmEngineServer
	addr  string
	srv   *grpc.Server
	calls chan *call
}

// call is one SubscribeKvEvents call held open by the server.
type call struct {
	req    *kvpb.SubscribeKvEventsRequest
	stream grpc.ServerStreamingServer[kvpb.KvEventBatch]
	end    chan error // the handler returns what is sent here
	ended  chan struct{}
}

func startServer(t *testing.T) *scriptedServer {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s := &scriptedServer{addr: lis.Addr().String(), srv: grpc.NewServer(), calls: make(chan *call, 16)}
	kvpb.RegisterVllmEngineServer(s.srv, s)
	go func() { _ = s.srv.Serve(lis) }()
	t.Cleanup(s.srv.Stop)
	return s
}

func (s *scriptedServer) SubscribeKvEvents(req *kvpb.SubscribeKvEventsRequest, stream grpc.ServerStreamingServer[kvpb.KvEventBatch]) error {
	c := &call{req: req, stream: stream, end: make(chan error, 1), ended: make(chan struct{})}
	defer close(c.ended)
	select {
	case s.calls <- c:
	case <-stream.Context().Done():
		return stream.Context().Err()
	}
	select {
	case err := <-c.end:
		return err
	case <-stream.Context().Done():
		return stream.Context().Err()
	}
}

// next waits for the monitor's next subscribe call.
func (s *scriptedServer) next(t *testing.T) *call {
	t.Helper()
	select {
	case c := <-s.calls:
		return c
	case <-time.After(waitFor):
		t.Fatal("no subscribe call arrived")
		return nil
	}
}

// none asserts that no call arrives within d.
func (s *scriptedServer) none(t *testing.T, d time.Duration) {
	t.Helper()
	select {
	case c := <-s.calls:
		t.Fatalf("unexpected subscribe call (start %d)", c.req.GetStartSequenceNumber())
	case <-time.After(d):
	}
}

// answer sends the response headers, as real servers do before any batch.
func (c *call) answer(t *testing.T) *call {
	t.Helper()
	if err := c.stream.SendHeader(nil); err != nil {
		t.Fatalf("send header: %v", err)
	}
	return c
}

func (c *call) send(t *testing.T, batches ...*kvpb.KvEventBatch) *call {
	t.Helper()
	for _, b := range batches {
		if err := c.stream.Send(b); err != nil {
			t.Fatalf("send seq %d: %v", b.GetSequenceNumber(), err)
		}
	}
	return c
}

// finish ends the call with err (nil: a clean end of stream).
func (c *call) finish(err error) { c.end <- err }

// waitEnded waits until the client has gone away or the call was finished.
func (c *call) waitEnded(t *testing.T) {
	t.Helper()
	select {
	case <-c.ended:
	case <-time.After(waitFor):
		t.Fatal("call did not end")
	}
}

// recordingSink records what the monitor hands its index.
type recordingSink struct {
	mu  sync.Mutex
	ops []string
	ch  chan string
}

func newRecordingSink() *recordingSink { return &recordingSink{ch: make(chan string, 1024)} }

func (r *recordingSink) record(op string) {
	r.mu.Lock()
	r.ops = append(r.ops, op)
	r.mu.Unlock()
	r.ch <- op
}

func (r *recordingSink) Apply(worker string, b *kvpb.KvEventBatch) {
	r.record(fmt.Sprintf("apply r%d s%d", b.GetDpRank(), b.GetSequenceNumber()))
}

func (r *recordingSink) ClearWorker(worker string) { r.record("clear") }

// expect waits for the next ops, in order.
func (r *recordingSink) expect(t *testing.T, ops ...string) {
	t.Helper()
	for _, want := range ops {
		select {
		case got := <-r.ch:
			if got != want {
				t.Fatalf("sink got %q, want %q", got, want)
			}
		case <-time.After(waitFor):
			t.Fatalf("sink: waited for %q; saw so far %v", want, r.all())
		}
	}
}

// quiet asserts the sink saw nothing more.
func (r *recordingSink) quiet(t *testing.T) {
	t.Helper()
	select {
	case got := <-r.ch:
		t.Fatalf("unexpected sink op %q", got)
	default:
	}
}

func (r *recordingSink) all() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]string(nil), r.ops...)
}

// rig is a monitor subscribed to one scripted server.
type rig struct {
	srv  *scriptedServer
	mon  *Monitor
	sink *recordingSink
	reg  *prometheus.Registry
	id   string
	stop func()
}

func fastOptions(reg *prometheus.Registry) Options {
	return Options{
		SubscribeDeadline: 300 * time.Millisecond,
		InitialBackoff:    10 * time.Millisecond,
		MaxBackoff:        40 * time.Millisecond,
		Registerer:        reg,
	}
}

func newRig(t *testing.T, mutate func(*Options)) *rig {
	t.Helper()
	srv := startServer(t)
	reg := prometheus.NewRegistry()
	opts := fastOptions(reg)
	if mutate != nil {
		mutate(&opts)
	}
	mon, err := New(opts)
	if err != nil {
		t.Fatal(err)
	}
	sink := newRecordingSink()
	if err := mon.Add(Worker{Addr: srv.addr, Model: "m"}, sink); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = mon.Run(ctx)
	}()
	r := &rig{srv: srv, mon: mon, sink: sink, reg: reg, id: srv.addr}
	r.stop = func() {
		cancel()
		<-done
	}
	t.Cleanup(r.stop)
	return r
}

func (r *rig) status(t *testing.T) WorkerStatus {
	t.Helper()
	ws := r.mon.Workers()
	if len(ws) != 1 {
		t.Fatalf("%d workers", len(ws))
	}
	return ws[0]
}

// eventually polls cond until it holds.
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(waitFor)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func (r *rig) counter(t *testing.T, name string, labels ...string) float64 {
	t.Helper()
	var c prometheus.Collector
	m := r.mon.metrics
	switch name {
	case "batches":
		c = m.batches
	case "gaps":
		c = m.gaps
	case "resyncs":
		c = m.resyncs
	case "failures":
		c = m.failures
	case "missed":
		c = m.missed
	case "subscriptions":
		c = m.subscriptions
	case "degraded":
		c = m.degraded
	default:
		t.Fatalf("unknown metric %s", name)
	}
	switch v := c.(type) {
	case *prometheus.CounterVec:
		return testutil.ToFloat64(v.WithLabelValues(append([]string{r.id}, labels...)...))
	case *prometheus.GaugeVec:
		return testutil.ToFloat64(v.WithLabelValues(append([]string{r.id}, labels...)...))
	}
	t.Fatalf("metric %s has an unexpected type", name)
	return 0
}

// batch builds a live batch; rank < 0 leaves dp_rank unset.
func batch(rank int32, seq uint64, events ...*kvpb.KvCacheEvent) *kvpb.KvEventBatch {
	b := &kvpb.KvEventBatch{SequenceNumber: seq, Timestamp: float64(time.Now().UnixNano()) / 1e9, Events: events}
	if rank >= 0 {
		b.DpRank = &rank
	}
	return b
}

func stored(blockSize int32, hashes ...int64) *kvpb.KvCacheEvent {
	s := &kvpb.KvBlocksStored{}
	for _, h := range hashes {
		toks := make([]uint32, blockSize)
		for i := range toks {
			toks[i] = uint32(h)*1000 + uint32(i)
		}
		s.Blocks = append(s.Blocks, &kvpb.KvBlock{BlockHash: h, TokenIds: toks, BlockSize: blockSize})
	}
	return &kvpb.KvCacheEvent{Data: &kvpb.KvCacheEvent_Stored{Stored: s}}
}

func clearedEvent() *kvpb.KvCacheEvent {
	return &kvpb.KvCacheEvent{Data: &kvpb.KvCacheEvent_Cleared{Cleared: &kvpb.KvCacheCleared{}}}
}

func chunk(rank int32, seq uint64, index, count uint32, unknownBefore uint64, events ...*kvpb.KvCacheEvent) *kvpb.KvEventBatch {
	b := batch(rank, seq, events...)
	b.Snapshot = &kvpb.KvSnapshotChunk{Index: index, Count: count, UnknownBefore: unknownBefore}
	return b
}

func statusErr(c codes.Code, msg string) error { return status.Error(c, msg) }

func hasSubstr(s, sub string) bool { return strings.Contains(s, sub) }

// histogramCount is the sample count of the rig worker's histogram name.
func (r *rig) histogramCount(t *testing.T, name string) uint64 {
	t.Helper()
	mfs, err := r.reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "worker" && l.GetValue() == r.id {
					return m.GetHistogram().GetSampleCount()
				}
			}
		}
	}
	return 0
}
