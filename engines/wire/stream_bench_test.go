package wire

import (
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"

	"github.com/kvrelay/kvrelay/proto/kvenc"
	"github.com/kvrelay/kvrelay/proto/kvpb"
)

// A realistic event stream, for the decode and normalize figures: distinct
// batches (not one payload repeated) of chained stores and removals, with
// LoRA adapters and cache salts, in each engine's wire form.
//
// Per batch: one to three stores of 8-64 blocks of 16 tokens (a new chain,
// or a continuation of a recent one whose parent it names), and in about a
// third of the batches a removal of 4-32 blocks stored earlier. A quarter
// of the chains run under one of 4 LoRA adapters and a sixth under one of
// 8 cache salts (some under both), where the form can say so.

// streamForm is one engine's wire form.
type streamForm struct {
	name    string
	dialect Dialect
	// lora, salt: whether the form can carry a LoRA name or a cache salt.
	lora, salt bool
	stored     func(s streamStore) any
	removed    func(hashes []uint64) any
}

// streamStore is one store event before encoding.
type streamStore struct {
	hashes    []uint64
	parent    *uint64
	tokens    []any
	lora      string
	salt      string
	continues bool // a continuation: the namespace comes from the chain
}

func (s streamStore) parentValue(signed bool) any {
	if s.parent == nil {
		return nil
	}
	if signed {
		return int64(*s.parent)
	}
	return *s.parent
}

func hashList(hs []uint64, signed bool) []any {
	out := make([]any, len(hs))
	for i, h := range hs {
		if signed {
			out[i] = int64(h)
		} else {
			out[i] = h
		}
	}
	return out
}

func optText(s string) any {
	if s == "" {
		return nil
	}
	return s
}

// vllmExtraKeys is vLLM's per-block extra_keys: the LoRA name on every
// block, the salt on a chain's first block only; nil for a block with none.
func vllmExtraKeys(s streamStore) any {
	if s.lora == "" && s.salt == "" {
		return nil
	}
	out := make([]any, len(s.hashes))
	for i := range out {
		var keys []any
		if s.lora != "" {
			keys = append(keys, s.lora)
		}
		if s.salt != "" && i == 0 && !s.continues {
			keys = append(keys, s.salt)
		}
		if keys != nil {
			out[i] = keys
		}
	}
	return out
}

var streamForms = []streamForm{
	{
		name: "vllm-map", dialect: VLLM, lora: true, salt: true,
		stored: func(s streamStore) any {
			ev := om{"type", "BlockStored", "block_hashes", hashList(s.hashes, false), "parent_block_hash", s.parentValue(false),
				"token_ids", s.tokens, "block_size", benchBlockSize, "lora_id", nil, "medium", "GPU", "lora_name", optText(s.lora),
				"extra_keys", vllmExtraKeys(s), "group_idx", 0, "kv_cache_spec_kind", "full_attention"}
			if s.salt != "" && !s.continues {
				ev = append(ev, "cache_salt", s.salt)
			}
			return ev
		},
		removed: func(hs []uint64) any {
			return om{"type", "BlockRemoved", "block_hashes", hashList(hs, false), "medium", "GPU", "group_idx", 0}
		},
	},
	{
		name: "vllm-array", dialect: VLLM, lora: true, salt: true,
		stored: func(s streamStore) any {
			return []any{"BlockStored", hashList(s.hashes, false), s.parentValue(false), s.tokens, benchBlockSize, nil, "GPU",
				optText(s.lora), vllmExtraKeys(s), 0, "full_attention", nil}
		},
		removed: func(hs []uint64) any { return []any{"BlockRemoved", hashList(hs, false), "GPU", 0} },
	},
	{
		name: "sglang-array", dialect: SGLang, salt: true,
		stored: func(s streamStore) any {
			ev := []any{"BlockStored", hashList(s.hashes, true), s.parentValue(true), s.tokens, benchBlockSize, nil, "GPU"}
			if s.salt != "" {
				ev = append(ev, om{"cache_salt", s.salt})
			}
			return ev
		},
		removed: func(hs []uint64) any { return []any{"BlockRemoved", hashList(hs, true), "GPU"} },
	},
	{
		name: "sglang-map", dialect: SGLang, salt: true,
		stored: func(s streamStore) any {
			ev := om{"type", "BlockStored", "block_hashes", hashList(s.hashes, true), "parent_block_hash", s.parentValue(true),
				"token_ids", s.tokens, "block_size", benchBlockSize, "lora_id", nil, "medium", "GPU"}
			if s.salt != "" {
				ev = append(ev, "cache_salt", s.salt)
			}
			return ev
		},
		removed: func(hs []uint64) any {
			return om{"type", "BlockRemoved", "block_hashes", hashList(hs, true), "medium", "GPU"}
		},
	},
	{
		name: "tokenspeed-array", dialect: TokenSpeed,
		stored: func(s streamStore) any {
			return []any{"BlockStored", hashList(s.hashes, false), s.parentValue(false), s.tokens, benchBlockSize}
		},
		removed: func(hs []uint64) any { return []any{"BlockRemoved", hashList(hs, false)} },
	},
}

