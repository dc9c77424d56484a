package enginepeer

import (
	"encoding/hex"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"testing"

	"github.com/kvrelay/kvrelay/testkit/prereq"
	"github.com/kvrelay/kvrelay/testkit/pyenv"
)

// Release is one engine release whose own kv_events module the interop
// tests run, as listed in testdata/engines/releases.json.
type Release struct {
	Name   string `json:"name"`   // e.g. "vllm-0.33.0"; its folder under the engines dir
	Engine string `json:"engine"` // VLLM, SGLang or TokenSpeed
	Tier   string `json:"tier"`   // "newest" (make test) or "long" (make test-long)
	// NoDPRanks: the release predates DP support (one publisher, batches
	// without a rank), so it runs with one rank.
	NoDPRanks bool `json:"no_dp_ranks"`
}

// The tiers of the release matrix.
const (
	TierNewest = "newest"
	TierLong   = "long"
)

// Releases lists the releases a test run covers: the newest tier always,
// and every tier when KVRELAY_ENGINE_TIER=long (make test-long).
func Releases() ([]Release, error) {
	b, err := os.ReadFile(pyenv.Script("engines", "releases.json"))
	if err != nil {
		return nil, fmt.Errorf("release matrix: %w", err)
	}
	var doc struct {
		Releases []Release `json:"releases"`
	}
	if err := json.Unmarshal(b, &doc); err != nil {
		return nil, fmt.Errorf("release matrix: %w", err)
	}
	long := os.Getenv("KVRELAY_ENGINE_TIER") == TierLong
	var out []Release
	for _, r := range doc.Releases {
		if r.Tier == TierNewest || long {
			out = append(out, r)
		}
	}
	return out, nil
}

// EnginesDir holds the extracted releases: KVRELAY_ENGINES (set by the
// Makefile) or the repository's .venv/engines.
func EnginesDir() string {
	if d := os.Getenv("KVRELAY_ENGINES"); d != "" {
		return d
	}
	return filepath.Join(pyenv.RepoRoot(), ".venv", "engines")
}

// dir is the release's extracted folder. A release not fetched is a missing
// prerequisite (package prereq): skipped on a plain `go test`, naming the
// command that fetches it; a failure under `make test`.
func (r *Release) dir(t testing.TB) string {
	t.Helper()
	d := filepath.Join(EnginesDir(), r.Name)
	if _, err := os.Stat(filepath.Join(d, ".sha256")); err != nil {
		fetch := "make engines"
		if r.Tier != TierNewest {
			fetch = "make engines-long"
		}
		prereq.Missing(t, "the engine release "+r.Name, fetch, err)
	}
	return d
}

// RingPayload is the payload the publisher encoded for rank's batch seq, read
// from its replay ring (release peers only): what went on the wire.
func (p *Peer) RingPayload(rank int, seq uint64) ([]byte, error) {
	var out struct {
		Payload string `json:"payload"`
	}
	if err := p.call(map[string]any{"op": "ring_payload", "rank": rank, "seq": seq}, &out); err != nil {
		return nil, err
	}
	return hex.DecodeString(out.Payload)
}

// NamespacedHash is the block hash SGLang publishes for hash h under an
// extra_key and a cache_salt (nil: absent), computed by the release's own
// kv_event_namespace_seed and namespaced_block_hash (SGLang 0.5.23 peers only).
func (p *Peer) NamespacedHash(h int64, extraKey, cacheSalt *string) (int64, error) {
	var out struct {
		Hash int64 `json:"hash"`
	}
	err := p.call(map[string]any{"op": "namespaced_hash", "hash": h, "extra_key": extraKey, "cache_salt": cacheSalt}, &out)
	return out.Hash, err
}

// ReleaseOf returns the newest-tier release of engine from the matrix.
func ReleaseOf(engine string) (*Release, error) {
	rs, err := Releases()
	if err != nil {
		return nil, err
	}
	for i := range rs {
		if rs[i].Engine == engine && rs[i].Tier == TierNewest {
			return &rs[i], nil
		}
	}
	return nil, fmt.Errorf("no newest release of %s in the matrix", engine)
}
