package placement

import (
	"fmt"
	"runtime"
	"strconv"
	"testing"
	"time"

	"github.com/kvrelay/kvrelay/testkit/memstats"
)

// TestEntryBytesCoversAFullStore: EntryBytes, from which the README
// states a model's placement memory and placementsync its flood ceiling,
// is at least what a store holds per entry when full at the default cap
// (the entries, the hash map, the holder slices), measured as the heap
// the store keeps after two collections. With EntryBytes at 128 it was
// 168 bytes: the map of 262,144 keys runs at about half its slots.
func TestEntryBytesCoversAFullStore(t *testing.T) {
	if strconv.IntSize != 64 {
		t.Skip("EntryBytes is stated for 64-bit platforms")
	}
	workers := make([]string, 8)
	for i := range workers {
		workers[i] = fmt.Sprint("grpc://10.0.0.", i, ":50061")
	}
	before := memstats.Settled().HeapAlloc
	s := newStore(t, Options{})
	now := time.Unix(1_000_000, 0)
	for i := 0; s.Stats().Entries < DefaultMaxEntries; i++ {
		p := hashes(1+64*i, 64)
		if i%2 == 0 {
			s.Record(workers[i%len(workers)], p, 0, now)
		} else {
			s.RecordFrom(fmt.Sprint("replica-", i%16), workers[i%len(workers)], p, 0, now)
		}
	}
	per := float64(memstats.Settled().HeapAlloc-before) / float64(s.Stats().Entries)
	runtime.KeepAlive(s)
	t.Logf("%d entries: %.1f bytes each (EntryBytes %d)", s.Stats().Entries, per, EntryBytes)
	if per > EntryBytes {
		t.Errorf("a full store holds %.1f bytes an entry, over EntryBytes (%d)", per, EntryBytes)
	}
}
