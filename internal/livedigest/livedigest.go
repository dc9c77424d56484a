// Package livedigest defines kvrelay's anti-entropy digest of a DP rank's
// live set, the one thing the relay's record and a gateway's index must
// compute alike: the sum (mod 2^64) over every live physical copy on the
// device and host tiers of Block(engine hash, tier). A sum, not a XOR, so
// that two copies of a block do not cancel; order-independent, so each side
// keeps it incrementally (add on a store, subtract on a removal). Disk and
// external tiers are left out because a gateway's index does not hold them.
package livedigest

// The tiers the digest covers, as the proto's KvCacheTier numbers them.
const (
	TierDevice = 1
	TierHost   = 2
)

// Block is one copy's share of the digest: a 64-bit mix (splitmix64's
// finalizer) of the engine hash and the tier, so that nearby hashes and the
// same hash on two tiers spread over the whole range.
func Block(engineHash uint64, tier uint8) uint64 {
	z := engineHash ^ uint64(tier)*0x9e3779b97f4a7c15
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9
	z = (z ^ (z >> 27)) * 0x94d049bb133111eb
	return z ^ (z >> 31)
}

// Covered reports whether a tier (KvCacheTier number) counts in the digest.
func Covered(tier uint8) bool { return tier == TierDevice || tier == TierHost }
