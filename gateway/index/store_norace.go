//go:build !race

package index

// store64 and store32 are the writers' stores into memory that lock-free
// readers read. The readers are guarded by the shard's seqlock: a writer's
// stores happen between two atomic increments of the version (full
// barriers), and a reader trusts what it read only if the version was even
// and unchanged around it, so the stores themselves need no ordering. A
// plain store lets the CPU retire it into the store buffer; an atomic one
// (XCHG on amd64) waits for every earlier store to reach the cache, which
// made it the largest cost of filing a block (the reverse table's writes
// before it usually miss). Word-sized plain stores do not tear in Go.
//
// Under the race detector they are atomic (store_race.go), so that it still
// checks everything else.
func store64(p *uint64, v uint64) { *p = v }
func store32(p *uint32, v uint32) { *p = v }

// copy64 and copy32 copy a run's arrays into a new body with the stores
// above: a plain copy (memmove) here. A CPU profile of the Mooncake corpus
// replay put 16 % of its samples on the element-by-element loop of store64
// and store32 calls this replaces (runs grow a turn at a time; mostly the
// old body's cache misses); the memmove takes 1.5 % of the replay's
// instructions off (callgrind, apply and walk: 1,278.7 M → 1,258.9 M).
func copy64(dst, src []uint64) { copy(dst, src) }
func copy32(dst, src []uint32) { copy(dst, src) }
