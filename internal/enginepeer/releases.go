package enginepeer

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"

	"github.com/kvrelay/kvrelay/internal/pyenv"
)

// Release is one engine release whose own kv_events module the interop
// tests run, as listed in testdata/engines/releases.json.
type Release struct {
	Name   string `json:"name"`   // e.g. "vllm-0.33.0"; its folder under the engines dir
	Engine string `json:"engine"` // VLLM, SGLang or TokenSpeed
	Tier   string `json:"tier"`   // "newest" (make test) or "long" (make test-long)
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

// dir is the release's extracted folder; missing files are an error that
// says how to fetch them, not a skip: the matrix is the point.
func (r *Release) dir() (string, error) {
	d := filepath.Join(EnginesDir(), r.Name)
	if _, err := os.Stat(filepath.Join(d, ".sha256")); err != nil {
		return "", fmt.Errorf("release %s is not fetched (%v): run `make engines` (or `make engines-long`)", r.Name, err)
	}
	return d, nil
}
