package placementsync

import (
	"fmt"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/kvrelay/kvrelay/gateway"
)

// Short load-sharing periods, so peers age out within the tests; the
// timeout is 30 heartbeats, so a stall of a loaded machine does not age a
// live peer out.
const (
	testHeartbeat   = 50 * time.Millisecond
	testPeerTimeout = 1500 * time.Millisecond
)

// startLoadReplica is startReplica sharing in-flight counts too.
func startLoadReplica(t testing.TB, url string, workers int) *replica {
	return startLoadReplicaTimeout(t, url, workers, testPeerTimeout)
}

func startLoadReplicaTimeout(t testing.TB, url string, workers int, peerTimeout time.Duration) *replica {
	t.Helper()
	var ws []gateway.Worker
	for i := range workers {
		ws = append(ws, gateway.Worker{ID: fmt.Sprintf("w%d", i), Addr: "127.0.0.1:1", Model: "llama"})
	}
	g, err := gateway.New(gateway.Config{Workers: ws})
	if err != nil {
		t.Fatal(err)
	}
	reg := prometheus.NewRegistry()
	s, err := Start(g, Options{
		URL: url, Registerer: reg, ReconnectWait: 50 * time.Millisecond,
		Load: g, LoadInterval: 5 * time.Millisecond, Heartbeat: testHeartbeat, PeerTimeout: peerTimeout,
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Close)
	g.SetPlacementPublisher(s)
	return &replica{g: g, sync: s, reg: reg}
}

// peerRouted is r's view of the other replicas' tracked requests on worker.
func peerRouted(r *replica, worker string) int {
	for _, ws := range r.g.Workers() {
		if ws.ID == worker {
			return ws.PeerRouted
		}
	}
	return -1
}

func peersGauge(t testing.TB, reg *prometheus.Registry) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() == "kvrelay_gateway_nats_peers" {
			return mf.GetMetric()[0].GetGauge().GetValue()
		}
	}
	t.Fatal("no kvrelay_gateway_nats_peers")
	return 0
}

// loadOnA routes three tracked requests with one prompt on a (w0: ties go
// to the first name, and placements keep the rest with it) and waits until
// b counts them.
func loadOnA(t *testing.T, a, b *replica) []gateway.Decision {
	t.Helper()
	var ds []gateway.Decision
	for range 3 {
		d := routeTracked(t, a, prompt(0, 64))
		if d.Worker != "w0" {
			t.Fatalf("a routed to %s, want w0", d.Worker)
		}
		ds = append(ds, d)
	}
	eventually(t, "b counts a's requests", func() bool { return peerRouted(b, "w0") == 3 })
	return ds
}

// TestLoadSharedBetweenReplicas: requests a replica routed to a worker make
// another replica send non-overlapping requests elsewhere, and completing
// them gives the worker back. Without shared counts, b's first request
// would go to w0 (both idle to b, ties to the first name).
func TestLoadSharedBetweenReplicas(t *testing.T) {
	url := runNATS(t).URL()
	a, b := startLoadReplica(t, url, 2), startLoadReplica(t, url, 2)
	eventually(t, "each sees the other", func() bool { return a.sync.Peers() == 1 && b.sync.Peers() == 1 })
	if got := peersGauge(t, b.reg); got != 1 {
		t.Errorf("kvrelay_gateway_nats_peers = %v, want 1", got)
	}
	onA := loadOnA(t, a, b)
	for i := range 3 {
		if d := routeTracked(t, b, prompt(10000*(i+1), 64)); d.Worker != "w1" {
			t.Fatalf("b's request %d went to %s (%s), want w1: w0 has a's 3 in flight", i, d.Worker, d.Reason)
		}
	}
	// b's own counts reach a the same way; a's own are not echoed back.
	eventually(t, "a counts b's requests", func() bool { return peerRouted(a, "w1") == 3 })
	if got := peerRouted(a, "w0"); got != 0 {
		t.Errorf("a counts %d peer requests on w0, want 0 (its own are not added twice)", got)
	}
	for _, d := range onA {
		d.Done()
	}
	eventually(t, "b sees a's requests complete", func() bool { return peerRouted(b, "w0") == 0 })
	if got := testutil.ToFloat64(b.sync.load.shared.WithLabelValues("received")); got < 2 {
		t.Errorf("b received %v snapshots", got)
	}
}

