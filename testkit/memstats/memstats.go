// Package memstats reads the heap as tests that measure what something
// holds want it: after the garbage is gone, pooled buffers included.
package memstats

import "runtime"

// Settled is runtime.MemStats after two collections: the first moves
// sync.Pool's cached objects (the NATS server and client pool their
// buffers) to the pools' victim caches, the second frees them, so what is
// left on the heap is what someone holds. HeapAlloc is then the bytes of
// live objects, HeapInuse the spans that hold them.
func Settled() runtime.MemStats {
	runtime.GC()
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return m
}
