// Package goldenvec loads testdata/golden's vector sets for the tests that
// check an encoder or decoder against them (proto/kvenc, proto/kvdec): the
// engine payloads and the batches they must normalize to (see
// testdata/golden/README.md for the format).
package goldenvec

import (
	"encoding/json"
	"os"
	"path/filepath"
	"testing"
)

// Set is the part of a vector set these tests read.
type Set struct {
	Name     string `json:"name"`
	Payloads []struct {
		Hex      string `json:"hex"`
		Seq      uint64 `json:"seq"`
		Rank     int32  `json:"rank"`
		Expected struct {
			Batch json.RawMessage `json:"batch"`
		} `json:"expected"`
		ExpectedByEngine map[string]struct {
			Batch json.RawMessage `json:"batch"`
		} `json:"expected_by_engine"`
	} `json:"payloads"`
}

// Load reads every vector set in dir (testdata/golden, relative to the
// calling test's package), failing tb on any error, and on fewer than 30
// sets: a moved directory would otherwise make every check over them pass
// over nothing.
func Load(tb testing.TB, dir string) []Set {
	tb.Helper()
	files, err := filepath.Glob(filepath.Join(dir, "*.json"))
	if err != nil {
		tb.Fatal(err)
	}
	if len(files) < 30 {
		tb.Fatalf("found %d golden vector sets in %s, want at least 30", len(files), dir)
	}
	var sets []Set
	for _, f := range files {
		raw, err := os.ReadFile(f)
		if err != nil {
			tb.Fatal(err)
		}
		var s Set
		if err := json.Unmarshal(raw, &s); err != nil {
			tb.Fatalf("%s: %v", f, err)
		}
		sets = append(sets, s)
	}
	return sets
}
