package record

import (
	"fmt"
	"math/rand/v2"
	"runtime"
	"slices"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"

	"github.com/kvrelay/kvrelay/proto/kvpb"
	"github.com/kvrelay/kvrelay/testkit/memstats"
)

const (
	benchStoreBlocks = 64
	benchBlockSize   = 16
)

// benchFeed applies stores of 64 blocks of 16 tokens until blocks live blocks exist. Half the
// stores extend a random earlier block (shared prefixes), the rest start new chains; the tail is
// a vLLM-like GPU store. One batch is reused, as the record keeps nothing of it.
func benchFeed(r *Record, blocks int, seed uint64) { benchFeedNS(r, blocks, seed, plainBlocks) }

// benchNamespaces says which stores of benchFeedNS carry a namespace.
type benchNamespaces int

const (
	plainBlocks benchNamespaces = iota
	// mixedNamespaces: item 7's realistic stream, a quarter of the stores under one of 4 LoRA
	// adapters (lora_name, lora_id on every block) and a sixth under one of 8 cache salts, the
	// adapter and salt also as vLLM's extra_keys on the store's first block.
	mixedNamespaces
	// everyStoreSalted: every store under a LoRA adapter and a salt of its own (a per-request
	// salt), the record's worst case for interned store tails.
	everyStoreSalted
)

func benchFeedNS(r *Record, blocks int, seed uint64, ns benchNamespaces) {
	rng := rand.New(rand.NewPCG(seed, 1))
	st := &kvpb.KvBlocksStored{
		Medium: proto.String("GPU"), GroupIdx: proto.Uint32(0),
		KvCacheSpecKind: proto.String("full_attention"),
		Tier:            kvpb.KvCacheTier_KV_CACHE_TIER_DEVICE.Enum(),
		Locality:        kvpb.KvCacheLocality_KV_CACHE_LOCALITY_LOCAL.Enum(),
	}
	tokens := make([]uint32, benchStoreBlocks*benchBlockSize)
	for i := range benchStoreBlocks {
		st.Blocks = append(st.Blocks, &kvpb.KvBlock{
			BlockSize: benchBlockSize, TokenIds: tokens[i*benchBlockSize : (i+1)*benchBlockSize],
		})
	}
	batch := batchOf(0, &kvpb.KvCacheEvent{Data: &kvpb.KvCacheEvent_Stored{Stored: st}})
	recent := make([]int64, 0, 4096)
	for done := 0; done < blocks; done += benchStoreBlocks {
		st.ParentBlockHash = nil
		if len(recent) > 0 && rng.IntN(2) == 0 {
			st.ParentBlockHash = proto.Int64(recent[rng.IntN(len(recent))])
		}
		for i := range tokens {
			tokens[i] = rng.Uint32() % 152000
		}
		for _, blk := range st.Blocks {
			blk.BlockHash = int64(rng.Uint64())
			blk.LoraId = nil
		}
		st.Blocks[0].ExtraKeys = nil
		st.LoraName, st.CacheSalt = nil, nil
		lora, salt := -1, -1
		switch ns {
		case mixedNamespaces:
			if rng.IntN(4) == 0 {
				lora = rng.IntN(4)
			}
			if rng.IntN(6) == 0 {
				salt = rng.IntN(8)
			}
		case everyStoreSalted:
			lora, salt = rng.IntN(4), done
		}
		if lora >= 0 {
			name := fmt.Sprintf("adapter-%d", lora)
			st.LoraName = proto.String(name)
			id := int64(lora + 1)
			for _, blk := range st.Blocks {
				blk.LoraId = &id
			}
			st.Blocks[0].ExtraKeys = append(st.Blocks[0].ExtraKeys, &kvpb.KvBlockExtraKey{Key: &kvpb.KvBlockExtraKey_Text{Text: name}})
		}
		if salt >= 0 {
			v := fmt.Sprintf("salt-%08x", salt)
			st.CacheSalt = proto.String(v)
			st.Blocks[0].ExtraKeys = append(st.Blocks[0].ExtraKeys, &kvpb.KvBlockExtraKey{Key: &kvpb.KvBlockExtraKey_Text{Text: v}})
		}
		if len(recent) < cap(recent) {
			recent = append(recent, st.Blocks[rng.IntN(benchStoreBlocks)].BlockHash)
		} else {
			recent[rng.IntN(len(recent))] = st.Blocks[rng.IntN(benchStoreBlocks)].BlockHash
		}
		r.Apply(batch)
	}
}