// streamBatch is one encoded batch and the block operations in it.
type streamBatch struct {
	payload []byte
	stored  int // blocks stored
	removed int // blocks removed
	// namespaced stores (LoRA or salt) in it
	namespaced int
}

// realisticStream encodes n distinct batches in form f.
func realisticStream(tb testing.TB, f streamForm, n int) []streamBatch {
	rng := rand.New(rand.NewPCG(19, 7))
	type chain struct {
		last       uint64
		lora, salt string
	}
	var chains []chain // recent chain tips
	var live []uint64  // stored, not yet removed
	next := uint64(0x9e3779b97f4a7c15)
	out := make([]streamBatch, 0, n)
	for range n {
		var sb streamBatch
		var events []any
		if len(live) > 64 && rng.IntN(3) == 0 {
			k := 4 + rng.IntN(29)
			start := rng.IntN(len(live) - k)
			hs := append([]uint64(nil), live[start:start+k]...)
			live = append(live[:start], live[start+k:]...)
			events = append(events, f.removed(hs))
			sb.removed += k
		}
		for range 1 + rng.IntN(3) {
			var s streamStore
			var c chain
			if len(chains) > 0 && rng.IntN(2) == 0 {
				i := rng.IntN(len(chains))
				c = chains[i]
				parent := c.last
				s.parent, s.continues = &parent, true
				chains = append(chains[:i], chains[i+1:]...)
			} else {
				if f.lora && rng.IntN(4) == 0 {
					c.lora = fmt.Sprintf("adapter-%d", rng.IntN(4))
				}
				if f.salt && rng.IntN(6) == 0 {
					c.salt = fmt.Sprintf("tenant-%d", rng.IntN(8))
				}
			}
			s.lora, s.salt = c.lora, c.salt
			blocks := 8 + rng.IntN(57)
			s.hashes = make([]uint64, blocks)
			for i := range s.hashes {
				next = next*6364136223846793005 + 1442695040888963407
				s.hashes[i] = next
			}
			s.tokens = make([]any, blocks*benchBlockSize)
			for i := range s.tokens {
				s.tokens[i] = rng.IntN(151_936)
			}
			events = append(events, f.stored(s))
			live = append(live, s.hashes...)
			c.last = s.hashes[blocks-1]
			chains = append(chains, c)
			if len(chains) > 32 {
				chains = chains[1:]
			}
			sb.stored += blocks
			if s.lora != "" || s.salt != "" {
				sb.namespaced++
			}
		}
		sb.payload = batch(tb, 0, events...)
		out = append(out, sb)
	}
	return out
}

const streamBatches = 512

// TestRealisticStreamsNormalizeCleanly checks the benchmark's workload:
// every form's stream normalizes with no drop, forwards every block it
// stores and removes, and its namespaced stores keep their namespace.
func TestRealisticStreamsNormalizeCleanly(t *testing.T) {
	for _, f := range streamForms {
		t.Run(f.name, func(t *testing.T) {
			n := NewNormalizer(f.dialect)
			stored, removed, namespaced := 0, 0, 0
			wantStored, wantRemoved, wantNamespaced := 0, 0, 0
			for i, sb := range realisticStream(t, f, streamBatches) {
				out, drops, err := n.Normalize(sb.payload, uint64(i), 0)
				if err != nil || drops.Total() != 0 {
					t.Fatalf("batch %d: %v, drops %v", i, err, drops)
				}
				wantStored += sb.stored
				wantRemoved += sb.removed
				wantNamespaced += sb.namespaced
				for _, ev := range out.Events {
					if s := ev.GetStored(); s != nil {
						stored += len(s.Blocks)
						if s.GetLoraName() != "" || s.GetCacheSalt() != "" {
							namespaced++
						}
					}
					if r := ev.GetRemoved(); r != nil {
						removed += len(r.BlockHashes)
					}
				}
			}
			if stored != wantStored || removed != wantRemoved || namespaced != wantNamespaced {
				t.Fatalf("forwarded %d stored, %d removed, %d namespaced stores; want %d, %d, %d",
					stored, removed, namespaced, wantStored, wantRemoved, wantNamespaced)
			}
			if (f.lora || f.salt) && namespaced == 0 {
				t.Fatal("no namespaced store in the stream")
			}
		})
	}
}

