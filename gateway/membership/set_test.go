package membership

import (
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"go.uber.org/goleak"

	"github.com/kvrelay/kvrelay/gateway"
	"github.com/kvrelay/kvrelay/gateway/monitor"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m, goleak.IgnoreAnyFunction("github.com/go-zeromq/zmq4.(*pubMWriter).run"))
}

const waitFor = 10 * time.Second

// eventually waits for cond, failing the test with what after waitFor.
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(waitFor)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting: %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// newSet builds a Set over a real gateway (not running: membership and
// routing need no streams).
func newSet(t *testing.T, opts Options) (*Set, *gateway.Gateway, *prometheus.Registry) {
	t.Helper()
	reg := prometheus.NewRegistry()
	g, err := gateway.New(gateway.Config{Registerer: reg})
	if err != nil {
		t.Fatal(err)
	}
	opts.Registerer = reg
	s, err := New(g, opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Close)
	return s, g, reg
}

func workers(t *testing.T, specs ...string) []gateway.Worker {
	t.Helper()
	var out []gateway.Worker
	for _, sp := range specs {
		w, err := ParseWorker(sp)
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, w)
	}
	return out
}

// gatewayWorkers lists the gateway's workers by ID.
func gatewayWorkers(g *gateway.Gateway) []string {
	var out []string
	for _, ws := range g.Workers() {
		out = append(out, ws.ID)
	}
	return out
}

// routesTo routes n tracked requests (so the load spreads them over every
// eligible worker), completes them, and returns the workers chosen.
func routesTo(t *testing.T, g *gateway.Gateway, model string, n int) map[string]int {
	t.Helper()
	got := map[string]int{}
	for i := range n {
		d, err := g.Route(gateway.RouteRequest{Model: model, TokenIDs: []uint32{uint32(i), 1, 2, 3}, Track: true})
		if err != nil {
			t.Fatal(err)
		}
		defer d.Done()
		got[d.Worker]++
	}
	return got
}

// holdOn routes tracked requests until one goes to w, completes the others
// and returns that one, still in flight.
func holdOn(t *testing.T, g *gateway.Gateway, w string) gateway.Decision {
	t.Helper()
	var others []gateway.Decision
	defer func() {
		for _, d := range others {
			d.Done()
		}
	}()
	for i := range 1000 {
		d, err := g.Route(gateway.RouteRequest{TokenIDs: []uint32{uint32(i)}, Track: true})
		if err != nil {
			t.Fatal(err)
		}
		if d.Worker == w {
			return d
		}
		others = append(others, d)
	}
	t.Fatalf("no route went to %s", w)
	return gateway.Decision{}
}

func TestParseWorker(t *testing.T) {
	for _, tc := range []struct {
		in, id, model string
		svc           monitor.Service
		err           string
	}{
		{in: "grpc://10.0.0.1:50051", id: "grpc://10.0.0.1:50051", model: "default", svc: monitor.ServiceVLLM},
		{in: "grpcs://h:1,model=llama,service=sglang", id: "grpcs://h:1", model: "llama", svc: monitor.ServiceSGLang},
		{in: " grpc://[::1]:7 , model=m ", id: "grpc://[::1]:7", model: "m", svc: monitor.ServiceVLLM},
		{in: "10.0.0.1:50051", err: "want grpc://HOST:PORT"},
		{in: "grpc://10.0.0.1", err: "want grpc://HOST:PORT"},
		{in: "grpc://h:1/x", err: "nothing after the port"},
		{in: "grpc://h:1,model", err: "not key=value"},
		{in: "grpc://h:1,colour=red", err: "unknown option"},
		{in: "grpc://h:1,service=trt", err: "unknown service"},
		{in: "grpc://h:1,model=" + string(make([]byte, 2000)), err: "at most 1024"},
	} {
		w, err := ParseWorker(tc.in)
		if tc.err != "" {
			if err == nil || !strings.Contains(err.Error(), tc.err) {
				t.Errorf("%q: error %v, want one saying %q", tc.in, err, tc.err)
			}
			continue
		}
		if err != nil || w.ID != tc.id || w.Model != tc.model || w.Service != tc.svc {
			t.Errorf("%q: got %+v, %v", tc.in, w, err)
			continue
		}
		if back, err := ParseWorker(FormatWorker(w)); err != nil || back.ID != w.ID || back.Model != w.Model || back.Service != w.Service {
			t.Errorf("%q: FormatWorker does not read back: %q, %v", tc.in, FormatWorker(w), err)
		}
	}
}

