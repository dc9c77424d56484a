package natsevents

import (
	"math"
	"testing"

	"google.golang.org/protobuf/proto"

	"github.com/kvrelay/kvrelay/proto/kvpb"
)

func TestBatchHeaderReadsWhatTheMessageIDNeeds(t *testing.T) {
	for _, b := range []*kvpb.KvEventBatch{
		{SequenceNumber: 7, Timestamp: 1.5, DpRank: proto.Int32(3), Events: []*kvpb.KvCacheEvent{{EventId: 1}}},
		{SequenceNumber: 0, Timestamp: 0},
		{SequenceNumber: math.MaxUint64, Timestamp: 1e9, DpRank: proto.Int32(0), LiveDigest: proto.Uint64(9), LiveBlocks: proto.Uint64(4)},
	} {
		enc, err := proto.Marshal(b)
		if err != nil {
			t.Fatal(err)
		}
		h, err := batchHeader(enc)
		if err != nil {
			t.Fatal(err)
		}
		if h.GetSequenceNumber() != b.GetSequenceNumber() || h.GetTimestamp() != b.GetTimestamp() || h.GetDpRank() != b.GetDpRank() {
			t.Errorf("header of %v read as %v", b, h)
		}
	}
	if _, err := batchHeader([]byte{0x08}); err == nil {
		t.Error("a truncated varint decoded")
	}
}

// FuzzBatchHeader: the light header reader agrees with the full decoder
// wherever the full decoder accepts the bytes, and never panics.
func FuzzBatchHeader(f *testing.F) {
	enc, _ := proto.Marshal(&kvpb.KvEventBatch{SequenceNumber: 3, Timestamp: 2, DpRank: proto.Int32(1), Events: []*kvpb.KvCacheEvent{{EventId: 5}}})
	f.Add(enc)
	f.Add([]byte{0x08, 0x80})
	f.Fuzz(func(t *testing.T, data []byte) {
		h, herr := batchHeader(data)
		var full kvpb.KvEventBatch
		if err := proto.Unmarshal(data, &full); err != nil || herr != nil {
			return
		}
		if h.GetSequenceNumber() != full.GetSequenceNumber() || math.Float64bits(h.GetTimestamp()) != math.Float64bits(full.GetTimestamp()) || h.GetDpRank() != full.GetDpRank() {
			t.Fatalf("header %v, full decode %v", h, &full)
		}
	})
}
