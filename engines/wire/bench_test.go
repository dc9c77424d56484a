package wire

import (
	"syscall"
	"testing"
	"time"
)

// cpuTime is the process's user+system CPU time: on a shared machine the
// wall clock measures the neighbours, so blocks/cpu-s is reported as well.
func cpuTime() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

const benchBlockSize = 16

// benchPayloads are one step's batch: a single store of blocks of 16 tokens
// with realistic token ids, as vLLM (map event, uint64 hashes) and SGLang
// (legacy array event, signed hashes) publish it.
func benchPayloads(b *testing.B, benchBlocks int) map[string][]byte {
	hashes := make([]any, benchBlocks)
	tokens := make([]any, benchBlocks*benchBlockSize)
	for i := range hashes {
		hashes[i] = uint64(0x9e3779b97f4a7c15) * uint64(i+1)
	}
	for i := range tokens {
		tokens[i] = (i*7919 + 13) % 151000
	}
	extra := make([]any, benchBlocks)
	vllm := batch(b, 0, om{"type", "BlockStored", "block_hashes", hashes, "parent_block_hash", uint64(12345),
		"token_ids", tokens, "block_size", benchBlockSize, "lora_id", nil, "medium", "GPU", "lora_name", nil,
		"extra_keys", extra, "group_idx", 0, "kv_cache_spec_kind", "full_attention"})
	signed := make([]any, benchBlocks)
	for i, h := range hashes {
		signed[i] = int64(h.(uint64))
	}
	sglang := batch(b, 0, []any{"BlockStored", signed, int64(-12345), tokens, benchBlockSize, nil, "GPU"})
	return map[string][]byte{"vllm-map": vllm, "sglang-array": sglang}
}

// BenchmarkNormalize measures decode + normalize + proto build for one
// batch. The same store repeats, so after the first round every hash is a
// known record (a steady per-rank state of 64 blocks).
func BenchmarkNormalize(b *testing.B) {
	cases := []struct {
		name    string
		payload string
		dialect Dialect
		blocks  int
	}{
		{"vllm-map-64", "vllm-map", VLLM, 64},
		{"sglang-array-64", "sglang-array", SGLang, 64},
		// Allocations per batch do not grow with the block count.
		{"vllm-map-256", "vllm-map", VLLM, 256},
	}
	for _, c := range cases {
		b.Run(c.name, func(b *testing.B) {
			n := NewNormalizer(c.dialect)
			payload := benchPayloads(b, c.blocks)[c.payload]
			b.SetBytes(int64(len(payload)))
			b.ReportAllocs()
			b.ResetTimer()
			cpu0 := cpuTime()
			for i := 0; i < b.N; i++ {
				out, _, err := n.Normalize(payload, uint64(i), 0)
				if err != nil || len(out.Events) != 1 {
					b.Fatalf("normalize: %v", err)
				}
			}
			b.ReportMetric(float64(b.N*c.blocks)/b.Elapsed().Seconds(), "blocks/s")
			if cpu := cpuTime() - cpu0; cpu > 0 {
				b.ReportMetric(float64(b.N*c.blocks)/cpu.Seconds(), "blocks/cpu-s")
			}
		})
	}
}
