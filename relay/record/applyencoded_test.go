package record

import (
	"bytes"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"testing"

	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	"github.com/kvrelay/kvrelay/proto/kvenc"
	"github.com/kvrelay/kvrelay/proto/kvpb"
	"github.com/kvrelay/kvrelay/testkit/goldenvec"
)

// recordOptions are the record configurations the differential tests run under.
type recordOptions struct {
	name       string
	detect     bool   // DetectReannouncements
	maxEntries uint64 // SetMaxEntries
}

var encodedTestOptions = []recordOptions{
	{name: "plain"},
	{name: "reannouncements", detect: true},
	{name: "capped", maxEntries: 12},
	{name: "reannouncements-capped", detect: true, maxEntries: 12},
}

func (o recordOptions) record() *Record {
	r := New()
	if o.detect {
		r.DetectReannouncements()
	}
	r.SetMaxEntries(o.maxEntries)
	return r
}

// applyBoth applies enc to want through proto.Unmarshal and Apply, and to got through
// ApplyEncoded, and requires the same outcome: the same error or none, the same re-announced
// indexes and counts. It returns what ApplyEncoded reported and proto.Unmarshal's error.
func applyBoth(t testing.TB, want, got *Record, enc []byte) (Applied, *kvpb.KvEventBatch, error) {
	t.Helper()
	b := &kvpb.KvEventBatch{}
	uerr := proto.Unmarshal(enc, b)
	a, err := got.ApplyEncoded(enc)
	if uerr != nil {
		if err == nil {
			t.Fatalf("ApplyEncoded accepted %x, which proto.Unmarshal refuses: %v", enc, uerr)
		}
		if errors.Unwrap(err) == nil {
			t.Fatalf("ApplyEncoded's error %q wraps no cause", err)
		}
		return a, nil, uerr
	}
	if err != nil {
		t.Fatalf("ApplyEncoded refused %x, which proto.Unmarshal accepts: %v", enc, err)
	}
	re := want.Apply(b)
	if !slices.Equal(a.Reannounced, re) {
		t.Fatalf("ApplyEncoded re-announced %v, Apply %v", a.Reannounced, re)
	}
	blocks := 0
	for _, ev := range b.Events {
		blocks += len(ev.GetStored().GetBlocks())
	}
	if a.Events != len(b.Events) || a.StoredBlocks != blocks {
		t.Fatalf("ApplyEncoded counted %d events and %d stored blocks, the batch has %d and %d",
			a.Events, a.StoredBlocks, len(b.Events), blocks)
	}
	return a, b, nil
}

// sameRecord requires got to hold what want holds, by everything a caller can observe: Stats,
// every rank's live digest and evictions, the bytes of a Cut's chunks, and IsReannouncement's
// answers for probes on every rank.
func sameRecord(t testing.TB, want, got *Record, probes []*kvpb.KvBlocksStored) {
	t.Helper()
	ws, gs := want.Stats(), got.Stats()
	if fmt.Sprint(ws) != fmt.Sprint(gs) {
		t.Fatalf("stats differ:\nApply         %+v\nApplyEncoded  %+v", ws, gs)
	}
	ranks := []int32{NoRank, 0, 1, 2}
	for rank := range want.ranks {
		ranks = append(ranks, rank)
	}
	for rank := range got.ranks {
		ranks = append(ranks, rank)
	}
	slices.Sort(ranks)
	ranks = slices.Compact(ranks)
	cursors := map[int32]uint64{}
	for _, rank := range ranks {
		wd, wb := want.LiveDigest(rank)
		gd, gb := got.LiveDigest(rank)
		if wd != gd || wb != gb {
			t.Fatalf("rank %d: live digest %x over %d blocks after Apply, %x over %d after ApplyEncoded", rank, wd, wb, gd, gb)
		}
		if w, g := want.EvictedFrom(rank), got.EvictedFrom(rank); w != g {
			t.Fatalf("rank %d: %d evicted after Apply, %d after ApplyEncoded", rank, w, g)
		}
		for i, p := range probes {
			if w, g := want.IsReannouncement(rank, p), got.IsReannouncement(rank, p); w != g {
				t.Fatalf("rank %d probe %d: IsReannouncement %v after Apply, %v after ApplyEncoded", rank, i, w, g)
			}
		}
		cursors[rank] = 40
	}
	wc, gc := want.Cut(nil), got.Cut(nil)
	defer wc.Release()
	defer gc.Release()
	wst, gst := wc.Stream(cursors, nil, 3), gc.Stream(cursors, nil, 3)
	for i := 0; ; i++ {
		w, g := wst.NextEncoded(), gst.NextEncoded()
		if !bytes.Equal(w, g) {
			t.Fatalf("snapshot chunk %d differs (%d bytes after Apply, %d after ApplyEncoded)", i, len(w), len(g))
		}
		if w == nil {
			break
		}
	}
}

