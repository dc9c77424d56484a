package bench

import (
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"runtime"
	"slices"
	"time"

	"google.golang.org/protobuf/proto"

	"github.com/kvrelay/kvrelay/gateway/index"
	"github.com/kvrelay/kvrelay/gateway/picker"
	"github.com/kvrelay/kvrelay/gateway/placementsync"
	"github.com/kvrelay/kvrelay/proto/kvdec"
	"github.com/kvrelay/kvrelay/proto/kvpb"
)

// The fleet scale study (issue 18 item 4): what one gateway replica, one
// relay and the NATS server carry as the fleet grows, measured on a
// scaled-down simulated fleet here and extrapolated with fitted curves to
// TargetWorkers workers behind TargetReplicas gateway replicas.
//
// It is a `kvrelay bench` part rather than a Go benchmark family because
// its figures are curves over a sweep with repetitions and fits, written
// to results.json for the plots and BENCHMARKS.md, which the bench's
// report already does; the Go benchmark harness would time one size at a
// time.

// FleetScaleResults is the study's measurements, fits and projection.
type FleetScaleResults struct {
	Workload FleetWorkload `json:"workload"`
	// Gateway holds one point per (workers, repetition), at CacheBlocks a
	// worker.
	Gateway []GatewayScalePoint `json:"gateway"`
	// Larger holds the full replica measured closer to the target than the
	// sweep: Workload.Larger's sizes, one point per repetition.
	Larger []GatewayScalePoint `json:"larger,omitempty"`
	// Partition holds one worker group of a partitioned tier measured at
	// its real size: TargetWorkers/P workers at RealCacheBlocks a worker,
	// for each P of Workload.Partitions, one point per repetition.
	Partition []GatewayScalePoint `json:"partition,omitempty"`
	// Tier is each tier's cost at the target, from the points above.
	Tier []TierRow `json:"tier,omitempty"`
	// Fanout holds one point per (gateway subscribers, repetition).
	Fanout []FanoutScalePoint `json:"fanout"`
	Fits   []CurveFit         `json:"fits"`
	// NATS is computed, not measured: message counts from what the code
	// publishes per routed request and per batch, sizes from the real
	// encoders, at TargetWorkers.
	NATS       []NATSLoadRow   `json:"nats"`
	Projection FleetProjection `json:"projection"`
	JetStream  JetStreamSizing `json:"jetstream"`
}

// FleetWorkload states the simulated fleet and the realistic figures the
// study scales to.
type FleetWorkload struct {
	BlockSize   int `json:"block_size"`
	StoreBlocks int `json:"store_blocks"` // blocks a steady-state batch stores (and removes)
	// CacheBlocks is each simulated worker's cache; RealCacheBlocks what a
	// GPU holds (the projection scales memory by their ratio).
	CacheBlocks     int `json:"cache_blocks"`
	RealCacheBlocks int `json:"real_cache_blocks"`
	SharedDocs      int `json:"shared_docs"` // hot shared prefixes (system prompts)
	DocBlocks       int `json:"doc_blocks"`  // each one's length, held by every worker it is assigned to
	SteadySteps     int `json:"steady_steps"`
	RouteReps       int `json:"route_reps"`
	Reps            int `json:"reps"`
	// BatchesPerWorkerPerSec is a busy engine's event rate (research:
	// 15–20 batches/s per worker at 3× Mooncake on an 8B model).
	BatchesPerWorkerPerSec  float64 `json:"batches_per_worker_per_s"`
	RequestsPerWorkerPerSec float64 `json:"requests_per_worker_per_s"`
	NewBlocksPerRequest     int     `json:"new_blocks_per_request"` // blocks a placement carries
	InFlightPerWorker       int     `json:"in_flight_per_worker"`
	RanksPerRelay           int     `json:"ranks_per_relay"`
	RetentionSeconds        float64 `json:"retention_s"`
	StreamReplicas          int     `json:"stream_replicas"`
	TargetWorkers           int     `json:"target_workers"`
	TargetReplicas          int     `json:"target_replicas"`
	Workers                 []int   `json:"workers"`
	Subscribers             []int   `json:"subscribers"`
	// Larger are full-replica sizes past the sweep, as close to the target
	// as this host holds in memory and minutes.
	Larger []FleetSize `json:"larger,omitempty"`
	// Partitions are the worker-group counts of a partitioned tier whose
	// one group is measured at its real size; PartitionReps its repetitions.
	Partitions    []int `json:"partitions,omitempty"`
	PartitionReps int   `json:"partition_reps,omitempty"`
}

// FleetSize is a replica's workers and each one's cache.
type FleetSize struct {
	Workers     int `json:"workers"`
	CacheBlocks int `json:"cache_blocks"`
}

