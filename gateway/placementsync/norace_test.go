//go:build !race

package placementsync

const raceOn = false
