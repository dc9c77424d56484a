package wire

import (
	"bufio"
	"bytes"
	"encoding/hex"
	"encoding/json"
	"testing"

	"google.golang.org/protobuf/proto"

	"github.com/kvrelay/kvrelay/proto/kvpb"
	"github.com/kvrelay/kvrelay/testkit/pyenv"
)

type oracleBatch struct {
	payload []byte // nil: start a fresh Normalizer
	seq     uint64
	rank    int32 // -1: none
}

// pythonNormalize runs smg's Python normalizer over batches, in order, on
// one Normalizer.
func pythonNormalize(t *testing.T, batches []oracleBatch) ([]*kvpb.KvEventBatch, []map[string]uint64) {
	t.Helper()
	var in bytes.Buffer
	answers := 0
	for _, b := range batches {
		if b.payload == nil {
			in.WriteString("{\"reset\": true}\n")
			continue
		}
		answers++
		var rank any
		if b.rank >= 0 {
			rank = b.rank
		}
		line, _ := json.Marshal(map[string]any{"payload": hex.EncodeToString(b.payload), "seq": b.seq, "rank": rank})
		in.Write(append(line, '\n'))
	}
	cmd := pyenv.Command(t, "testdata/smg_normalize.py")
	cmd.Stdin = &in
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("python oracle: %v\n%s", err, stderr.String())
	}
	var protos []*kvpb.KvEventBatch
	var dropped []map[string]uint64
	sc := bufio.NewScanner(bytes.NewReader(out))
	sc.Buffer(nil, 1<<24)
	for sc.Scan() {
		var resp struct {
			Proto   string            `json:"proto"`
			Dropped map[string]uint64 `json:"dropped"`
		}
		if err := json.Unmarshal(sc.Bytes(), &resp); err != nil {
			t.Fatalf("oracle output %q: %v", sc.Text(), err)
		}
		raw, _ := hex.DecodeString(resp.Proto)
		var b kvpb.KvEventBatch
		if err := proto.Unmarshal(raw, &b); err != nil {
			t.Fatalf("oracle proto: %v", err)
		}
		protos = append(protos, &b)
		dropped = append(dropped, resp.Dropped)
	}
	if len(protos) != answers {
		t.Fatalf("oracle answered %d of %d batches", len(protos), answers)
	}
	return protos, dropped
}

// Where smg's two relays agree, our output equals the Python relay's byte
// for byte (as protos). Scenarios avoid the documented divergences: tail
// alignment, window-only ranks, the group pre-pass and SGLang's salted
// array slot.
func TestMatchesThePythonRelay(t *testing.T) {
	grp := func(ev om, g int, kind any) om {
		ev = append(ev, "group_idx", g)
		if kind != nil {
			ev = append(ev, "kv_cache_spec_kind", kind)
		}
		return ev
	}
	scenarios := map[string][]oracleBatch{
		"golden": {{unhex(t, hexF1Batch1), 9, -1}, {unhex(t, hexF1Batch2), 10, -1}},
		"fixtures": {
			{unhex(t, hexF2), 1, 0}, {unhex(t, hexF5), 2, 3}, {unhex(t, hexF6Legacy), 3, -1}, {unhex(t, hexF8), 4, 2},
			{unhex(t, hexF9), 5, 0}, {unhex(t, hexVLLMMap), 6, 0}, {unhex(t, hexVLLMArray12), 7, 0},
			{unhex(t, hexVLLM16750), 8, -1}, {unhex(t, hexSGLangMap), 9, 1}, {unhex(t, hexSGLangArray7), 10, 1},
			{unhex(t, hexTokenSpeed), 11, 4}, {batchOf(t, "00", hexSGLangSaltedMapEvent, hexVLLMRemovedMapEvent, hexClearedArrayEvent), 12, 0},
		},
		"gates": {{batch(t, 0,
			stored([]any{1}, nil, toks(1, 2), 2, "ownership", "kvcr"),
			stored([]any{2}, nil, toks(1, 2), 2, "locality", "REMOTE"),
			stored([]any{3}, nil, toks(1, 2), 2, "locality", "local", "medium", "cpu_tier2"),
			stored([]any{4}, nil, toks(1, 2), 2, "medium", "MARS"),
			removed([]any{3}, "medium", "CPU_TIER2", "ownership", "other"),
			cleared("ownership", "KVCR"),
			stored([]any{}, nil, toks(1, 2), 2),
			stored([]any{5}, nil, []any{}, 0),
			stored([]any{6}, nil, toks(1, 3), 2),
			stored([]any{7, 7}, nil, toks(1, 2), 1),
			stored([]any{8}, 8, toks(1, 2), 2),
			om{"type", "Future"},
			om{"type", "BlockStored"},
			stored([]any{9}, nil, []any{[]any{1, 2}, []any{2, 3}}, 2),
		), 1, 0}},
		"groups": {{batch(t, 0,
			grp(stored([]any{1}, nil, toks(1, 2), 2), 0, "full_attention"),
			grp(stored([]any{2}, nil, toks(1, 2), 2), 1, "mamba"),
			grp(stored([]any{3}, nil, toks(1, 2), 2), 2, "mla_attention"),
			grp(removed([]any{2}), 1, nil),
			grp(removed([]any{9}), 5, nil),
			grp(stored([]any{4}, nil, toks(1, 2), 2), 1, nil),
		), 1, 0}},
		"namespaces and copies": {
			{batch(t, 0,
				stored([]any{1}, nil, toks(1, 2), 2, "lora_name", "L", "extra_keys", []any{[]any{"L", "salt", 7, []byte{9}, []any{"mm", 3}, 1.5}}),
				stored([]any{1}, nil, toks(1, 2), 2, "lora_name", "L", "cache_salt", "salt"),
				stored([]any{2}, 1, toks(3, 4), 2),
				removed([]any{1}),
				stored([]any{3}, 2, toks(5, 6), 2, "lora_name", ""),
			), 1, 0},
			{batch(t, 1, stored([]any{4}, 1, toks(3, 4), 2), cleared()), 1, 1},
			{batch(t, 0, removed([]any{1}), stored([]any{5}, 1, toks(3, 4), 2), cleared(), stored([]any{6}, 2, toks(3, 4), 2)), 2, 0},
			{enc(t, []any{2.0, []any{stored([]any{7}, nil, toks(1, 2), 2, "session_id", "s1")}}), 3, -1},
		},
	}
	// One Python process serves every scenario, each on a fresh Normalizer.
	names := []string{"golden", "fixtures", "gates", "groups", "namespaces and copies"}
	var all []oracleBatch
	for _, name := range names {
		all = append(append(all, oracleBatch{}), scenarios[name]...)
	}
	want, wantDropped := pythonNormalize(t, all)
	if len(want[0].Events) != 4 {
		t.Fatalf("oracle's BATCH1 has %d events, want 4", len(want[0].Events))
	}
	i := 0
	for _, name := range names {
		n := NewNormalizer(VLLM)
		for j, b := range scenarios[name] {
			got, _ := mustNormalize(t, n, b.payload, b.seq, b.rank)
			if !proto.Equal(got, want[i]) {
				t.Errorf("%s batch %d differs from the Python relay:\n go %v\n py %v", name, j, got, want[i])
			}
			if gotDropped := n.Counts().Dropped.Map(); !mapsEqual(gotDropped, wantDropped[i]) {
				t.Errorf("%s batch %d drops %v, Python %v", name, j, gotDropped, wantDropped[i])
			}
			i++
		}
	}
}

func mapsEqual(a, b map[string]uint64) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		if b[k] != v {
			return false
		}
	}
	return true
}
