package demo

import (
	"bufio"
	"errors"
	"io"
	"net"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

func TestCounterSum(t *testing.T) {
	regs := []*prometheus.Registry{prometheus.NewRegistry(), prometheus.NewRegistry()}
	for i, reg := range regs {
		c := prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvrelay_subscriptions_total"}, []string{"served"})
		reg.MustRegister(c)
		c.WithLabelValues("snapshot").Add(float64(1 + i))
		c.WithLabelValues("history").Add(10)
		g := prometheus.NewGauge(prometheus.GaugeOpts{Name: "kvrelay_subscribers"})
		reg.MustRegister(g)
		g.Set(4)
	}
	for _, tc := range []struct {
		name  string
		match map[string]string
		want  float64
	}{
		{"kvrelay_subscriptions_total", nil, 23},
		{"kvrelay_subscriptions_total", map[string]string{"served": "snapshot"}, 3},
		{"kvrelay_subscriptions_total", map[string]string{"served": "live"}, 0},
		{"kvrelay_subscriptions_total", map[string]string{"missing_label": "x"}, 0},
		{"kvrelay_subscribers", nil, 8},
		{"kvrelay_absent_total", nil, 0},
	} {
		if got := counterSum(regs, tc.name, tc.match); got != tc.want {
			t.Errorf("counterSum(%s, %v) = %v, want %v", tc.name, tc.match, got, tc.want)
		}
	}
}

// TestProxyCut: bytes flow both ways through the proxy, and cut resets the
// connection under the client, as a network drop would.
func TestProxyCut(t *testing.T) {
	echo, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer echo.Close()
	go func() {
		for {
			c, err := echo.Accept()
			if err != nil {
				return
			}
			go func() { _, _ = io.Copy(c, c); c.Close() }()
		}
	}()
	p, err := startProxy(echo.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer p.close()

	c, err := net.Dial("tcp", p.addr())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	r := bufio.NewReader(c)
	if _, err := c.Write([]byte("ping\n")); err != nil {
		t.Fatal(err)
	}
	if line, err := r.ReadString('\n'); err != nil || line != "ping\n" {
		t.Fatalf("echo through the proxy: %q, %v", line, err)
	}
	deadline := time.Now().Add(5 * time.Second)
	n := 0
	for n == 0 && time.Now().Before(deadline) {
		n = p.cut() // the proxy may not have registered the pair yet
		time.Sleep(time.Millisecond)
	}
	if n != 1 {
		t.Fatalf("cut %d connections, want 1", n)
	}
	_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := r.ReadString('\n'); !errors.Is(err, io.EOF) {
		t.Fatalf("read after cut: %v, want EOF", err)
	}
}

// TestProxyUpstreamDown: with nothing listening behind it, the proxy closes
// the client's connection instead of holding it open.
func TestProxyUpstreamDown(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	dead := l.Addr().String()
	l.Close()
	p, err := startProxy(dead)
	if err != nil {
		t.Fatal(err)
	}
	defer p.close()
	c, err := net.Dial("tcp", p.addr())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := c.Read(make([]byte, 1)); !errors.Is(err, io.EOF) {
		t.Fatalf("read: %v, want EOF", err)
	}
}
