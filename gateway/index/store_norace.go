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
