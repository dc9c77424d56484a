package placementsync

import (
	"fmt"
	"slices"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvrelay/kvrelay/gateway"
)

// arrivals is a Target that reports when each placement arrived.
type arrivals chan time.Time

func (a arrivals) ApplyPlacement(string, string, string, []uint64) error {
	a <- time.Now()
	return nil
}

// BenchmarkPropagation measures how long a placement takes from one
// replica's PublishPlacement to the other's ApplyPlacement, through an
// embedded NATS server on loopback: one 16-block placement at a time, so
// it is latency, not throughput. Reports p50 and p99 in µs; run it with
// -benchtime=1000x for 1,000 placements.
func BenchmarkPropagation(b *testing.B) {
	url := runNATS(b).URL()
	pub, err := Start(arrivals(make(chan time.Time, 1)), Options{URL: url})
	if err != nil {
		b.Fatal(err)
	}
	defer pub.Close()
	got := arrivals(make(chan time.Time, 1))
	sub, err := Start(got, Options{URL: url})
	if err != nil {
		b.Fatal(err)
	}
	defer sub.Close()
	eventually(b, "connected", func() bool { return pub.Connected() && sub.Connected() })
	if err := sub.Flush(waitFor); err != nil {
		b.Fatal(err)
	}
	hashes := make([]uint64, 16)
	for i := range hashes {
		hashes[i] = uint64(i) * 0x9e3779b97f4a7c15
	}
	lat := make([]time.Duration, 0, b.N)
	b.ResetTimer()
	for range b.N {
		start := time.Now()
		pub.PublishPlacement("llama", "grpc://10.0.0.1:50051", hashes)
		select {
		case at := <-got:
			lat = append(lat, at.Sub(start))
		case <-time.After(waitFor):
			b.Fatal("placement never arrived")
		}
	}
	b.StopTimer()
	slices.Sort(lat)
	q := func(p float64) float64 {
		return float64(lat[min(int(p*float64(len(lat))), len(lat)-1)].Microseconds())
	}
	b.ReportMetric(q(0.50), "p50-µs")
	b.ReportMetric(q(0.99), "p99-µs")
	b.ReportMetric(float64(lat[len(lat)-1].Microseconds()), "max-µs")
}

// peerCounts is a LoadSource with nothing of its own in flight that
// reports when the peers' counts it is given change.
type peerCounts chan time.Time

func (peerCounts) RoutedCounts() (map[string]int, uint64) { return nil, 0 }
func (peerCounts) RoutedVersion() uint64                  { return 0 }
func (peerCounts) RoutedChanged() <-chan struct{}         { return nil }
func (p peerCounts) SetPeerRouted(map[string]int) {
	select {
	case p <- time.Now():
	default:
	}
}

// BenchmarkLoadPropagation measures how long a change of a real gateway's
// tracked in-flight count (a tracked route, then its completion) takes to
// reach another replica's picker view, with the default LoadInterval.
// Changes are paced one LoadInterval apart (as requests arriving slower
// than the rate limit), so each is published at once; faster changes wait
// for the rate limit, up to LoadInterval. Reports p50, p99 and max in µs;
// run it with -benchtime=100x for 200 changes.
func BenchmarkLoadPropagation(b *testing.B) {
	url := runNATS(b).URL()
	a := startReplica(b, url, 2) // placements only; the load sync below is the one measured
	aLoad, err := Start(arrivals(make(chan time.Time, 1024)), Options{URL: url, Load: a.g})
	if err != nil {
		b.Fatal(err)
	}
	defer aLoad.Close()
	got := peerCounts(make(chan time.Time, 1))
	sub, err := Start(arrivals(make(chan time.Time, 1024)), Options{URL: url, Load: got})
	if err != nil {
		b.Fatal(err)
	}
	defer sub.Close()
	eventually(b, "peers", func() bool { return sub.Peers() == 1 })
	wait := func(start time.Time) time.Duration {
		select {
		case at := <-got:
			return at.Sub(start)
		case <-time.After(waitFor):
			b.Fatal("count never arrived")
			return 0
		}
	}
	lat := make([]time.Duration, 0, 2*b.N)
	b.ResetTimer()
	for i := range b.N {
		time.Sleep(DefaultLoadInterval) // pacing, not synchronization
		start := time.Now()
		d := routeTracked(b, a, prompt(1000*i, 64))
		lat = append(lat, wait(start))
		time.Sleep(DefaultLoadInterval)
		start = time.Now()
		d.Done()
		lat = append(lat, wait(start))
	}
	b.StopTimer()
	slices.Sort(lat)
	q := func(p float64) float64 {
		return float64(lat[min(int(p*float64(len(lat))), len(lat)-1)].Microseconds())
	}
	b.ReportMetric(q(0.50), "p50-µs")
	b.ReportMetric(q(0.99), "p99-µs")
	b.ReportMetric(float64(lat[len(lat)-1].Microseconds()), "max-µs")
}

