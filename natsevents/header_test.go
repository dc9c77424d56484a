package natsevents

import (
	"math"
	"testing"

	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	"github.com/kvrelay/kvrelay/proto/kvpb"
)

func TestBatchHeaderReadsWhatTheSinkNeeds(t *testing.T) {
	for _, b := range []*kvpb.KvEventBatch{
		{SequenceNumber: 7, Timestamp: 1.5, DpRank: proto.Int32(3), Events: []*kvpb.KvCacheEvent{{EventId: 1}}},
		{SequenceNumber: 0, Timestamp: 0},
		{SequenceNumber: math.MaxUint64, Timestamp: 1e9, DpRank: proto.Int32(0), LiveDigest: proto.Uint64(9), LiveBlocks: proto.Uint64(4)},
		// Snapshot chunks, as the relay hands them out (bytes only).
		{SequenceNumber: 0, Timestamp: 1.7e9, DpRank: proto.Int32(1), Events: []*kvpb.KvCacheEvent{{EventId: 2}},
			Snapshot: &kvpb.KvSnapshotChunk{Index: 2, Count: 5, Blocks: 9000, UnknownBefore: 3}},
		{SequenceNumber: 4, Timestamp: 2, Snapshot: &kvpb.KvSnapshotChunk{Index: 0, Count: 1}},
		// Present but empty: still a chunk (index 0 of count 0).
		{SequenceNumber: 4, Timestamp: 2, Snapshot: &kvpb.KvSnapshotChunk{}},
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
		if (h.Snapshot == nil) != (b.Snapshot == nil) || !proto.Equal(h.GetSnapshot(), b.GetSnapshot()) {
			t.Errorf("snapshot of %v read as %v", b, h.GetSnapshot())
		}
	}
}

// TestBatchHeaderMergesRepeatedSnapshotFields: a message field that occurs
// twice is merged by a protobuf decoder (as the relay's appended digest
// fields rely on); the header reader reads it the same way.
func TestBatchHeaderMergesRepeatedSnapshotFields(t *testing.T) {
	first, _ := proto.Marshal(&kvpb.KvSnapshotChunk{Index: 3, Count: 9})
	second, _ := proto.Marshal(&kvpb.KvSnapshotChunk{Blocks: 70, Index: 4})
	var enc []byte
	for _, part := range [][]byte{first, second} {
		enc = protowire.AppendTag(enc, snapshotField, protowire.BytesType)
		enc = protowire.AppendBytes(enc, part)
	}
	var full kvpb.KvEventBatch
	if err := proto.Unmarshal(enc, &full); err != nil {
		t.Fatal(err)
	}
	h, err := batchHeader(enc)
	if err != nil {
		t.Fatal(err)
	}
	want := &kvpb.KvSnapshotChunk{Index: 4, Count: 9, Blocks: 70}
	if !proto.Equal(full.GetSnapshot(), want) || !proto.Equal(h.GetSnapshot(), want) {
		t.Errorf("two snapshot fields read as %v (full decode %v), want %v", h.GetSnapshot(), full.GetSnapshot(), want)
	}
}

func TestBatchHeaderRejectsMalformedInput(t *testing.T) {
	snapTag := protowire.AppendTag(nil, snapshotField, protowire.BytesType)
	for name, enc := range map[string][]byte{
		"truncated varint":               {0x08},
		"snapshot longer than the batch": append(append([]byte{}, snapTag...), 5, 0x08),
		"truncated varint in snapshot":   append(append([]byte{}, snapTag...), 2, 0x08, 0x80),
	} {
		if h, err := batchHeader(enc); err == nil {
			t.Errorf("%s: decoded as %v", name, h)
		}
	}
}

// FuzzBatchHeader: the light header reader agrees with the full decoder
// wherever the full decoder accepts the bytes, and never panics.
func FuzzBatchHeader(f *testing.F) {
	enc, _ := proto.Marshal(&kvpb.KvEventBatch{SequenceNumber: 3, Timestamp: 2, DpRank: proto.Int32(1), Events: []*kvpb.KvCacheEvent{{EventId: 5}}})
	f.Add(enc)
	f.Add([]byte{0x08, 0x80})
	chunk, _ := proto.Marshal(&kvpb.KvEventBatch{SequenceNumber: 0, Timestamp: 2, DpRank: proto.Int32(1),
		Snapshot: &kvpb.KvSnapshotChunk{Index: 1, Count: 4, Blocks: 5000, UnknownBefore: 2}})
	f.Add(chunk)
	f.Fuzz(func(t *testing.T, data []byte) {
		h, herr := batchHeader(data)
		var full kvpb.KvEventBatch
		if err := proto.Unmarshal(data, &full); err != nil || herr != nil {
			return
		}
		if h.GetSequenceNumber() != full.GetSequenceNumber() || math.Float64bits(h.GetTimestamp()) != math.Float64bits(full.GetTimestamp()) || h.GetDpRank() != full.GetDpRank() {
			t.Fatalf("header %v, full decode %v", h, &full)
		}
		if (h.Snapshot == nil) != (full.Snapshot == nil) || !proto.Equal(h.GetSnapshot(), full.GetSnapshot()) {
			t.Fatalf("snapshot %v, full decode %v", h.GetSnapshot(), full.GetSnapshot())
		}
	})
}