// TestLoadPeerAgesOut: a replica that stops (its connection closed, no
// goodbye) stops counting on the others after the peer timeout.
func TestLoadPeerAgesOut(t *testing.T) {
	url := runNATS(t).URL()
	a, b := startLoadReplica(t, url, 2), startLoadReplica(t, url, 2)
	eventually(t, "each sees the other", func() bool { return a.sync.Peers() == 1 && b.sync.Peers() == 1 })
	loadOnA(t, a, b)
	a.sync.nc.Close() // as a crashed process: the loop still runs, its publishes fail
	eventually(t, "a's counts age out on b", func() bool { return peerRouted(b, "w0") == 0 && b.sync.Peers() == 0 })
	if got := peersGauge(t, b.reg); got != 0 {
		t.Errorf("kvrelay_gateway_nats_peers = %v, want 0", got)
	}
	if d := routeTracked(t, b, prompt(10000, 64)); d.Worker != "w0" {
		t.Errorf("b routed to %s, want w0 (idle again by its own counts)", d.Worker)
	}
}

// TestLoadNATSLost: the server goes away during a run; each replica drops
// the other's counts, routes on its own, and shares again once NATS is back.
func TestLoadNATSLost(t *testing.T) {
	ns := runNATS(t)
	url := ns.URL()
	a, b := startLoadReplica(t, url, 2), startLoadReplica(t, url, 2)
	eventually(t, "each sees the other", func() bool { return a.sync.Peers() == 1 && b.sync.Peers() == 1 })
	loadOnA(t, a, b)

	ns.Stop()
	eventually(t, "a's counts age out on b", func() bool { return peerRouted(b, "w0") == 0 && b.sync.Peers() == 0 })
	if d := routeTracked(t, b, prompt(10000, 64)); d.Worker != "w0" {
		t.Errorf("b routed to %s during the outage, want w0 (its own counts: all idle)", d.Worker)
	}
	if d := routeTracked(t, b, prompt(20000, 64)); d.Worker != "w1" {
		t.Errorf("b routed to %s during the outage, want w1 (its own request on w0)", d.Worker)
	}
	eventually(t, "snapshots dropped while down", func() bool {
		return testutil.ToFloat64(a.sync.load.shared.WithLabelValues("dropped")) >= 1
	})

	ns.Restart()
	eventually(t, "a's counts back on b", func() bool { return peerRouted(b, "w0") == 3 && b.sync.Peers() == 1 })
	eventually(t, "b's counts back on a", func() bool { return peerRouted(a, "w0") == 1 && peerRouted(a, "w1") == 1 })
}

// TestLoadRejectsGarbageAndTooManyPeers: undecodable snapshots and peers
// past MaxPeers are counted and ignored.
func TestLoadRejectsGarbageAndTooManyPeers(t *testing.T) {
	url := runNATS(t).URL()
	// The fake peers never send again: a's timeout must outlast the test.
	a, b := startLoadReplicaTimeout(t, url, 2, time.Hour), startLoadReplica(t, url, 2)
	eventually(t, "each sees the other", func() bool { return a.sync.Peers() == 1 && b.sync.Peers() == 1 })
	if err := b.sync.nc.Publish(a.sync.load.subject, []byte{1, 200}); err != nil {
		t.Fatal(err)
	}
	for i := range MaxPeers {
		msg := encodeLoad(nil, fmt.Sprintf("fake%d", i), []string{"w1"}, []int{1})
		if err := b.sync.nc.Publish(a.sync.load.subject, msg); err != nil {
			t.Fatal(err)
		}
	}
	// b is one peer, so one of the fakes is over the limit, plus the garbage.
	eventually(t, "rejections counted", func() bool {
		return testutil.ToFloat64(a.sync.load.shared.WithLabelValues("rejected")) == 2
	})
	if got := a.sync.Peers(); got != MaxPeers {
		t.Errorf("a tracks %d peers, want MaxPeers %d", got, MaxPeers)
	}
	if got := peerRouted(a, "w1"); got != MaxPeers-1 {
		t.Errorf("a counts %d peer requests on w1, want %d", got, MaxPeers-1)
	}
}
