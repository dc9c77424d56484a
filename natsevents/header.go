package natsevents

import (
	"fmt"
	"math"

	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	"github.com/kvrelay/kvrelay/proto/kvpb"
)

// snapshotField is KvEventBatch.snapshot's field number, from the
// generated descriptor rather than restated here.
var snapshotField = (&kvpb.KvEventBatch{}).ProtoReflect().Descriptor().Fields().ByName("snapshot").Number()

// batchHeader reads what the sink needs of an encoded KvEventBatch (its
// sequence number, timestamp and DP rank, for the subject and the message
// id, and its snapshot chunk info) without decoding its events: the relay
// hands the sink the bytes it encoded once for every subscriber, and a
// 131,072-block batch would cost megabytes to decode only to read these.
// The events are skipped field by field; a malformed encoding is
// an error.
//
// The snapshot field matters as much as the numbers: the relay hands out
// its snapshot chunks as bytes only, and a chunk read as a plain batch
// would get a message id, which chunks of one rank can share (a rank with
// more chunks than sequences stamps several with 0), so the stream's
// duplicate window would drop them; and the sink would not know a snapshot
// is arriving, and could cut its snapshot object inside it.
func batchHeader(enc []byte) (*kvpb.KvEventBatch, error) {
	h := &kvpb.KvEventBatch{}
	for len(enc) > 0 {
		num, typ, n := protowire.ConsumeTag(enc)
		if n < 0 {
			return nil, fmt.Errorf("batch header: %w", protowire.ParseError(n))
		}
		enc = enc[n:]
		switch {
		case num == 1 && typ == protowire.VarintType:
			v, n := protowire.ConsumeVarint(enc)
			if n < 0 {
				return nil, fmt.Errorf("batch sequence number: %w", protowire.ParseError(n))
			}
			h.SequenceNumber, enc = v, enc[n:]
		case num == 2 && typ == protowire.Fixed64Type:
			v, n := protowire.ConsumeFixed64(enc)
			if n < 0 {
				return nil, fmt.Errorf("batch timestamp: %w", protowire.ParseError(n))
			}
			h.Timestamp, enc = math.Float64frombits(v), enc[n:]
		case num == 4 && typ == protowire.VarintType:
			v, n := protowire.ConsumeVarint(enc)
			if n < 0 {
				return nil, fmt.Errorf("batch dp_rank: %w", protowire.ParseError(n))
			}
			h.DpRank, enc = proto.Int32(int32(v)), enc[n:]
		case num == snapshotField && typ == protowire.BytesType:
			v, n := protowire.ConsumeBytes(enc)
			if n < 0 {
				return nil, fmt.Errorf("batch snapshot: %w", protowire.ParseError(n))
			}
			// A few varints; repeated occurrences merge, as in a full
			// decode.
			if h.Snapshot == nil {
				h.Snapshot = &kvpb.KvSnapshotChunk{}
			}
			if err := (proto.UnmarshalOptions{Merge: true}).Unmarshal(v, h.Snapshot); err != nil {
				return nil, fmt.Errorf("batch snapshot: %w", err)
			}
			enc = enc[n:]
		default:
			n := protowire.ConsumeFieldValue(num, typ, enc)
			if n < 0 {
				return nil, fmt.Errorf("batch field %d: %w", num, protowire.ParseError(n))
			}
			enc = enc[n:]
		}
	}
	return h, nil
}
