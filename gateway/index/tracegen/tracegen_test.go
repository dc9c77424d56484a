package tracegen

import (
	"os"
	"slices"
	"strings"
	"testing"
)

func TestSynthetic(t *testing.T) {
	cfg := SyntheticConfig{Seed: 42, Sessions: 10, Turns: 3, PrefixPool: 2, PrefixBlocks: 4, TurnBlocks: 2, BlockSize: 16}
	a, err := Synthetic(cfg)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := Synthetic(cfg)
	if len(a) != 30 {
		t.Fatalf("%d requests, want 30", len(a))
	}
	last := map[int][]uint32{}
	for i, r := range a {
		if !slices.Equal(r.Tokens, b[i].Tokens) || r.Session != b[i].Session {
			t.Fatalf("request %d differs between runs with one seed", i)
		}
		prev, seen := last[r.Session]
		want := len(prev) + 2*16
		if !seen {
			want = 16 * (4 + 2)
		}
		if len(r.Tokens) != want {
			t.Fatalf("request %d: %d tokens, want %d", i, len(r.Tokens), want)
		}
		if seen && !slices.Equal(prev, r.Tokens[:len(prev)]) {
			t.Fatalf("request %d does not extend its session's previous turn", i)
		}
		last[r.Session] = r.Tokens
	}
	// Two prefixes for ten sessions: some sessions share their first blocks.
	shared := 0
	for s := 1; s < 10; s++ {
		if slices.Equal(last[0][:64], last[s][:64]) {
			shared++
		}
	}
	if shared == 0 {
		t.Errorf("no session shares session 0's prefix")
	}
	if _, err := Synthetic(SyntheticConfig{}); err == nil {
		t.Errorf("zero config accepted")
	}
}

func TestReadMooncakeSample(t *testing.T) {
	f, err := os.Open("testdata/sample_mooncake.jsonl")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	recs, err := ReadMooncake(f)
	if err != nil {
		t.Fatal(err)
	}
	if len(recs) != 60 || len(recs[0].HashIDs) != 7 || recs[0].Timestamp != 274 {
		t.Fatalf("parsed %d records, first %+v", len(recs), recs[0])
	}
	reqs, err := ExpandMooncake(recs, ExpandConfig{BlockSize: 16, LengthFactor: 2, Duplication: 3})
	if err != nil {
		t.Fatal(err)
	}
	if len(reqs) != 180 {
		t.Fatalf("%d requests, want 180", len(reqs))
	}
	for i := 1; i < len(reqs); i++ {
		if reqs[i].TimestampMs < reqs[i-1].TimestampMs {
			t.Fatalf("requests out of time order at %d", i)
		}
	}
	if got := len(reqs[0].Tokens); got != 7*2*16 {
		t.Errorf("first request %d tokens, want %d", got, 7*2*16)
	}
}

func TestExpandSharesEqualIDs(t *testing.T) {
	recs := []MooncakeRecord{{HashIDs: []uint64{1, 2, 3}}, {HashIDs: []uint64{1, 2, 9}}}
	reqs, err := ExpandMooncake(recs, ExpandConfig{BlockSize: 4, LengthFactor: 1, Duplication: 2})
	if err != nil {
		t.Fatal(err)
	}
	byKey := map[[2]int][]uint32{}
	for i, r := range reqs {
		byKey[[2]int{r.Session, i % 2}] = r.Tokens
	}
	a, b := byKey[[2]int{0, 0}], byKey[[2]int{1, 0}]
	if !slices.Equal(a[:8], b[:8]) || slices.Equal(a[8:], b[8:]) {
		t.Errorf("equal ids must give equal blocks and different ids different ones")
	}
	if slices.Equal(byKey[[2]int{0, 0}], byKey[[2]int{0, 1}]) {
		t.Errorf("duplicates must use disjoint id spaces")
	}
}

func TestReadMooncakeErrors(t *testing.T) {
	tests := []struct {
		name, in, want string
	}{
		{"not json", "{\"timestamp\": 1}\nnope\n", "line 2"},
		{"wrong type", `{"hash_ids": "x"}`, "line 1"},
		{"negative length", `{"input_length": -1}`, "negative"},
		{"too many ids", `{"hash_ids": [` + strings.Repeat("1,", maxHashIDs) + `1]}`, "limit"},
		{"line too long", strings.Repeat(" ", maxLineBytes+1), "longer"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, err := ReadMooncake(strings.NewReader(tc.in))
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("err = %v, want it to mention %q", err, tc.want)
			}
		})
	}
	recs, err := ReadMooncake(strings.NewReader("\n  \n{\"hash_ids\":[1]}\n\n"))
	if err != nil || len(recs) != 1 {
		t.Errorf("blank lines: %v %v", recs, err)
	}
	if _, err := ExpandMooncake(recs, ExpandConfig{}); err == nil {
		t.Errorf("zero expand config accepted")
	}
}

func FuzzReadMooncake(f *testing.F) {
	f.Add([]byte(`{"timestamp": 274, "input_length": 3286, "output_length": 39, "hash_ids": [0, 1, 2]}` + "\n"))
	f.Add([]byte("\n\n{}\n"))
	f.Add([]byte(`{"hash_ids": [18446744073709551615]}`))
	f.Add([]byte(`{"hash_ids": [-1]}`))
	f.Fuzz(func(t *testing.T, data []byte) {
		recs, err := ReadMooncake(strings.NewReader(string(data)))
		if err != nil {
			return
		}
		reqs, err := ExpandMooncake(recs, ExpandConfig{BlockSize: 2, LengthFactor: 1, Duplication: 1})
		if err != nil {
			return
		}
		for i, r := range reqs {
			if len(r.Tokens)%2 != 0 {
				t.Fatalf("request %d: %d tokens, not whole blocks", i, len(r.Tokens))
			}
		}
	})
}