// GatewayScalePoint is one gateway replica's index at Workers workers.
type GatewayScalePoint struct {
	Workers     int   `json:"workers"`
	CacheBlocks int   `json:"cache_blocks"`         // each worker's
	Partitions  int   `json:"partitions,omitempty"` // the tier this group is one of; 0 for a full replica
	Rep         int   `json:"rep"`
	Memberships int64 `json:"memberships"` // (worker, block) pairs the index holds
	HeapBytes   int64 `json:"heap_bytes"`  // live heap of the index after GC
	// BytesPerBlock is HeapBytes per membership.
	BytesPerBlock float64 `json:"bytes_per_block"`
	SteadyBatches int     `json:"steady_batches"`
	// CPUPerBatchUs is process CPU time (getrusage: the applying thread
	// and the garbage collector) per steady-state batch decoded from its
	// wire bytes and applied: a StoreBlocks-block store and a
	// StoreBlocks-block removal, the tokens hashed.
	CPUPerBatchUs float64 `json:"cpu_per_batch_us"`
	// BatchesPerCPUSecond is what one core applies at this size.
	BatchesPerCPUSecond float64 `json:"batches_per_cpu_s"`
	// CPUPerSecond is the CPU seconds per wall second the replica spends
	// applying events when every worker publishes at the realistic rate:
	// Workers × rate × CPUPerBatchUs (the sim applies unpaced; the per-batch
	// cost is what it measures).
	CPUPerSecond float64 `json:"cpu_s_per_s"`
	// EventsPerSecond is the realistic event rate this replica must apply.
	EventsPerSecond float64 `json:"batches_per_s_at_rate"`
	RouteP50us      float64 `json:"route_p50_us"`
	RouteP99us      float64 `json:"route_p99_us"`
	RouteCPUP50us   float64 `json:"route_cpu_p50_us"`
	// RouteCPUP99us is the thread CPU time's p99: the wall clock's p99 on
	// a shared host is mostly time spent waiting for a CPU.
	RouteCPUP99us float64 `json:"route_cpu_p99_us"`
	// The route's thread CPU in its parts, means over the routes (a tier's
	// cores are rates times means): hashing the request's tokens once, the
	// index lookup on its prefix hashes (what a worker group answers for
	// every route of the fleet in a partitioned tier), and the pick over
	// every worker's load.
	RouteCPUMeanUs  float64 `json:"route_cpu_mean_us"`
	HashCPUMeanUs   float64 `json:"hash_cpu_mean_us"`
	LookupCPUMeanUs float64 `json:"lookup_cpu_mean_us"`
	LookupCPUP99us  float64 `json:"lookup_cpu_p99_us"`
	PickCPUMeanUs   float64 `json:"pick_cpu_mean_us"`
	Holders         int     `json:"holders"` // workers matching a routed prompt's full shared prefix
}

// TierRow is one gateway tier's cost at the target fleet: Partitions
// worker groups (1: every replica a full copy), Copies replicas a group.
// CPU is CPU-seconds per second; the ranges are the measured points'
// (or, for a full copy, the projection band's) low and high ends.
type TierRow struct {
	Partitions int    `json:"partitions"`
	Copies     int    `json:"copies"` // replicas per worker group (a full-copy tier: its replicas)
	Replicas   int    `json:"replicas"`
	Basis      string `json:"basis"` // "measured at the group's real size" or the full copy's band basis
	// Per replica.
	EventsCPULow  float64 `json:"events_cpu_s_per_s_low"`
	EventsCPUHigh float64 `json:"events_cpu_s_per_s_high"`
	LookupCPU     float64 `json:"lookup_cpu_s_per_s"` // the group's lookups for every route, shared by its copies
	FrontCPU      float64 `json:"front_cpu_s_per_s"`  // hashing and picking its share of the routes
	// ReplicaCPULow/High are events + lookups + front; the tier's totals
	// are Replicas times them and the heaps.
	ReplicaCPULow   float64 `json:"replica_cpu_s_per_s_low"`
	ReplicaCPUHigh  float64 `json:"replica_cpu_s_per_s_high"`
	ReplicaHeapLow  float64 `json:"replica_heap_bytes_low"`
	ReplicaHeapHigh float64 `json:"replica_heap_bytes_high"`
	TierCPULow      float64 `json:"tier_cpu_s_per_s_low"`
	TierCPUHigh     float64 `json:"tier_cpu_s_per_s_high"`
	TierHeapLow     float64 `json:"tier_heap_bytes_low"`
	TierHeapHigh    float64 `json:"tier_heap_bytes_high"`
}

// FanoutScalePoint is one relay's cost per batch per gateway subscriber.
type FanoutScalePoint struct {
	Subscribers int     `json:"subscribers"`
	Rep         int     `json:"rep"`
	Batches     int     `json:"batches"`
	CPUSeconds  float64 `json:"cpu_seconds"`
	// CPUPerBatchUs is CPU per relayed batch, all subscribers together;
	// CPUPerDeliveryUs per batch per subscriber. Both include the
	// subscribers' own receiving (in the same process), so they are an
	// upper bound on the relay's.
	CPUPerBatchUs    float64 `json:"cpu_per_batch_us"`
	CPUPerDeliveryUs float64 `json:"cpu_per_delivery_us"`
}

// CurveFit is y = A + B·f(x) fitted by least squares over every
// repetition's point, with f the model's transform.
type CurveFit struct {
	Figure string  `json:"figure"`
	Unit   string  `json:"unit"`
	X      string  `json:"x"`
	Model  string  `json:"model"` // "linear", "n log n" or "log"
	A      float64 `json:"a"`
	B      float64 `json:"b"`
	R2     float64 `json:"r2"`
	// MaxResidualPct is the largest |residual| relative to its point.
	MaxResidualPct float64 `json:"max_residual_pct"`
	Points         int     `json:"points"`
	// At is the fit evaluated at AtX (the projection's size).
	AtX float64 `json:"at_x"`
	At  float64 `json:"at"`
	// Accepted: R2 is at least MinFitR2 and the value at AtX is positive,
	// so the model may carry a projection. A fit below the bar explains too
	// little of the measured variance to be extrapolated.
	Accepted bool `json:"accepted"`
	// Chosen is the accepted model with the smallest squared error of those
	// fitted for this figure (none when no model is accepted).
	Chosen bool `json:"chosen"`
}

// MinFitR2 is the least R² a fitted curve needs to carry a projection.
// The issue-18 study extrapolated a linear CPU fit of R² 0.22 eighteen
// times past its largest point (23.5 cores); below this bar the study
// reports the measured range instead of a curve.
const MinFitR2 = 0.9

