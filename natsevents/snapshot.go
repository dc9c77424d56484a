package natsevents

import (
	"encoding/binary"
	"errors"
	"fmt"
)

// A snapshot object holds one worker's live-block record as the relay's
// snapshot chunks, and the stream sequence it is consistent with: the
// chunks hold every batch of the worker published at or below StreamSeq
// and none above. A consumer applies the chunks, then the worker's
// messages from StreamSeq+1 on.
//
//	"KVRSNAP1"                       magic and format version
//	uvarint stream sequence
//	uvarint chunk count n
//	n × (uvarint length, length bytes of an encoded KvEventBatch)
type snapshotObject struct {
	StreamSeq uint64
	Chunks    [][]byte
}

const snapshotMagic = "KVRSNAP1"

// maxSnapshotChunks bounds an object's chunk count. A chunk costs the
// decoder a 24-byte slice header however few bytes it takes in the object
// (an empty one takes one), so the count, not only the object's size, must
// be bounded. A relay's chunks carry up to 4 MiB each: 1 M blocks take
// about 500 chunks and the record's default cap (2 Mi entries) about
// 1,000, so 65,536 leaves room and bounds the headers at 1.5 MiB.
const maxSnapshotChunks = 1 << 16

// errSnapshotFormat marks an object that is not a snapshot this code wrote.
var errSnapshotFormat = errors.New("malformed snapshot object")

func encodeSnapshot(o snapshotObject) []byte {
	n := len(snapshotMagic) + 2*binary.MaxVarintLen64
	for _, c := range o.Chunks {
		n += binary.MaxVarintLen64 + len(c)
	}
	out := make([]byte, 0, n)
	out = append(out, snapshotMagic...)
	out = binary.AppendUvarint(out, o.StreamSeq)
	out = binary.AppendUvarint(out, uint64(len(o.Chunks)))
	for _, c := range o.Chunks {
		out = binary.AppendUvarint(out, uint64(len(c)))
		out = append(out, c...)
	}
	return out
}

// decodeSnapshot parses an object. Every declared count and length is
// checked against the bytes that are left, and the chunk count against
// maxSnapshotChunks, before anything is allocated for it: a corrupt or
// hostile object costs at most its own size plus 1.5 MiB of chunk headers
// (the chunks alias data).
func decodeSnapshot(data []byte) (snapshotObject, error) {
	var o snapshotObject
	if len(data) < len(snapshotMagic) || string(data[:len(snapshotMagic)]) != snapshotMagic {
		return o, fmt.Errorf("%w: no %q header", errSnapshotFormat, snapshotMagic)
	}
	rest := data[len(snapshotMagic):]
	next := func(what string) (uint64, error) {
		v, n := binary.Uvarint(rest)
		if n <= 0 {
			return 0, fmt.Errorf("%w: bad varint for the %s", errSnapshotFormat, what)
		}
		rest = rest[n:]
		return v, nil
	}
	var err error
	if o.StreamSeq, err = next("stream sequence"); err != nil {
		return o, err
	}
	count, err := next("chunk count")
	if err != nil {
		return o, err
	}
	if count > maxSnapshotChunks {
		return o, fmt.Errorf("%w: %d chunks declared, at most %d taken", errSnapshotFormat, count, maxSnapshotChunks)
	}
	if count > uint64(len(rest)) { // every chunk takes at least its length byte
		return o, fmt.Errorf("%w: %d chunks declared in %d bytes", errSnapshotFormat, count, len(rest))
	}
	o.Chunks = make([][]byte, 0, count)
	for i := uint64(0); i < count; i++ {
		l, err := next("chunk length")
		if err != nil {
			return o, err
		}
		if l > uint64(len(rest)) {
			return o, fmt.Errorf("%w: chunk %d declares %d bytes, %d left", errSnapshotFormat, i, l, len(rest))
		}
		o.Chunks = append(o.Chunks, rest[:l:l])
		rest = rest[l:]
	}
	if len(rest) != 0 {
		return o, fmt.Errorf("%w: %d bytes after the last chunk", errSnapshotFormat, len(rest))
	}
	return o, nil
}
