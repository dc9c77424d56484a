package demo

import (
	"github.com/prometheus/client_golang/prometheus"
)

// counterSum adds up a counter (or gauge) family over registries, keeping
// only the series whose labels include every pair in match. The demo reads
// the relays' own Prometheus series, so the table shows what an operator's
// dashboard would, not a second bookkeeping of the demo's.
func counterSum(regs []*prometheus.Registry, name string, match map[string]string) float64 {
	var sum float64
	for _, reg := range regs {
		mfs, err := reg.Gather()
		if err != nil {
			// Gather returns what it could collect alongside the error.
			if len(mfs) == 0 {
				continue
			}
		}
		for _, mf := range mfs {
			if mf.GetName() != name {
				continue
			}
		series:
			for _, m := range mf.GetMetric() {
				for k, v := range match {
					found := false
					for _, lp := range m.GetLabel() {
						if lp.GetName() == k && lp.GetValue() == v {
							found = true
							break
						}
					}
					if !found {
						continue series
					}
				}
				switch {
				case m.GetCounter() != nil:
					sum += m.GetCounter().GetValue()
				case m.GetGauge() != nil:
					sum += m.GetGauge().GetValue()
				}
			}
		}
	}
	return sum
}

// RelayCounters are the relay figures the table shows, read from the relays'
// Prometheus series and summed over every relay incarnation.
type RelayCounters struct {
	Relayed        uint64 `json:"batches_relayed"`
	Gaps           uint64 `json:"live_gaps"`
	Recovered      uint64 `json:"batches_recovered"`
	Lost           uint64 `json:"batches_lost"`
	ReplaysTrunc   uint64 `json:"replays_truncated"`
	Restarts       uint64 `json:"publisher_restarts"`
	Snapshots      uint64 `json:"snapshots_served"`
	HistoryResumes uint64 `json:"history_resumes"`
	OutOfRange     uint64 `json:"out_of_range"`
	RelayStarts    int    `json:"relay_starts"`
}

func readRelayCounters(regs []*prometheus.Registry) RelayCounters {
	u := func(name string, match map[string]string) uint64 { return uint64(counterSum(regs, name, match)) }
	return RelayCounters{
		Relayed:        u("kvrelay_batches_relayed_total", nil),
		Gaps:           u("kvrelay_publisher_gaps_total", nil),
		Recovered:      u("kvrelay_batches_recovered_total", nil),
		Lost:           u("kvrelay_batches_lost_total", nil),
		ReplaysTrunc:   u("kvrelay_replays_total", map[string]string{"result": "truncated"}),
		Restarts:       u("kvrelay_publisher_restarts_total", nil),
		Snapshots:      u("kvrelay_subscriptions_total", map[string]string{"served": "snapshot"}),
		HistoryResumes: u("kvrelay_subscriptions_total", map[string]string{"served": "history"}),
		OutOfRange:     u("kvrelay_subscriptions_total", map[string]string{"served": "out_of_range"}),
		RelayStarts:    len(regs),
	}
}

func (a RelayCounters) minus(b RelayCounters) RelayCounters {
	return RelayCounters{
		Relayed: a.Relayed - b.Relayed, Gaps: a.Gaps - b.Gaps, Recovered: a.Recovered - b.Recovered,
		Lost: a.Lost - b.Lost, ReplaysTrunc: a.ReplaysTrunc - b.ReplaysTrunc, Restarts: a.Restarts - b.Restarts,
		Snapshots: a.Snapshots - b.Snapshots, HistoryResumes: a.HistoryResumes - b.HistoryResumes,
		OutOfRange: a.OutOfRange - b.OutOfRange, RelayStarts: a.RelayStarts - b.RelayStarts,
	}
}

func (a RelayCounters) plus(b RelayCounters) RelayCounters {
	return RelayCounters{
		Relayed: a.Relayed + b.Relayed, Gaps: a.Gaps + b.Gaps, Recovered: a.Recovered + b.Recovered,
		Lost: a.Lost + b.Lost, ReplaysTrunc: a.ReplaysTrunc + b.ReplaysTrunc, Restarts: a.Restarts + b.Restarts,
		Snapshots: a.Snapshots + b.Snapshots, HistoryResumes: a.HistoryResumes + b.HistoryResumes,
		OutOfRange: a.OutOfRange + b.OutOfRange, RelayStarts: a.RelayStarts + b.RelayStarts,
	}
}
