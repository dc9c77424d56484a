package natsevents

import (
	"context"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrelay/kvrelay/gateway/index"
	"github.com/kvrelay/kvrelay/gateway/monitor"
	"github.com/kvrelay/kvrelay/proto/kvpb"
	"github.com/kvrelay/kvrelay/testkit/testrelay"
)

// lagSink is an index that also records, for every live batch it applies,
// how long after the engine stamped it the batch reached the index.
type lagSink struct {
	*index.Index
	mu   sync.Mutex
	lags []time.Duration
	seen int
}

func (s *lagSink) Apply(w string, b *kvpb.KvEventBatch) {
	s.Index.Apply(w, b)
	if b.GetSnapshot() != nil || b.GetTimestamp() == 0 {
		return
	}
	lag := time.Since(time.Unix(0, int64(b.GetTimestamp()*1e9)))
	s.mu.Lock()
	s.lags = append(s.lags, lag)
	s.seen++
	s.mu.Unlock()
}

func (s *lagSink) count() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.seen
}

// follow runs a monitor over sink for the worker; open nil is plain gRPC.
func follow(b *testing.B, w monitor.Worker, sink monitor.Sink, open monitor.StreamOpener) {
	mon, err := monitor.New(monitor.Options{OpenStream: open})
	if err != nil {
		b.Fatal(err)
	}
	if err := mon.Add(w, sink); err != nil {
		b.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = mon.Run(ctx) }()
	b.Cleanup(func() { cancel(); <-done })
}

func percentile(lags []time.Duration, p float64) float64 {
	if len(lags) == 0 {
		return 0
	}
	s := slices.Clone(lags)
	slices.Sort(s)
	return float64(s[int(p*float64(len(s)-1))].Microseconds())
}

// BenchmarkPublishToIndex: one engine step (one batch) at a time, from the
// engine's stamp to a replica's index, over JetStream (the sink, the
// stream, a Source-fed monitor) and over gRPC, measured in the same run on
// the same batches. It also reports what JetStream carries per batch.
func BenchmarkPublishToIndex(b *testing.B) {
	js := startJetStream(b)
	w := startWorker(b, "bench", 1)
	reg := prometheus.NewRegistry()
	sink, err := NewSink(w.rel, SinkOptions{URL: js.URL(), Worker: w.name, Registerer: reg, RetryWait: 50 * time.Millisecond})
	if err != nil {
		b.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	sdone := make(chan struct{})
	go func() { defer close(sdone); _ = sink.Run(ctx) }()
	b.Cleanup(func() { cancel(); <-sdone; sink.Close() })
	w.run(5)
	eventually(b, "the first snapshot", func() bool {
		return counterValue(reg, "kvrelay_nats_events_snapshots_total", "result", "written") >= 1
	})

	src, err := NewSource(SourceOptions{URL: js.URL(), Names: map[string]string{"n": w.name}})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(src.Close)
	viaNATS := &lagSink{Index: index.New(index.Options{})}
	viaGRPC := &lagSink{Index: index.New(index.Options{})}
	follow(b, monitor.Worker{ID: "n", Addr: deadAddr}, viaNATS, src.Open)
	follow(b, monitor.Worker{ID: "g", Addr: w.addr}, viaGRPC, nil)
	eventually(b, "both replicas exact", func() bool {
		want := testrelay.EngineLive(w.eng)
		return slices.Equal(viaNATS.LiveSet("n"), want) && slices.Equal(viaGRPC.LiveSet("g"), want)
	})
	viaNATS.mu.Lock()
	viaNATS.lags, viaNATS.seen = nil, 0
	viaNATS.mu.Unlock()
	viaGRPC.mu.Lock()
	viaGRPC.lags, viaGRPC.seen = nil, 0
	viaGRPC.mu.Unlock()
	msgs0 := counterValue(reg, "kvrelay_nats_events_published_total", "result", "stored")
	bytes0 := counterValue(reg, "kvrelay_nats_events_published_bytes_total")
	info0 := streamState(b, js.URL())

	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		before := viaNATS.count()
		if _, err := w.eng.Step(); err != nil {
			b.Fatal(err)
		}
		// One batch at a time: wait until it reached both indexes.
		eventually(b, "the batch in both indexes", func() bool {
			return viaNATS.count() > before && viaGRPC.count() >= viaNATS.count()
		})
	}
	b.StopTimer()
	b.ReportMetric(percentile(viaNATS.lags, 0.5), "nats-p50-µs")
	b.ReportMetric(percentile(viaNATS.lags, 0.99), "nats-p99-µs")
	b.ReportMetric(percentile(viaGRPC.lags, 0.5), "grpc-p50-µs")
	b.ReportMetric(percentile(viaGRPC.lags, 0.99), "grpc-p99-µs")
	msgs := counterValue(reg, "kvrelay_nats_events_published_total", "result", "stored") - msgs0
	if msgs > 0 {
		b.ReportMetric((counterValue(reg, "kvrelay_nats_events_published_bytes_total")-bytes0)/msgs, "payload-B/batch")
		info := streamState(b, js.URL())
		b.ReportMetric(float64(info.Bytes-info0.Bytes)/float64(info.Msgs-info0.Msgs), "stored-B/msg")
		b.ReportMetric(float64(info.Msgs-info0.Msgs)/msgs, "msgs/batch")
	}
}

func streamState(b *testing.B, url string) jetstream.StreamState {
	_, jsc := jetStreamClient(b, url)
	st, err := jsc.Stream(context.Background(), DefaultStream)
	if err != nil {
		b.Fatal(err)
	}
	info, err := st.Info(context.Background())
	if err != nil {
		b.Fatal(err)
	}
	return info.State
}

// counterValue is metricValue for a benchmark, 0 when reg cannot be read.
func counterValue(reg *prometheus.Registry, name string, labels ...string) float64 {
	v, _ := metricValue(reg, name, labels...)
	return v
}

// metricValue reads the counters or gauges of reg whose labels include
// the given name/value pairs, summed (one series when the pairs name
// one), 0 if absent.
func metricValue(reg prometheus.Gatherer, name string, labels ...string) (float64, error) {
	var sum float64
	mfs, err := reg.Gather()
	if err != nil {
		return 0, err
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	metric:
		for _, m := range mf.GetMetric() {
			for i := 0; i+1 < len(labels); i += 2 {
				found := false
				for _, l := range m.GetLabel() {
					found = found || (l.GetName() == labels[i] && l.GetValue() == labels[i+1])
				}
				if !found {
					continue metric
				}
			}
			sum += m.GetCounter().GetValue() + m.GetGauge().GetValue()
		}
	}
	return sum, nil
}
