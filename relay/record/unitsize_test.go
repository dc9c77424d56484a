package record

import (
	"math"
	"slices"
	"testing"

	"google.golang.org/protobuf/proto"

	"github.com/kvrelay/kvrelay/proto/kvpb"
)

// maxUnitBytesByOrder is the unit bound as Stream took it before orderRankSized folded it into
// its pass over the entries: a pass of its own over the emission order, every record's tokens
// read through segment.tokensOf. The reference for TestTheOrderPassBoundsUnitsAsItsOwnPassDid.
func maxUnitBytesByOrder(c *Cut, cr *cutRank, order []uint32) int {
	largest := 1
	for _, slot := range order {
		e := cr.entry(slot)
		seg := cr.segs[slot>>segShift]
		tb := proto.Size(c.tails[e.tail].storedEvent())
		var xb int
		if e.flags&flagExtra != 0 {
			xb = len(c.extras[seg.extraOf(e)])
		}
		n := 3*6 + tb + 11 + 6 + 11 + 6 + 11 + 6 + 6 + len(seg.tokensOf(e)) + xb
		largest = max(largest, n)
	}
	return largest
}

// TestTheOrderPassBoundsUnitsAsItsOwnPassDid: the bound that sizes a rank's chunks, now taken in
// orderRankSized's pass over the segments (records' lengths read by packedTokens), equals the
// separate pass's over every rank of records with one and several tiers, every tail field, extra
// keys, token lists whose packed length takes one byte and two, and slots freed and reused; and
// the order is orderRank's.
func TestTheOrderPassBoundsUnitsAsItsOwnPassDid(t *testing.T) {
	huge := int64(math.MinInt64)
	for _, tc := range []struct {
		name  string
		build func(r *Record)
	}{
		{"chains under every tail, extra keys, three ranks", func(r *Record) {
			for i := range 40 {
				ev := storedEv(chain(int64(i*50+1), 50), tails[i%len(tails)]...)
				if i%3 == 0 {
					(&opGen{intn: func(n int) int { return i % n }}).extraKeys(ev.GetStored())
				}
				r.Apply(batchOf(int32(i%3)-1, ev))
			}
		}},
		{"long token lists and several tiers", func(r *Record) {
			r.Apply(batchOf(2, &kvpb.KvCacheEvent{Data: &kvpb.KvCacheEvent_Stored{Stored: &kvpb.KvBlocksStored{
				ParentBlockHash: &huge,
				Blocks: []*kvpb.KvBlock{
					{BlockHash: 0, BlockSize: -3, TokenIds: []uint32{0, math.MaxUint32, 127, 128, 1 << 21}},
					{BlockHash: -1, TokenIds: make([]uint32, 127)},
					{BlockHash: 5, TokenIds: make([]uint32, 128)},
					{BlockHash: math.MaxInt64, TokenIds: make([]uint32, 5000)},
				},
			}}}))
			r.Apply(batchOf(2, storedEv([]int64{-1, 5}, withTier(host))))
		}},
		{"item 7's mix, half evicted and refilled", func(r *Record) {
			benchFeedNS(r, 20_000, 3, mixedNamespaces)
			evictHalf(r)
			benchFeedNS(r, 10_000, 4, mixedNamespaces)
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := New()
			tc.build(r)
			c := r.Cut(nil)
			defer c.Release()
			if len(c.ranks) == 0 {
				t.Fatal("no rank to order")
			}
			for i := range c.ranks {
				cr := &c.ranks[i]
				order, got := c.orderRankSized(cr)
				if want := maxUnitBytesByOrder(c, cr, order); got != want {
					t.Errorf("rank %d: unit bound %d, its own pass over the order gives %d", cr.rank, got, want)
				}
				if plain := c.orderRank(cr); !slices.Equal(order, plain) || uint64(len(order)) != cr.entries {
					t.Errorf("rank %d: %d slots ordered with the bound, %d without, %d entries", cr.rank, len(order), len(plain), cr.entries)
				}
			}
		})
	}
}
