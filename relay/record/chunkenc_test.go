package record

import (
	"bytes"
	"encoding/binary"
	"math"
	"testing"

	"google.golang.org/protobuf/proto"

	"github.com/kvrelay/kvrelay/proto/kvpb"
)

// requireEncodedEqualsMarshal streams the Cut twice, as messages (Next) and in wire form
// (NextEncoded), and requires every chunk's bytes to be what proto.Marshal makes of the message:
// the gateway decodes the one and tests check the other.
func requireEncodedEqualsMarshal(t testing.TB, c *Cut, cursors, unknown map[int32]uint64, ts float64) int {
	t.Helper()
	msgs, encs := c.Stream(cursors, unknown, ts), c.Stream(cursors, unknown, ts)
	n := 0
	for {
		m, enc := msgs.Next(), encs.NextEncoded()
		if m == nil || enc == nil {
			if m != nil || enc != nil {
				t.Fatalf("chunk %d: Next gave %v, NextEncoded %d bytes", n, m != nil, len(enc))
			}
			return n
		}
		want, err := proto.Marshal(m)
		if err != nil {
			t.Fatalf("chunk %d: marshal: %v", n, err)
		}
		if !bytes.Equal(enc, want) {
			got := &kvpb.KvEventBatch{}
			uerr := proto.Unmarshal(enc, got)
			t.Fatalf("chunk %d: NextEncoded differs from proto.Marshal (%d vs %d bytes, decodes: %v)\nwant %v\ngot  %v",
				n, len(enc), len(want), uerr, m, got)
		}
		if msgs.Left() != encs.Left() {
			t.Fatalf("chunk %d: %d chunks left as messages, %d encoded", n, msgs.Left(), encs.Left())
		}
		n++
	}
}

func TestEncodedChunksEqualMarshalledOnes(t *testing.T) {
	huge := int64(math.MinInt64)
	for _, tc := range []struct {
		name    string
		batches []*kvpb.KvEventBatch
		cursors map[int32]uint64
		ts      float64
	}{
		{name: "empty record", cursors: map[int32]uint64{3: 9}, ts: 1},
		{
			name: "chains, every tail field, extra keys, several ranks",
			batches: func() []*kvpb.KvEventBatch {
				var out []*kvpb.KvEventBatch
				for i := range 40 {
					ev := storedEv(chain(int64(i*50+1), 50), tails[i%len(tails)]...)
					if i%3 == 0 {
						(&opGen{intn: func(n int) int { return i % n }}).extraKeys(ev.GetStored())
					}
					out = append(out, batchOf(int32(i%3)-1, ev))
				}
				return out
			}(),
			cursors: map[int32]uint64{NoRank: 2, 0: 1 << 40, 1: 0}, ts: 1.5,
		},
		{
			name: "extreme values: zero and negative hashes, a negative rank, big tokens, negative sizes",
			batches: []*kvpb.KvEventBatch{
				batchOf(-7, &kvpb.KvCacheEvent{Data: &kvpb.KvCacheEvent_Stored{Stored: &kvpb.KvBlocksStored{
					ParentBlockHash: &huge,
					Blocks: []*kvpb.KvBlock{
						{BlockHash: 0, BlockSize: -3, TokenIds: []uint32{0, math.MaxUint32, 127, 128, 1 << 21}},
						{BlockHash: -1, CacheLevel: proto.Int32(-2), LoraId: proto.Int64(-9)},
						{BlockHash: math.MaxInt64, TokenIds: make([]uint32, 5000)},
					},
				}}}),
				batchOf(-7, storedEv([]int64{-1}, withTier(host))),
			},
			cursors: map[int32]uint64{-7: math.MaxUint64}, ts: math.Copysign(0, -1),
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := New()
			for _, b := range tc.batches {
				r.Apply(b)
			}
			c := r.Cut(nil)
			defer c.Release()
			if n := requireEncodedEqualsMarshal(t, c, tc.cursors, map[int32]uint64{0: 4}, tc.ts); n == 0 {
				t.Fatal("no chunk")
			}
		})
	}
}

