package gateway

import (
	"fmt"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrelay/kvrelay/gateway/index"
)

type gatewayMetrics struct {
	routes       *prometheus.CounterVec // model, reason
	routeSeconds prometheus.Histogram
}

func newGatewayMetrics(reg prometheus.Registerer, g *Gateway) (*gatewayMetrics, error) {
	m := &gatewayMetrics{
		routes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvrelay_gateway_route_decisions_total",
			Help: "Routing decisions, by model and reason (event_hit, event_spill, no_overlap).",
		}, []string{"model", "reason"}),
		routeSeconds: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "kvrelay_gateway_route_seconds",
			Help:    "Time to route one request: prefix lookup and choice.",
			Buckets: prometheus.ExponentialBuckets(1e-6, 4, 10),
		}),
	}
	if reg == nil {
		return m, nil
	}
	for _, c := range []prometheus.Collector{m.routes, m.routeSeconds, indexCollector{g}} {
		if err := reg.Register(c); err != nil {
			return nil, fmt.Errorf("gateway metrics: %w", err)
		}
	}
	return m, nil
}

// indexCollector reads the indexes' sizes at scrape time: counting blocks on
// every applied batch would put a pass over the index on the event path.
type indexCollector struct{ g *Gateway }

var (
	indexBlocksDesc = prometheus.NewDesc("kvrelay_gateway_index_blocks",
		"Engine blocks the model's index holds for the worker.", []string{"model", "worker"}, nil)
	indexEntriesDesc = prometheus.NewDesc("kvrelay_gateway_index_entries",
		"Distinct prefix entries in the model's index.", []string{"model"}, nil)
	indexMembershipsDesc = prometheus.NewDesc("kvrelay_gateway_index_memberships",
		"Prefix entries counted once per holding worker.", []string{"model"}, nil)
	indexMemoryDesc = prometheus.NewDesc("kvrelay_gateway_index_memory_bytes",
		"Estimated size of the model's index tables.", []string{"model"}, nil)
	inflightDesc = prometheus.NewDesc("kvrelay_gateway_inflight_requests",
		"Last reported in-flight requests per worker.", []string{"worker"}, nil)
)

func (c indexCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- indexBlocksDesc
	ch <- indexEntriesDesc
	ch <- indexMembershipsDesc
	ch <- indexMemoryDesc
	ch <- inflightDesc
}

func (c indexCollector) Collect(ch chan<- prometheus.Metric) {
	g := c.g
	g.mu.Lock()
	ixs := make(map[string]*index.Index, len(g.models))
	for name, m := range g.models {
		ixs[name] = m.ix
	}
	inflight := make(map[string]int, len(g.workerOf))
	for w := range g.workerOf {
		inflight[w] = g.inflight[w]
	}
	g.mu.Unlock()
	for name, ix := range ixs {
		st := ix.Stats()
		ch <- prometheus.MustNewConstMetric(indexEntriesDesc, prometheus.GaugeValue, float64(st.Entries), name)
		ch <- prometheus.MustNewConstMetric(indexMembershipsDesc, prometheus.GaugeValue, float64(st.Memberships), name)
		ch <- prometheus.MustNewConstMetric(indexMemoryDesc, prometheus.GaugeValue, float64(st.MemoryBytes), name)
		for w, ws := range st.Workers {
			ch <- prometheus.MustNewConstMetric(indexBlocksDesc, prometheus.GaugeValue, float64(ws.Blocks), name, w)
		}
	}
	for w, n := range inflight {
		ch <- prometheus.MustNewConstMetric(inflightDesc, prometheus.GaugeValue, float64(n), w)
	}
}
