package record

import (
	"fmt"
	"math/rand/v2"
	"runtime"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"

	"github.com/kvrelay/kvrelay/proto/kvenc"
	"github.com/kvrelay/kvrelay/proto/kvpb"
)

// BenchmarkApplyEncoded compares Apply and ApplyEncoded side by side on the same vLLM-like
// batches: each stores 64 new blocks (half the stores extending a live block) and removes the 64
// blocks of the oldest store still live, leaves first, so the record keeps its size. Three
// records of the same content take the same batches: Apply of the batch's message on one,
// ApplyEncoded of the batch in the relay's encoding on another, and proto.Unmarshal of that
// encoding then Apply (what the record would do with wire bytes without ApplyEncoded) on the
// third, alternating every 16 batches so that all see the same load; each side's applying
// thread's CPU time is summed.
//
// Sub-benchmarks: live=1M or live=1k entries before the stream (the cost of cache misses: a 1k
// record is all in cache), tokens=16 or 128 a block, ns=plain or mix (benchFeedNS's
// mixedNamespaces: LoRA names and ids, salts and extra keys on a quarter and a sixth of the
// stores). Metrics are per stored block (the batch's removal included): apply-ns/block,
// encoded-ns/block, unmarshal-ns/block (proto.Unmarshal and Apply), encoded/apply and
// encoded/unmarshal. For instruction counts, run one iteration
// under callgrind with --toggle-collect on applyAll, applyAllEncoded or applyAllUnmarshalled
// (see BENCHMARKS.md).
func BenchmarkApplyEncoded(b *testing.B) {
	const batches = 1024
	for _, live := range []int{1_000_000, 1_000} {
		for _, tokens := range []int{16, 128} {
			for _, ns := range []benchNamespaces{plainBlocks, mixedNamespaces} {
				name := fmt.Sprintf("live=%s/tokens=%d/ns=%s", map[int]string{1_000_000: "1M", 1_000: "1k"}[live],
					tokens, map[benchNamespaces]string{plainBlocks: "plain", mixedNamespaces: "mix"}[ns])
				b.Run(name, func(b *testing.B) {
					runtime.LockOSThread() // threadCPU reads this goroutine's thread
					defer runtime.UnlockOSThread()
					var applyNS, encodedNS, unmarshalNS time.Duration
					for b.Loop() {
						msgRec, encRec, unmRec := New(), New(), New()
						benchFeedNS(msgRec, live, 1, ns)
						benchFeedNS(encRec, live, 1, ns)
						benchFeedNS(unmRec, live, 1, ns)
						msgs, encs := wireStream(msgRec, batches, tokens, ns)
						runtime.GC()
						applyNS, encodedNS, unmarshalNS = 0, 0, 0
						const step = 16
						for i := 0; i < batches; i += step {
							t0 := threadCPU()
							applyAll(msgRec, msgs[i:i+step])
							t1 := threadCPU()
							applyAllEncoded(b, encRec, encs[i:i+step])
							t2 := threadCPU()
							applyAllUnmarshalled(b, unmRec, encs[i:i+step])
							applyNS += t1 - t0
							encodedNS += t2 - t1
							unmarshalNS += threadCPU() - t2
						}
						if got, want := encRec.Stats(), msgRec.Stats(); fmt.Sprint(got) != fmt.Sprint(want) {
							b.Fatalf("the records differ: %+v after ApplyEncoded, %+v after Apply", got, want)
						}
						if got := encRec.Stats().Entries; got < uint64(live)*9/10 {
							b.Fatalf("%d live entries, want about %d", got, live)
						}
					}
					n := float64(batches * benchStoreBlocks)
					b.ReportMetric(float64(applyNS.Nanoseconds())/n, "apply-ns/block")
					b.ReportMetric(float64(encodedNS.Nanoseconds())/n, "encoded-ns/block")
					b.ReportMetric(float64(unmarshalNS.Nanoseconds())/n, "unmarshal-ns/block")
					b.ReportMetric(float64(encodedNS)/float64(applyNS), "encoded/apply")
					b.ReportMetric(float64(encodedNS)/float64(unmarshalNS), "encoded/unmarshal")
				})
			}
		}
	}
}