// ProjectionBand is one figure's projection as a band: the lowest and
// highest value at the target among the accepted models, or, when no model
// is accepted, the measured range (Basis says which), with the measured
// range and the largest measured x beside it.
type ProjectionBand struct {
	Figure string  `json:"figure"`
	Unit   string  `json:"unit"`
	AtX    float64 `json:"at_x"`
	Low    float64 `json:"low"`
	High   float64 `json:"high"`
	// Basis is "fits" (Low and High are the accepted models' values at
	// AtX) or "measured range" (no model reached MinFitR2: the figure does
	// not follow x within the noise of the measurements, and the band is
	// what was measured, not extrapolated).
	Basis        string   `json:"basis"`
	Models       []string `json:"models,omitempty"` // the accepted models
	MeasuredLow  float64  `json:"measured_low"`
	MeasuredHigh float64  `json:"measured_high"`
	MeasuredMaxX float64  `json:"measured_max_x"` // the largest x measured
}

// Band basis values.
const (
	BasisFits     = "fits"
	BasisMeasured = "measured range"
)

// NATSLoadRow is the NATS server's load from the gateway replicas at
// TargetWorkers workers and Replicas replicas.
type NATSLoadRow struct {
	Replicas int `json:"replicas"`
	// Placements: one message per routed request (a request whose blocks
	// are all placed or held already publishes none, so this is a bound).
	PlacementBytes    int     `json:"placement_bytes"` // one message, subject included
	PlacementsIn      float64 `json:"placements_in_per_s"`
	PlacementsOut     float64 `json:"placements_out_per_s"` // delivered: R-1 peers (NoEcho)
	PlacementBytesIn  float64 `json:"placement_bytes_in_per_s"`
	PlacementBytesOut float64 `json:"placement_bytes_out_per_s"`
	// Load sharing: a busy replica publishes a snapshot every
	// DefaultLoadInterval.
	LoadWorkers  int     `json:"load_snapshot_workers"` // non-zero counts in one replica's snapshot
	LoadBytes    int     `json:"load_snapshot_bytes"`
	LoadCapped   bool    `json:"load_snapshot_capped"`   // over MaxLoadParts parts: the rest is not shared
	LoadParts    int     `json:"load_snapshot_messages"` // messages one snapshot takes (parts past MaxLoadWorkers or the payload limit)
	LoadIn       float64 `json:"load_in_per_s"`          // messages
	LoadOut      float64 `json:"load_out_per_s"`         // messages delivered
	LoadBytesIn  float64 `json:"load_bytes_in_per_s"`
	LoadBytesOut float64 `json:"load_bytes_out_per_s"`
}

// JetStreamSizing is the events-over-JetStream design at TargetWorkers:
// one message per relayed batch, subject per worker and rank, payload the
// encoded KvEventBatch, consumed by every gateway replica.
type JetStreamSizing struct {
	Subject        string  `json:"subject_example"`
	BatchBytes     int     `json:"batch_bytes"`  // proto-encoded steady-state batch
	RecordBytes    int     `json:"record_bytes"` // file store record: header, subject, payload, checksum
	MsgsPerSec     float64 `json:"msgs_per_s"`
	BytesInPerSec  float64 `json:"bytes_in_per_s"`
	BytesOutPerSec float64 `json:"bytes_out_per_s"` // every replica consumes every message
	StorageBytes   float64 `json:"storage_bytes"`   // retention × rate × records × stream replicas
}

// FleetProjection is the extrapolation to TargetWorkers and TargetReplicas.
type FleetProjection struct {
	Workers            int     `json:"workers"`
	Replicas           int     `json:"replicas"`
	Memberships        float64 `json:"memberships"` // at RealCacheBlocks a worker
	IndexBytes         float64 `json:"index_bytes"`
	CPUPerBatchUs      float64 `json:"cpu_per_batch_us"`
	EventsPerSecond    float64 `json:"batches_per_s"`
	CPUPerSecond       float64 `json:"cpu_s_per_s"`
	RouteP50us         float64 `json:"route_p50_us"`
	RouteCPUP99us      float64 `json:"route_cpu_p99_us"`
	RelayCPUPerBatchUs float64 `json:"relay_cpu_per_batch_us"` // at Replicas subscribers
	RelayCPUPerSecond  float64 `json:"relay_cpu_s_per_s"`      // one relay's ranks at the realistic rate
	// Bands holds every fitted figure's band (the single values above are
	// the chosen fit's, or the band's high end when no fit is accepted).
	Bands []ProjectionBand `json:"bands"`
	// CPUPerSecondLow/High and IndexBytesLow/High are the replica's cores
	// and heap at the target from the bands' ends.
	CPUPerSecondLow  float64 `json:"cpu_s_per_s_low"`
	CPUPerSecondHigh float64 `json:"cpu_s_per_s_high"`
	IndexBytesLow    float64 `json:"index_bytes_low"`
	IndexBytesHigh   float64 `json:"index_bytes_high"`
}

// Band is the projection band of figure, nil if there is none.
func (pr *FleetProjection) Band(figure string) *ProjectionBand {
	for i := range pr.Bands {
		if pr.Bands[i].Figure == figure {
			return &pr.Bands[i]
		}
	}
	return nil
}

// fleetIDBase seeds the shared documents, the same in every repetition;
// repetitions differ in the workers' own stores and the routed questions.
const fleetIDBase = 0x5eed