// BenchmarkRecordMemory builds 1,000,000 live blocks and reports the heap they hold per block
// (goal ≤128 B at block size 16, the 64 B of tokens included) and the apply cost per block.
// "churned" then evicts half the blocks (whole stores, leaves first, like an LRU) and stores as
// many again, so that freed slots, arenas and index cells are reused.
func BenchmarkRecordMemory(b *testing.B) {
	const blocks = 1_000_000
	for _, tc := range []struct {
		name  string
		churn bool
		ns    benchNamespaces
	}{
		{"fresh", false, plainBlocks},
		{"churned", true, plainBlocks},
		{"fresh-namespaced-mix", false, mixedNamespaces},
		{"churned-namespaced-mix", true, mixedNamespaces},
		{"fresh-every-store-salted", false, everyStoreSalted},
	} {
		churn := tc.churn
		b.Run(tc.name, func(b *testing.B) {
			var perBlock, nsPerBlock, cpuPerBlock float64
			for b.Loop() {
				before := memstats.Settled().HeapAlloc
				r := New()
				cpu0 := processCPU()
				start := time.Now()
				benchFeedNS(r, blocks, 1, tc.ns)
				nsPerBlock = float64(time.Since(start).Nanoseconds()) / blocks
				cpuPerBlock = float64((processCPU() - cpu0).Nanoseconds()) / blocks
				if churn {
					evictHalf(r)
					benchFeedNS(r, blocks/2, 5, tc.ns)
				}
				after := memstats.Settled().HeapAlloc
				if got := r.Stats().Blocks; got != blocks {
					b.Fatalf("%d live blocks", got)
				}
				perBlock = float64(after-before) / blocks
				runtime.KeepAlive(r)
			}
			b.ReportMetric(perBlock, "B/block")
			b.ReportMetric(nsPerBlock, "ns/block-applied")
			b.ReportMetric(cpuPerBlock, "cpu-ns/block-applied")
		})
	}
}

// evictHalf removes every other store of rank 0, leaves first.
func evictHalf(r *Record) {
	rs := r.ranks[0]
	var hashes []int64
	for slot := uint32(0); slot < rs.used; slot += benchStoreBlocks * 2 {
		hashes = hashes[:0]
		for i := int(slot) + benchStoreBlocks - 1; i >= int(slot); i-- {
			hashes = append(hashes, rs.entry(uint32(i)).hash)
		}
		r.Apply(batchOf(0, removedEv(noTier, hashes...)))
	}
}

// BenchmarkGoMapIndexOverhead measures what a Go map keyed by (rank, tier, hash) would cost per
// entry as the record's index, for comparison with the 4-byte cells of slotIndex.
func BenchmarkGoMapIndexOverhead(b *testing.B) {
	type key struct {
		hash int64
		rank int32
		tier uint8
	}
	const n = 1_000_000
	var perEntry float64
	for b.Loop() {
		before := memstats.Settled().HeapAlloc
		m := make(map[key]uint32)
		for i := range n {
			m[key{hash: int64(uint64(i) * 0x9E3779B97F4A7C15), tier: 1}] = uint32(i)
		}
		perEntry = float64(memstats.Settled().HeapAlloc-before) / n
		runtime.KeepAlive(m)
	}
	b.ReportMetric(perEntry, "B/entry")
}

// BenchmarkSnapshot takes whole snapshots and reports each stage: the Cut (the time the relay's
// lock is held), the ordering (Stream plans every rank), the encoding and, for a receiver, the
// decoding. Encoding is measured both ways in every iteration, one after the other on the same
// Cut: "encode" is NextEncoded (the wire form straight from the entries, what the relay sends),
// "build+marshal" is Next and proto.Marshal (the message path the relay used before). decode is
// proto.Unmarshal of every chunk, what a gateway's generated client does. Goals at 1M blocks: Cut
// ≤5 ms; the whole delivery ≤250 ms (see bench.BenchmarkSnapshotDelivery for it over gRPC).
// Every stage is reported as wall ms and process CPU ms (GC included), the figure to trust
// when the machine is shared; medians over the iterations.
func BenchmarkSnapshot(b *testing.B) {
	for _, tc := range []struct {
		blocks int
		churn  bool
	}{{10_000, false}, {100_000, false}, {1_000_000, false}, {1_000_000, true}} {
		name := fmt.Sprintf("blocks=%d", tc.blocks)
		if tc.churn {
			name += "/churned"
		}
		b.Run(name, func(b *testing.B) {
			r := New()
			benchFeed(r, tc.blocks, 2)
			if tc.churn {
				evictHalf(r)
				benchFeed(r, tc.blocks/2, 6)
			}
			cursors := map[int32]uint64{0: 1 << 40}
			stages := []string{"cut", "order", "encode", "build+marshal", "decode"}
			wall := map[string][]time.Duration{}
			cpu := map[string][]time.Duration{}
			var chunks int
			var bytes int
			for b.Loop() {
				var w0 time.Time
				var c0 time.Duration
				begin := func() { w0, c0 = time.Now(), processCPU() }
				end := func(stage string) {
					wall[stage] = append(wall[stage], time.Since(w0))
					cpu[stage] = append(cpu[stage], processCPU()-c0)
				}
				begin()
				c := r.Cut(nil)
				end("cut")
				begin()
				st := c.Stream(cursors, nil, 1)
				end("order")
				var encoded [][]byte
				begin()
				for enc := st.NextEncoded(); enc != nil; enc = st.NextEncoded() {
					encoded = append(encoded, enc)
				}
				end("encode")
				old := c.Stream(cursors, nil, 1)
				begin()
				for m := old.Next(); m != nil; m = old.Next() {
					if _, err := proto.Marshal(m); err != nil {
						b.Fatal(err)
					}
				}
				end("build+marshal")
				c.Release()
				chunks, bytes = len(encoded), 0
				begin()
				for _, enc := range encoded {
					bytes += len(enc)
					if err := proto.Unmarshal(enc, &kvpb.KvEventBatch{}); err != nil {
						b.Fatal(err)
					}
				}
				end("decode")
			}
			med := func(ds []time.Duration) float64 {
				slices.Sort(ds)
				return float64(ds[len(ds)/2].Microseconds()) / 1000
			}
			for _, stage := range stages {
				b.ReportMetric(med(wall[stage]), stage+"-ms")
				b.ReportMetric(med(cpu[stage]), stage+"-cpu-ms")
			}
			b.ReportMetric(float64(chunks), "chunks")
			b.ReportMetric(float64(bytes)/float64(tc.blocks), "wire-B/block")
		})
	}
}

