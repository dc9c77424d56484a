//go:build race

package index

import "sync/atomic"

// With the race detector, the writers' stores are atomic: see store_norace.go.
func store64(p *uint64, v uint64) { atomic.StoreUint64(p, v) }
func store32(p *uint32, v uint32) { atomic.StoreUint32(p, v) }

// copy64 and copy32 store element by element, atomically (see store_norace.go).
func copy64(dst, src []uint64) {
	for i, v := range src[:min(len(src), len(dst))] {
		atomic.StoreUint64(&dst[i], v)
	}
}

func copy32(dst, src []uint32) {
	for i, v := range src[:min(len(src), len(dst))] {
		atomic.StoreUint32(&dst[i], v)
	}
}
