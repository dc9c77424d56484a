package wire

import (
	"bytes"
	"encoding/json"
)

// DropReason says why an event was not forwarded. The names are the metrics
// contract shared with smg's relays.
type DropReason uint8

const (
	DropUnknownType DropReason = iota
	DropUnsupportedOwnership
	DropNonLocalLocality
	DropUnknownMedium
	DropNonMainAttentionGroup
	DropUnalignedBlocks
	DropSelfReferencingHashes
	DropPlaceholder
	DropMalformed
	numDropReasons
)

var dropNames = [numDropReasons]string{
	"unknown_type",
	"unsupported_ownership",
	"non_local_locality",
	"unknown_medium",
	"non_main_attention_group",
	"unaligned_blocks",
	"self_referencing_hashes",
	"placeholder",
	"malformed",
}

func (r DropReason) String() string {
	if r < numDropReasons {
		return dropNames[r]
	}
	return "invalid"
}

// DropReasons lists every reason, in a stable order (for metrics).
func DropReasons() []DropReason {
	out := make([]DropReason, numDropReasons)
	for i := range out {
		out[i] = DropReason(i)
	}
	return out
}

// Drops counts dropped events by reason. It is a fixed array so counting
// drops never allocates.
type Drops [numDropReasons]uint64

// Total is the number of dropped events.
func (d Drops) Total() uint64 {
	var n uint64
	for _, v := range d {
		n += v
	}
	return n
}

// Map returns the non-zero counts keyed by reason name.
func (d Drops) Map() map[string]uint64 {
	m := make(map[string]uint64)
	for i, v := range d {
		if v != 0 {
			m[dropNames[i]] = v
		}
	}
	return m
}

// MarshalJSON prints {"<reason>": n} for the non-zero reasons, in reason order.
func (d Drops) MarshalJSON() ([]byte, error) {
	var b bytes.Buffer
	b.WriteByte('{')
	first := true
	for i, v := range d {
		if v == 0 {
			continue
		}
		if !first {
			b.WriteByte(',')
		}
		first = false
		name, _ := json.Marshal(dropNames[i])
		b.Write(name)
		b.WriteByte(':')
		b.Write([]byte(jsonUint(v)))
	}
	b.WriteByte('}')
	return b.Bytes(), nil
}

func (d Drops) String() string {
	b, _ := d.MarshalJSON()
	return string(b)
}

func jsonUint(v uint64) string {
	b, _ := json.Marshal(v)
	return string(b)
}

// Counts are a Normalizer's cumulative counters.
type Counts struct {
	ForwardedStored  uint64 `json:"forwarded_stored"`
	ForwardedRemoved uint64 `json:"forwarded_removed"`
	ForwardedCleared uint64 `json:"forwarded_cleared"`
	// BigramStores are forwarded stores whose tokens came as bigram pairs.
	BigramStores uint64 `json:"bigram_stores"`
	// WindowOnlyStores are sliding-window stores forwarded because their
	// rank has shown no main-attention group.
	WindowOnlyStores uint64 `json:"window_only_stores"`
	// TailAlignedStores named fewer blocks than their tokens spanned and
	// took the tail of the tokens.
	TailAlignedStores uint64 `json:"tail_aligned_stores"`
	// UndecodableBatches are payloads Normalize returned an error for.
	UndecodableBatches uint64 `json:"undecodable_batches"`
	Dropped            Drops  `json:"dropped"`
}