// BenchmarkApplyDuringCut reports what copy-on-write costs the lock holder: removal batches of 64
// random blocks (the worst case: every block in another segment) applied while a Cut is
// outstanding pay for copying the segments they touch. "none": no Cut, the batch's own cost;
// "held": the Cut is only held; "read": a
// reader streams the whole snapshot (NextEncoded) meanwhile, as a subscriber's sender does, and
// competes for the CPU and the memory bus. Goal: ≤ 1 ms a batch. The batch's thread CPU time is
// reported besides its wall time, which a loaded machine inflates with waits for a core.
func BenchmarkApplyDuringCut(b *testing.B) {
	const blocks = 1_000_000
	r := New()
	benchFeed(r, blocks, 3)
	rm := removedEv(noTier)
	batch := batchOf(0, rm)
	rng := rand.New(rand.NewPCG(4, 4))
	// Live hashes to remove, gathered from the record itself.
	var live []int64
	rs := r.ranks[0]
	for slot := uint32(0); slot < rs.used; slot++ {
		live = append(live, rs.entry(slot).hash)
	}
	for _, mode := range []string{"none", "held", "read"} {
		b.Run(mode, func(b *testing.B) {
			runtime.LockOSThread() // threadCPU reads this goroutine's thread
			defer runtime.UnlockOSThread()
			var walls, cpus []time.Duration
			for b.Loop() {
				var c *Cut
				if mode != "none" {
					c = r.Cut(nil)
				}
				read := make(chan int, 1)
				if mode == "read" {
					go func() {
						n := 0
						st := c.Stream(map[int32]uint64{0: 1 << 40}, nil, 1)
						for enc := st.NextEncoded(); enc != nil; enc = st.NextEncoded() {
							n++
						}
						read <- n
					}()
				}
				for range 100 {
					hashes := make([]int64, 64)
					for i := range hashes {
						hashes[i] = live[rng.IntN(len(live))]
					}
					rm.GetRemoved().BlockHashes = hashes
					cpu0 := threadCPU()
					start := time.Now()
					r.Apply(batch)
					walls = append(walls, time.Since(start))
					cpus = append(cpus, threadCPU()-cpu0)
				}
				if mode == "read" {
					if n := <-read; n == 0 {
						b.Fatal("the reader got no chunk")
					}
				}
				if c != nil {
					c.Release()
				}
			}
			us := func(d time.Duration) float64 { return float64(d.Nanoseconds()) / 1e3 }
			slices.Sort(walls)
			slices.Sort(cpus)
			var total time.Duration
			for _, w := range walls {
				total += w
			}
			b.ReportMetric(us(walls[len(walls)-1]), "worst-batch-µs")
			b.ReportMetric(us(walls[len(walls)*99/100]), "p99-batch-µs")
			b.ReportMetric(us(total)/float64(len(walls)), "mean-batch-µs")
			b.ReportMetric(us(cpus[len(cpus)-1]), "worst-batch-cpu-µs")
			b.ReportMetric(us(cpus[len(cpus)*99/100]), "p99-batch-cpu-µs")
		})
	}
}
