package relay

import (
	"fmt"
	"strings"
	"testing"

	"google.golang.org/protobuf/proto"

	"github.com/kvrelay/kvrelay/proto/kvpb"
)

// hb is the encoding of an empty batch of rank at seq, as the history keeps it.
func hb(rank int32, seq uint64) []byte {
	enc, err := proto.Marshal(&kvpb.KvEventBatch{SequenceNumber: seq, DpRank: &rank})
	if err != nil {
		panic(err)
	}
	return enc
}

// seqs names the batches after pos, "rank:seq".
func seqsAfter(h *history, pos uint64, keep func(*entry) bool) string {
	pbs, _ := h.batchesAfter(nil, pos, 0, keep)
	var out []string
	for _, pb := range pbs {
		b := &kvpb.KvEventBatch{}
		if err := proto.Unmarshal(pb.enc, b); err != nil {
			return "undecodable: " + err.Error()
		}
		out = append(out, describe(b))
	}
	return strings.Join(out, " ")
}

func TestHistoryEvictsByCountAndByBytesKeepingOneEntry(t *testing.T) {
	h := newHistory(3, 1<<20)
	for seq := uint64(0); seq < 5; seq++ {
		h.pushBatch(0, seq, hb(0, seq), 10, liveDigest{})
	}
	if first, last, _ := h.rankBounds(0); first != 2 || last != 4 || h.len() != 3 {
		t.Fatalf("count cap: window %d..%d, %d entries", first, last, h.len())
	}
	if h.bytes != 3*(10+entryOverhead) {
		t.Fatalf("bytes %d", h.bytes)
	}
	small := newHistory(100, 250)
	for seq := uint64(0); seq < 4; seq++ {
		small.pushBatch(0, seq, hb(0, seq), 50, liveDigest{}) // 146 bytes each
	}
	if small.len() != 1 {
		t.Fatalf("byte cap keeps %d entries, want 1", small.len())
	}
	huge := newHistory(100, 10)
	huge.pushBatch(0, 0, hb(0, 0), 1000, liveDigest{})
	if huge.len() != 1 {
		t.Fatal("an entry larger than the byte cap must still be kept")
	}
}

func TestHistoryHolesKeepTheirPlaceAndAreSkippedOnResume(t *testing.T) {
	h := newHistory(10, 1<<20)
	h.pushBatch(0, 0, hb(0, 0), 1, liveDigest{})
	h.pushHole(0, 1, 5)
	h.pushBatch(1, 0, hb(1, 0), 1, liveDigest{})
	h.pushBatch(0, 6, hb(0, 6), 1, liveDigest{})
	if h.holes != 1 || h.ranks[0].holeSeqs != 5 || h.completeFrom0(0) || !h.completeFrom0(1) {
		t.Fatalf("holes %d/%d complete %v/%v", h.holes, h.ranks[0].holeSeqs, h.completeFrom0(0), h.completeFrom0(1))
	}
	for _, c := range []uint64{1, 3, 5} {
		if got := seqsAfter(h, h.rankPos(0, c), nil); got != "1:0 0:6" {
			t.Errorf("rank 0 cursor %d: %q", c, got)
		}
	}
	if got := seqsAfter(h, h.rankPos(0, 6), nil); got != "" {
		t.Errorf("cursor at the newest: %q", got)
	}
	keep := func(e *entry) bool { return e.rank == 0 }
	if got := seqsAfter(h, 0, keep); got != "0:0 0:6" {
		t.Errorf("rank 0 only: %q", got)
	}
}

func TestHistoryPositionsSurviveClearAndCompaction(t *testing.T) {
	h := newHistory(5, 1<<30)
	for seq := uint64(0); seq < 5000; seq++ {
		h.pushBatch(int32(seq%2), seq/2, hb(int32(seq%2), seq/2), 1, liveDigest{})
	}
	if h.tip() != 5000 || h.firstPos() != 4996 || h.len() != 5 {
		t.Fatalf("tip %d first %d len %d", h.tip(), h.firstPos(), h.len())
	}
	if len(h.entries) > 2100 || len(h.ranks[0].slots) > 2100 {
		t.Fatalf("not compacted: %d entries, %d slots", len(h.entries), len(h.ranks[0].slots))
	}
	if got := seqsAfter(h, 4997, nil); got != "1:2498 0:2499 1:2499" {
		t.Fatalf("after 4997: %q", got)
	}
	if first, last, _ := h.rankBounds(1); first != 2497 || last != 2499 {
		t.Fatalf("rank 1 bounds %d..%d", first, last)
	}
	if pos := h.rankPos(1, 2499); pos != 5000 {
		t.Fatalf("rankPos %d", pos)
	}
	h.clear()
	if h.len() != 0 || h.tip() != 5000 || h.firstPos() != 5001 {
		t.Fatalf("after clear: len %d tip %d first %d", h.len(), h.tip(), h.firstPos())
	}
	if pos := h.pushBatch(0, 0, hb(0, 0), 1, liveDigest{}); pos != 5001 {
		t.Fatalf("position after clear %d", pos)
	}
}

func TestHistoryBatchesAfterHonoursItsLimit(t *testing.T) {
	h := newHistory(100, 1<<30)
	for seq := uint64(0); seq < 10; seq++ {
		h.pushBatch(0, seq, hb(0, seq), 1, liveDigest{})
	}
	pbs, looked := h.batchesAfter(nil, 2, 3, nil)
	var got []string
	for _, pb := range pbs {
		got = append(got, fmt.Sprint(pb.pos))
	}
	if strings.Join(got, ",") != "3,4,5" || looked != 5 {
		t.Fatalf("positions %v, looked at %d", got, looked)
	}
}
