package bench

import "slices"

// The tiers the study prices at the target fleet: (worker groups, replicas
// a group). One group is a tier of full copies: (1, 1) is one replica,
// (1, TargetReplicas) today's tier of full copies. The others split the
// fleet's workers into groups (docs/partitioned-tier.md), one or two
// replicas a group.
var fleetTiers = [][2]int{{1, 1}, {1, 0}, {4, 1}, {8, 2}, {16, 1}, {16, 2}}

// Tier basis values.
const (
	TierBasisGroup = "group measured at its real size"
	TierBasisFull  = "full copy: projection band"
)

// tiers prices each tier of fleetTiers from the measured points. A group's
// events and heap are its point's, measured at TargetWorkers/P workers
// with RealCacheBlocks blocks each, so nothing is extrapolated; a full
// copy's are the projection's band. Every group answers every route's
// lookup (its copies share them); the replica a route arrives at hashes
// it once and picks over the whole fleet. The scatter's messaging (NATS
// in and out, the merge) is not in this in-process study: the built
// tier's benchmark measures it.
func (fs *FleetScaleResults) tiers() {
	wl := fs.Workload
	routes := float64(wl.TargetWorkers) * wl.RequestsPerWorkerPerSec
	// The whole fleet's route: the full replica closest to the target.
	full := fs.Larger
	if len(full) == 0 {
		for _, p := range fs.Gateway {
			if p.Workers == wl.TargetWorkers {
				full = append(full, p)
			}
		}
	}
	if len(full) == 0 {
		return
	}
	hash := medianOf(full, func(p GatewayScalePoint) float64 { return p.HashCPUMeanUs })
	pick := medianOf(full, func(p GatewayScalePoint) float64 { return p.PickCPUMeanUs })
	fullLookup := medianOf(full, func(p GatewayScalePoint) float64 { return p.LookupCPUMeanUs })
	pr := fs.Projection
	fs.Tier = nil
	for _, t := range fleetTiers {
		parts, copies := t[0], t[1]
		if copies == 0 {
			copies = wl.TargetReplicas
		}
		r := TierRow{Partitions: parts, Copies: copies, Replicas: parts * copies}
		lookup := fullLookup
		if parts == 1 {
			r.Basis = TierBasisFull
			r.EventsCPULow, r.EventsCPUHigh = pr.CPUPerSecondLow, pr.CPUPerSecondHigh
			r.ReplicaHeapLow, r.ReplicaHeapHigh = pr.IndexBytesLow, pr.IndexBytesHigh
		} else {
			var group []GatewayScalePoint
			for _, p := range fs.Partition {
				if p.Partitions == parts {
					group = append(group, p)
				}
			}
			if len(group) == 0 {
				continue
			}
			r.Basis = TierBasisGroup
			rate := float64(wl.TargetWorkers/parts) * wl.BatchesPerWorkerPerSec
			cpu := spreadOfPoints(group, func(p GatewayScalePoint) float64 { return p.CPUPerBatchUs })
			heap := spreadOfPoints(group, func(p GatewayScalePoint) float64 { return float64(p.HeapBytes) })
			r.EventsCPULow, r.EventsCPUHigh = rate*cpu[0]/1e6, rate*cpu[1]/1e6
			r.ReplicaHeapLow, r.ReplicaHeapHigh = heap[0], heap[1]
			lookup = medianOf(group, func(p GatewayScalePoint) float64 { return p.LookupCPUMeanUs })
		}
		// A group's copies split its lookups; every replica takes an
		// equal share of the routes' hashing and picking.
		r.LookupCPU = routes * lookup / 1e6 / float64(copies)
		r.FrontCPU = routes * (hash + pick) / 1e6 / float64(r.Replicas)
		r.ReplicaCPULow = r.EventsCPULow + r.LookupCPU + r.FrontCPU
		r.ReplicaCPUHigh = r.EventsCPUHigh + r.LookupCPU + r.FrontCPU
		n := float64(r.Replicas)
		r.TierCPULow, r.TierCPUHigh = n*r.ReplicaCPULow, n*r.ReplicaCPUHigh
		r.TierHeapLow, r.TierHeapHigh = n*r.ReplicaHeapLow, n*r.ReplicaHeapHigh
		fs.Tier = append(fs.Tier, r)
	}
}

// median is the median of figure over points (0 for none).
func medianOf(points []GatewayScalePoint, figure func(GatewayScalePoint) float64) float64 {
	v := make([]float64, 0, len(points))
	for _, p := range points {
		v = append(v, figure(p))
	}
	if len(v) == 0 {
		return 0
	}
	slices.Sort(v)
	if len(v)%2 == 1 {
		return v[len(v)/2]
	}
	return (v[len(v)/2-1] + v[len(v)/2]) / 2
}

// spreadOfPoints is figure's lowest and highest value over points.
func spreadOfPoints(points []GatewayScalePoint, figure func(GatewayScalePoint) float64) [2]float64 {
	lo, hi := figure(points[0]), figure(points[0])
	for _, p := range points[1:] {
		lo, hi = min(lo, figure(p)), max(hi, figure(p))
	}
	return [2]float64{lo, hi}
}
