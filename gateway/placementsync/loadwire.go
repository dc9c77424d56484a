package placementsync

import (
	"encoding/binary"
	"fmt"
)

// A load message is one replica's snapshot of its own tracked in-flight
// requests, or one part of it, one subject for all models (worker names
// are unique across a gateway's models). Version 1 is a whole snapshot:
//
//	byte     version (1)
//	uvarint  replica ID length, then the ID's bytes
//	uvarint  worker count n
//	n ×      uvarint name length, the name's bytes, uvarint count
//
// A snapshot over MaxLoadWorkers entries, or over the server's payload
// limit, goes out as version 2 parts, each a version 1 body with three
// fields after the ID:
//
//	uvarint  generation (one per snapshot, rising)
//	uvarint  part index, from 0
//	uvarint  part count (2 to MaxLoadParts)
//
// A receiver applies a generation only when all its parts arrived (a lost
// part: the next generation replaces it). A replica of before version 2
// rejects the parts as an unknown version rather than misreading them;
// a snapshot that fits one message is still sent as version 1, so mixed
// versions share counts as before up to MaxLoadWorkers.
//
// Only non-zero counts are listed; an empty list says "nothing in flight"
// and is also the heartbeat of an idle replica.
const (
	loadWireVersion      = 1
	loadPartsWireVersion = 2
)

// Load decoder bounds, checked before anything is allocated.
const (
	// MaxReplicaID bounds a replica's ID (random, 16 hex digits here).
	MaxReplicaID = 64
	// MaxLoadWorkers bounds the workers of one message; a snapshot with
	// more is split into parts.
	MaxLoadWorkers = 4096
	// MaxLoadParts bounds the parts of one snapshot: at least 256 ×
	// MaxLoadWorkers workers (fewer with names so long a part fills the
	// payload limit first); a replica with more in flight sends the most
	// loaded ones.
	MaxLoadParts = 256
	// MaxLoadCount bounds one worker's count.
	MaxLoadCount = 1 << 24
)

// loadMsg is one decoded load message; a version 1 message is part 0 of 1.
type loadMsg struct {
	id          string
	gen         uint64
	part, parts int
	counts      map[string]int
}

// encodeLoad appends replica id's whole snapshot of counts (version 1) to
// dst; names and counts are parallel slices.
func encodeLoad(dst []byte, id string, names []string, counts []int) []byte {
	dst = append(dst, loadWireVersion)
	dst = binary.AppendUvarint(dst, uint64(len(id)))
	dst = append(dst, id...)
	return appendLoadEntries(dst, names, counts)
}

// encodeLoadPart appends part of parts of generation gen (version 2).
func encodeLoadPart(dst []byte, id string, gen uint64, part, parts int, names []string, counts []int) []byte {
	dst = append(dst, loadPartsWireVersion)
	dst = binary.AppendUvarint(dst, uint64(len(id)))
	dst = append(dst, id...)
	dst = binary.AppendUvarint(dst, gen)
	dst = binary.AppendUvarint(dst, uint64(part))
	dst = binary.AppendUvarint(dst, uint64(parts))
	return appendLoadEntries(dst, names, counts)
}

func appendLoadEntries(dst []byte, names []string, counts []int) []byte {
	dst = binary.AppendUvarint(dst, uint64(len(names)))
	for i, w := range names {
		dst = binary.AppendUvarint(dst, uint64(len(w)))
		dst = append(dst, w...)
		dst = binary.AppendUvarint(dst, uint64(counts[i]))
	}
	return dst
}

// loadHeaderBytes bounds a message's bytes before its entries: version,
// ID and its length, three uvarint64s, the entry count.
const loadHeaderBytes = 1 + 1 + MaxReplicaID + 3*binary.MaxVarintLen64 + binary.MaxVarintLen64

// decodeLoad reads a message encodeLoad or encodeLoadPart wrote.
func decodeLoad(b []byte) (m loadMsg, err error) {
	if len(b) == 0 {
		return m, ErrTruncated
	}
	version := b[0]
	if version != loadWireVersion && version != loadPartsWireVersion {
		return m, fmt.Errorf("%w %d", ErrVersion, b[0])
	}
	b = b[1:]
	if m.id, b, err = readString(b, MaxReplicaID, "replica ID"); err != nil {
		return m, err
	}
	if m.id == "" {
		return m, fmt.Errorf("placementsync: empty replica ID")
	}
	m.parts = 1
	if version == loadPartsWireVersion {
		var part, parts uint64
		for _, f := range []struct {
			v    *uint64
			what string
		}{{&m.gen, "generation"}, {&part, "part index"}, {&parts, "part count"}} {
			n, k := binary.Uvarint(b)
			if k <= 0 {
				return m, fmt.Errorf("%w: %s", ErrTruncated, f.what)
			}
			*f.v, b = n, b[k:]
		}
		if parts > MaxLoadParts {
			return m, fmt.Errorf("%w: %d parts (max %d)", ErrTooLarge, parts, MaxLoadParts)
		}
		if parts < 2 || part >= parts {
			return m, fmt.Errorf("placementsync: part %d of %d", part, parts)
		}
		m.part, m.parts = int(part), int(parts)
	}
	n, k := binary.Uvarint(b)
	if k <= 0 {
		return m, fmt.Errorf("%w: worker count", ErrTruncated)
	}
	b = b[k:]
	if n > MaxLoadWorkers {
		return m, fmt.Errorf("%w: %d workers (max %d)", ErrTooLarge, n, MaxLoadWorkers)
	}
	// Each entry takes at least 3 bytes (two lengths and a 1-byte name).
	if uint64(len(b)) < 3*n {
		return m, fmt.Errorf("%w: %d workers, %d bytes left", ErrTruncated, n, len(b))
	}
	m.counts = make(map[string]int, n)
	for range n {
		var w string
		if w, b, err = readString(b, MaxWorkerName, "worker name"); err != nil {
			return m, err
		}
		if w == "" {
			return m, fmt.Errorf("placementsync: empty worker name")
		}
		c, k := binary.Uvarint(b)
		if k <= 0 {
			return m, fmt.Errorf("%w: count of worker %q", ErrTruncated, w)
		}
		b = b[k:]
		if c > MaxLoadCount {
			return m, fmt.Errorf("%w: worker %q count %d (max %d)", ErrTooLarge, w, c, MaxLoadCount)
		}
		if _, dup := m.counts[w]; dup {
			return m, fmt.Errorf("placementsync: worker %q listed twice", w)
		}
		m.counts[w] = int(c)
	}
	if len(b) > 0 {
		return m, fmt.Errorf("%w: %d", ErrTrailing, len(b))
	}
	return m, nil
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
