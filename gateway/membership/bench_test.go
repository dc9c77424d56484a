package membership

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvrelay/kvrelay/gateway"
	"github.com/kvrelay/kvrelay/natsevents"
	"github.com/kvrelay/kvrelay/testkit/testnats"
)

// BenchmarkMembershipLatency measures, per source, how long after a
// worker's change at its source (a POST to the admin API, a file
// rewritten, a DNS answer changed, a relay announcing) routing follows:
// join is until the first route to the worker, leave until the first route
// that cannot go to it. Each iteration joins and drains one worker, the
// only worker of its own model, so a route's answer says which side of the
// change it saw; routes are polled every millisecond (the resolution).
// The polling sources' intervals are set to 100 ms here; their bound is
// interval + the figures' apply time.
//
//	go test -run '^$' -bench MembershipLatency -benchtime 20x ./gateway/membership
func BenchmarkMembershipLatency(b *testing.B) {
	const interval = 100 * time.Millisecond
	b.Run("admin", func(b *testing.B) {
		set, g := benchSet(b)
		mux := http.NewServeMux()
		RegisterAdmin(mux, set)
		srv := httptest.NewServer(mux)
		defer srv.Close()
		post := func(method, path, spec string) {
			req, _ := http.NewRequest(method, srv.URL+path, strings.NewReader(`{"worker": "`+spec+`"}`))
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				b.Fatal(err)
			}
			resp.Body.Close()
			if resp.StatusCode >= 300 {
				b.Fatalf("%s %s: %d", method, path, resp.StatusCode)
			}
		}
		measure(b, g, func(spec string) { post("POST", "/v1/workers", spec) }, func(spec string) { post("POST", "/v1/workers/drain", spec) })
	})
	b.Run("file", func(b *testing.B) {
		set, g := benchSet(b)
		path := filepath.Join(b.TempDir(), "workers")
		write := func(body string) {
			if err := os.WriteFile(path+".tmp", []byte(body), 0o644); err != nil {
				b.Fatal(err)
			}
			if err := os.Rename(path+".tmp", path); err != nil {
				b.Fatal(err)
			}
		}
		write("")
		fw, err := WatchFile(set, path, interval)
		if err != nil {
			b.Fatal(err)
		}
		stop := runBench(fw.Run)
		defer stop()
		measure(b, g, func(spec string) { write(spec + "\n") }, func(string) { write("") })
	})
	b.Run("dns", func(b *testing.B) {
		set, g := benchSet(b)
		srv := startDNS(b)
		spec, err := ParseDNSSpec("engines.test:50051,model=m0")
		if err != nil {
			b.Fatal(err)
		}
		// The DNS spec fixes the model, so each iteration's worker is a new
		// address of model m0: join waits for a route to it, leave for
		// ErrNoWorkers (it is the only address).
		srv.set("engines.test")
		dw, err := WatchDNS(set, DNSOptions{Specs: []DNSSpec{spec}, Server: srv.addr, Interval: interval})
		if err != nil {
			b.Fatal(err)
		}
		stop := runBench(dw.Run)
		defer stop()
		measureModel(b, g, "m0", func(i int) string { return fmt.Sprintf("127.0.%d.%d", i/250, i%250+1) },
			func(ip string) { srv.set("engines.test", ip) }, func(string) { srv.set("engines.test", "127.255.255.254") },
			func(ip string) string { return "grpc://" + ip + ":50051" })
	})
	b.Run("nats", func(b *testing.B) {
		set, g := benchSet(b)
		node := testnats.Start(b, testnats.Config{})
		nc, err := nats.Connect(node.URL())
		if err != nil {
			b.Fatal(err)
		}
		defer nc.Close()
		js, err := jetstream.New(nc)
		if err != nil {
			b.Fatal(err)
		}
		ctx := context.Background()
		if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: natsevents.DefaultStream, Subjects: []string{natsevents.DefaultSubjectPrefix + ".>"}}); err != nil {
			b.Fatal(err)
		}
		mw, err := natsevents.WatchMembers(natsevents.MemberOptions{
			URL: node.URL(), LeaveAfter: interval,
			OnChange: func(specs []string) {
				var ws []gateway.Worker
				for _, sp := range specs {
					if w, err := ParseWorker(sp); err == nil {
						ws = append(ws, w)
					}
				}
				_ = set.Replace(SourceNATS, ws)
			},
		})
		if err != nil {
			b.Fatal(err)
		}
		defer mw.Close()
		stop := runBench(mw.Run)
		defer stop()
		// A relay's sink: its marker stored on the stream (what the
		// gateway checks the announcements against), then its
		// announcement every interval; natsevents' wire, published here
		// so that the figure is the gateway's, not a relay's start-up.
		type relay struct {
			spec     string
			inc, seq uint64
		}
		announcing := make(chan relay)
		annDone := make(chan struct{})
		go func() {
			defer close(annDone)
			t := time.NewTicker(interval)
			defer t.Stop()
			var r relay
			for {
				select {
				case next, ok := <-announcing:
					if !ok {
						return
					}
					r = next
				case <-t.C:
				}
				if r.spec != "" {
					_ = nc.PublishMsg(natsevents.MemberAnnouncement("", r.spec, r.spec, r.inc, r.seq, interval))
				}
			}
		}()
		defer func() { close(announcing); <-annDone }()
		inc := uint64(0)
		join := func(spec string) {
			inc++
			pa, err := js.PublishMsg(ctx, natsevents.MemberMark("", spec, spec, inc))
			if err != nil {
				b.Fatal(err)
			}
			announcing <- relay{spec: spec, inc: inc, seq: pa.Sequence}
		}
		measure(b, g, join, func(string) { announcing <- relay{} })
	})
}