func storedOf(b *kvpb.KvEventBatch) []*kvpb.KvBlocksStored {
	var out []*kvpb.KvBlocksStored
	for _, ev := range b.GetEvents() {
		if s := ev.GetStored(); s != nil {
			out = append(out, s)
		}
	}
	return out
}

// TestApplyEncodedMatchesApplyOnTheGoldenBatches applies every batch the golden vectors stand
// for, in the relay's encoding, to two records of each configuration, one through Apply and one
// through ApplyEncoded, and compares them after every batch. Every one must take the fast path.
func TestApplyEncodedMatchesApplyOnTheGoldenBatches(t *testing.T) {
	batches := goldenvec.Batches(t, "../../testdata/golden")
	if len(batches) < 50 {
		t.Fatalf("only %d golden batches", len(batches))
	}
	for _, o := range encodedTestOptions {
		t.Run(o.name, func(t *testing.T) {
			want, got := o.record(), o.record()
			var blocks, reannounced int
			for i, b := range batches {
				enc, err := kvenc.AppendBatch(nil, b)
				if err != nil {
					t.Fatalf("batch %d: %v", i, err)
				}
				a, ub, _ := applyBoth(t, want, got, enc)
				if a.Unmarshalled {
					t.Fatalf("batch %d: the relay's own encoding left the fast path", i)
				}
				blocks += a.StoredBlocks
				reannounced += len(a.Reannounced)
				sameRecord(t, want, got, storedOf(ub))
			}
			if blocks == 0 {
				t.Fatal("the golden batches stored no block")
			}
			t.Logf("%d batches, %d stored blocks, %d re-announcements", len(batches), blocks, reannounced)
		})
	}
}

// tokenWidths are token ids of every varint width, the 5-byte ones up to 2^32-1.
var tokenWidths = []uint32{0, 1, 127, 128, 16383, 16384, 151_999, 2_097_151, 2_097_152, 1 << 28, math.MaxUint32}

// encodedGen draws batches for the generated differential test: opGen's stores (ranks, tiers,
// tails with LoRA names and salts, extra keys), removals and clears, with tokens of every width
// and count, and re-sends of earlier stores without a parent (report-mode re-announcements).
type encodedGen struct {
	rng  *rand.Rand
	ops  *opGen
	sent map[int32][]*kvpb.KvEventBatch // earlier batches with a parentless store, per rank
}

func newEncodedGen(seed uint64) *encodedGen {
	rng := rand.New(rand.NewPCG(seed, seed^0x5eed))
	return &encodedGen{
		rng:  rng,
		ops:  &opGen{intn: rng.IntN, pool: 40, ranks: 3, maxStore: 8},
		sent: map[int32][]*kvpb.KvEventBatch{},
	}
}

func (g *encodedGen) batch() *kvpb.KvEventBatch {
	rank := NoRank
	if g.rng.IntN(6) == 0 {
		rank = int32(g.rng.IntN(3)) - 1
		if earlier := g.sent[rank]; len(earlier) > 0 {
			b := proto.Clone(earlier[g.rng.IntN(len(earlier))]).(*kvpb.KvEventBatch)
			var events []*kvpb.KvCacheEvent
			for _, ev := range b.Events {
				if s := ev.GetStored(); s != nil && s.ParentBlockHash == nil {
					events = append(events, ev)
				}
			}
			b.Events = events
			return b
		}
	}
	b := g.ops.batch()
	rank = NoRank
	if b.DpRank != nil {
		rank = *b.DpRank
	}
	parentless := false
	for _, s := range storedOf(b) {
		parentless = parentless || s.ParentBlockHash == nil
		for _, blk := range s.Blocks {
			n := g.rng.IntN(6)
			switch g.rng.IntN(8) {
			case 0:
				n = 0
			case 1:
				n = 20 + g.rng.IntN(20) // past 25 tokens the record's length prefix takes 2 bytes
			}
			blk.TokenIds = make([]uint32, n)
			for i := range blk.TokenIds {
				blk.TokenIds[i] = tokenWidths[g.rng.IntN(len(tokenWidths))] - uint32(g.rng.IntN(2))
			}
		}
	}
	if parentless {
		g.sent[rank] = append(g.sent[rank], b)
	}
	return b
}

