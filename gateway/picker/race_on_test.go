//go:build race

package picker

// raceEnabled: under the race detector sync.Pool drops a share of what is
// put back on purpose, so pooled code allocates and allocation counts do not
// hold.
const raceEnabled = true
