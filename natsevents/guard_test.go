package natsevents

import (
	"encoding/binary"
	"slices"
	"testing"

	"google.golang.org/protobuf/proto"

	"github.com/kvrelay/kvrelay/proto/kvpb"
	"github.com/kvrelay/kvrelay/relay/record"
)

// TestChunkCheckTakesRelayCuts: the relay's own snapshots pass the guard,
// including a rank with more chunks than sequences (its first chunks
// stamped 0: tokens long enough that a chunk holds few blocks) and blocks
// held twice (a copy is a block of its own).
func TestChunkCheckTakesRelayCuts(t *testing.T) {
	rec := record.New()
	tokens := make([]uint32, 1024)
	for i := range tokens {
		tokens[i] = 1<<21 + uint32(i) // 4-byte varints: a unit of about 4 KiB
	}
	hash := int64(1)
	store := func(rank int32, seq uint64, n int, again bool) {
		var blocks []*kvpb.KvBlock
		for range n {
			blocks = append(blocks, &kvpb.KvBlock{BlockHash: hash, TokenIds: tokens, BlockSize: 1024})
			if !again {
				hash++
			}
		}
		rec.Apply(&kvpb.KvEventBatch{SequenceNumber: seq, DpRank: proto.Int32(rank),
			Events: []*kvpb.KvCacheEvent{{Data: &kvpb.KvCacheEvent_Stored{Stored: &kvpb.KvBlocksStored{Blocks: blocks}}}}})
	}
	store(0, 0, 3000, false)
	store(0, 1, 1, true) // one block twice
	store(2, 7, 10, false)
	cut := rec.Cut(nil)
	defer cut.Release()
	cursors := map[int32]uint64{0: 1, 2: 7}
	chunks := cut.Chunks(cursors, nil, 1)
	if len(chunks) < 4 {
		t.Fatalf("%d chunks: the cut does not exercise more chunks than sequences", len(chunks))
	}
	check := snapshotCheck{maxBytes: DefaultMaxSnapshotBytes, ceiling: func(rank int32) (uint64, bool, error) { return cursors[rank], true, nil }}
	var seqs []uint64
	for _, c := range chunks {
		if err := check.add(c, proto.Size(c)); err != nil {
			t.Fatalf("the relay's chunk %d refused: %v", c.GetSnapshot().GetIndex(), err)
		}
		seqs = append(seqs, c.GetSequenceNumber())
	}
	if err := check.finish(); err != nil {
		t.Fatalf("the relay's snapshot refused: %v", err)
	}
	if check.stored != cut.Blocks() || seqs[0] != 0 || seqs[1] != 0 {
		t.Fatalf("stored %d of %d blocks, sequences %v: want the cut's blocks and a rank stamped 0, 0, …", check.stored, cut.Blocks(), seqs)
	}
	// A ceiling below the cut's cursor refuses it.
	check = snapshotCheck{maxBytes: DefaultMaxSnapshotBytes, ceiling: func(int32) (uint64, bool, error) { return 0, true, nil }}
	var err error
	for _, c := range chunks {
		if err = check.add(c, proto.Size(c)); err != nil {
			break
		}
	}
	if refusalReason(err) != reasonSequenceAhead {
		t.Fatalf("a cursor beyond the ceiling: %v, want a %s refusal", err, reasonSequenceAhead)
	}
}

// fuzzChunk is one chunk a FuzzChunkCheck input describes.
type fuzzChunk struct {
	index, count uint32
	blocks       uint64
	rank         int32
	seq          uint64
	stored       int
	size         int
	snapshot     bool
}

// fuzzChunkBytes is the size of one chunk's description.
const fuzzChunkBytes = 4 + 4 + 8 + 1 + 8 + 1 + 2 + 1

func parseFuzzChunks(data []byte) []fuzzChunk {
	var out []fuzzChunk
	for len(data) >= fuzzChunkBytes && len(out) < 64 {
		out = append(out, fuzzChunk{
			index:    binary.LittleEndian.Uint32(data[0:]),
			count:    binary.LittleEndian.Uint32(data[4:]),
			blocks:   binary.LittleEndian.Uint64(data[8:]),
			rank:     int32(int8(data[16])),
			seq:      binary.LittleEndian.Uint64(data[17:]),
			stored:   int(data[25] % 16),
			size:     int(binary.LittleEndian.Uint16(data[26:])),
			snapshot: data[28]&1 == 0,
		})
		data = data[fuzzChunkBytes:]
	}
	return out
}

func (c fuzzChunk) append(out []byte) []byte {
	out = binary.LittleEndian.AppendUint32(out, c.index)
	out = binary.LittleEndian.AppendUint32(out, c.count)
	out = binary.LittleEndian.AppendUint64(out, c.blocks)
	out = append(out, byte(int8(c.rank)))
	out = binary.LittleEndian.AppendUint64(out, c.seq)
	out = append(out, byte(c.stored))
	out = binary.LittleEndian.AppendUint16(out, uint16(c.size))
	snap := byte(1)
	if c.snapshot {
		snap = 0
	}
	return append(out, snap)
}

