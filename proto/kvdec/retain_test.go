package kvdec

import (
	"testing"

	"google.golang.org/protobuf/encoding/protowire"
)

// TestAHugeBatchIsNotKeptForTheStreamsLife: after a batch far larger than
// usual, the next batch leaves the decoder holding no more than its bound.
func TestAHugeBatchIsNotKeptForTheStreamsLife(t *testing.T) {
	block := protowire.AppendTag(nil, 2, protowire.BytesType)
	block = protowire.AppendBytes(block, make([]byte, 16)) // 16 zero tokens
	var stored []byte
	for range 40_000 {
		stored = protowire.AppendTag(stored, 1, protowire.BytesType)
		stored = protowire.AppendBytes(stored, block)
	}
	var removed []byte
	removed = protowire.AppendTag(removed, 1, protowire.BytesType)
	removed = protowire.AppendBytes(removed, make([]byte, 2*keepFlat))
	event := protowire.AppendBytes(protowire.AppendTag(nil, 2, protowire.BytesType), stored)
	huge := protowire.AppendBytes(protowire.AppendTag(nil, 3, protowire.BytesType), event)
	event2 := protowire.AppendBytes(protowire.AppendTag(nil, 3, protowire.BytesType), removed)
	huge = append(huge, protowire.AppendBytes(protowire.AppendTag(nil, 3, protowire.BytesType), event2)...)

	var d Decoder
	b, err := d.Decode(huge)
	if err != nil {
		t.Fatal(err)
	}
	if n := len(b.Events[0].GetStored().GetBlocks()); n != 40_000 {
		t.Fatalf("decoded %d blocks", n)
	}
	if len(d.blocks.chunks) <= keepSlabChunks || cap(d.tokens) <= keepFlat || cap(d.hashes) <= keepFlat {
		t.Fatalf("the huge batch did not grow the storage past its bound (%d chunks, %d tokens, %d hashes): the test tests nothing",
			len(d.blocks.chunks), cap(d.tokens), cap(d.hashes))
	}
	if _, err := d.Decode(nil); err != nil {
		t.Fatal(err)
	}
	if len(d.blocks.chunks) > keepSlabChunks || cap(d.tokens) > keepFlat || cap(d.hashes) > keepFlat || cap(d.blockPtrs) > keepFlat {
		t.Fatalf("after a small batch the decoder still holds %d block chunks, %d tokens, %d hashes, %d pointers",
			len(d.blocks.chunks), cap(d.tokens), cap(d.hashes), cap(d.blockPtrs))
	}
}
