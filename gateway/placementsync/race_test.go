//go:build race

package placementsync

// raceOn shrinks the floods of hostile_test.go under the race detector,
// which makes every message ten times dearer.
const raceOn = true