func TestReplaceAddsDrainsAndRemoves(t *testing.T) {
	s, g, reg := newSet(t, Options{DrainTimeout: time.Hour})
	a, b, c := "grpc://127.0.0.1:1", "grpc://127.0.0.1:2", "grpc://127.0.0.1:3"
	if err := s.Replace(SourceFile, workers(t, a, b)); err != nil {
		t.Fatal(err)
	}
	if got := gatewayWorkers(g); !slices.Equal(got, []string{a, b}) {
		t.Fatalf("gateway workers %v", got)
	}
	// A tracked request on b keeps it draining once the file drops it.
	onB := holdOn(t, g, b)
	if err := s.Replace(SourceFile, workers(t, a, c)); err != nil {
		t.Fatal(err)
	}
	if got := s.Routable(); !slices.Equal(got, []string{a, c}) {
		t.Fatalf("routable %v", got)
	}
	if got := routesTo(t, g, "", 40); got[b] > 0 || got[a] == 0 || got[c] == 0 {
		t.Fatalf("routes after the drain of b: %v", got)
	}
	if !slices.Contains(gatewayWorkers(g), b) {
		t.Fatal("b left before its request ended")
	}
	onB.Done()
	eventually(t, "b leaves once its request ends", func() bool { return !slices.Contains(gatewayWorkers(g), b) })

	// Listed again while draining: the drain is called off.
	if err := s.Replace(SourceFile, workers(t, a)); err != nil {
		t.Fatal(err)
	}
	eventually(t, "c leaves", func() bool { return !slices.Contains(gatewayWorkers(g), c) })
	if err := s.Replace(SourceFile, workers(t, a, c)); err != nil {
		t.Fatal(err)
	}
	if got := s.Routable(); !slices.Equal(got, []string{a, c}) {
		t.Fatalf("routable after c came back %v", got)
	}
	for op, want := range map[string]float64{"add": 4, "drain": 2, "remove": 2} {
		if got := readCounter(s.changes.WithLabelValues(SourceFile, op)); got != want {
			t.Errorf("changes{file,%s} = %v, want %v", op, got, want)
		}
	}
	if n, err := testutil.GatherAndCount(reg, "kvrelay_gateway_membership_changes_total"); err != nil || n != 3 {
		t.Errorf("membership series: %d, %v", n, err)
	}
}

func TestUndrainWhenListedAgainBeforeTheDrainEnds(t *testing.T) {
	s, g, _ := newSet(t, Options{DrainTimeout: time.Hour})
	a, b := "grpc://127.0.0.1:1", "grpc://127.0.0.1:2"
	if err := s.Replace(SourceDNS, workers(t, a, b)); err != nil {
		t.Fatal(err)
	}
	held := holdOn(t, g, b)
	if err := s.Replace(SourceDNS, workers(t, a)); err != nil {
		t.Fatal(err)
	}
	if !g.Draining(b) {
		t.Fatal("b is not draining")
	}
	if err := s.Replace(SourceDNS, workers(t, a, b)); err != nil {
		t.Fatal(err)
	}
	if g.Draining(b) || !slices.Equal(s.Routable(), []string{a, b}) {
		t.Fatal("b still draining after it was listed again")
	}
	held.Done()
	if got := readCounter(s.changes.WithLabelValues(SourceDNS, "undrain")); got != 1 {
		t.Fatalf("undrains %v", got)
	}
}

