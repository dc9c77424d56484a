//go:build race

package index

import "sync/atomic"

// With the race detector, the writers' stores are atomic: see store_norace.go.
func store64(p *uint64, v uint64) { atomic.StoreUint64(p, v) }
func store32(p *uint32, v uint32) { atomic.StoreUint32(p, v) }
