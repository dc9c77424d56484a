package gateway

import (
	"fmt"
	"strconv"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrelay/kvrelay/gateway/index"
	"github.com/kvrelay/kvrelay/gateway/placement"
)

type gatewayMetrics struct {
	routes          *prometheus.CounterVec // model, reason
	routeSeconds    prometheus.Histogram
	inflightExpired prometheus.Counter
	loadPolls       loadPollMetrics
	// Partitioned: answers the merge refused, and block sizes other
	// partitions' answers offered (adopted or refused, by why).
	answersDropped prometheus.Counter
	blockSizes     *prometheus.CounterVec // model, outcome
	// fleetSyncs counts the walks that bring the fleets in line with
	// reachability, draining and membership, by scope.
	fleetSyncs                     *prometheus.CounterVec // scope
	fleetSyncsAll, fleetSyncsModel prometheus.Counter
	fleetSyncsWorkers              prometheus.Counter
}

func newGatewayMetrics(reg prometheus.Registerer, g *Gateway) (*gatewayMetrics, error) {
	m := &gatewayMetrics{
		routes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvrelay_gateway_route_decisions_total",
			Help: "Routing decisions, by model and reason (event_hit, placement_hit, event_spill, no_overlap, kv_pressure).",
		}, []string{"model", "reason"}),
		routeSeconds: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "kvrelay_gateway_route_seconds",
			Help:    "Time to route one request: prefix lookup and choice.",
			Buckets: prometheus.ExponentialBuckets(1e-6, 4, 10),
		}),
		inflightExpired: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvrelay_gateway_inflight_expired_total",
			Help: "Tracked requests that stopped counting as in flight because nobody completed them within the timeout.",
		}),
		loadPolls: newLoadPollMetrics(),
		answersDropped: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvrelay_gateway_partition_answers_dropped_total",
			Help: "Partitioned: answers a route dropped because they claimed this replica's own partition or one outside the tier.",
		}),
		blockSizes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvrelay_gateway_partition_block_sizes_total",
			Help: "Partitioned: larger block sizes other partitions' answers offered for a model, by outcome: adopted; not_assigned (the answering partition owns none of the model's workers here); too_large (above the largest block size any engine uses).",
		}, []string{"model", "outcome"}),
		fleetSyncs: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvrelay_gateway_fleet_syncs_total",
			Help: "Times the routing fleets were brought in line with the workers' reachability, draining and membership, by scope: all (every model's workers walked, under the gateway's lock: a worker's own stream state, draining or membership changed); model (one model's workers: another partition's answer made none of them reachable, or one again); workers (only the workers another partition's answer said the opposite of its last answer about). Partitioned replicas of one partition that disagree on a worker show as a steady rate of workers syncs.",
		}, []string{"scope"}),
	}
	m.fleetSyncsAll = m.fleetSyncs.WithLabelValues("all")
	m.fleetSyncsModel = m.fleetSyncs.WithLabelValues("model")
	m.fleetSyncsWorkers = m.fleetSyncs.WithLabelValues("workers")
	if reg == nil {
		return m, nil
	}
	for _, c := range []prometheus.Collector{m.routes, m.routeSeconds, m.inflightExpired, m.loadPolls.polls, m.loadPolls.failures, m.answersDropped, m.blockSizes, m.fleetSyncs, indexCollector{g}} {
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
	indexUnindexedDesc = prometheus.NewDesc("kvrelay_gateway_index_unindexed_blocks_total",
		"Stored blocks the model's index left out for the worker because the index had no run id left for the run they would start (2^24 - 2 live runs a model); lookups under-report the worker for them until runs are freed.", []string{"model", "worker"}, nil)
	indexUnknownRemovalsDesc = prometheus.NewDesc("kvrelay_gateway_index_unknown_removals_total",
		"Removals of a block (or tier copy) the model's index did not hold for the worker: blocks left out at the run cap, or stores the index never saw.", []string{"model", "worker"}, nil)
	indexMemoryDesc = prometheus.NewDesc("kvrelay_gateway_index_memory_bytes",
		"Estimated size of the model's index tables.", []string{"model"}, nil)
	inflightDesc = prometheus.NewDesc("kvrelay_gateway_inflight_requests",
		"In-flight requests per worker as the picker counts them: the larger of the last client report and the tracked requests routed and not completed.", []string{"worker"}, nil)
	cacheHitRateDesc = prometheus.NewDesc("kvrelay_gateway_engine_cache_hit_rate",
		"The engine's own prefix-cache hit rate, from its last load record that carried one.", []string{"model", "worker", "rank"}, nil)
	placementsDesc = prometheus.NewDesc("kvrelay_gateway_placements",
		"Placements the gateway holds for the model: blocks of requests it routed, recorded on the chosen worker until the engine reports them.", []string{"model"}, nil)
	placementsEndedDesc = prometheus.NewDesc("kvrelay_gateway_placements_ended_total",
		"Placements that ended, by how: confirmed (the index then held the block), expired (TTL), evicted (entry cap), removed (worker removed).", []string{"model", "how"}, nil)
	blockSizeDesc = prometheus.NewDesc("kvrelay_gateway_block_size",
		"Block size (tokens) learned from the model's KV events, or (partitioned) adopted from another partition's answer; absent until one is seen.", []string{"model"}, nil)
)

