package bench

import (
	"fmt"
	"io"
	"slices"
	"strings"
)

// writeFleetScale writes the fleet scale study: each measured figure's
// median over the repetitions with its range, the fits, and what is
// extrapolated or computed from them.
func writeFleetScale(w io.Writer, fs *FleetScaleResults) {
	wl := fs.Workload
	fmt.Fprintf(w, "### Fleet scale study (issue 18 item 4)\n\n")
	fmt.Fprintf(w, "Simulated workers, each with a %d-block cache (block size %d; a real GPU holds about %d): one of %d shared %d-block documents pinned, "+
		"the rest its own conversations in %d-block stores, evicted oldest first; a steady-state batch stores %d blocks and removes %d, decoded from its wire bytes (proto/kvdec) and applied, tokens hashed by the index. "+
		"%d repetitions per size; figures are medians (range). CPU is process CPU time (getrusage); the realistic rate is %.0f batches/s a worker.\n\n",
		wl.CacheBlocks, wl.BlockSize, wl.RealCacheBlocks, wl.SharedDocs, wl.DocBlocks, wl.StoreBlocks, wl.StoreBlocks, wl.StoreBlocks,
		wl.Reps, wl.BatchesPerWorkerPerSec)
	fmt.Fprintf(w, "| workers | (worker, block) pairs | index heap (MiB) | B per pair | CPU per batch (µs) | batches per CPU-s | CPU-s/s at the rate | route p50 (µs) | route p99 (µs) | route CPU p50 / p99 (µs) | holders of a prompt |\n")
	fmt.Fprintf(w, "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n")
	for _, n := range wl.Workers {
		var heap, per, cpu, rate, cps, p50, p99, rc, rc99, holders []float64
		var pairs int64
		for _, p := range fs.Gateway {
			if p.Workers != n {
				continue
			}
			pairs = p.Memberships
			heap = append(heap, float64(p.HeapBytes))
			per = append(per, p.BytesPerBlock)
			cpu = append(cpu, p.CPUPerBatchUs)
			rate = append(rate, p.BatchesPerCPUSecond)
			cps = append(cps, p.CPUPerSecond)
			p50 = append(p50, p.RouteP50us)
			p99 = append(p99, p.RouteP99us)
			rc = append(rc, p.RouteCPUP50us)
			rc99 = append(rc99, p.RouteCPUP99us)
			holders = append(holders, float64(p.Holders))
		}
		if len(heap) == 0 {
			continue
		}
		fmt.Fprintf(w, "| %d | %d | %s | %s | %s | %s | %s | %s | %s | %s | %s |\n", n, pairs,
			spreadOf(heap).format(1.0/(1<<20), "", 1), spreadOf(per).format(1, "", 1), spreadOf(cpu).format(1, "", 1),
			spreadOf(rate).format(1e-3, " k", 1), spreadOf(cps).format(1, "", 2), spreadOf(p50).format(1, "", 1),
			spreadOf(p99).format(1, "", 1), spreadOf(rc).format(1, "", 1)+" / "+spreadOf(rc99).format(1, "", 1), spreadOf(holders).format(1, "", 0))
	}
	fmt.Fprintln(w)
	writeFleetPoints(w, "Past the sweep, the full replica at larger caches (closer to the target's pairs):", fs.Larger)
	writeFleetPoints(w, fmt.Sprintf("One worker group of a partitioned tier at its real size (%d workers split into P groups, %d blocks a worker):", wl.TargetWorkers, wl.RealCacheBlocks), fs.Partition)
	fmt.Fprintf(w, "Relay fan-out to gateway subscribers (64-block stores with removals, 2 ranks, gRPC on loopback; the subscribers' receiving is in the same process, so the figures bound the relay's cost from above):\n\n")
	fmt.Fprintf(w, "| gateway subscribers | CPU per batch, all subscribers (µs) | CPU per batch per subscriber (µs) |\n|---:|---:|---:|\n")
	for _, n := range wl.Subscribers {
		var all, per []float64
		for _, p := range fs.Fanout {
			if p.Subscribers == n {
				all = append(all, p.CPUPerBatchUs)
				per = append(per, p.CPUPerDeliveryUs)
			}
		}
		if len(all) > 0 {
			fmt.Fprintf(w, "| %d | %s | %s |\n", n, spreadOf(all).format(1, "", 1), spreadOf(per).format(1, "", 1))
		}
	}
	fmt.Fprintln(w)
	fmt.Fprintf(w, "Fits (least squares over every repetition's point). A fit with R² below %.2f is refused: it may not carry a projection. "+
		"Of the accepted ones, the model with the smallest squared error is chosen:\n\n", MinFitR2)
	fmt.Fprintf(w, "| figure | x | model | y = A + B·f(x) | R² | max residual | at x = | value | accepted | chosen |\n|---|---|---|---|---:|---:|---:|---:|---|---|\n")
	for _, c := range fs.Fits {
		accepted, chosen := "refused", ""
		if c.Accepted {
			accepted = "yes"
		}
		if c.Chosen {
			chosen = "yes"
		}
		fmt.Fprintf(w, "| %s | %s | %s | A = %.4g, B = %.4g | %.3f | %.1f%% | %.3g | %.4g %s | %s | %s |\n",
			c.Figure, c.X, c.Model, c.A, c.B, c.R2, c.MaxResidualPct, c.AtX, c.At, c.Unit, accepted, chosen)
	}
	fmt.Fprintln(w)
	fmt.Fprintf(w, "Projection bands at the target (the accepted models' values; the measured range where no model is accepted):\n\n")
	fmt.Fprintf(w, "| figure | at x = | band | basis | models | measured range | largest x measured |\n|---|---:|---:|---|---|---:|---:|\n")
	for _, b := range fs.Projection.Bands {
		fmt.Fprintf(w, "| %s | %.3g | %.4g – %.4g %s | %s | %s | %.4g – %.4g | %.3g |\n",
			b.Figure, b.AtX, b.Low, b.High, b.Unit, b.Basis, strings.Join(b.Models, ", "), b.MeasuredLow, b.MeasuredHigh, b.MeasuredMaxX)
	}
	fmt.Fprintln(w)
	pr := fs.Projection
	fmt.Fprintf(w, "Band per replica at %d workers (%.3g pairs): index heap **%.1f – %.1f GiB**, applying events **%.2f – %.2f CPU-s/s**.\n\n",
		pr.Workers, pr.Memberships, pr.IndexBytesLow/(1<<30), pr.IndexBytesHigh/(1<<30), pr.CPUPerSecondLow, pr.CPUPerSecondHigh)
	fmt.Fprintf(w, "Extrapolated to %d workers (%.3g (worker, block) pairs at %d blocks a worker) and %d gateway replicas, per replica: index heap **%.1f GiB**; "+
		"%.0f batches/s to apply at **%.1f CPU-s/s** (%.1f µs a batch); route p50 %.0f µs, CPU p99 %.0f µs. Per relay (%d ranks at the rate, %d subscribers): %.1f µs a batch, %.3f CPU-s/s.\n\n",
		pr.Workers, pr.Memberships, wl.RealCacheBlocks, pr.Replicas, pr.IndexBytes/(1<<30), pr.EventsPerSecond, pr.CPUPerSecond, pr.CPUPerBatchUs,
		pr.RouteP50us, pr.RouteCPUP99us, wl.RanksPerRelay, pr.Replicas, pr.RelayCPUPerBatchUs, pr.RelayCPUPerSecond)
	writeFleetTiers(w, fs)
	fmt.Fprintf(w, "NATS at %d workers (computed: %.0f requests/s a worker, each placing %d new blocks; %d requests in flight a worker; message sizes from gateway/placementsync's encoders, subject included, protocol framing not):\n\n",
		wl.TargetWorkers, wl.RequestsPerWorkerPerSec, wl.NewBlocksPerRequest, wl.InFlightPerWorker)
	fmt.Fprintf(w, "| replicas | placement (B) | placements in / out per s | placement MB/s in / out | load snapshot: workers, messages, bytes | load messages in / out per s | load MB/s in / out |\n|---:|---:|---:|---:|---:|---:|---:|\n")
	for _, r := range fs.NATS {
		capped := ""
		if r.LoadCapped {
			capped = " (capped)"
		}
		fmt.Fprintf(w, "| %d | %d | %.0f / %.0f | %.1f / %.1f | %d%s, %d, %d | %.0f / %.0f | %.1f / %.1f |\n", r.Replicas, r.PlacementBytes,
			r.PlacementsIn, r.PlacementsOut, r.PlacementBytesIn/1e6, r.PlacementBytesOut/1e6, r.LoadWorkers, capped, r.LoadParts, r.LoadBytes,
			r.LoadIn, r.LoadOut, r.LoadBytesIn/1e6, r.LoadBytesOut/1e6)
	}
	fmt.Fprintln(w)
	j := fs.JetStream
	fmt.Fprintf(w, "Events over JetStream at %d workers and %d replicas (computed): one message per batch on a subject such as `%s`, %d B (the proto-encoded steady-state batch), "+
		"%.0f messages/s, %.0f MB/s in, %.0f MB/s out to the replicas; %.0f s retention at R%d: **%.0f GB** of file store (%d B a record).\n\n",
		wl.TargetWorkers, wl.TargetReplicas, j.Subject, j.BatchBytes, j.MsgsPerSec, j.BytesInPerSec/1e6, j.BytesOutPerSec/1e6,
		wl.RetentionSeconds, wl.StreamReplicas, j.StorageBytes/1e9, j.RecordBytes)
}

