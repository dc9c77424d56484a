package placementsync

import (
	"encoding/binary"
	"fmt"
)

// A load message is one replica's snapshot of its own tracked in-flight
// requests, one subject for all models (worker names are unique across a
// gateway's models):
//
//	byte     version (1)
//	uvarint  replica ID length, then the ID's bytes
//	uvarint  worker count n
//	n ×      uvarint name length, the name's bytes, uvarint count
//
// Only non-zero counts are listed; an empty list says "nothing in flight"
// and is also the heartbeat of an idle replica.
const loadWireVersion = 1

// Load decoder bounds, checked before anything is allocated.
const (
	// MaxReplicaID bounds a replica's ID (random, 16 hex digits here).
	MaxReplicaID = 64
	// MaxLoadWorkers bounds the workers of one snapshot; a replica with
	// more in flight publishes the most loaded ones.
	MaxLoadWorkers = 4096
	// MaxLoadCount bounds one worker's count.
	MaxLoadCount = 1 << 24
)

// encodeLoad appends replica id's snapshot of counts to dst; names and
// counts are parallel slices.
func encodeLoad(dst []byte, id string, names []string, counts []int) []byte {
	dst = append(dst, loadWireVersion)
	dst = binary.AppendUvarint(dst, uint64(len(id)))
	dst = append(dst, id...)
	dst = binary.AppendUvarint(dst, uint64(len(names)))
	for i, w := range names {
		dst = binary.AppendUvarint(dst, uint64(len(w)))
		dst = append(dst, w...)
		dst = binary.AppendUvarint(dst, uint64(counts[i]))
	}
	return dst
}

// decodeLoad reads a message encodeLoad wrote.
func decodeLoad(b []byte) (id string, counts map[string]int, err error) {
	if len(b) == 0 {
		return "", nil, ErrTruncated
	}
	if b[0] != loadWireVersion {
		return "", nil, fmt.Errorf("%w %d", ErrVersion, b[0])
	}
	b = b[1:]
	if id, b, err = readString(b, MaxReplicaID, "replica ID"); err != nil {
		return "", nil, err
	}
	if id == "" {
		return "", nil, fmt.Errorf("placementsync: empty replica ID")
	}
	n, k := binary.Uvarint(b)
	if k <= 0 {
		return "", nil, fmt.Errorf("%w: worker count", ErrTruncated)
	}
	b = b[k:]
	if n > MaxLoadWorkers {
		return "", nil, fmt.Errorf("%w: %d workers (max %d)", ErrTooLarge, n, MaxLoadWorkers)
	}
	// Each entry takes at least 3 bytes (two lengths and a 1-byte name).
	if uint64(len(b)) < 3*n {
		return "", nil, fmt.Errorf("%w: %d workers, %d bytes left", ErrTruncated, n, len(b))
	}
	counts = make(map[string]int, n)
	for range n {
		var w string
		if w, b, err = readString(b, MaxWorkerName, "worker name"); err != nil {
			return "", nil, err
		}
		if w == "" {
			return "", nil, fmt.Errorf("placementsync: empty worker name")
		}
		c, k := binary.Uvarint(b)
		if k <= 0 {
			return "", nil, fmt.Errorf("%w: count of worker %q", ErrTruncated, w)
		}
		b = b[k:]
		if c > MaxLoadCount {
			return "", nil, fmt.Errorf("%w: worker %q count %d (max %d)", ErrTooLarge, w, c, MaxLoadCount)
		}
		if _, dup := counts[w]; dup {
			return "", nil, fmt.Errorf("placementsync: worker %q listed twice", w)
		}
		counts[w] = int(c)
	}
	if len(b) > 0 {
		return "", nil, fmt.Errorf("%w: %d", ErrTrailing, len(b))
	}
	return id, counts, nil
}

// readString reads a uvarint length (at most limit) and that many bytes.
func readString(b []byte, limit uint64, what string) (string, []byte, error) {
	n, k := binary.Uvarint(b)
	if k <= 0 {
		return "", nil, fmt.Errorf("%w: %s length", ErrTruncated, what)
	}
	b = b[k:]
	if n > limit {
		return "", nil, fmt.Errorf("%w: %s of %d bytes (max %d)", ErrTooLarge, what, n, limit)
	}
	if uint64(len(b)) < n {
		return "", nil, fmt.Errorf("%w: %s of %d bytes, %d left", ErrTruncated, what, n, len(b))
	}
	return string(b[:n]), b[n:], nil
}