func (c indexCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- indexBlocksDesc
	ch <- indexEntriesDesc
	ch <- indexMembershipsDesc
	ch <- indexMemoryDesc
	ch <- indexUnindexedDesc
	ch <- indexUnknownRemovalsDesc
	ch <- inflightDesc
	ch <- cacheHitRateDesc
	ch <- engineLoadAgeDesc
	ch <- blockSizeDesc
	ch <- placementsDesc
	ch <- placementsEndedDesc
}

func (c indexCollector) Collect(ch chan<- prometheus.Metric) {
	g := c.g
	g.mu.Lock()
	ixs := make(map[string]*index.Index, len(g.models))
	places := make(map[string]*placement.Store, len(g.models))
	learned := make(map[string]int, len(g.models))
	for name, m := range g.models {
		ixs[name] = m.ix
		learned[name] = int(m.learnedBlock.Load())
		if m.places != nil {
			places[name] = m.places
		}
	}
	inflight := make(map[string]int, len(g.workerOf))
	type hitRate struct {
		model, worker, rank string
		rate                float64
	}
	var hitRates []hitRate
	type age struct {
		model, worker, rank, source string
		seconds                     float64
	}
	var ages []age
	now := g.now()
	for w, model := range g.workerOf {
		inflight[w] = g.inflightLocked(w)
		for rank, l := range g.engine[w] {
			if l.CacheHitRate != nil {
				hitRates = append(hitRates, hitRate{model, w, strconv.Itoa(int(rank)), *l.CacheHitRate})
			}
			ages = append(ages, age{model, w, strconv.Itoa(int(rank)), l.Source, now.Sub(l.At).Seconds()})
		}
	}
	g.mu.Unlock()
	for _, a := range ages {
		ch <- prometheus.MustNewConstMetric(engineLoadAgeDesc, prometheus.GaugeValue, a.seconds, a.model, a.worker, a.rank, a.source)
	}
	for _, h := range hitRates {
		ch <- prometheus.MustNewConstMetric(cacheHitRateDesc, prometheus.GaugeValue, h.rate, h.model, h.worker, h.rank)
	}
	for name := range ixs {
		// The largest learned here: the own workers' (the monitor's) or,
		// partitioned, one adopted from another partition.
		if n := max(g.mon.BlockSize(name), learned[name]); n > 0 {
			ch <- prometheus.MustNewConstMetric(blockSizeDesc, prometheus.GaugeValue, float64(n), name)
		}
	}
	for name, ix := range ixs {
		st := ix.Stats()
		ch <- prometheus.MustNewConstMetric(indexEntriesDesc, prometheus.GaugeValue, float64(st.Entries), name)
		ch <- prometheus.MustNewConstMetric(indexMembershipsDesc, prometheus.GaugeValue, float64(st.Memberships), name)
		ch <- prometheus.MustNewConstMetric(indexMemoryDesc, prometheus.GaugeValue, float64(st.MemoryBytes), name)
		for w, ws := range st.Workers {
			ch <- prometheus.MustNewConstMetric(indexBlocksDesc, prometheus.GaugeValue, float64(ws.Blocks), name, w)
			ch <- prometheus.MustNewConstMetric(indexUnindexedDesc, prometheus.CounterValue, float64(ws.Counters.UnindexedBlocks), name, w)
			ch <- prometheus.MustNewConstMetric(indexUnknownRemovalsDesc, prometheus.CounterValue, float64(ws.Counters.UnknownRemovals), name, w)
		}
	}
	for name, p := range places {
		st := p.Stats()
		ch <- prometheus.MustNewConstMetric(placementsDesc, prometheus.GaugeValue, float64(st.Entries), name)
		for how, n := range map[string]uint64{"confirmed": st.Confirmed, "expired": st.Expired, "evicted": st.Evicted, "removed": st.Removed} {
			ch <- prometheus.MustNewConstMetric(placementsEndedDesc, prometheus.CounterValue, float64(n), name, how)
		}
	}
	for w, n := range inflight {
		ch <- prometheus.MustNewConstMetric(inflightDesc, prometheus.GaugeValue, float64(n), w)
	}
}