// FleetMedians is each worker count's median of figure over the
// repetitions, in Workers order (the plots' points).
func FleetMedians(fs *FleetScaleResults, figure func(GatewayScalePoint) float64) (xs, ys []float64) {
	for _, n := range fs.Workload.Workers {
		var v []float64
		for _, p := range fs.Gateway {
			if p.Workers == n {
				v = append(v, figure(p))
			}
		}
		if len(v) == 0 {
			continue
		}
		slices.Sort(v)
		xs, ys = append(xs, float64(n)), append(ys, v[len(v)/2])
	}
	return xs, ys
}

// ChosenFit is the chosen fit of figure, nil if there is none.
func (fs *FleetScaleResults) ChosenFit(figure string) *CurveFit {
	for i := range fs.Fits {
		if fs.Fits[i].Figure == figure && fs.Fits[i].Chosen {
			return &fs.Fits[i]
		}
	}
	return nil
}

// writeFleetPoints writes points measured outside the sweep, one row each.
func writeFleetPoints(w io.Writer, title string, points []GatewayScalePoint) {
	if len(points) == 0 {
		return
	}
	fmt.Fprintf(w, "%s\n\n", title)
	fmt.Fprintf(w, "| groups | workers | blocks a worker | (worker, block) pairs | rep | index heap (MiB) | B per pair | CPU per batch (µs) | CPU-s/s at the rate | route CPU p50 / p99 (µs) | lookup CPU mean / p99 (µs) | hash + pick CPU mean (µs) |\n")
	fmt.Fprintf(w, "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n")
	for _, p := range points {
		groups := "full"
		if p.Partitions > 0 {
			groups = fmt.Sprint(p.Partitions)
		}
		fmt.Fprintf(w, "| %s | %d | %d | %d | %d | %.1f | %.1f | %.1f | %.2f | %.1f / %.1f | %.1f / %.1f | %.1f + %.1f |\n",
			groups, p.Workers, p.CacheBlocks, p.Memberships, p.Rep, float64(p.HeapBytes)/(1<<20), p.BytesPerBlock, p.CPUPerBatchUs,
			p.CPUPerSecond, p.RouteCPUP50us, p.RouteCPUP99us, p.LookupCPUMeanUs, p.LookupCPUP99us, p.HashCPUMeanUs, p.PickCPUMeanUs)
	}
	fmt.Fprintln(w)
}