// TestApplyEncodedMatchesApplyOnGeneratedBatches compares Apply and ApplyEncoded after every one
// of thousands of generated batches under each configuration, with Cuts held across some of them
// (so that segments and arenas are shared while packed records are written).
func TestApplyEncodedMatchesApplyOnGeneratedBatches(t *testing.T) {
	for _, o := range encodedTestOptions {
		t.Run(o.name, func(t *testing.T) {
			g := newEncodedGen(uint64(len(o.name)))
			want, got := o.record(), o.record()
			var held []*Cut
			var reannounced, evicted int
			for i := range 3000 {
				b := g.batch()
				enc, err := kvenc.AppendBatch(nil, b)
				if err != nil {
					t.Fatalf("batch %d: %v", i, err)
				}
				a, _, _ := applyBoth(t, want, got, enc)
				if a.Unmarshalled {
					t.Fatalf("batch %d: the relay's own encoding left the fast path", i)
				}
				// The caller reuses its buffer: nothing of the record may still read it.
				for j := range enc {
					enc[j] = 'x'
				}
				reannounced += len(a.Reannounced)
				sameRecord(t, want, got, storedOf(b))
				switch {
				case len(held) == 0 && g.rng.IntN(20) == 0:
					held = append(held, want.Cut(nil), got.Cut(nil))
				case len(held) > 0 && g.rng.IntN(5) == 0:
					for _, c := range held {
						c.Release()
					}
					held = held[:0]
				}
			}
			for _, c := range held {
				c.Release()
			}
			evicted = int(want.Stats().Evicted)
			if o.detect && reannounced == 0 {
				t.Fatal("no batch was taken for a re-announcement")
			}
			if o.maxEntries > 0 && evicted == 0 {
				t.Fatal("no entry was evicted at the cap")
			}
			t.Logf("%d re-announcements, %d evicted", reannounced, evicted)
		})
	}
}

// Wire builders for the structured cases.
func fBytes(num protowire.Number, parts ...[]byte) []byte {
	b := protowire.AppendTag(nil, num, protowire.BytesType)
	return protowire.AppendBytes(b, slices.Concat(parts...))
}

func fVarint(num protowire.Number, v uint64) []byte {
	return protowire.AppendVarint(protowire.AppendTag(nil, num, protowire.VarintType), v)
}

func fRaw(num protowire.Number, typ protowire.Type, raw ...byte) []byte {
	return append(protowire.AppendTag(nil, num, typ), raw...)
}

func packed(toks ...uint64) []byte {
	var b []byte
	for _, v := range toks {
		b = protowire.AppendVarint(b, v)
	}
	return b
}

func cat(parts ...[]byte) []byte { return slices.Concat(parts...) }

// Canonical pieces: a block, a store of it, events and a batch around them.
func blockW(h uint64, more ...[]byte) []byte {
	return cat(append([][]byte{fVarint(1, h), fBytes(2, packed(151000, 7, 16384)), fVarint(3, 16)}, more...)...)
}

func storedW(parts ...[]byte) []byte { return fBytes(2, parts...) }
func eventW(data ...[]byte) []byte   { return fBytes(3, cat(fVarint(1, 9), cat(data...))) }
func batchW(rank uint64, events ...[]byte) []byte {
	return cat(fVarint(1, 77), fRaw(2, protowire.Fixed64Type, 0, 0, 0, 0, 0, 0, 0xf0, 0x3f), cat(events...), fVarint(4, rank))
}