// BenchmarkDecodeAndNormalize measures, on each form's realistic stream,
// the decoder alone (msgpack to the decoder's event table) and Normalize
// whole (decode, gates, namespaces, the output messages); normalizing alone
// is the difference, both measured in one run. Figures are per block
// operation (a block stored or removed), in CPU time as well as wall time.
func BenchmarkDecodeAndNormalize(b *testing.B) {
	for _, f := range streamForms {
		// The stream is made when the first of the form's sub-benchmarks
		// runs (they run one after another), so that a -bench filter naming
		// one form does not pay for encoding the other four; under callgrind
		// that was most of the run.
		var stream []streamBatch
		var ops, bytes int
		prepare := func(tb testing.TB) {
			if stream != nil {
				return
			}
			stream = realisticStream(tb, f, streamBatches)
			for _, sb := range stream {
				ops += sb.stored + sb.removed
				bytes += len(sb.payload)
			}
		}
		report := func(b *testing.B, cpu0 time.Duration) {
			perBatch := float64(ops) / float64(len(stream))
			blocks := float64(b.N) * perBatch
			b.ReportMetric(b.Elapsed().Seconds()*1e9/blocks, "ns/block")
			if cpu := cpuTime() - cpu0; cpu > 0 {
				b.ReportMetric(blocks/cpu.Seconds(), "blocks/cpu-s")
			}
			b.ReportMetric(perBatch, "blocks/batch")
		}
		// measure runs one per iteration over the stream, framed alike for
		// every sub-benchmark: bytes per batch, allocations, CPU time.
		measure := func(b *testing.B, one func(i int) error) {
			prepare(b)
			b.SetBytes(int64(bytes / len(stream)))
			b.ReportAllocs()
			b.ResetTimer()
			cpu0 := cpuTime()
			for i := 0; i < b.N; i++ {
				if err := one(i); err != nil {
					b.Fatal(err)
				}
			}
			report(b, cpu0)
		}
		b.Run("decode/"+f.name, func(b *testing.B) {
			x := newDecoder(f.dialect)
			measure(b, func(i int) error { return x.decode(stream[i%len(stream)].payload) })
		})
		b.Run("normalize/"+f.name, func(b *testing.B) {
			n := NewNormalizer(f.dialect)
			measure(b, func(i int) error {
				_, _, err := n.Normalize(stream[i%len(stream)].payload, uint64(i), 0)
				return err
			})
		})
		// Decode, normalize and encode, the relay's way today (Normalize's
		// messages, then kvenc into a reused buffer) and straight from the
		// decoder's slabs (AppendNormalized into a reused buffer): the same
		// bytes either way (TestAppendNormalizedMatchesMarshalOnGoldenVectors).
		b.Run("normalize+kvenc/"+f.name, func(b *testing.B) {
			n := NewNormalizer(f.dialect)
			var buf []byte
			measure(b, func(i int) error {
				out, _, err := n.Normalize(stream[i%len(stream)].payload, uint64(i), 0)
				if err != nil {
					return err
				}
				buf, err = kvenc.AppendBatch(buf[:0], out)
				return err
			})
		})
		b.Run("wire/"+f.name, func(b *testing.B) {
			n := NewNormalizer(f.dialect)
			var buf []byte
			measure(b, func(i int) error {
				var err error
				buf, _, err = n.AppendNormalized(buf[:0], stream[i%len(stream)].payload, uint64(i), 0)
				return err
			})
		})
		// The relay's encoding of each normalized batch (issue 19 item 1):
		// proto.Marshal against kvenc.AppendBatch into a reused buffer
		// copied out at its exact size, as relay.relay does; same batches.
		var batches []*kvpb.KvEventBatch
		normalized := func(b *testing.B) []*kvpb.KvEventBatch {
			prepare(b)
			if batches == nil {
				n := NewNormalizer(f.dialect)
				for i, sb := range stream {
					out, _, err := n.Normalize(sb.payload, uint64(i), 0)
					if err != nil {
						b.Fatal(err)
					}
					batches = append(batches, out)
				}
			}
			return batches
		}
		b.Run("encode-marshal/"+f.name, func(b *testing.B) {
			batches := normalized(b)
			b.ReportAllocs()
			b.ResetTimer()
			cpu0 := cpuTime()
			for i := 0; i < b.N; i++ {
				if _, err := proto.Marshal(batches[i%len(batches)]); err != nil {
					b.Fatal(err)
				}
			}
			report(b, cpu0)
		})
		b.Run("encode-kvenc/"+f.name, func(b *testing.B) {
			batches := normalized(b)
			var buf []byte
			b.ReportAllocs()
			b.ResetTimer()
			cpu0 := cpuTime()
			for i := 0; i < b.N; i++ {
				var err error
				if buf, err = kvenc.AppendBatch(buf[:0], batches[i%len(batches)]); err != nil {
					b.Fatal(err)
				}
				sink = append([]byte(nil), buf...)
			}
			report(b, cpu0)
		})
	}
}

// sink keeps the encoding benchmark's copies alive.
var sink []byte
