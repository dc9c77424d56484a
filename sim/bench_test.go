package sim

import (
	"testing"

	"github.com/kvrelay/kvrelay/sim/prefixcache"
)

// BenchmarkStep measures a full step: four workload requests through the
// cache, encoding and publishing one batch (no subscriber attached).
func BenchmarkStep(b *testing.B) {
	for _, engine := range []string{"vllm", "sglang", "tokenspeed"} {
		b.Run(engine, func(b *testing.B) {
			e := startSimB(b, engine)
			b.ReportAllocs()
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				if _, err := e.Step(); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// BenchmarkEncodeBatch measures encoding a 16-block store batch.
func BenchmarkEncodeBatch(b *testing.B) {
	ev := prefixcache.BlockStored{BlockSize: 16, Tokens: make([]uint32, 256)}
	for i := 0; i < 16; i++ {
		ev.Hashes = append(ev.Hashes, uint64(i)*0x9e3779b97f4a7c15)
	}
	for _, engine := range []string{"vllm", "sglang", "tokenspeed"} {
		f, _ := lookupWire(engine, "")
		b.Run(engine, func(b *testing.B) {
			b.ReportAllocs()
			for i := 0; i < b.N; i++ {
				if _, err := f.encodeBatch(1.5, []prefixcache.Event{ev}, 0); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

func startSimB(b *testing.B, engine string) *Engine {
	b.Helper()
	cfg := `{"enable_kv_cache_events": true, "endpoint": "inproc://bench-` + engine + `", "replay_endpoint": "inproc://bench-replay-` + engine + `"}`
	if engine == "sglang" {
		cfg = `{"publisher": "zmq", "endpoint": "inproc://bench-` + engine + `", "replay_endpoint": "inproc://bench-replay-` + engine + `"}`
	}
	e, err := Start(b.Context(), Options{Engine: engine, KVEventsConfig: cfg, CapacityBlocks: 2048})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { e.Close() })
	return e
}