func fleetWorkload(quick bool) FleetWorkload {
	w := FleetWorkload{
		BlockSize: blockSize, StoreBlocks: storeBlocks,
		CacheBlocks: 2048, RealCacheBlocks: 30_000,
		SharedDocs: 64, DocBlocks: 512,
		SteadySteps: 8, RouteReps: 2000, Reps: 3,
		BatchesPerWorkerPerSec: 20, RequestsPerWorkerPerSec: 2, NewBlocksPerRequest: 256,
		InFlightPerWorker: 8, RanksPerRelay: 8,
		RetentionSeconds: 600, StreamReplicas: 3,
		TargetWorkers: 10_000, TargetReplicas: 16,
		// The largest point is the target's worker count at the reduced
		// cache: 20.5 M (worker, block) pairs, the most this shared host
		// holds in a few minutes a repetition.
		Workers:     []int{250, 500, 1000, 2000, 4000, 8000, 10_000},
		Subscribers: []int{1, 2, 4, 8, 16},
		// The full replica at 10,000 workers and a quarter of a real
		// cache: 74.9 M pairs, 3.7x the sweep's largest point and a
		// quarter of the target's, about 2.5 GiB of index on a 24 GiB host.
		Larger: []FleetSize{{Workers: 10_000, CacheBlocks: 7_488}},
		// A group of a 4-, 8- and 16-group tier at its real size: 2,500,
		// 1,250 and 625 workers at 30,000 blocks (29,952 held: whole
		// stores past the document), 74.9, 37.4 and 18.7 M pairs.
		Partitions: []int{4, 8, 16}, PartitionReps: 2,
	}
	if quick {
		w.CacheBlocks, w.SharedDocs, w.DocBlocks = 256, 4, 64
		w.SteadySteps, w.RouteReps, w.Reps = 2, 50, 1
		w.Workers, w.Subscribers = []int{8, 16, 32}, []int{1, 2}
		w.RealCacheBlocks, w.TargetWorkers = 500, 64
		w.Larger = []FleetSize{{Workers: 32, CacheBlocks: 384}}
		w.Partitions, w.PartitionReps = []int{2, 4}, 1
	}
	return w
}

func runFleetScale(ctx context.Context, env *environment) (*FleetScaleResults, error) {
	fs := &FleetScaleResults{Workload: fleetWorkload(env.quick)}
	wl := &fs.Workload
	docs := fleetDocs(wl)
	for rep := range wl.Reps {
		for _, w := range wl.Workers {
			if err := ctx.Err(); err != nil {
				return nil, err
			}
			p, err := gatewayScalePoint(wl, docs, w, rep)
			if err != nil {
				return nil, err
			}
			logScalePoint(env, "gateway", p)
			fs.Gateway = append(fs.Gateway, p)
		}
	}
	// Past the sweep: the full replica at larger caches, then one group of
	// each partitioned tier at its real size. Each point's index is
	// dropped before the next is built, so the host holds one at a time.
	for rep := range wl.Reps {
		for _, sz := range wl.Larger {
			if err := ctx.Err(); err != nil {
				return nil, err
			}
			lw := *wl
			lw.CacheBlocks = sz.CacheBlocks
			p, err := gatewayScalePoint(&lw, docs, sz.Workers, rep)
			if err != nil {
				return nil, err
			}
			logScalePoint(env, "gateway, larger cache", p)
			fs.Larger = append(fs.Larger, p)
		}
	}
	for rep := range wl.PartitionReps {
		for _, parts := range wl.Partitions {
			if err := ctx.Err(); err != nil {
				return nil, err
			}
			pw := *wl
			pw.CacheBlocks = wl.RealCacheBlocks
			p, err := gatewayScalePoint(&pw, docs, wl.TargetWorkers/parts, rep)
			if err != nil {
				return nil, err
			}
			p.Partitions = parts
			logScalePoint(env, "tier group at its real size", p)
			fs.Partition = append(fs.Partition, p)
		}
	}
	burst := 2000
	if env.quick {
		burst = 60
	}
	for rep := range max(wl.Reps, 1) {
		for _, n := range wl.Subscribers {
			fp, err := fanoutRun(ctx, env, n, burst, false)
			if err != nil {
				return nil, err
			}
			p := FanoutScalePoint{Subscribers: n, Rep: rep, Batches: burst, CPUSeconds: fp.CPUSeconds,
				CPUPerBatchUs:    fp.CPUSeconds / float64(burst) * 1e6,
				CPUPerDeliveryUs: fp.CPUSeconds / float64(burst*n) * 1e6}
			env.log.Info("fleetscale: fan-out", "subscribers", n, "rep", rep, "cpu_per_batch_us", p.CPUPerBatchUs)
			fs.Fanout = append(fs.Fanout, p)
		}
	}
	if err := fs.fit(); err != nil {
		return nil, err
	}
	fs.tiers()
	batch := steadyBatch(wl, docs, 0, rand.New(rand.NewPCG(1, 1)))
	fs.NATS = natsLoad(wl)
	fs.JetStream = jetStreamSizing(wl, proto.Size(batch))
	return fs, nil
}

// fleetDocs are the shared prompts' tokens.
func fleetDocs(wl *FleetWorkload) [][]uint32 {
	rng := rand.New(rand.NewPCG(fleetIDBase, 1))
	docs := make([][]uint32, wl.SharedDocs)
	for d := range docs {
		docs[d] = make([]uint32, wl.DocBlocks*wl.BlockSize)
		for i := range docs[d] {
			docs[d][i] = rng.Uint32N(151_936)
		}
	}
	return docs
}

// Engine block hashes: a document's blocks have the same hash on every
// worker (same content, same engine hashing); a worker's own blocks are
// unique to it.
func docHash(d, k int) int64  { return 1<<62 | int64(d)<<24 | int64(k) }
func tailHash(w, n int) int64 { return int64(w+1)<<32 | int64(n) }
func workerName(w int) string {
	return fmt.Sprintf("grpc://10.%d.%d.%d:50051", w>>16&255, w>>8&255, w&255)
}
func docOf(wl *FleetWorkload, w int) int { return w % wl.SharedDocs }

