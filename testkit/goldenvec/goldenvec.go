// Package goldenvec loads testdata/golden's vector sets for the tests that
// check an encoder or decoder against them (proto/kvenc, proto/kvdec): the
// engine payloads and the batches they must normalize to (see
// testdata/golden/README.md for the format).
package goldenvec

import (
	"encoding/hex"
	"encoding/json"
	"os"
	"path/filepath"
	"testing"

	"google.golang.org/protobuf/encoding/protojson"

	"github.com/kvrelay/kvrelay/engines/wire"
	"github.com/kvrelay/kvrelay/proto/kvpb"
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

// Batches is every batch the vector sets in dir stand for: every payload
// normalized by a normalizer of every dialect (state carried across a set's
// payloads, as the golden test does; payloads a dialect refuses are left
// out), and every expected batch of the vectors. These are the batches a
// relay sends for the engines' real wire.
func Batches(tb testing.TB, dir string) []*kvpb.KvEventBatch {
	tb.Helper()
	var out []*kvpb.KvEventBatch
	for _, set := range Load(tb, dir) {
		for d := wire.VLLM; d <= wire.TokenSpeed; d++ {
			n := wire.NewNormalizer(d)
			for i, p := range set.Payloads {
				payload, err := hex.DecodeString(p.Hex)
				if err != nil {
					tb.Fatalf("%s payload %d: %v", set.Name, i, err)
				}
				if b, _, err := n.Normalize(payload, p.Seq, p.Rank); err == nil {
					out = append(out, b)
				}
			}
		}
		for i, p := range set.Payloads {
			raws := []json.RawMessage{p.Expected.Batch}
			for _, e := range p.ExpectedByEngine {
				raws = append(raws, e.Batch)
			}
			for _, raw := range raws {
				if len(raw) == 0 {
					continue
				}
				b := &kvpb.KvEventBatch{}
				if err := protojson.Unmarshal(raw, b); err != nil {
					tb.Fatalf("%s payload %d: expected batch does not parse: %v", set.Name, i, err)
				}
				out = append(out, b)
			}
		}
	}
	return out
}
