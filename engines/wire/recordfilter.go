package wire

// recordFilter answers "might this tier's record table hold h?" for the
// stores without a namespace and the removals, which otherwise probe the
// table once per block although almost none of their blocks are in it
// (the table holds namespaced blocks only). That probe, a cache miss per
// block once the table is large, was the largest single line of
// normalizing a realistic batch.
//
// It is a Bloom filter with two probes, a superset of the table's keys:
// every key the table gains is added; keys the table loses stay set until
// the next rebuild, which costs only a probe of the table. It is rebuilt
// from the table when the keys added since the last rebuild pass 1/16 of
// its bits (false positives then stay under about 1.5 %), or once the table
// has lost more keys than it holds, so its size follows the table's.
type recordFilter struct {
	bits  []uint64
	shift uint8 // 64 - log2(bit count)
	added int   // keys set since the last rebuild
	lost  int   // keys the table lost since the last rebuild
}

const (
	filterMul1 = 0x9e3779b97f4a7c15
	filterMul2 = 0xc2b2ae3d27d4eb4f
)

// mayHold is false only for a key the table certainly lacks.
func (f *recordFilter) mayHold(h int64) bool {
	if f.bits == nil {
		return false
	}
	i, j := (uint64(h)*filterMul1)>>f.shift, (uint64(h)*filterMul2)>>f.shift
	return f.bits[i>>6]&(1<<(i&63)) != 0 && f.bits[j>>6]&(1<<(j&63)) != 0
}

func (f *recordFilter) set(h int64) {
	i, j := (uint64(h)*filterMul1)>>f.shift, (uint64(h)*filterMul2)>>f.shift
	f.bits[i>>6] |= 1 << (i & 63)
	f.bits[j>>6] |= 1 << (j & 63)
}

// added notes that records gained h (records already holds it).
func (f *recordFilter) add(h int64, records *recordTable) {
	if f.bits == nil || 16*(f.added+1) > 64*len(f.bits) {
		f.rebuild(records)
		return // the rebuild saw h
	}
	f.set(h)
	f.added++
}

// removed notes that records lost a key.
func (f *recordFilter) removed(records *recordTable) {
	f.lost++
	if f.lost > 1024 && f.lost > records.len() {
		f.rebuild(records)
	}
}

// rebuild sizes the filter at 32 bits a key (at least 1,024 bits) and sets
// every key of records.
func (f *recordFilter) rebuild(records *recordTable) {
	nbits, log := 1024, 10
	for nbits < 32*records.len() {
		nbits, log = 2*nbits, log+1
	}
	if len(f.bits) == nbits/64 {
		clear(f.bits)
	} else {
		f.bits = make([]uint64, nbits/64)
	}
	f.shift = uint8(64 - log)
	f.added, f.lost = records.len(), 0
	records.each(func(h int64, _ *blockRecord) { f.set(h) })
}