// tailState is a worker's FIFO of its own stored batches (first hash of
// each), oldest first, and the next hash number.
type tailState struct {
	fifo []int
	next int
}

// steadyBatch is a steady-state batch of worker w (its cache full: a
// store and a removal), for sizing a relayed batch.
func steadyBatch(wl *FleetWorkload, docs [][]uint32, w int, rng *rand.Rand) *kvpb.KvEventBatch {
	var ts tailState
	for {
		if b := nextBatch(wl, docs, w, &ts, rng); len(b.Events) == 2 {
			return b
		}
	}
}

// nextBatch is worker w's next batch: a new StoreBlocks-block store of
// its own, chained to its shared document at a random depth (a new
// conversation) or to its previous store (the next turn), and, when its
// cache is full, the removal of its oldest store.
func nextBatch(wl *FleetWorkload, docs [][]uint32, w int, ts *tailState, rng *rand.Rand) *kvpb.KvEventBatch {
	st := &kvpb.KvBlocksStored{}
	if len(ts.fifo) > 0 && rng.IntN(4) != 0 {
		parent := tailHash(w, ts.next-1)
		st.ParentBlockHash = &parent
	} else {
		parent := docHash(docOf(wl, w), 1+rng.IntN(wl.DocBlocks-1))
		st.ParentBlockHash = &parent
	}
	tokens := make([]uint32, wl.StoreBlocks*wl.BlockSize)
	for i := range tokens {
		tokens[i] = rng.Uint32N(151_936)
	}
	first := ts.next
	for k := range wl.StoreBlocks {
		st.Blocks = append(st.Blocks, &kvpb.KvBlock{
			BlockHash: tailHash(w, first+k), TokenIds: tokens[k*wl.BlockSize : (k+1)*wl.BlockSize], BlockSize: int32(wl.BlockSize),
		})
	}
	ts.next += wl.StoreBlocks
	b := &kvpb.KvEventBatch{Events: []*kvpb.KvCacheEvent{{Data: &kvpb.KvCacheEvent_Stored{Stored: st}}}}
	ts.fifo = append(ts.fifo, first)
	if (len(ts.fifo))*wl.StoreBlocks > wl.CacheBlocks-wl.DocBlocks {
		old := ts.fifo[0]
		ts.fifo = ts.fifo[1:]
		rm := &kvpb.KvBlocksRemoved{}
		for k := range wl.StoreBlocks {
			rm.BlockHashes = append(rm.BlockHashes, tailHash(w, old+k))
		}
		b.Events = append(b.Events, &kvpb.KvCacheEvent{Data: &kvpb.KvCacheEvent_Removed{Removed: rm}})
	}
	return b
}

// docBatches stores document d's blocks in StoreBlocks-block chained stores.
func docBatches(wl *FleetWorkload, docs [][]uint32, d int) []*kvpb.KvEventBatch {
	var out []*kvpb.KvEventBatch
	for s := 0; s < wl.DocBlocks; s += wl.StoreBlocks {
		st := &kvpb.KvBlocksStored{}
		if s > 0 {
			parent := docHash(d, s-1)
			st.ParentBlockHash = &parent
		}
		for k := s; k < min(wl.DocBlocks, s+wl.StoreBlocks); k++ {
			st.Blocks = append(st.Blocks, &kvpb.KvBlock{
				BlockHash: docHash(d, k), TokenIds: docs[d][k*wl.BlockSize : (k+1)*wl.BlockSize], BlockSize: int32(wl.BlockSize),
			})
		}
		out = append(out, &kvpb.KvEventBatch{Events: []*kvpb.KvCacheEvent{{Data: &kvpb.KvCacheEvent_Stored{Stored: st}}}})
	}
	return out
}

// gatewayScalePoint fills one replica's index with workers' caches, runs
// the steady stream through it and routes on it.
func logScalePoint(env *environment, what string, p GatewayScalePoint) {
	env.log.Info("fleetscale: "+what, "workers", p.Workers, "cache_blocks", p.CacheBlocks, "rep", p.Rep, "heap_mib", p.HeapBytes>>20,
		"bytes_per_block", p.BytesPerBlock, "cpu_per_batch_us", p.CPUPerBatchUs, "route_p50_us", p.RouteP50us,
		"lookup_cpu_mean_us", p.LookupCPUMeanUs, "pick_cpu_mean_us", p.PickCPUMeanUs)
}