// TestApplyEncodedOnHandWrittenEncodings covers what the relay's encoder never writes but
// protobuf allows (or refuses): each case must end as proto.Unmarshal and Apply have it, through
// the path it names, and a refused batch must leave the record unchanged.
func TestApplyEncodedOnHandWrittenEncodings(t *testing.T) {
	const (
		fast = iota
		fallback
		refused
	)
	bad := []byte{0xff, 0xfe}
	for _, tc := range []struct {
		name string
		enc  []byte
		want int
	}{
		{"canonical store", batchW(0, eventW(storedW(fBytes(1, blockW(100)), fBytes(4, []byte("GPU"))))), fast},
		{"an empty batch", nil, fast},
		{"an event without data", batchW(0, eventW()), fast},
		{"a token of 2^32-1 in five bytes", batchW(0, eventW(storedW(fBytes(1, fVarint(1, 100), fBytes(2, packed(math.MaxUint32, 0)))))), fast},
		{"empty packed tokens", batchW(0, eventW(storedW(fBytes(1, fVarint(1, 100), fBytes(2))))), fast},
		{"dp_rank twice: the last counts", cat(batchW(0, eventW(storedW(fBytes(1, blockW(100))))), fVarint(4, 1)), fast},
		{"a negative dp_rank in ten bytes", batchW(uint64(math.MaxUint64), eventW(storedW(fBytes(1, blockW(100))))), fast},
		{"parent, medium, tier and block hash twice", batchW(1, eventW(storedW(
			fVarint(2, 5), fBytes(4, []byte("GPU")), fVarint(3, 2),
			fBytes(1, blockW(100, fVarint(1, 101), fVarint(5, 1), fVarint(5, 0))),
			fVarint(2, 6), fBytes(4, []byte("CPU")), fVarint(3, 1)))), fast},
		{"block fields in reverse order", batchW(0, eventW(storedW(fBytes(1, fVarint(5, 1), fVarint(4, 3), fVarint(3, 16),
			fBytes(2, packed(5, 151000)), fVarint(1, 100))))), fast},
		{"a block's cache level before its LoRA id, then its hash again", batchW(0, eventW(storedW(fBytes(1, fVarint(1, 100),
			fBytes(2, packed(5)), fVarint(5, 1), fVarint(4, 3), fVarint(1, 101))))), fast},
		{"an out-of-range tier and cache level", batchW(0, eventW(storedW(fVarint(3, 1<<40|7), fBytes(1, blockW(100, fVarint(5, 1<<33|2)))))), fast},
		{"unknown fields at every level", batchW(2,
			fVarint(99, 1), fRaw(98, protowire.Fixed32Type, 1, 2, 3, 4), fBytes(97, []byte("x")),
			eventW(fVarint(50, 3), storedW(fVarint(40, 1), fBytes(1, blockW(100, fRaw(30, protowire.Fixed64Type, 1, 2, 3, 4, 5, 6, 7, 8), fBytes(31))))),
			eventW(fBytes(3, fVarint(1, 100), fVarint(1, 101), fBytes(20, []byte("y")))),
			eventW(fBytes(4, fBytes(1, []byte("engine")), fVarint(9, 9)))), fast},
		{"removals packed and one field a hash, with tier, level, medium, group, locality, ownership", batchW(0,
			eventW(storedW(fBytes(1, blockW(100)), fBytes(1, blockW(101)), fBytes(1, blockW(102)), fVarint(3, 2))),
			eventW(fBytes(3, fBytes(1, packed(100, 555)), fVarint(1, 101), fVarint(3, 2), fVarint(2, 0),
				fBytes(4, []byte("CPU")), fVarint(5, 0), fVarint(6, 1), fBytes(7, []byte("o"))))), fast},
		{"extra keys, one with an unknown field", batchW(0, eventW(storedW(fBytes(1, blockW(100,
			fBytes(6, fBytes(1, []byte("lora"))), fBytes(6, fVarint(3, 5), fVarint(15, 1)),
			fBytes(6, fBytes(4, fBytes(1, []byte("img")), fVarint(2, 3)))))))), fast},
		{"LoRA, salt and session", batchW(0, eventW(storedW(fBytes(11, []byte("adapter")), fBytes(12, []byte("salt")),
			fBytes(10, []byte("s")), fBytes(1, blockW(100, fVarint(4, 3)))))), fast},
		{"a clear", batchW(0, eventW(storedW(fBytes(1, blockW(100)))), eventW(fBytes(4))), fast},

		{"tokens one field each", batchW(0, eventW(storedW(fBytes(1, fVarint(1, 100), fVarint(2, 5), fVarint(2, 151000))))), fallback},
		{"tokens packed then one field", batchW(0, eventW(storedW(fBytes(1, fVarint(1, 100), fBytes(2, packed(1, 2)), fVarint(2, 3))))), fallback},
		{"tokens in two packed fields", batchW(0, eventW(storedW(fBytes(1, fVarint(1, 100), fBytes(2, packed(1)), fBytes(2, packed(2)))))), fallback},
		{"a padded token varint", batchW(0, eventW(storedW(fBytes(1, fVarint(1, 100), fBytes(2, []byte{0x81, 0x00, 5}))))), fallback},
		{"a token wider than 32 bits", batchW(0, eventW(storedW(fBytes(1, fVarint(1, 100), fBytes(2, packed(1<<33|5, 1<<40)))))), fallback},
		{"a stored event split in two (merged)", batchW(0, eventW(storedW(fBytes(1, blockW(100))), storedW(fBytes(1, blockW(101)), fVarint(2, 4)))), fallback},
		{"a oneof set twice: the last counts", batchW(0, eventW(storedW(fBytes(1, blockW(100))), fBytes(3, fVarint(1, 100)))), fallback},
		{"a block hash of the wrong wire type (unknown to proto)", batchW(0, eventW(storedW(fBytes(1, fRaw(1, protowire.Fixed64Type, 1, 0, 0, 0, 0, 0, 0, 0), fVarint(1, 100))))), fallback},
		{"an unknown group", cat(batchW(0, eventW(storedW(fBytes(1, blockW(100))))), fRaw(60, protowire.StartGroupType), fVarint(1, 1), fRaw(60, protowire.EndGroupType)), fallback},
		{"a snapshot field", cat(batchW(0, eventW(storedW(fBytes(1, blockW(100))))), fBytes(7, fVarint(2, 1))), fallback},
		{"a load field", cat(batchW(0, eventW(storedW(fBytes(1, blockW(100))))), fBytes(8, fVarint(1, 3))), fallback},

		{"truncated", batchW(0, eventW(storedW(fBytes(1, blockW(100)))))[:20], refused},
		{"an event declaring 2^40 bytes", cat(protowire.AppendTag(nil, 3, protowire.BytesType), protowire.AppendVarint(nil, 1<<40), []byte{1, 2}), refused},
		{"tokens declaring 2^31 bytes", batchW(0, eventW(storedW(fBytes(1, fVarint(1, 1), protowire.AppendTag(nil, 2, protowire.BytesType), protowire.AppendVarint(nil, 1<<31))))), refused},
		{"field number 0", cat(fVarint(0, 1)), refused},
		{"a field number past 2^29-1", cat(protowire.AppendVarint(nil, uint64(protowire.MaxValidNumber+1)<<3), []byte{1}), refused},
		{"a varint of eleven bytes", cat(protowire.AppendTag(nil, 4, protowire.VarintType), bytes.Repeat([]byte{0x80}, 10), []byte{1}), refused},
		{"an end group at the top", fRaw(5, protowire.EndGroupType), refused},
		{"wire type 6", fRaw(5, 6, 1), refused},
		{"a medium not UTF-8", batchW(0, eventW(storedW(fBytes(4, bad), fBytes(1, blockW(100))))), refused},
		{"a LoRA name not UTF-8", batchW(0, eventW(storedW(fBytes(11, bad), fBytes(1, blockW(100))))), refused},
		{"a salt not UTF-8, after a valid event", batchW(0, eventW(storedW(fBytes(1, blockW(100)))), eventW(storedW(fBytes(12, bad), fBytes(1, blockW(101))))), refused},
		{"a removal's medium not UTF-8", batchW(0, eventW(fBytes(3, fVarint(1, 100), fBytes(4, bad)))), refused},
		{"a clear's ownership not UTF-8", batchW(0, eventW(fBytes(4, fBytes(1, bad)))), refused},
		{"an extra key's text not UTF-8", batchW(0, eventW(storedW(fBytes(1, blockW(100, fBytes(6, fBytes(1, bad))))))), refused},
		{"a truncated packed removal", batchW(0, eventW(fBytes(3, fBytes(1, []byte{0x80, 0x80})))), refused},
	} {
		for _, o := range encodedTestOptions {
			t.Run(tc.name+"/"+o.name, func(t *testing.T) {
				want, got := o.record(), o.record()
				// A state for the case to change: the chain 100..102 on every rank and tier the
				// cases use, which re-announcements and removals then find.
				base := batchW(0, eventW(storedW(fBytes(1, blockW(100)), fBytes(1, blockW(101)), fBytes(1, blockW(102)))))
				for _, rank := range []uint64{0, 1, 2} {
					b := slices.Clone(base)
					b[len(b)-1] = byte(rank)
					applyBoth(t, want, got, b)
				}
				a, b, err := applyBoth(t, want, got, tc.enc)
				switch {
				case tc.want == refused && err == nil:
					t.Fatal("proto.Unmarshal accepts the case, which is meant to be refused")
				case tc.want != refused && err != nil:
					t.Fatalf("proto.Unmarshal refuses the case: %v", err)
				case tc.want != refused && a.Unmarshalled != (tc.want == fallback):
					t.Fatalf("went through proto.Unmarshal: %v, want %v", a.Unmarshalled, tc.want == fallback)
				}
				sameRecord(t, want, got, storedOf(b))
			})
		}
	}
}

