package record

import (
	"fmt"
	"math"
	"math/rand/v2"
	"runtime"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"

	"github.com/kvrelay/kvrelay/proto/kvpb"
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

func heapAlloc() uint64 {
	runtime.GC()
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return m.HeapAlloc
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
				before := heapAlloc()
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
				after := heapAlloc()
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
		before := heapAlloc()
		m := make(map[key]uint32)
		for i := range n {
			m[key{hash: int64(uint64(i) * 0x9E3779B97F4A7C15), tier: 1}] = uint32(i)
		}
		perEntry = float64(heapAlloc()-before) / n
		runtime.KeepAlive(m)
	}
	b.ReportMetric(perEntry, "B/entry")
}

// BenchmarkSnapshot reports the time the relay's lock is held (Cut), the time to order and build
// the chunks off the lock (Chunks) and to encode them for the wire (proto.Marshal).
// Goals at 1M blocks: Cut ≤5 ms, Cut+Chunks ≤250 ms. cut+chunks-cpu-ms is the process CPU time
// over Cut+Chunks (GC included), the figure to trust when the machine is shared.
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
			var lock, whole, cpu, encode time.Duration
			bestCPU := time.Duration(math.MaxInt64)
			var chunks int
			for b.Loop() {
				cpu0 := processCPU()
				start := time.Now()
				c := r.Cut(nil)
				lock += time.Since(start)
				out := c.Chunks(cursors, nil, 1)
				whole += time.Since(start)
				spent := processCPU() - cpu0
				cpu += spent
				bestCPU = min(bestCPU, spent)
				c.Release()
				chunks = len(out)
				start = time.Now()
				for _, batch := range out {
					if _, err := proto.Marshal(batch); err != nil {
						b.Fatal(err)
					}
				}
				encode += time.Since(start)
			}
			n := float64(b.N)
			ms := func(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }
			b.ReportMetric(float64(lock.Microseconds())/n, "cut-µs")
			b.ReportMetric(ms(whole)/n, "cut+chunks-ms")
			b.ReportMetric(ms(cpu)/n, "cut+chunks-cpu-ms")
			b.ReportMetric(ms(bestCPU), "best-cut+chunks-cpu-ms")
			b.ReportMetric(ms(encode)/n, "marshal-ms")
			b.ReportMetric(float64(chunks), "chunks")
		})
	}
}

// BenchmarkApplyDuringCut reports what copy-on-write costs the lock holder: removal batches of 64
// random blocks (the worst case: every block in another segment) applied while a Cut is
// outstanding pay for copying the segments they touch.
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
	var worst, worstCPU, total time.Duration
	batches := 0
	for b.Loop() {
		c := r.Cut(nil)
		for range 100 {
			hashes := make([]int64, 64)
			for i := range hashes {
				hashes[i] = live[rng.IntN(len(live))]
			}
			rm.GetRemoved().BlockHashes = hashes
			cpu0 := processCPU()
			start := time.Now()
			r.Apply(batch)
			spent := time.Since(start)
			worst, total = max(worst, spent), total+spent
			worstCPU = max(worstCPU, processCPU()-cpu0)
			batches++
		}
		c.Release()
	}
	b.ReportMetric(float64(worst.Microseconds()), "worst-batch-µs")
	b.ReportMetric(float64(worstCPU.Microseconds()), "worst-batch-cpu-µs")
	b.ReportMetric(float64(total.Microseconds())/float64(batches), "mean-batch-µs")
}