// wireStream prepares BenchmarkApplyEncoded's batches as messages and in the relay's encoding:
// each stores 64 new blocks of tokens ids and removes the oldest store's 64 blocks, the stores
// benchFeedNS made first (its slots are in store order), then the stream's own.
func wireStream(r *Record, n, tokens int, ns benchNamespaces) ([]*kvpb.KvEventBatch, [][]byte) {
	rs := r.ranks[0]
	rng := rand.New(rand.NewPCG(7, uint64(tokens)))
	var fifo []int64 // live hashes in store order
	for slot := uint32(0); slot < rs.used; slot++ {
		fifo = append(fifo, rs.entry(slot).hash)
	}
	msgs := make([]*kvpb.KvEventBatch, 0, n)
	encs := make([][]byte, 0, n)
	for range n {
		st := benchStored()
		if rng.IntN(2) == 0 {
			st.ParentBlockHash = proto.Int64(fifo[len(fifo)-1-rng.IntN(min(len(fifo), 4096))])
		}
		var loraID *int64
		if ns == mixedNamespaces {
			if rng.IntN(4) == 0 {
				lora := rng.IntN(4)
				st.LoraName = proto.String(fmt.Sprintf("adapter-%d", lora))
				loraID = proto.Int64(int64(lora + 1))
			}
			if rng.IntN(6) == 0 {
				st.CacheSalt = proto.String(fmt.Sprintf("salt-%08x", rng.IntN(8)))
			}
		}
		toks := make([]uint32, benchStoreBlocks*tokens)
		for i := range toks {
			toks[i] = rng.Uint32() % 152000
		}
		for j := range benchStoreBlocks {
			st.Blocks = append(st.Blocks, &kvpb.KvBlock{
				BlockHash: int64(rng.Uint64()), BlockSize: int32(tokens),
				TokenIds: toks[j*tokens : (j+1)*tokens], LoraId: loraID,
			})
		}
		for _, v := range []*string{st.LoraName, st.CacheSalt} {
			if v != nil {
				st.Blocks[0].ExtraKeys = append(st.Blocks[0].ExtraKeys, &kvpb.KvBlockExtraKey{Key: &kvpb.KvBlockExtraKey_Text{Text: *v}})
			}
		}
		old := fifo[:benchStoreBlocks]
		rm := make([]int64, 0, benchStoreBlocks)
		for j := len(old) - 1; j >= 0; j-- {
			rm = append(rm, old[j])
		}
		fifo = fifo[benchStoreBlocks:]
		for _, blk := range st.Blocks {
			fifo = append(fifo, blk.BlockHash)
		}
		b := batchOf(0, &kvpb.KvCacheEvent{EventId: 1, Data: &kvpb.KvCacheEvent_Stored{Stored: st}},
			&kvpb.KvCacheEvent{EventId: 2, Data: &kvpb.KvCacheEvent_Removed{Removed: &kvpb.KvBlocksRemoved{BlockHashes: rm}}})
		enc, err := kvenc.AppendBatch(nil, b)
		if err != nil {
			panic(err)
		}
		msgs = append(msgs, b)
		encs = append(encs, enc)
	}
	return msgs, encs
}

// applyAllEncoded is BenchmarkApplyEncoded's measured ApplyEncoded part, a function of its own so
// that a profiler can count it alone (valgrind --toggle-collect), as applyAll is Apply's.
//
//go:noinline
func applyAllEncoded(b *testing.B, r *Record, encs [][]byte) {
	for _, enc := range encs {
		if a, err := r.ApplyEncoded(enc); err != nil || a.Unmarshalled {
			b.Fatalf("ApplyEncoded: %v (went through proto.Unmarshal: %v)", err, a.Unmarshalled)
		}
	}
}

// applyAllUnmarshalled is BenchmarkApplyEncoded's third way: proto.Unmarshal, then Apply.
//
//go:noinline
func applyAllUnmarshalled(b *testing.B, r *Record, encs [][]byte) {
	for _, enc := range encs {
		batch := &kvpb.KvEventBatch{}
		if err := proto.Unmarshal(enc, batch); err != nil {
			b.Fatal(err)
		}
		r.Apply(batch)
	}
}

// BenchmarkTokenPackers packs the same ids (16,384 below 152,000, a vocabulary's spread) with the
// record's packTokens and kvenc.PutVarints32, the two packers whose comments disagreed on which is
// cheaper. For instruction counts, run it under callgrind with --toggle-collect on
// packWithPackTokens or packWithPutVarints32.
func BenchmarkTokenPackers(b *testing.B) {
	rng := rand.New(rand.NewPCG(3, 3))
	toks := make([]uint32, 16384)
	for i := range toks {
		toks[i] = rng.Uint32() % 152000
	}
	buf := make([]byte, 5*len(toks))
	for _, p := range []struct {
		name string
		pack func([]byte, []uint32) int
	}{{"packTokens", packWithPackTokens}, {"PutVarints32", packWithPutVarints32}} {
		b.Run(p.name, func(b *testing.B) {
			b.SetBytes(int64(len(toks)))
			for b.Loop() {
				if n := p.pack(buf, toks); n < 2*len(toks) {
					b.Fatalf("%d bytes", n)
				}
			}
		})
	}
}

//go:noinline
func packWithPackTokens(b []byte, toks []uint32) int { return packTokens(b, 0, toks) }

//go:noinline
func packWithPutVarints32(b []byte, toks []uint32) int { return kvenc.PutVarints32(b, 0, toks) }