// TestApplyEncodedOnEveryPrefix applies every prefix of a generated batch's encoding: each either
// decodes and applies as Apply does, or is refused with the record unchanged.
func TestApplyEncodedOnEveryPrefix(t *testing.T) {
	g := newEncodedGen(3)
	var enc []byte
	for len(enc) < 400 {
		b := g.batch()
		var err error
		if enc, err = kvenc.AppendBatch(nil, b); err != nil {
			t.Fatal(err)
		}
	}
	refused := 0
	for n := range len(enc) + 1 {
		want, got := encodedTestOptions[3].record(), encodedTestOptions[3].record()
		_, b, err := applyBoth(t, want, got, enc[:n])
		if err != nil {
			refused++
		}
		sameRecord(t, want, got, storedOf(b))
	}
	if refused == 0 {
		t.Fatal("no prefix was refused")
	}
}

// FuzzApplyEncodedMatchesApply: for any bytes, ApplyEncoded either refuses them as proto.Unmarshal
// does, leaving the record unchanged, or leaves the record as Apply of the unmarshalled batch
// does, applied twice (the second time finds the first's blocks).
func FuzzApplyEncodedMatchesApply(f *testing.F) {
	for i, b := range goldenvec.Batches(f, "../../testdata/golden") {
		if i%3 != 0 {
			continue // a third of them: the golden vectors repeat their shapes across dialects
		}
		enc, err := kvenc.AppendBatch(nil, b)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(enc, uint8(i))
	}
	g := newEncodedGen(11)
	for i := range 20 {
		enc, err := kvenc.AppendBatch(nil, g.batch())
		if err != nil {
			f.Fatal(err)
		}
		f.Add(enc, uint8(i))
	}
	f.Add(batchW(0, eventW(storedW(fBytes(1, fVarint(1, 100), fVarint(2, 5), fBytes(2, packed(1, 1<<33)))))), uint8(1))
	f.Add(batchW(0, eventW(storedW(fBytes(1, blockW(100))), fBytes(3, fVarint(1, 100)))), uint8(2))
	f.Fuzz(func(t *testing.T, enc []byte, mode uint8) {
		o := encodedTestOptions[int(mode)%len(encodedTestOptions)]
		want, got := o.record(), o.record()
		base := batchW(0, eventW(storedW(fBytes(1, blockW(100)), fBytes(1, blockW(101)), fBytes(4, []byte("GPU")))))
		applyBoth(t, want, got, base)
		for range 2 {
			_, b, _ := applyBoth(t, want, got, enc)
			sameRecord(t, want, got, storedOf(b))
		}
	})
}

