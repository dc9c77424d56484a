package engines_test

import (
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"testing"

	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/testing/protocmp"

	"github.com/kvrelay/kvrelay/engines"
	"github.com/kvrelay/kvrelay/engines/sglang"
	"github.com/kvrelay/kvrelay/engines/tokenspeed"
	"github.com/kvrelay/kvrelay/engines/vllm"
	"github.com/kvrelay/kvrelay/engines/wire"
	"github.com/kvrelay/kvrelay/proto/kvpb"
)

// goldenDir holds the vectors testdata/golden/gen.py writes: payloads encoded
// by the real msgspec (or copied from public captures) and the output smg's
// Python relay makes of them, with kvrelay's intended differences written out.
const goldenDir = "../testdata/golden"

type goldenExpectation struct {
	Batch json.RawMessage   `json:"batch"`
	Drops map[string]uint64 `json:"drops"`
	Error string            `json:"error"`
}

type goldenPayload struct {
	Hex              string                       `json:"hex"`
	Seq              uint64                       `json:"seq"`
	Rank             int32                        `json:"rank"`
	Note             string                       `json:"note"`
	Expected         goldenExpectation            `json:"expected"`
	ExpectedByEngine map[string]goldenExpectation `json:"expected_by_engine"`
	DiffersFromPy    string                       `json:"differs_from_python"`
}

type goldenSet struct {
	Name        string          `json:"name"`
	Description string          `json:"description"`
	Engines     []string        `json:"engines"`
	Payloads    []goldenPayload `json:"payloads"`
}

func loadGoldenSets(t *testing.T) []goldenSet {
	t.Helper()
	files, err := filepath.Glob(filepath.Join(goldenDir, "*.json"))
	if err != nil {
		t.Fatal(err)
	}
	// The generator writes a few dozen sets; far fewer means the directory
	// was emptied or moved, and a test over nothing would pass silently.
	if len(files) < 30 {
		t.Fatalf("found %d golden vector sets in %s, want at least 30 (regenerate: make golden)", len(files), goldenDir)
	}
	sets := make([]goldenSet, 0, len(files))
	for _, f := range files {
		raw, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		var s goldenSet
		if err := json.Unmarshal(raw, &s); err != nil {
			t.Fatalf("%s: %v", f, err)
		}
		if s.Name == "" || len(s.Payloads) == 0 || len(s.Engines) == 0 {
			t.Fatalf("%s: a vector set needs a name, engines and payloads", f)
		}
		sets = append(sets, s)
	}
	return sets
}

func goldenEngines() map[string]engines.Engine {
	return map[string]engines.Engine{
		vllm.Engine.Name:       vllm.Engine,
		sglang.Engine.Name:     sglang.Engine,
		tokenspeed.Engine.Name: tokenspeed.Engine,
	}
}

// TestGoldenVectors normalizes every golden payload with every engine's
// normalizer and requires the exact batch (protocmp) and drop counts.
func TestGoldenVectors(t *testing.T) {
	sets := loadGoldenSets(t)
	byName := goldenEngines()
	checked := map[string]int{}
	for _, set := range sets {
		for _, engineName := range set.Engines {
			eng, ok := byName[engineName]
			if !ok {
				t.Fatalf("%s: unknown engine %q", set.Name, engineName)
			}
			checked[engineName] += len(set.Payloads)
			t.Run(set.Name+"/"+engineName, func(t *testing.T) {
				runGoldenSet(t, set, eng)
			})
		}
	}
	for name := range byName {
		if checked[name] == 0 {
			t.Errorf("no golden payload was checked against %s", name)
		}
	}
}

func runGoldenSet(t *testing.T, set goldenSet, eng engines.Engine) {
	n := wire.NewNormalizer(eng.Dialect)
	for i, p := range set.Payloads {
		want := p.Expected
		if override, ok := p.ExpectedByEngine[eng.Name]; ok {
			want = override
		}
		payload, err := hex.DecodeString(p.Hex)
		if err != nil {
			t.Fatalf("payload %d: bad hex in vector: %v", i, err)
		}
		where := func() string {
			s := fmt.Sprintf("payload %d (seq %d, rank %d)", i, p.Seq, p.Rank)
			if p.Note != "" {
				s += " " + p.Note
			}
			if p.DiffersFromPy != "" {
				s += " [intended difference from the Python relay: " + p.DiffersFromPy + "]"
			}
			return s + "\n  hex " + p.Hex
		}
		got, drops, err := n.Normalize(payload, p.Seq, p.Rank)
		if want.Error != "" {
			if err == nil {
				t.Errorf("%s: want an undecodable error, got batch %v drops %v", where(), got, drops)
			} else if !errors.Is(err, wire.ErrUndecodable) {
				t.Errorf("%s: error %v does not wrap wire.ErrUndecodable", where(), err)
			}
			continue
		}
		if err != nil {
			t.Errorf("%s: unexpected error: %v", where(), err)
			continue
		}
		wantBatch := &kvpb.KvEventBatch{}
		if err := protojson.Unmarshal(want.Batch, wantBatch); err != nil {
			t.Fatalf("%s: expected batch in the vector does not parse: %v", where(), err)
		}
		if diff := cmp.Diff(wantBatch, got, protocmp.Transform()); diff != "" {
			t.Errorf("%s: batch mismatch (-want +got):\n%s", where(), diff)
		}
		if diff := cmp.Diff(want.Drops, drops.Map(), cmpopts.EquateEmpty()); diff != "" {
			t.Errorf("%s: drops mismatch (-want +got):\n%s", where(), diff)
		}
	}
}