// writeFleetTiers writes each tier's cores and memory at the target.
func writeFleetTiers(w io.Writer, fs *FleetScaleResults) {
	if len(fs.Tier) == 0 {
		return
	}
	wl := fs.Workload
	fmt.Fprintf(w, "Gateway tiers at %d workers (%.0f batches/s, %.0f routes/s, %d blocks a worker). A group's events and heap are its point's above, "+
		"measured at its real size; a full copy's are the projection band. Every group answers every route's lookup, its replicas sharing them; "+
		"the replica a route reaches hashes it and picks over the whole fleet. Not in these figures: the scatter's NATS messaging and merge, "+
		"which the built tier's benchmark measures (docs/partitioned-tier.md). CPU in CPU-s/s (cores):\n\n",
		wl.TargetWorkers, float64(wl.TargetWorkers)*wl.BatchesPerWorkerPerSec, float64(wl.TargetWorkers)*wl.RequestsPerWorkerPerSec, wl.RealCacheBlocks)
	fmt.Fprintf(w, "| groups × replicas a group | replicas | per replica: events | lookups | hash + pick | **CPU** | **heap (GiB)** | tier: CPU | heap (GiB) | basis |\n")
	fmt.Fprintf(w, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|\n")
	for _, r := range fs.Tier {
		fmt.Fprintf(w, "| %d × %d | %d | %.2f – %.2f | %.2f | %.2f | **%.2f – %.2f** | **%.2f – %.2f** | %.1f – %.1f | %.1f – %.1f | %s |\n",
			r.Partitions, r.Copies, r.Replicas, r.EventsCPULow, r.EventsCPUHigh, r.LookupCPU, r.FrontCPU, r.ReplicaCPULow, r.ReplicaCPUHigh,
			r.ReplicaHeapLow/(1<<30), r.ReplicaHeapHigh/(1<<30), r.TierCPULow, r.TierCPUHigh, r.TierHeapLow/(1<<30), r.TierHeapHigh/(1<<30), r.Basis)
	}
	fmt.Fprintln(w)
}