// minimalPackedReference is minimalPacked32's rule read plainly: p decodes as varints, each below
// 2^32, and encoding the values again gives p.
func minimalPackedReference(p []byte) bool {
	var again []byte
	for q := p; len(q) > 0; {
		v, n := protowire.ConsumeVarint(q)
		if n < 0 || v > math.MaxUint32 {
			return false
		}
		again = protowire.AppendVarint(again, v)
		q = q[n:]
	}
	return bytes.Equal(again, p)
}

// varint is fieldReader.varint in protowire.ConsumeVarint's form, for checkWireHelpers. The
// reader keeps no reason for a refusal: a refused varint gives protowire's error code if
// protowire refuses it too, and -1, which no accepted varint has, if not.
func varint(p []byte) (uint64, int) {
	r := fieldReader{b: p}
	v := r.varint()
	if r.ok() {
		return v, r.i
	}
	_, n := protowire.ConsumeVarint(p)
	return 0, min(n, -1)
}

// checkWireHelpers requires minimalPacked32 to follow its reference, and varint to read every
// prefix of p as protowire.ConsumeVarint does.
func checkWireHelpers(t *testing.T, p []byte) {
	t.Helper()
	if got, want := minimalPacked32(p), minimalPackedReference(p); got != want {
		t.Fatalf("minimalPacked32(%x) = %v, want %v", p, got, want)
	}
	gv, gn := varint(p)
	wv, wn := protowire.ConsumeVarint(p)
	if gn != wn || gn >= 0 && gv != wv {
		t.Fatalf("varint(%x) = %d, %d; protowire has %d, %d", p, gv, gn, wv, wn)
	}
}