func TestNextEncodedStopsAtRelease(t *testing.T) {
	r := New()
	for i := range 8 {
		r.Apply(batchOf(0, storedEv(chain(int64(i*ChunkBlocks+1), ChunkBlocks))))
	}
	c := r.Cut(nil)
	st := c.Stream(map[int32]uint64{0: 100}, nil, 1)
	if st.NextEncoded() == nil || st.Left() == 0 {
		t.Fatalf("want a first chunk and more left (%d)", st.Left())
	}
	c.Release()
	if b := st.NextEncoded(); b != nil {
		t.Fatalf("a released Cut encoded %d more bytes", len(b))
	}
}

// FuzzChunkEncoding drives a record with stores whose every field the fuzzer picks (hashes,
// parents, tokens, sizes, optionals, tails, extra keys, ranks) and removals, and requires every
// encoded chunk to equal proto.Marshal of the message chunk.
func FuzzChunkEncoding(f *testing.F) {
	f.Add([]byte{})
	f.Add([]byte("\x01\x02\x03\x04\x05\x06\x07\x08\x09\x0a\x0b\x0c\x0d\x0e\x0f\x10\x11\x12\x13\x14\x15"))
	f.Add(bytes.Repeat([]byte{0xff, 0x80, 0x00, 0x7f}, 64))
	f.Fuzz(func(t *testing.T, data []byte) {
		src := &fuzzSource{data: data}
		word := func() uint64 {
			var b [8]byte
			n := copy(b[:], src.data)
			src.data = src.data[n:]
			return binary.LittleEndian.Uint64(b[:])
		}
		r := New()
		ranks := []int32{NoRank, 0, 1, -5, math.MaxInt32}
		var hashes []int64
		for len(src.data) > 0 {
			rank := ranks[src.intn(len(ranks))]
			if src.intn(5) == 0 && len(hashes) > 0 {
				r.Apply(batchOf(rank, removedEv(noTier, hashes[src.intn(len(hashes))])))
				continue
			}
			st := &kvpb.KvBlocksStored{}
			if src.intn(2) == 0 {
				p := int64(word())
				if len(hashes) > 0 && src.intn(2) == 0 {
					p = hashes[src.intn(len(hashes))]
				}
				st.ParentBlockHash = &p
			}
			for _, opt := range tails[src.intn(len(tails))] {
				opt(st)
			}
			for _, opt := range []storeOpt{nil, withTier(host), withCacheLevel(int32(word()))}[src.intn(3):][:1] {
				if opt != nil {
					opt(st)
				}
			}
			for range 1 + src.intn(6) {
				h := int64(word() >> (src.intn(4) * 20))
				if src.intn(4) == 0 {
					h = -h
				}
				blk := &kvpb.KvBlock{BlockHash: h, BlockSize: int32(word() >> (src.intn(2) * 40))}
				for range src.intn(20) {
					blk.TokenIds = append(blk.TokenIds, uint32(word()>>(src.intn(4)*10)))
				}
				if src.intn(3) == 0 {
					blk.LoraId = proto.Int64(int64(word()))
				}
				st.Blocks = append(st.Blocks, blk)
				hashes = append(hashes, h)
			}
			(&opGen{intn: src.intn}).extraKeys(st)
			r.Apply(batchOf(rank, &kvpb.KvCacheEvent{Data: &kvpb.KvCacheEvent_Stored{Stored: st}}))
		}
		c := r.Cut(nil)
		defer c.Release()
		cursors := map[int32]uint64{0: 3, 1: math.MaxUint64, -5: 1 << 33}
		requireEncodedEqualsMarshal(t, c, cursors, map[int32]uint64{1: 2}, 0)
	})
}
