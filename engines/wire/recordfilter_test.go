package wire

import (
	"math/rand/v2"
	"testing"
)

// TestRecordFilterNeverMissesAKey drives a table and its filter through
// random insertions and deletions (growing past several rebuilds, then
// shrinking past the lost-keys rebuild): every key in the table must read
// as possibly held, and keys never inserted must mostly read as absent, or
// the filter saves nothing.
func TestRecordFilterNeverMissesAKey(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	records := &recordTable{}
	var f recordFilter
	var keys []int64
	check := func(phase string) {
		for _, h := range keys {
			if _, ok := records.get(h); ok && !f.mayHold(h) {
				t.Fatalf("%s: key %d is in the table, the filter says not", phase, h)
			}
		}
		falsePos := 0
		for range 10000 {
			h := int64(rng.Uint64()) | 1 // inserted keys are even
			if f.mayHold(h) {
				falsePos++
			}
		}
		if records.len() > 0 && falsePos > 500 {
			t.Fatalf("%s: %d of 10000 absent keys read as held with %d keys in the table", phase, falsePos, records.len())
		}
	}
	for range 50000 {
		h := int64(rng.Uint64()) &^ 1
		records.insert(h, blockRecord{ns: 1, copies: 1})
		f.add(h, records)
		keys = append(keys, h)
	}
	check("after growing")
	for _, h := range keys[:49000] {
		records.deleteAt(records.find(h))
		f.removed(records)
	}
	check("after shrinking")
	if len(f.bits)*64 > 64*1024 {
		t.Errorf("the filter kept %d bits for %d keys", len(f.bits)*64, records.len())
	}
	// Sequential hashes, as tests and some engines' hashes look.
	records = &recordTable{}
	f = recordFilter{}
	keys = keys[:0]
	for h := int64(2); h < 20000; h += 2 {
		records.insert(h, blockRecord{ns: 1, copies: 1})
		f.add(h, records)
		keys = append(keys, h)
	}
	check("sequential keys")
}

// TestNamespaceRecordsSurviveFilterRebuilds: thousands of namespaced blocks
// (several filter rebuilds), most removed again (the lost-keys rebuild),
// then children of the survivors still inherit their namespace, a block
// re-stored without a namespace passes on none, and children of removed
// blocks inherit nothing.
func TestNamespaceRecordsSurviveFilterRebuilds(t *testing.T) {
	n := NewNormalizer(VLLM)
	const total = 6000
	for i := 0; i < total; i += 100 {
		hs := make([]any, 100)
		for j := range hs {
			hs[j] = 1_000_000 + i + j
		}
		mustNormalize(t, n, batch(t, 0, stored(hs, nil, toks(1, 100), 1, "lora_name", "adapter")), uint64(i), 0)
	}
	gone := make([]any, 0, total-10)
	for i := 10; i < total; i++ {
		gone = append(gone, 1_000_000+i)
	}
	mustNormalize(t, n, batch(t, 0, removed(gone)), 1, 0)
	// Block 1_000_005 is stored again, without a namespace: it now passes on none.
	mustNormalize(t, n, batch(t, 0, stored([]any{1_000_005}, nil, toks(1, 1), 1)), 2, 0)
	b, d := mustNormalize(t, n, batch(t, 0,
		stored([]any{1}, 1_000_003, toks(1, 1), 1), // survivor: inherits
		stored([]any{2}, 1_000_005, toks(1, 1), 1), // re-stored plain: its record now has no namespace
		stored([]any{3}, 1_000_500, toks(1, 1), 1), // removed: nothing
	), 3, 0)
	if d.Total() != 0 || len(b.Events) != 3 {
		t.Fatalf("drops %v, %d events", d, len(b.Events))
	}
	for i, want := range []string{"adapter", "", ""} {
		if got := b.Events[i].GetStored().GetLoraName(); got != want {
			t.Errorf("child %d: lora %q, want %q", i+1, got, want)
		}
	}
}