// TestWireHelpersMatchTheirReferences draws packed ids of every width with padding, long
// varints and cut ends at every position of the word loops, and 9 to 11-byte varints.
func TestWireHelpersMatchTheirReferences(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	accepted, refused := 0, 0
	for range 200_000 {
		var p []byte
		for range rng.IntN(24) {
			switch rng.IntN(40) {
			case 0:
				p = append(p, 0x80|byte(rng.IntN(128)), 0x00) // padding
			case 1:
				p = protowire.AppendVarint(p, 1<<32+uint64(rng.IntN(1000))) // wider than 32 bits
			case 2:
				p = append(p, 0xff, 0xff, 0xff, 0xff, byte(rng.IntN(32))) // five bytes, maybe too wide
			case 3:
				p = append(p, 0x80) // a continuation byte astray
			default:
				p = protowire.AppendVarint(p, uint64(tokenWidths[rng.IntN(len(tokenWidths))]-uint32(rng.IntN(3))))
			}
		}
		if minimalPackedReference(p) {
			accepted++
		} else {
			refused++
		}
		checkWireHelpers(t, p)
		h := protowire.AppendVarint(nil, rng.Uint64()>>rng.IntN(64))
		switch rng.IntN(4) {
		case 0:
			h = append(h[:len(h)-1], h[len(h)-1]|0x80, byte(rng.IntN(4))) // one byte longer
		case 1:
			h = h[:rng.IntN(len(h))] // cut short
		}
		checkWireHelpers(t, append(h, make([]byte, rng.IntN(3))...))
	}
	if accepted < 1000 || refused < 1000 {
		t.Fatalf("%d accepted, %d refused: the draw misses a side", accepted, refused)
	}
}

func FuzzWireHelpers(f *testing.F) {
	f.Add([]byte{0xd8, 0x9b, 0x09, 0x07, 0x80, 0x80, 0x01, 0x81, 0x00, 0x05})
	f.Add(bytes.Repeat([]byte{0xff}, 11))
	f.Fuzz(checkWireHelpers)
}

// A hand-built event whose oneof holds a nil payload applies as nothing,
// in every record mode, as it did before Apply and ApplyEncoded shared
// their store path (the relay never builds one; Apply is public).
func TestApplySkipsEventsWithANilPayload(t *testing.T) {
	for _, full := range []bool{false, true} {
		r := New()
		if full {
			r.DetectReannouncements()
		}
		b := &kvpb.KvEventBatch{DpRank: proto.Int32(0), Events: []*kvpb.KvCacheEvent{
			{Data: &kvpb.KvCacheEvent_Stored{}},
			{Data: &kvpb.KvCacheEvent_Removed{}},
			{Data: &kvpb.KvCacheEvent_Stored{Stored: &kvpb.KvBlocksStored{Blocks: []*kvpb.KvBlock{{BlockHash: 7}}}}},
			{Data: &kvpb.KvCacheEvent_Removed{}},
		}}
		if got := r.Apply(b); got != nil {
			t.Errorf("full=%v: re-announced %v, want none", full, got)
		}
		if st := r.Stats(); st.Blocks != 1 || st.Stored != 1 || st.Removed != 0 {
			t.Errorf("full=%v: stats %+v, want the one real block stored", full, st)
		}
	}
}
