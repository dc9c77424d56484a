package placementsync

import (
	"slices"
	"testing"
	"time"
)

// arrivals is a Target that reports when each placement arrived.
type arrivals chan time.Time

func (a arrivals) ApplyPlacement(string, string, []uint64) error {
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