func (c fuzzChunk) batch() *kvpb.KvEventBatch {
	b := &kvpb.KvEventBatch{SequenceNumber: c.seq, DpRank: proto.Int32(c.rank)}
	if c.snapshot {
		b.Snapshot = &kvpb.KvSnapshotChunk{Index: c.index, Count: c.count, Blocks: c.blocks}
	}
	if c.stored > 0 {
		blocks := make([]*kvpb.KvBlock, c.stored)
		for i := range blocks {
			blocks[i] = &kvpb.KvBlock{BlockHash: int64(i)}
		}
		b.Events = []*kvpb.KvCacheEvent{{Data: &kvpb.KvCacheEvent_Stored{Stored: &kvpb.KvBlocksStored{Blocks: blocks}}}}
	}
	return b
}

// The fuzz's bounds: ranks 0 to 2 may carry at most 1000+rank, the
// chunks take at most 4 KiB together.
const fuzzMaxBytes = 4 << 10

func fuzzCeiling(rank int32) (uint64, bool, error) {
	if rank >= 0 && rank <= 2 {
		return 1000 + uint64(rank), true, nil
	}
	return 0, false, nil
}

// fuzzValid says, independently of snapshotCheck, whether chunks are one
// whole consistent snapshot under the fuzz's bounds.
func fuzzValid(chunks []fuzzChunk) bool {
	if len(chunks) == 0 {
		return false
	}
	first := chunks[0]
	if first.count == 0 || first.count > maxSnapshotChunks || first.blocks > maxSnapshotBlocks || uint32(len(chunks)) != first.count {
		return false
	}
	var stored uint64
	size := 0
	for i, c := range chunks {
		if !c.snapshot || c.index != uint32(i) || c.count != first.count || c.blocks != first.blocks {
			return false
		}
		if top, ok, _ := fuzzCeiling(c.rank); ok && c.seq > top {
			return false
		}
		if i > 0 {
			p := chunks[i-1]
			if c.rank < p.rank || c.rank == p.rank && c.seq != p.seq+1 && (c.seq != 0 || p.seq != 0) {
				return false
			}
		}
		stored += uint64(c.stored)
		size += c.size
	}
	return stored == first.blocks && size <= fuzzMaxBytes
}

// FuzzChunkCheck: a snapshot described chunk by chunk (index, count,
// declared blocks, rank, sequence, blocks stored, size) is accepted by the
// guard exactly when it is whole and consistent, and every refusal names
// one of the metric's reasons; no input panics.
func FuzzChunkCheck(f *testing.F) {
	seed := func(chunks ...fuzzChunk) {
		var data []byte
		for _, c := range chunks {
			data = c.append(data)
		}
		f.Add(data)
	}
	seed(fuzzChunk{index: 0, count: 1, snapshot: true})
	seed(fuzzChunk{index: 0, count: 3, blocks: 9, seq: 0, stored: 3, size: 10, snapshot: true},
		fuzzChunk{index: 1, count: 3, blocks: 9, seq: 0, stored: 3, size: 10, snapshot: true},
		fuzzChunk{index: 2, count: 3, blocks: 9, seq: 1, stored: 3, size: 10, snapshot: true})
	seed(fuzzChunk{index: 0, count: 2, blocks: 4, rank: 0, seq: 999, stored: 2, snapshot: true},
		fuzzChunk{index: 1, count: 2, blocks: 4, rank: 2, seq: 1002, stored: 2, snapshot: true})
	seed(fuzzChunk{index: 0, count: 1<<32 - 1, blocks: 10_000_000, seq: 1 << 40, stored: 15, snapshot: true})
	seed(fuzzChunk{index: 0, count: 2, blocks: 1, stored: 1, snapshot: true}, fuzzChunk{index: 1, count: 2, blocks: 1})
	f.Fuzz(func(t *testing.T, data []byte) {
		chunks := parseFuzzChunks(data)
		check := snapshotCheck{maxBytes: fuzzMaxBytes, ceiling: fuzzCeiling}
		var err error
		for _, c := range chunks {
			if err = check.add(c.batch(), c.size); err != nil {
				break
			}
		}
		if err == nil {
			err = check.finish()
		}
		if err != nil && !slices.Contains(rejectReasons, refusalReason(err)) {
			t.Fatalf("a refusal without a known reason: %v", err)
		}
		if want := fuzzValid(chunks); (err == nil) != want {
			t.Fatalf("guard says %v, an independent check valid=%v, for %+v", err, want, chunks)
		}
	})
}