func gatewayScalePoint(wl *FleetWorkload, docs [][]uint32, workers, rep int) (GatewayScalePoint, error) {
	// A worker holds its document and whole stores: the cache a size that
	// is not a whole number of stores past the document rounds down.
	held := wl.DocBlocks + (wl.CacheBlocks-wl.DocBlocks)/wl.StoreBlocks*wl.StoreBlocks
	p := GatewayScalePoint{Workers: workers, CacheBlocks: held, Rep: rep}
	rng := rand.New(rand.NewPCG(uint64(workers), uint64(rep)))
	names := make([]string, workers)
	tails := make([]tailState, workers)
	for w := range names {
		names[w] = workerName(w)
	}
	before := heapInUse()
	ix := index.New(index.Options{BlockSize: wl.BlockSize})
	// Fill: the worker's document, then its own stores until the cache is
	// full (the first removal is the steady state's).
	for w := range workers {
		for _, b := range docBatches(wl, docs, docOf(wl, w)) {
			ix.Apply(names[w], b)
		}
		for (len(tails[w].fifo)+1)*wl.StoreBlocks <= wl.CacheBlocks-wl.DocBlocks {
			ix.Apply(names[w], nextBatch(wl, docs, w, &tails[w], rng))
		}
	}
	// Steady state: every worker in turn, generated and encoded in chunks
	// outside the CPU clock. Inside it, each batch is decoded from its wire
	// bytes by the monitor's decoder (proto/kvdec, one per stream) and
	// applied, as a gateway receives it; the process clock counts the
	// garbage collector's threads too.
	var cpu time.Duration
	const chunk = 256
	pending := make([][]byte, 0, chunk)
	owners := make([]int, 0, chunk)
	var dec kvdec.Decoder
	flush := func() error {
		c0 := processCPU()
		for i, frame := range pending {
			b, err := dec.Decode(frame)
			if err != nil {
				return fmt.Errorf("bench: fleetscale: decode a steady-state batch: %w", err)
			}
			ix.Apply(names[owners[i]], b)
		}
		cpu += processCPU() - c0
		p.SteadyBatches += len(pending)
		pending, owners = pending[:0], owners[:0]
		return nil
	}
	for range wl.SteadySteps {
		for w := range workers {
			frame, err := proto.Marshal(nextBatch(wl, docs, w, &tails[w], rng))
			if err != nil {
				return p, fmt.Errorf("bench: fleetscale: encode a steady-state batch: %w", err)
			}
			pending = append(pending, frame)
			owners = append(owners, w)
			if len(pending) == chunk {
				if err := flush(); err != nil {
					return p, err
				}
			}
		}
	}
	if err := flush(); err != nil {
		return p, err
	}
	pending = nil
	st := ix.Stats()
	p.Memberships = int64(st.Memberships)
	if want := int64(workers) * int64(held); p.Memberships != want {
		return p, fmt.Errorf("bench: fleetscale: %d workers' index holds %d (worker, block) pairs, want %d", workers, p.Memberships, want)
	}
	p.HeapBytes = heapInUse() - before
	p.BytesPerBlock = float64(p.HeapBytes) / float64(p.Memberships)
	p.CPUPerBatchUs = cpu.Seconds() / float64(p.SteadyBatches) * 1e6
	if cpu > 0 {
		p.BatchesPerCPUSecond = float64(p.SteadyBatches) / cpu.Seconds()
	}
	p.EventsPerSecond = float64(workers) * wl.BatchesPerWorkerPerSec
	p.CPUPerSecond = p.EventsPerSecond * p.CPUPerBatchUs / 1e6

	// Route: a shared document and a new question, lookup and pick over
	// the fleet's in-flight loads.
	pk, err := picker.New(picker.Config{Rand: rand.New(rand.NewPCG(1, 2))})
	if err != nil {
		return p, fmt.Errorf("bench: picker: %w", err)
	}
	fleet := picker.NewFleet()
	for _, n := range names {
		fleet.Add(n)
		fleet.Set(n, rng.IntN(wl.InFlightPerWorker+1))
	}
	question := make([]uint32, 4*wl.BlockSize)
	routes := make([]time.Duration, 0, wl.RouteReps)
	cpus := make([]time.Duration, 0, wl.RouteReps)
	lookups := make([]time.Duration, 0, wl.RouteReps)
	var hashSum, pickSum time.Duration
	runtime.GC()
	runtime.LockOSThread()
	for i := range wl.RouteReps {
		d := i % wl.SharedDocs
		for j := range question {
			question[j] = rng.Uint32N(151_936)
		}
		tokens := append(slices.Clip(docs[d]), question...)
		// The three clock reads split the route into what a partitioned
		// tier does once (hash, pick) and in every group (the lookup).
		c0 := threadCPU()
		t0 := time.Now()
		prefix := index.PrefixHashes(tokens, wl.BlockSize, index.Namespace{})
		c1 := threadCPU()
		m := ix.FindMatchesHashes(prefix)
		c2 := threadCPU()
		if _, err := pk.PickFleet(fleet, picker.Request{}, m); err != nil {
			runtime.UnlockOSThread()
			return p, fmt.Errorf("bench: pick: %w", err)
		}
		routes = append(routes, time.Since(t0))
		c3 := threadCPU()
		cpus = append(cpus, c3-c0)
		lookups = append(lookups, c2-c1)
		hashSum += c1 - c0
		pickSum += c3 - c2
		if i == 0 {
			p.Holders = len(m.Workers)
		}
	}
	runtime.UnlockOSThread()
	n := float64(len(cpus))
	var cpuSum, lookupSum time.Duration
	for i := range cpus {
		cpuSum += cpus[i]
		lookupSum += lookups[i]
	}
	p.RouteCPUMeanUs, p.LookupCPUMeanUs = us(cpuSum)/n, us(lookupSum)/n
	p.HashCPUMeanUs, p.PickCPUMeanUs = us(hashSum)/n, us(pickSum)/n
	slices.Sort(routes)
	slices.Sort(cpus)
	slices.Sort(lookups)
	p.RouteP50us, p.RouteP99us = us(quantile(routes, 0.5)), us(quantile(routes, 0.99))
	p.RouteCPUP50us, p.RouteCPUP99us = us(quantile(cpus, 0.5)), us(quantile(cpus, 0.99))
	p.LookupCPUP99us = us(quantile(lookups, 0.99))
	runtime.KeepAlive(ix)
	return p, nil
}

