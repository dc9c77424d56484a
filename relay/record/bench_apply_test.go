package record

import (
	"fmt"
	"math/rand/v2"
	"runtime"
	"testing"

	"google.golang.org/protobuf/proto"

	"github.com/kvrelay/kvrelay/proto/kvpb"
)

// BenchmarkApply reports the record's own CPU per block at 1 M live blocks, nothing else timed:
// the record is filled with benchFeedNS, then 1,024 prepared batches are applied, each storing 64
// new blocks of 16 tokens (half of them extending a random live block) and removing the 64 blocks
// of the oldest store (leaves first), so the rank stays at 1 M. "mix" stores carry item 7's
// namespaces (benchFeedNS's mixedNamespaces). cpu-ns/block is process CPU (the collector
// included) per block stored or removed; thread-cpu-ns/block the applying thread's alone.
func BenchmarkApply(b *testing.B) {
	const (
		blocks  = 1_000_000
		batches = 1024
	)
	for _, tc := range []struct {
		name string
		ns   benchNamespaces
	}{{"plain", plainBlocks}, {"mix", mixedNamespaces}} {
		b.Run(tc.name, func(b *testing.B) {
			runtime.LockOSThread() // threadCPU reads this goroutine's thread
			defer runtime.UnlockOSThread()
			var cpuPerBlock, threadPerBlock float64
			for b.Loop() {
				r := New()
				benchFeedNS(r, blocks, 1, tc.ns)
				stream := applyStream(r, batches, tc.ns)
				runtime.GC()
				cpu0, th0 := processCPU(), threadCPU()
				applyAll(r, stream)
				cpu, th := processCPU()-cpu0, threadCPU()-th0
				if got := r.Stats().Blocks; got != blocks {
					b.Fatalf("%d live blocks, want %d", got, blocks)
				}
				n := float64(batches * 2 * benchStoreBlocks)
				cpuPerBlock = float64(cpu.Nanoseconds()) / n
				threadPerBlock = float64(th.Nanoseconds()) / n
			}
			b.ReportMetric(cpuPerBlock, "cpu-ns/block")
			b.ReportMetric(threadPerBlock, "thread-cpu-ns/block")
		})
	}
}

// applyStream prepares BenchmarkApply's batches: store 64 new blocks, remove the oldest store's.
// benchStored is a store event with the fields vLLM's device stores carry,
// before its blocks.
func benchStored() *kvpb.KvBlocksStored {
	return &kvpb.KvBlocksStored{
		Medium: proto.String("GPU"), GroupIdx: proto.Uint32(0),
		KvCacheSpecKind: proto.String("full_attention"),
		Tier:            kvpb.KvCacheTier_KV_CACHE_TIER_DEVICE.Enum(),
		Locality:        kvpb.KvCacheLocality_KV_CACHE_LOCALITY_LOCAL.Enum(),
	}
}

func applyStream(r *Record, n int, ns benchNamespaces) []*kvpb.KvEventBatch {
	rs := r.ranks[0]
	rng := rand.New(rand.NewPCG(7, 7))
	var live []int64
	for slot := uint32(0); slot < rs.used; slot++ {
		live = append(live, rs.entry(slot).hash)
	}
	out := make([]*kvpb.KvEventBatch, 0, n)
	tokens := make([]uint32, n*benchStoreBlocks*benchBlockSize)
	for i := range tokens {
		tokens[i] = rng.Uint32() % 152000
	}
	for i := range n {
		st := benchStored()
		if rng.IntN(2) == 0 {
			st.ParentBlockHash = proto.Int64(live[rng.IntN(len(live))])
		}
		var loraID *int64
		if ns == mixedNamespaces {
			if rng.IntN(4) == 0 {
				name := fmt.Sprintf("adapter-%d", rng.IntN(4))
				st.LoraName = proto.String(name)
				loraID = proto.Int64(int64(name[len(name)-1]-'0') + 1)
			}
			if rng.IntN(6) == 0 {
				st.CacheSalt = proto.String(fmt.Sprintf("salt-%08x", rng.IntN(8)))
			}
		}
		for j := range benchStoreBlocks {
			k := (i*benchStoreBlocks + j) * benchBlockSize
			st.Blocks = append(st.Blocks, &kvpb.KvBlock{
				BlockHash: int64(rng.Uint64()), BlockSize: benchBlockSize,
				TokenIds: tokens[k : k+benchBlockSize], LoraId: loraID,
			})
		}
		for _, v := range []*string{st.LoraName, st.CacheSalt} {
			if v != nil {
				st.Blocks[0].ExtraKeys = append(st.Blocks[0].ExtraKeys, &kvpb.KvBlockExtraKey{Key: &kvpb.KvBlockExtraKey_Text{Text: *v}})
			}
		}
		// The oldest store still live: benchFeedNS filled slots in store order, 64 a store.
		old := live[i*benchStoreBlocks : (i+1)*benchStoreBlocks]
		rm := make([]int64, 0, benchStoreBlocks)
		for j := len(old) - 1; j >= 0; j-- {
			rm = append(rm, old[j])
		}
		out = append(out, batchOf(0,
			&kvpb.KvCacheEvent{Data: &kvpb.KvCacheEvent_Stored{Stored: st}},
			removedEv(noTier, rm...)))
	}
	return out
}

// applyAll is the measured part of BenchmarkApply, a function of its own so that a profiler can
// count it alone (valgrind --toggle-collect).
//
//go:noinline
func applyAll(r *Record, stream []*kvpb.KvEventBatch) {
	for _, batch := range stream {
		r.Apply(batch)
	}
}
