package relay

import (
	"math/rand/v2"
	"testing"
)

// BenchmarkRelayStream measures admission (decode, normalize, encode,
// record, history) of a vLLM-like stream, no subscriber: each batch stores
// 64 chained 16-token blocks (token ids below 152,000, as a 152k
// vocabulary's) and removes the 64 blocks stored 1,600 batches before, so
// the record holds about 100k live blocks. Reported per stored block.
func BenchmarkRelayStream(b *testing.B) {
	const (
		perBatch = 64
		tokens   = 16
		keep     = 1600 // batches whose blocks are live
		distinct = 4096 // payloads built, reused cyclically with fresh hashes
	)
	r, rk := benchRelay(b, 10_000)
	rng := rand.New(rand.NewPCG(1, 2))
	payloads := make([][]byte, distinct)
	for i := range payloads {
		base := int64(i) * perBatch
		hs := make([]any, perBatch)
		toks := make([]any, 0, perBatch*tokens)
		for j := range hs {
			hs[j] = base + int64(j) + 1
			for range tokens {
				toks = append(toks, rng.IntN(152_000))
			}
		}
		var parent any
		if i%8 != 0 {
			parent = base // the previous batch's last block: a chain of 8 batches
		}
		events := [][]any{{"BlockStored", hs, parent, toks, tokens, nil, "GPU", nil}}
		// The blocks payload i-keep stored (cyclically; unknown to the
		// record while it fills).
		o := (i - keep + distinct) % distinct
		rm := make([]int64, perBatch)
		for j := range rm {
			rm[j] = int64(o)*perBatch + int64(j) + 1
		}
		events = append(events, removed(rm...))
		payloads[i] = payload(0, events...)
	}
	// Fill the record to its steady state before timing.
	seq := uint64(0)
	for range keep {
		r.relay(rk, seq, payloads[seq%distinct])
		seq++
	}
	b.ReportAllocs()
	b.ResetTimer()
	start := seq
	for b.Loop() {
		r.relay(rk, seq, payloads[seq%distinct])
		seq++
	}
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64((seq-start)*perBatch), "ns/block")
}