// fit fits every figure's curve and projects to the target fleet.
func (fs *FleetScaleResults) fit() error {
	wl := fs.Workload
	var mem, cost, p50, p99 []xy
	for _, p := range fs.Gateway {
		mem = append(mem, xy{float64(p.Memberships), float64(p.HeapBytes)})
		cost = append(cost, xy{float64(p.Memberships), p.CPUPerBatchUs})
		p50 = append(p50, xy{float64(p.Workers), p.RouteP50us})
		p99 = append(p99, xy{float64(p.Workers), p.RouteCPUP99us})
	}
	// The larger caches carry the heap and the apply cost, whose x is the
	// pairs, closer to the target; the route's x is the workers, whose
	// cost does not follow the cache, so they stay out of its fits.
	for _, p := range fs.Larger {
		mem = append(mem, xy{float64(p.Memberships), float64(p.HeapBytes)})
		cost = append(cost, xy{float64(p.Memberships), p.CPUPerBatchUs})
	}
	var fan []xy
	for _, p := range fs.Fanout {
		fan = append(fan, xy{float64(p.Subscribers), p.CPUPerBatchUs})
	}
	target := float64(wl.TargetWorkers)
	targetBlocks := target * float64(wl.RealCacheBlocks)
	pr := &fs.Projection
	pr.Workers, pr.Replicas, pr.Memberships = wl.TargetWorkers, wl.TargetReplicas, targetBlocks
	for _, f := range []struct {
		figure, unit, x string
		pts             []xy
		at              float64
		models          []string
		out             *float64
	}{
		{FitIndexHeap, "bytes", "(worker, block) pairs", mem, targetBlocks, []string{"linear", "n log n"}, &pr.IndexBytes},
		{FitApplyCPU, "µs", "(worker, block) pairs", cost, targetBlocks, []string{"log", "linear"}, &pr.CPUPerBatchUs},
		{FitRouteP50, "µs", "workers", p50, target, []string{"linear", "n log n"}, &pr.RouteP50us},
		{FitRouteP99, "µs", "workers", p99, target, []string{"linear", "n log n"}, &pr.RouteCPUP99us},
		{FitRelayCPU, "µs", "gateway subscribers", fan, float64(wl.TargetReplicas), []string{"linear", "n log n"}, &pr.RelayCPUPerBatchUs},
	} {
		first := len(fs.Fits)
		for _, model := range f.models {
			c, err := fitCurve(f.pts, model)
			if err != nil {
				return fmt.Errorf("bench: fleetscale: fit %s: %w", f.figure, err)
			}
			c.Figure, c.Unit, c.X, c.AtX = f.figure, f.unit, f.x, f.at
			c.At = c.Eval(f.at)
			// A curve that projects a cost or a size of zero or less says
			// the measured trend cannot be carried that far: refused too.
			c.Accepted = c.Accepted && c.At > 0
			fs.Fits = append(fs.Fits, c)
		}
		band := projectBand(fs.Fits[first:], f.pts)
		band.Figure, band.Unit, band.AtX = f.figure, f.unit, f.at
		pr.Bands = append(pr.Bands, band)
		if best := bestAccepted(fs.Fits[first:], f.pts); best != nil {
			best.Chosen = true
			*f.out = best.At
		} else {
			*f.out = band.High // no curve: the measured range's high end
		}
	}
	pr.EventsPerSecond = target * wl.BatchesPerWorkerPerSec
	pr.CPUPerSecond = pr.EventsPerSecond * pr.CPUPerBatchUs / 1e6
	if b := pr.Band(FitApplyCPU); b != nil {
		pr.CPUPerSecondLow, pr.CPUPerSecondHigh = pr.EventsPerSecond*b.Low/1e6, pr.EventsPerSecond*b.High/1e6
	}
	if b := pr.Band(FitIndexHeap); b != nil {
		pr.IndexBytesLow, pr.IndexBytesHigh = b.Low, b.High
	}
	pr.RelayCPUPerSecond = float64(wl.RanksPerRelay) * wl.BatchesPerWorkerPerSec * pr.RelayCPUPerBatchUs / 1e6
	return nil
}

// The fitted figures' names.
const (
	FitIndexHeap = "index heap"
	FitApplyCPU  = "CPU per applied batch"
	FitRouteP50  = "route p50"
	FitRouteP99  = "route CPU p99"
	FitRelayCPU  = "relay CPU per batch, all subscribers"
)

type xy struct{ x, y float64 }

// bestAccepted is the accepted fit with the smallest squared error, nil
// when none is accepted.
func bestAccepted(fits []CurveFit, pts []xy) *CurveFit {
	var best *CurveFit
	for i := range fits {
		if fits[i].Accepted && (best == nil || fits[i].sse(pts) < best.sse(pts)) {
			best = &fits[i]
		}
	}
	return best
}

// projectBand is the band the fits of one figure give at their AtX: the
// accepted models' values, or the measured range when none is accepted.
func projectBand(fits []CurveFit, pts []xy) ProjectionBand {
	var b ProjectionBand
	for i, p := range pts {
		if i == 0 || p.y < b.MeasuredLow {
			b.MeasuredLow = p.y
		}
		if i == 0 || p.y > b.MeasuredHigh {
			b.MeasuredHigh = p.y
		}
		b.MeasuredMaxX = max(b.MeasuredMaxX, p.x)
	}
	for _, c := range fits {
		if !c.Accepted {
			continue
		}
		if len(b.Models) == 0 || c.At < b.Low {
			b.Low = c.At
		}
		if len(b.Models) == 0 || c.At > b.High {
			b.High = c.At
		}
		b.Models = append(b.Models, c.Model)
	}
	if len(b.Models) > 0 {
		b.Basis = BasisFits
	} else {
		b.Basis, b.Low, b.High = BasisMeasured, b.MeasuredLow, b.MeasuredHigh
	}
	return b
}

