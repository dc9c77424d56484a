package natsevents

import (
	"fmt"
	"math"

	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	"github.com/kvrelay/kvrelay/proto/kvpb"
)

// batchHeader reads what the sink needs of an encoded KvEventBatch (its
// sequence number, timestamp and DP rank, for the subject and the message
// id) without decoding its events: the relay hands the sink the bytes it
// encoded once for every subscriber, and a 131,072-block batch would cost
// megabytes to decode only to read three numbers. The events are skipped
// field by field; a malformed encoding is an error.
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
