//go:build indexerbench && !linux

package index

import (
	"errors"
	"os"
)

// stallProbeFromEnv: the stall diagnosis reads Linux's per-thread clocks
// and resource usage.
func stallProbeFromEnv() (lookupProbe, func() error, error) {
	if os.Getenv("KVRELAY_CORPUS_STALLS") != "" {
		return nil, nil, errors.New("KVRELAY_CORPUS_STALLS needs Linux (per-thread CPU clock and rusage)")
	}
	return nil, func() error { return nil }, nil
}