func benchSet(b *testing.B) (*Set, *gateway.Gateway) {
	g, err := gateway.New(gateway.Config{})
	if err != nil {
		b.Fatal(err)
	}
	set, err := New(g, Options{DrainTimeout: time.Second})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(set.Close)
	return set, g
}

func runBench(run func(context.Context)) (stop func()) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); run(ctx) }()
	return func() { cancel(); <-done }
}

// measure joins and drains one worker per iteration, each of its own model.
func measure(b *testing.B, g *gateway.Gateway, join, leave func(spec string)) {
	var joins, leaves []time.Duration
	b.ResetTimer()
	for i := range b.N {
		model := fmt.Sprintf("m%d", i)
		spec := fmt.Sprintf("grpc://127.0.%d.%d:50051,model=%s", i/250, i%250+1, model)
		id := spec[:strings.IndexByte(spec, ',')]
		t0 := time.Now()
		join(spec)
		waitRoute(b, g, model, func(w string, err error) bool { return err == nil && w == id })
		joins = append(joins, time.Since(t0))
		t0 = time.Now()
		leave(spec)
		waitRoute(b, g, model, func(w string, err error) bool { return err != nil && w != id })
		leaves = append(leaves, time.Since(t0))
	}
	report(b, joins, leaves)
}

// measureModel is measure for a source whose workers share one model.
func measureModel(b *testing.B, g *gateway.Gateway, model string, addr func(int) string, join, leave func(string), id func(string) string) {
	var joins, leaves []time.Duration
	b.ResetTimer()
	for i := range b.N {
		a := addr(i)
		t0 := time.Now()
		join(a)
		waitRoute(b, g, model, func(w string, err error) bool { return err == nil && w == id(a) })
		joins = append(joins, time.Since(t0))
		t0 = time.Now()
		leave(a)
		waitRoute(b, g, model, func(w string, err error) bool { return w != id(a) })
		leaves = append(leaves, time.Since(t0))
	}
	report(b, joins, leaves)
}

func waitRoute(b *testing.B, g *gateway.Gateway, model string, done func(string, error) bool) {
	deadline := time.Now().Add(30 * time.Second)
	for {
		d, err := g.Route(gateway.RouteRequest{Model: model, TokenIDs: []uint32{1, 2, 3}})
		if err != nil && !errors.Is(err, gateway.ErrUnknownModel) && !errors.Is(err, gateway.ErrNoWorkers) {
			b.Fatal(err)
		}
		if done(d.Worker, err) {
			return
		}
		if time.Now().After(deadline) {
			b.Fatalf("model %s: routing did not follow in 30s (last %q, %v)", model, d.Worker, err)
		}
		time.Sleep(time.Millisecond)
	}
}

func report(b *testing.B, joins, leaves []time.Duration) {
	b.StopTimer()
	for _, s := range []struct {
		name string
		d    []time.Duration
	}{{"join", joins}, {"leave", leaves}} {
		slices.Sort(s.d)
		ms := func(q float64) float64 { return float64(s.d[int(q*float64(len(s.d)-1))]) / 1e6 }
		b.ReportMetric(ms(0), s.name+"-min-ms")
		b.ReportMetric(ms(0.5), s.name+"-p50-ms")
		b.ReportMetric(ms(1), s.name+"-max-ms")
	}
}
