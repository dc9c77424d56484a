package membership

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/miekg/dns"

	"github.com/kvrelay/kvrelay/gateway"
	"github.com/kvrelay/kvrelay/testkit/logbuf"
)

// dnsServer is a real DNS server on loopback (UDP and TCP on one port, as
// a resolver falls back to TCP for a truncated answer), answering what the
// test sets.
type dnsServer struct {
	addr string
	mu   sync.Mutex
	a    map[string][]string   // name → IPv4 addresses
	srv  map[string][]*dns.SRV // name → SRV records
	// huge: answer this many A records for any name (a DNS gone wrong).
	huge       int
	hugePacked []byte // the whole answer, for TCP
	hugeErr    error  // why it cannot be sent (over 64 KiB)
	queries    int
}

func startDNS(t testing.TB) *dnsServer {
	t.Helper()
	d := &dnsServer{a: map[string][]string{}, srv: map[string][]*dns.SRV{}}
	pc, err := net.ListenPacket("udp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	d.addr = pc.LocalAddr().String()
	ln, err := net.Listen("tcp", d.addr)
	if err != nil {
		pc.Close()
		t.Fatal(err)
	}
	udp := &dns.Server{PacketConn: pc, Handler: d}
	tcp := &dns.Server{Listener: ln, Handler: d}
	started := make(chan struct{}, 2)
	udp.NotifyStartedFunc = func() { started <- struct{}{} }
	tcp.NotifyStartedFunc = func() { started <- struct{}{} }
	go func() { _ = udp.ActivateAndServe() }()
	go func() { _ = tcp.ActivateAndServe() }()
	<-started
	<-started
	t.Cleanup(func() {
		_ = udp.Shutdown()
		_ = tcp.Shutdown()
	})
	return d
}

func (d *dnsServer) set(name string, ips ...string) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.a[dns.Fqdn(name)] = ips
}

func (d *dnsServer) setSRV(name string, recs ...*dns.SRV) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.srv[dns.Fqdn(name)] = recs
}

