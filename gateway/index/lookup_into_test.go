package index

import (
	"fmt"
	"reflect"
	"testing"
)

// lookupFleet is an index where, of workers workers, every eighth holds the
// whole prompt and every other eighth its first half (BenchmarkRoute's
// shape), so that a lookup of the prompt ends with workers/4 overlaps and
// starts with a multi-word candidate set when workers > 64.
func lookupFleet(t testing.TB, workers, promptBlocks int) (*Index, []uint32) {
	t.Helper()
	const bs = 4
	ix := New(Options{BlockSize: bs})
	prompt := make([]uint32, promptBlocks*bs)
	for i := range prompt {
		prompt[i] = uint32(i*7 + 3)
	}
	for i := 0; i < workers; i++ {
		var toks []uint32
		switch i % 8 {
		case 0:
			toks = prompt
		case 4:
			toks = prompt[:len(prompt)/2]
		default:
			continue
		}
		ix.Apply(fmt.Sprintf("w%04d", i), batch(0, stored(chainBlocks(1, toks))))
	}
	return ix, prompt
}

// TestFindMatchesIntoAnswersAsFindMatches: the Into forms give the
// allocating forms' answer for every input form, also into a Matches that
// held a longer answer before (nothing of it may show through) and for a
// request nobody holds.
func TestFindMatchesIntoAnswersAsFindMatches(t *testing.T) {
	ix, prompt := lookupFleet(t, 200, 64)
	other := make([]uint32, len(prompt))
	for i := range other {
		other[i] = uint32(1e6 + i)
	}
	var dst Matches
	for _, tc := range []struct {
		name   string
		tokens []uint32
		wantN  int // overlapping workers
	}{
		{"whole prompt", prompt, 50},
		{"first quarter", prompt[:len(prompt)/4], 50},
		{"nobody holds it", other, 0},
		{"shorter than a block", prompt[:3], 0},
		{"whole prompt again", prompt, 50},
	} {
		t.Run(tc.name, func(t *testing.T) {
			want := ix.FindMatches(tc.tokens, Namespace{})
			if len(want.Workers) != tc.wantN {
				t.Fatalf("FindMatches found %d workers, want %d", len(want.Workers), tc.wantN)
			}
			prefix := PrefixHashes(tc.tokens, 4, Namespace{})
			content := ContentHashes(tc.tokens, 4, Namespace{}.Seed())
			for _, form := range []struct {
				name   string
				lookup func(*Matches)
				alloc  func() Matches
			}{
				{"tokens", func(m *Matches) { ix.FindMatchesInto(m, tc.tokens, Namespace{}) }, nil},
				{"hashes", func(m *Matches) { ix.FindMatchesHashesInto(m, prefix) }, func() Matches { return ix.FindMatchesHashes(prefix) }},
				{"content", func(m *Matches) { ix.FindMatchesContentInto(m, content) }, func() Matches { return ix.FindMatchesContent(content) }},
			} {
				form.lookup(&dst)
				if dst.RequestBlocks != want.RequestBlocks || len(dst.Workers) != len(want.Workers) ||
					(len(want.Workers) > 0 && !reflect.DeepEqual(dst.Workers, want.Workers)) {
					t.Fatalf("%s: Into answered %d blocks, %v; FindMatches %d blocks, %v", form.name, dst.RequestBlocks, dst.Workers, want.RequestBlocks, want.Workers)
				}
				if form.alloc != nil {
					if got := form.alloc(); !reflect.DeepEqual(got, want) {
						t.Fatalf("%s: allocating form answered %+v, FindMatches %+v", form.name, got, want)
					}
				}
			}
		})
	}
}

// TestFindMatchesIntoAllocatesNothing: once a caller's Matches has grown to
// the fleet's overlaps, a lookup allocates nothing, for each input form and
// for fleets whose candidate sets and answers outgrow the lookup's first
// buffers (16 live words, 32 overlaps). The allocating forms still allocate
// (their result), which the counts show as the reference.
func TestFindMatchesIntoAllocatesNothing(t *testing.T) {
	if raceEnabled {
		t.Skip("the race detector makes sync.Pool drop items on purpose; allocation counts do not hold")
	}
	for _, workers := range []int{8, 512, 4096} {
		ix, prompt := lookupFleet(t, workers, 512)
		prefix := PrefixHashes(prompt, 4, Namespace{})
		content := ContentHashes(prompt, 4, Namespace{}.Seed())
		var dst Matches
		for _, form := range []struct {
			name   string
			lookup func()
		}{
			{"FindMatchesInto", func() { ix.FindMatchesInto(&dst, prompt, Namespace{}) }},
			{"FindMatchesHashesInto", func() { ix.FindMatchesHashesInto(&dst, prefix) }},
			{"FindMatchesContentInto", func() { ix.FindMatchesContentInto(&dst, content) }},
		} {
			form.lookup() // grows dst and the pooled working memory
			if got := testing.AllocsPerRun(200, func() {
				form.lookup()
				if dst.Best() != 512 || len(dst.Workers) != workers/4 {
					t.Fatalf("best %d over %d workers, want 512 over %d", dst.Best(), len(dst.Workers), workers/4)
				}
			}); got != 0 {
				t.Errorf("workers=%d %s: %v allocations per lookup, want 0", workers, form.name, got)
			}
		}
		if got := testing.AllocsPerRun(200, func() { _ = ix.FindMatchesHashes(prefix) }); got != 1 {
			t.Errorf("workers=%d FindMatchesHashes: %v allocations per lookup, want 1 (its result)", workers, got)
		}
	}
}
