package placementsync

import (
	"fmt"
	"maps"
	"slices"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
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

// peerRoutedAll is r's view of the other replicas' tracked requests per
// worker, every worker listed.
func peerRoutedAll(r *replica) map[string]int {
	out := map[string]int{}
	for _, ws := range r.g.Workers() {
		out[ws.ID] = ws.PeerRouted
	}
	return out
}

// allEqual says whether every worker of counts has n.
func allEqual(counts map[string]int, n int) bool {
	for _, c := range counts {
		if c != n {
			return false
		}
	}
	return true
}

// fleetSize is past MaxLoadWorkers by enough for three parts.
const fleetSize = 10000

// TestLoadSharedAt10000Workers: a replica with requests in flight on
// 10,000 workers shares every one of them (before parts, the peer saw the
// most loaded 4,096), and when it stops they all age out on the peer.
func TestLoadSharedAt10000Workers(t *testing.T) {
	url := runNATS(t).URL()
	a, b := startLoadReplica(t, url, fleetSize), startLoadReplica(t, url, fleetSize)
	eventually(t, "each sees the other", func() bool { return a.sync.Peers() == 1 && b.sync.Peers() == 1 })
	// Distinct prompts go to the least loaded worker: one on each.
	for i := range fleetSize {
		routeTracked(t, a, prompt(1000*i, 16))
	}
	if own, _ := a.g.RoutedCounts(); len(own) != fleetSize || !allEqual(own, 1) {
		t.Fatalf("a tracks requests on %d workers, want one on each of %d", len(own), fleetSize)
	}
	eventually(t, "b counts a's request on every worker", func() bool { return allEqual(peerRoutedAll(b), 1) })
	if got := testutil.ToFloat64(b.sync.load.shared.WithLabelValues("rejected")); got != 0 {
		t.Errorf("b rejected %v messages", got)
	}
	if got := testutil.ToFloat64(a.sync.load.cut); got != 0 {
		t.Errorf("a cut %v workers", got)
	}

	a.sync.nc.Close() // as a crashed process: no goodbye
	eventually(t, "a's counts age out on b", func() bool { return b.sync.Peers() == 0 && allEqual(peerRoutedAll(b), 0) })
}

// fakeLoadPeer publishes load messages as replica id on r's subject.
type fakeLoadPeer struct {
	t       *testing.T
	nc      *nats.Conn
	subject string
	id      string
	gen     uint64
}

func newFakeLoadPeer(t *testing.T, url string, r *replica, id string) *fakeLoadPeer {
	nc, err := nats.Connect(url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	return &fakeLoadPeer{t: t, nc: nc, subject: r.sync.load.subject, id: id}
}

// send publishes a new generation with n on every one of fleetSize
// workers, leaving out the parts in lose; it returns the part count.
func (f *fakeLoadPeer) send(n int, lose ...int) int {
	counts := map[string]int{}
	for i := range fleetSize {
		counts[fmt.Sprintf("w%d", i)] = n
	}
	f.gen++
	msgs, _ := encodeSnapshot(f.id, f.gen, counts, int(f.nc.MaxPayload()))
	for i, msg := range msgs {
		if slices.Contains(lose, i) {
			continue
		}
		if err := f.nc.Publish(f.subject, msg); err != nil {
			f.t.Error(err)
		}
	}
	if err := f.nc.Flush(); err != nil {
		f.t.Error(err)
	}
	return len(msgs)
}

// TestLoadLostPart: a snapshot one of whose parts is lost is never applied
// in part (the peer's previous snapshot stays whole), the next whole one
// is, and a peer whose parts keep getting lost ages out even though it
// keeps sending.
func TestLoadLostPart(t *testing.T) {
	url := runNATS(t).URL()
	b := startLoadReplica(t, url, fleetSize)
	f := newFakeLoadPeer(t, url, b, "fake")
	if parts := f.send(1); parts != 3 {
		t.Fatalf("%d parts for %d workers, want 3", parts, fleetSize)
	}
	eventually(t, "b counts the fake's snapshot", func() bool { return allEqual(peerRoutedAll(b), 1) })

	// Its next snapshot loses its middle part, then one loses its last:
	// the second replaces the first before completing.
	f.send(2, 1)
	f.send(3, 2)
	f.send(4) // whole
	eventually(t, "the whole snapshot after the broken ones applied", func() bool { return allEqual(peerRoutedAll(b), 4) })
	if got := testutil.ToFloat64(b.sync.load.shared.WithLabelValues("incomplete")); got != 2 {
		t.Errorf("%v incomplete snapshots counted, want 2", got)
	}

	// From now on every snapshot loses a part: b keeps the last whole one,
	// never a mix, until the peer times out.
	deadline := time.Now().Add(waitFor)
	for n := 5; ; n++ {
		f.send(n, n%3)
		counts := peerRoutedAll(b)
		if allEqual(counts, 0) && b.sync.Peers() == 0 {
			break
		}
		// Each worker holds the last whole snapshot's 4, or 0 once the peer
		// timed out: the workers are read one by one, so a read racing the
		// time-out may see both. Any other value is a broken snapshot's.
		for w, c := range counts {
			if c != 4 && c != 0 {
				t.Fatalf("b applied part of a broken snapshot: %s=%d", w, c)
			}
		}
		if time.Now().After(deadline) {
			t.Fatal("a peer whose parts keep getting lost never aged out")
		}
		time.Sleep(20 * time.Millisecond)
	}
	f.send(6) // whole again: back
	eventually(t, "the peer back with a whole snapshot", func() bool { return allEqual(peerRoutedAll(b), 6) && b.sync.Peers() == 1 })
}

// lastPeerRouted is a LoadSource with nothing of its own that keeps the
// peers' counts it was last given.
type lastPeerRouted struct{ got map[string]int }

func (*lastPeerRouted) RoutedCounts() (map[string]int, uint64) { return nil, 0 }
func (*lastPeerRouted) RoutedVersion() uint64                  { return 0 }
func (*lastPeerRouted) RoutedChanged() <-chan struct{}         { return nil }
func (s *lastPeerRouted) SetPeerRouted(m map[string]int)       { s.got = maps.Clone(m) }

// TestLoadPartsCollected: how a receiver collects one peer's parts, message
// by message (no NATS: the order and losses are the test's).
func TestLoadPartsCollected(t *testing.T) {
	part := func(gen uint64, i, n int, counts map[string]int) []byte {
		names, vals := []string{}, []int{}
		for w, c := range counts {
			names, vals = append(names, w), append(vals, c)
		}
		return encodeLoadPart(nil, "p", gen, i, n, names, vals)
	}
	whole := encodeLoad(nil, "p", []string{"z"}, []int{9})
	for _, tc := range []struct {
		name     string
		msgs     [][]byte
		want     map[string]int // nil: nothing applied
		rejected float64
		incompl  float64
	}{
		{"in order", [][]byte{part(1, 0, 2, map[string]int{"a": 1}), part(1, 1, 2, map[string]int{"b": 2})}, map[string]int{"a": 1, "b": 2}, 0, 0},
		{"out of order", [][]byte{part(1, 1, 2, map[string]int{"b": 2}), part(1, 0, 2, map[string]int{"a": 1})}, map[string]int{"a": 1, "b": 2}, 0, 0},
		{"one part missing", [][]byte{part(1, 0, 3, map[string]int{"a": 1}), part(1, 2, 3, map[string]int{"c": 1})}, nil, 0, 0},
		{"a part repeated", [][]byte{part(1, 0, 2, map[string]int{"a": 1}), part(1, 0, 2, map[string]int{"a": 5}), part(1, 1, 2, map[string]int{"b": 2})}, map[string]int{"a": 1, "b": 2}, 1, 0},
		{"a worker in two parts", [][]byte{part(1, 0, 2, map[string]int{"a": 1}), part(1, 1, 2, map[string]int{"a": 2})}, nil, 1, 0},
		{"a generation dropped for a worker in two parts ignores its later parts", [][]byte{part(1, 0, 3, map[string]int{"a": 1}), part(1, 1, 3, map[string]int{"a": 2}), part(1, 2, 3, map[string]int{"c": 1}), whole}, map[string]int{"z": 9}, 1, 0},
		{"next generation drops the unfinished one, whose late part is ignored", [][]byte{part(1, 0, 2, map[string]int{"a": 1}), part(2, 1, 2, map[string]int{"b": 2}), part(1, 1, 2, map[string]int{"x": 1}), part(2, 0, 2, map[string]int{"c": 3})}, map[string]int{"b": 2, "c": 3}, 0, 1},
		{"a part of a generation applied already", [][]byte{part(2, 0, 2, map[string]int{"a": 1}), part(2, 1, 2, map[string]int{"b": 2}), part(1, 0, 2, map[string]int{"x": 1}), part(1, 1, 2, map[string]int{"y": 1})}, map[string]int{"a": 1, "b": 2}, 0, 0},
		{"a whole snapshot drops the unfinished one", [][]byte{part(1, 0, 2, map[string]int{"a": 1}), whole}, map[string]int{"z": 9}, 0, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			src := &lastPeerRouted{}
			l := newLoadShare(src, Options{})
			for _, m := range tc.msgs {
				l.receive(&nats.Msg{Data: m})
			}
			if !maps.Equal(src.got, tc.want) || (src.got == nil) != (tc.want == nil) {
				t.Errorf("applied %v, want %v", src.got, tc.want)
			}
			if got := testutil.ToFloat64(l.shared.WithLabelValues("rejected")); got != tc.rejected {
				t.Errorf("rejected %v, want %v", got, tc.rejected)
			}
			if got := testutil.ToFloat64(l.shared.WithLabelValues("incomplete")); got != tc.incompl {
				t.Errorf("incomplete %v, want %v", got, tc.incompl)
			}
			// A peer is live once one whole snapshot of it is in.
			wantLive := 0
			if tc.want != nil {
				wantLive = 1
			}
			if live := l.livePeers(); live != wantLive {
				t.Errorf("%d live peers, want %d", live, wantLive)
			}
		})
	}
}