// transform is the fit's regressor for a model.
func transform(model string, x float64) float64 {
	switch model {
	case "n log n":
		return x * math.Log2(max(x, 1))
	case "log":
		return math.Log2(max(x, 1))
	default:
		return x
	}
}

// Eval is the fitted curve at x.
func (c CurveFit) Eval(x float64) float64 { return c.A + c.B*transform(c.Model, x) }

func (c CurveFit) sse(pts []xy) float64 {
	var s float64
	for _, p := range pts {
		r := p.y - c.Eval(p.x)
		s += r * r
	}
	return s
}

// fitCurve is ordinary least squares of y on the model's transform of x.
func fitCurve(pts []xy, model string) (CurveFit, error) {
	c := CurveFit{Model: model, Points: len(pts)}
	var n, sx, sy, sxx, sxy float64
	for _, p := range pts {
		t := transform(model, p.x)
		n++
		sx += t
		sy += p.y
		sxx += t * t
		sxy += t * p.y
	}
	den := n*sxx - sx*sx
	if n < 2 || den == 0 {
		return c, fmt.Errorf("%d points over %d distinct sizes: need two sizes at least", len(pts), distinct(pts))
	}
	c.B = (n*sxy - sx*sy) / den
	c.A = (sy - c.B*sx) / n
	mean := sy / n
	var ssTot float64
	for _, p := range pts {
		ssTot += (p.y - mean) * (p.y - mean)
		if p.y != 0 {
			c.MaxResidualPct = max(c.MaxResidualPct, math.Abs(p.y-c.Eval(p.x))/math.Abs(p.y)*100)
		}
	}
	if ssTot > 0 {
		c.R2 = 1 - c.sse(pts)/ssTot
	}
	c.Accepted = c.R2 >= MinFitR2
	return c, nil
}

func distinct(pts []xy) int {
	seen := map[float64]bool{}
	for _, p := range pts {
		seen[p.x] = true
	}
	return len(seen)
}

// natsLoad is the replicas' NATS traffic at the target fleet, for 1 to
// TargetReplicas replicas, sized with placementsync's own encoders.
func natsLoad(wl *FleetWorkload) []NATSLoadRow {
	hashes := make([]uint64, wl.NewBlocksPerRequest)
	for i := range hashes {
		hashes[i] = uint64(i) * 0x9e3779b97f4a7c15
	}
	subject := placementsync.PlacementSubject("", "meta-llama-3-8b")
	// A message on the NATS wire costs its subject and payload plus the
	// protocol line (PUB/MSG, sizes, a subscription ID), under 40 bytes;
	// the figures below count subject and payload only.
	placement := len(subject) + len(placementsync.PlacementMessage(workerName(wl.TargetWorkers-1), hashes))
	loadSubject := placementsync.DefaultSubjectPrefix + "-load"
	requests := float64(wl.TargetWorkers) * wl.RequestsPerWorkerPerSec
	snapshotsPerSec := float64(time.Second / placementsync.DefaultLoadInterval)
	var rows []NATSLoadRow
	for r := 1; r <= wl.TargetReplicas; r *= 2 {
		row := NATSLoadRow{Replicas: r, PlacementBytes: placement}
		row.PlacementsIn = requests
		row.PlacementsOut = requests * float64(r-1)
		row.PlacementBytesIn = row.PlacementsIn * float64(placement)
		row.PlacementBytesOut = row.PlacementsOut * float64(placement)
		// Each worker's in-flight requests were routed by replicas picked
		// by a round-robin front: a replica's snapshot holds every worker
		// it has one or more of.
		rng := rand.New(rand.NewPCG(uint64(r), 3))
		counts := map[string]int{}
		for w := range wl.TargetWorkers {
			n := 0
			for range wl.InFlightPerWorker {
				if rng.IntN(r) == 0 {
					n++
				}
			}
			if n > 0 {
				counts[workerName(w)] = n
			}
		}
		msgs, cut := placementsync.LoadSnapshotMessages("0123456789abcdef", counts, 0)
		row.LoadWorkers = len(counts) - cut
		row.LoadCapped = cut > 0
		row.LoadParts = len(msgs)
		for _, m := range msgs {
			row.LoadBytes += len(loadSubject) + len(m)
		}
		if r > 1 {
			snapshotsIn := float64(r) * snapshotsPerSec
			row.LoadIn = snapshotsIn * float64(len(msgs))
			row.LoadOut = row.LoadIn * float64(r-1)
			// LoadBytes is a whole snapshot's, all its parts.
			row.LoadBytesIn = snapshotsIn * float64(row.LoadBytes)
			row.LoadBytesOut = row.LoadBytesIn * float64(r-1)
		}
		rows = append(rows, row)
	}
	return rows
}

// File store record framing of a JetStream message (the server's
// msgHdrSize and checksumSize): a record is header + subject + payload +
// checksum.
const (
	jsRecordHeader   = 22
	jsRecordChecksum = 8
)

func jetStreamSizing(wl *FleetWorkload, batchBytes int) JetStreamSizing {
	subject := fmt.Sprintf("kvrelay.events.%s.%d", "10-0-39-15-50051", 7)
	j := JetStreamSizing{Subject: subject, BatchBytes: batchBytes}
	j.RecordBytes = jsRecordHeader + len(subject) + batchBytes + jsRecordChecksum
	j.MsgsPerSec = float64(wl.TargetWorkers) * wl.BatchesPerWorkerPerSec
	j.BytesInPerSec = j.MsgsPerSec * float64(len(subject)+batchBytes)
	j.BytesOutPerSec = j.BytesInPerSec * float64(wl.TargetReplicas)
	j.StorageBytes = j.MsgsPerSec * wl.RetentionSeconds * float64(j.RecordBytes) * float64(wl.StreamReplicas)
	return j
}