func TestDrainTimeoutRemovesAWorkerWithRequestsInFlight(t *testing.T) {
	s, g, _ := newSet(t, Options{DrainTimeout: 50 * time.Millisecond})
	a := "grpc://127.0.0.1:1"
	if err := s.Replace(SourceFile, workers(t, a)); err != nil {
		t.Fatal(err)
	}
	if _, err := g.Route(gateway.RouteRequest{TokenIDs: []uint32{1}, Track: true}); err != nil {
		t.Fatal(err)
	}
	if err := s.Replace(SourceFile, nil); err != nil {
		t.Fatal(err)
	}
	eventually(t, "the drain times out and a leaves", func() bool { return len(gatewayWorkers(g)) == 0 })
}

func TestBadUpdatesAreRefusedWhole(t *testing.T) {
	s, g, _ := newSet(t, Options{MaxWorkers: 3})
	a, b := "grpc://127.0.0.1:1", "grpc://127.0.0.1:2"
	if err := s.Replace(SourceFile, workers(t, a, b)); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name   string
		source string
		ws     []gateway.Worker
		want   error
	}{
		{"duplicate", SourceFile, workers(t, a, "grpc://127.0.0.1:3", a), ErrDuplicate},
		{"over the cap", SourceDNS, workers(t, "grpc://127.0.0.1:3", "grpc://127.0.0.1:4"), ErrTooMany},
		{"another model", SourceDNS, workers(t, a+",model=other"), ErrConflict},
	} {
		err := s.Replace(tc.source, tc.ws)
		if !errors.Is(err, tc.want) {
			t.Errorf("%s: %v, want %v", tc.name, err, tc.want)
		}
		if got := gatewayWorkers(g); !slices.Equal(got, []string{a, b}) {
			t.Errorf("%s: the gateway's workers changed to %v", tc.name, got)
		}
	}
	if got := readCounter(s.rejected.WithLabelValues(SourceFile)) + readCounter(s.rejected.WithLabelValues(SourceDNS)); got != 3 {
		t.Errorf("rejected %v, want 3", got)
	}
	// The cap holds across sources: one more fits, two do not.
	if err := s.Replace(SourceDNS, workers(t, "grpc://127.0.0.1:3")); err != nil {
		t.Fatal(err)
	}
	if err := s.Add(workers(t, "grpc://127.0.0.1:4")[0]); !errors.Is(err, ErrTooMany) {
		t.Fatalf("fourth worker: %v", err)
	}
}

func TestSourcesShareAWorker(t *testing.T) {
	s, g, _ := newSet(t, Options{})
	a := "grpc://127.0.0.1:1"
	if err := s.Replace(SourceFile, workers(t, a)); err != nil {
		t.Fatal(err)
	}
	if err := s.Replace(SourceNATS, workers(t, a)); err != nil {
		t.Fatal(err)
	}
	if err := s.Replace(SourceFile, nil); err != nil {
		t.Fatal(err)
	}
	if g.Draining(a) || !slices.Equal(gatewayWorkers(g), []string{a}) {
		t.Fatal("a worker another source still lists left or drains")
	}
	m := s.Members()
	if len(m) != 1 || !slices.Equal(m[0].Sources, []string{SourceNATS}) {
		t.Fatalf("members %+v", m)
	}
}

func TestManyWorkersJoinAndLeave(t *testing.T) {
	s, g, _ := newSet(t, Options{})
	var specs []string
	for i := range 500 {
		specs = append(specs, fmt.Sprintf("grpc://10.1.%d.%d:50051,model=m%d", i/250, i%250, i%3))
	}
	if err := s.Replace(SourceDNS, workers(t, specs...)); err != nil {
		t.Fatal(err)
	}
	if n := len(gatewayWorkers(g)); n != 500 {
		t.Fatalf("%d workers", n)
	}
	if err := s.Replace(SourceDNS, workers(t, specs[:100]...)); err != nil {
		t.Fatal(err)
	}
	eventually(t, "400 workers leave", func() bool { return len(gatewayWorkers(g)) == 100 })
}

func readCounter(c prometheus.Counter) float64 { return testutil.ToFloat64(c) }