// addressNames are n worker names as the gateway names workers by address.
func addressNames(n int) []string {
	names := make([]string, n)
	for i := range names {
		names[i] = fmt.Sprintf("grpc://10.%d.%d.%d:50051", i>>16, i>>8&0xff, i&0xff)
	}
	return names
}

// cpuTime is the process's user and system CPU time.
func cpuTime(b *testing.B) time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		b.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// BenchmarkLoadSnapshot measures one replica's snapshot with a request in
// flight on every one of n workers (named by address, as the gateway
// does): its messages and bytes, the CPU to encode it, and the CPU for a
// receiving replica (a real gateway with those workers) to decode, collect
// and apply it while other peers' snapshots of the same size are live.
// Every iteration's snapshot differs from the last, so each is applied.
func BenchmarkLoadSnapshot(b *testing.B) {
	for _, tc := range []struct{ workers, peers int }{{4096, 1}, {10000, 1}, {10000, 7}} {
		b.Run(fmt.Sprintf("workers=%d/peers=%d", tc.workers, tc.peers), func(b *testing.B) {
			names := addressNames(tc.workers)
			ws := make([]gateway.Worker, len(names))
			counts := [2]map[string]int{{}, {}}
			for i, w := range names {
				ws[i] = gateway.Worker{ID: w, Addr: w, Model: "llama"}
				counts[0][w], counts[1][w] = 1, 2
			}
			g, err := gateway.New(gateway.Config{Workers: ws})
			if err != nil {
				b.Fatal(err)
			}
			l := newLoadShare(g, Options{})
			for p := 1; p < tc.peers; p++ {
				msgs, _ := encodeSnapshot(fmt.Sprintf("peer%d", p), 1, counts[0], 1<<20)
				for _, m := range msgs {
					l.receive(&nats.Msg{Data: m})
				}
			}
			msgs, _ := encodeSnapshot("peer0", 1, counts[0], 1<<20)
			size := 0
			for _, m := range msgs {
				size += len(m)
			}
			var encode, receive time.Duration
			b.ResetTimer()
			for i := range b.N {
				start := cpuTime(b)
				msgs, cut := encodeSnapshot("peer0", uint64(i+2), counts[i%2], 1<<20)
				mid := cpuTime(b)
				for _, m := range msgs {
					l.receive(&nats.Msg{Data: m})
				}
				end := cpuTime(b)
				encode, receive = encode+mid-start, receive+end-mid
				if cut != 0 {
					b.Fatalf("%d workers cut", cut)
				}
			}
			b.StopTimer()
			if got := l.livePeers(); got != tc.peers {
				b.Fatalf("%d live peers, want %d", got, tc.peers)
			}
			if got := peerRouted(&replica{g: g}, names[len(names)-1]); got != tc.peers-1+1+(b.N-1)%2 {
				b.Fatalf("last worker's peer count %d", got)
			}
			b.ReportMetric(float64(len(msgs)), "msgs/snapshot")
			b.ReportMetric(float64(size), "bytes/snapshot")
			b.ReportMetric(float64(encode.Microseconds())/float64(b.N), "encode-cpu-µs/op")
			b.ReportMetric(float64(receive.Microseconds())/float64(b.N), "receive-cpu-µs/op")
		})
	}
}