// setHuge makes every A answer n records. The answer is built and packed
// once here: packing 100,000 records per query would load the machine, not
// test the gateway.
func (d *dnsServer) setHuge(n int) {
	var packed []byte
	var packErr error
	if n > 0 {
		m := new(dns.Msg)
		m.SetQuestion("engines.test.", dns.TypeA)
		m.Response, m.Compress = true, true
		hdr := dns.RR_Header{Name: "engines.test.", Rrtype: dns.TypeA, Class: dns.ClassINET, Ttl: 5}
		for i := range n {
			m.Answer = append(m.Answer, &dns.A{Hdr: hdr, A: net.IPv4(10, byte(i>>16), byte(i>>8), byte(i))})
		}
		packed, packErr = m.Pack()
		if packErr == nil && len(packed) > dns.MaxMsgSize {
			// A TCP frame's length is 16 bits: no server can send it.
			packed, packErr = nil, fmt.Errorf("%d records pack to %d bytes, over %d", n, len(packed), dns.MaxMsgSize)
		}
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	d.huge, d.hugePacked, d.hugeErr = n, packed, packErr
}

func (d *dnsServer) ServeDNS(w dns.ResponseWriter, r *dns.Msg) {
	m := new(dns.Msg)
	m.SetReply(r)
	m.Compress = true
	d.mu.Lock()
	d.queries++
	q := r.Question[0]
	hdr := dns.RR_Header{Name: q.Name, Class: dns.ClassINET, Ttl: 5}
	switch {
	case q.Qtype == dns.TypeA && d.huge > 0:
		packed, packErr := d.hugePacked, d.hugeErr
		d.mu.Unlock()
		_, udp := w.RemoteAddr().(*net.UDPAddr)
		switch {
		case udp:
			// Too big for a datagram: truncated, ask again over TCP.
			m.Truncated = true
			_ = w.WriteMsg(m)
		case packErr != nil:
			// No DNS message holds it: the server fails the query.
			m.Rcode = dns.RcodeServerFailure
			_ = w.WriteMsg(m)
		default:
			b := append([]byte(nil), packed...)
			b[0], b[1] = byte(r.Id>>8), byte(r.Id)
			_, _ = w.Write(b)
		}
		return
	case q.Qtype == dns.TypeA:
		hdr.Rrtype = dns.TypeA
		for _, ip := range d.a[q.Name] {
			m.Answer = append(m.Answer, &dns.A{Hdr: hdr, A: net.ParseIP(ip)})
		}
		if _, ok := d.a[q.Name]; !ok {
			m.Rcode = dns.RcodeNameError
		}
	case q.Qtype == dns.TypeSRV:
		hdr.Rrtype = dns.TypeSRV
		for _, s := range d.srv[q.Name] {
			rr := *s
			rr.Hdr = hdr
			m.Answer = append(m.Answer, &rr)
		}
	}
	d.mu.Unlock()
	// Over UDP an answer past 512 bytes is truncated, and the resolver asks
	// again over TCP; over TCP one message holds at most 64 KiB.
	if _, udp := w.RemoteAddr().(*net.UDPAddr); udp {
		m.Truncate(dns.MinMsgSize)
	}
	_ = w.WriteMsg(m)
}

func TestDNSFollowsARecords(t *testing.T) {
	srv := startDNS(t)
	srv.set("engines.test", "127.0.0.1", "127.0.0.2")
	var logs logbuf.Buffer
	s, g, _ := newSet(t, Options{MaxWorkers: 100, Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	spec, err := ParseDNSSpec("engines.test:50051,model=llama,service=sglang")
	if err != nil {
		t.Fatal(err)
	}
	d, err := WatchDNS(s, DNSOptions{Specs: []DNSSpec{spec}, Server: srv.addr, Interval: 20 * time.Millisecond, Timeout: 500 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	want := []string{"grpc://127.0.0.1:50051", "grpc://127.0.0.2:50051"}
	if got := gatewayWorkers(g); !slices.Equal(got, want) {
		t.Fatalf("after the first resolution: %v, want %v", got, want)
	}
	for _, ws := range g.Workers() {
		if ws.Model != "llama" || ws.Service != "sglang" {
			t.Fatalf("worker %+v: want model llama, service sglang", ws)
		}
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); d.Run(ctx) }()
	defer func() { cancel(); <-done }()

	// Scale out, then in.
	srv.set("engines.test", "127.0.0.1", "127.0.0.2", "127.0.0.3")
	eventually(t, "the third engine joins", func() bool { return len(s.Routable()) == 3 })
	srv.set("engines.test", "127.0.0.3")
	eventually(t, "two engines leave", func() bool {
		return slices.Equal(gatewayWorkers(g), []string{"grpc://127.0.0.3:50051"})
	})

	// A DNS gone wrong: 100,000 records. No DNS message holds them (64 KiB
	// and 65,535 records at most), so the server fails the query; the last
	// good list stays, and routing goes on.
	srv.setHuge(100_000)
	if srv.hugeErr == nil {
		t.Fatal("100,000 records packed into one DNS message")
	}
	before := testutilRejected(s, SourceDNS)
	eventually(t, "the huge answer is refused", func() bool { return testutilRejected(s, SourceDNS) > before })
	if got := gatewayWorkers(g); !slices.Equal(got, []string{"grpc://127.0.0.3:50051"}) {
		t.Fatalf("after the huge answer: %v", got)
	}
	// About as many as one TCP message holds: over the cap of 100.
	// Waited on by its log line, not by the refusal counter: a look-up that
	// began before the change still fails on the 100,000 records and would
	// count a refusal before any of the 3,500.
	srv.setHuge(3500)
	const capLine = "answered 3500 records: over the cap on workers of 100"
	deadline := time.Now().Add(waitFor)
	for !strings.Contains(logs.String(), capLine) {
		if time.Now().After(deadline) {
			t.Fatalf("no log names the cap:\n%s", logs.String())
		}
		time.Sleep(5 * time.Millisecond)
	}
	if got := gatewayWorkers(g); !slices.Equal(got, []string{"grpc://127.0.0.3:50051"}) {
		t.Fatalf("after 3,500 records: %v", got)
	}
	if _, err := g.Route(gateway.RouteRequest{Model: "llama", TokenIDs: []uint32{1, 2}}); err != nil {
		t.Fatalf("routing after the refused answers: %v", err)
	}
	// The name gone (NXDOMAIN): kept, not emptied.
	srv.setHuge(0)
	srv.mu.Lock()
	delete(srv.a, "engines.test.")
	srv.mu.Unlock()
	before = testutilRejected(s, SourceDNS)
	eventually(t, "NXDOMAIN is refused", func() bool { return testutilRejected(s, SourceDNS) > before })
	if got := len(gatewayWorkers(g)); got != 1 {
		t.Fatalf("after NXDOMAIN: %d workers", got)
	}
}

func TestDNSFollowsSRVRecords(t *testing.T) {
	srv := startDNS(t)
	srv.setSRV("_grpc._tcp.engines.test",
		&dns.SRV{Target: "e-0.engines.test.", Port: 50051},
		&dns.SRV{Target: "e-1.engines.test.", Port: 50052})
	s, g, _ := newSet(t, Options{})
	spec, err := ParseDNSSpec("srv+_grpc._tcp.engines.test")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := WatchDNS(s, DNSOptions{Specs: []DNSSpec{spec}, Server: srv.addr, Interval: time.Hour}); err != nil {
		t.Fatal(err)
	}
	want := []string{"grpc://e-0.engines.test:50051", "grpc://e-1.engines.test:50052"}
	if got := gatewayWorkers(g); !slices.Equal(got, want) {
		t.Fatalf("%v, want %v", got, want)
	}
}

func TestParseDNSSpec(t *testing.T) {
	for _, tc := range []struct{ in, err string }{
		{in: "engines.ns.svc:50051"},
		{in: "srv+_grpc._tcp.engines.ns.svc,model=m,service=tokenspeed,tls=true"},
		{in: "engines.ns.svc", err: "want NAME:PORT"},
		{in: "engines:0", err: "want 1..65535"},
		{in: "engines:1,tls=maybe", err: "want true or false"},
		{in: "engines:1,zone=x", err: "unknown option"},
		{in: "srv+", err: "want NAME:PORT"},
	} {
		_, err := ParseDNSSpec(tc.in)
		if (tc.err == "") != (err == nil) || (err != nil && !strings.Contains(err.Error(), tc.err)) {
			t.Errorf("%q: %v, want %q", tc.in, err, tc.err)
		}
	}
}

func testutilRejected(s *Set, source string) float64 {
	return readCounter(s.rejected.WithLabelValues(source))
}
