package partitionsync

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"reflect"
	"slices"
	"strings"
	"testing"

	"github.com/kvrelay/kvrelay/gateway"
	"github.com/kvrelay/kvrelay/gateway/index"
	"github.com/kvrelay/kvrelay/gateway/picker"
)

func sampleAnswer() gateway.PartitionAnswer {
	return gateway.PartitionAnswer{
		Partition: 3, BlockSize: 16,
		Matches:     []index.Match{{Worker: "grpc://b:1", Blocks: 7}, {Worker: "grpc://a:1", Blocks: 2}},
		Unreachable: []string{"grpc://c:1"},
		Signals: []gateway.WorkerSignal{
			{Worker: "grpc://a:1", EngineSignal: picker.EngineSignal{TokenUsage: 0.5, HasTokenUsage: true, Backlog: 96, HasBacklog: true}},
			{Worker: "grpc://b:1", EngineSignal: picker.EngineSignal{TokenUsage: 0.25, HasTokenUsage: true}},
		},
	}
}

// TestWireRoundTrip: a query and an answer decode to what was encoded.
func TestWireRoundTrip(t *testing.T) {
	q := gateway.PartitionQuery{Model: "llama", Prefix: []uint64{1, 2, math.MaxUint64}, Loads: true}
	var q2 gateway.PartitionQuery
	if parts, err := decodeQuery(appendQuery(nil, 16, q), &q2); err != nil || parts != 16 || !reflect.DeepEqual(q, q2) {
		t.Fatalf("query: got %+v of %d partitions, %v; want %+v of 16", q2, parts, err, q)
	}
	a := sampleAnswer()
	var a2 gateway.PartitionAnswer
	st, parts, err := decodeAnswer(appendAnswer(nil, 16, statusAnswered, &a), &a2)
	if err != nil || st != statusAnswered || parts != 16 || !reflect.DeepEqual(a, a2) {
		t.Fatalf("answer: got %+v (status %d, %d partitions, %v); want %+v of 16", a2, st, parts, err, a)
	}
}

// TestWireRefusesWhatBreaksABound: each bound is refused with an error
// naming it, before anything is allocated from the declared size.
func TestWireRefusesWhatBreaksABound(t *testing.T) {
	var q gateway.PartitionQuery
	tooMany := binary.AppendUvarint([]byte{Version, 0, 4, 1, 'm'}, MaxHashes+1)
	if _, err := decodeQuery(tooMany, &q); !errors.Is(err, ErrTooLarge) {
		t.Errorf("more than MaxHashes hashes: %v", err)
	}
	short := binary.AppendUvarint([]byte{Version, 0, 4, 1, 'm'}, 4)
	short = binary.LittleEndian.AppendUint64(short, 1)
	if _, err := decodeQuery(short, &q); !errors.Is(err, ErrMalformed) {
		t.Errorf("4 hashes declared, 1 sent: %v", err)
	}
	if _, err := decodeQuery([]byte{1, 0, 0, 0}, &q); !errors.Is(err, ErrVersion) {
		t.Errorf("version 1 (before the partition count): %v", err)
	}
	longModel := binary.AppendUvarint([]byte{Version, 0, 4}, MaxModelBytes+1)
	if _, err := decodeQuery(longModel, &q); !errors.Is(err, ErrTooLarge) {
		t.Errorf("a model name over MaxModelBytes: %v", err)
	}
	for _, parts := range []uint64{0, 1, gateway.MaxPartitions + 1} {
		b := binary.AppendUvarint([]byte{Version, 0}, parts)
		if _, err := decodeQuery(append(b, 0, 0), &q); err == nil {
			t.Errorf("a query of %d partitions decoded", parts)
		}
	}

	var a gateway.PartitionAnswer
	// A count of a billion overlaps in a 10-byte message.
	huge := binary.AppendUvarint([]byte{Version, 4, 0, 0, 0}, 1e9)
	if _, _, err := decodeAnswer(huge, &a); !errors.Is(err, ErrTooLarge) || cap(a.Matches) > 0 {
		t.Errorf("a billion overlaps declared: %v (room for %d)", err, cap(a.Matches))
	}
	s := sampleAnswer()
	good := appendAnswer(nil, 4, statusAnswered, &s)
	if _, _, err := decodeAnswer(good[:len(good)-1], &a); err == nil {
		t.Error("a truncated answer decoded")
	}
	if _, _, err := decodeAnswer(append(slices.Clip(good), 0), &a); !errors.Is(err, ErrMalformed) {
		t.Errorf("trailing bytes: %v", err)
	}
	for _, u := range []float64{math.NaN(), math.Inf(1), -0.25, 1.5} {
		// One signal of worker "w": P 4, partition 0, answered, block size
		// 0, no overlap, no unreachable worker, one signal.
		b := []byte{Version, 4, 0, statusAnswered, 0, 0, 0, 1, 1, 'w', sigTokenUsage}
		b = binary.LittleEndian.AppendUint64(b, math.Float64bits(u))
		if _, _, err := decodeAnswer(b, &a); !errors.Is(err, ErrMalformed) {
			t.Errorf("a token usage of %v: %v", u, err)
		}
		if _, _, err := decodeAnswer(b[:len(b)-8], &a); err == nil {
			t.Error("a token usage without its bytes decoded")
		}
	}
	zero := gateway.PartitionAnswer{Matches: []index.Match{{Worker: "w", Blocks: 0}}}
	if _, _, err := decodeAnswer(appendAnswer(nil, 4, statusAnswered, &zero), &a); !errors.Is(err, ErrMalformed) {
		t.Errorf("an overlap of 0 blocks: %v", err)
	}
	// Partition 4 of a 4-partition tier, and 256 of 256.
	for _, parts := range []int{4, gateway.MaxPartitions} {
		far := binary.AppendUvarint(binary.AppendUvarint([]byte{Version}, uint64(parts)), uint64(parts))
		if _, _, err := decodeAnswer(far, &a); !errors.Is(err, ErrTooLarge) {
			t.Errorf("partition %d of %d: %v", parts, parts, err)
		}
	}
	for _, parts := range []uint64{0, 1, gateway.MaxPartitions + 1} {
		b := binary.AppendUvarint([]byte{Version}, parts)
		if _, _, err := decodeAnswer(append(b, 0, 0, 0, 0, 0, 0), &a); err == nil {
			t.Errorf("an answer of %d partitions decoded", parts)
		}
	}
}

// TestWireRefusesAWorkerNamedTwice: an answer naming a worker twice in its
// overlaps ({b:4},{c:2},{b:1}: not adjacent once sorted, so a merge kept
// both), its unreachable workers or its signals is refused, whatever the
// list's length; the same worker in two lists is fine.
func TestWireRefusesAWorkerNamedTwice(t *testing.T) {
	var a gateway.PartitionAnswer
	dup := gateway.PartitionAnswer{Partition: 1, Matches: []index.Match{{Worker: "b", Blocks: 4}, {Worker: "c", Blocks: 2}, {Worker: "b", Blocks: 1}}}
	if _, _, err := decodeAnswer(appendAnswer(nil, 4, statusAnswered, &dup), &a); !errors.Is(err, ErrMalformed) || !strings.Contains(err.Error(), `worker "b" overlaps twice`) {
		t.Errorf("b overlapping twice: %v", err)
	}
	var long gateway.PartitionAnswer // past the quadratic check's 16
	for i := range 40 {
		long.Matches = append(long.Matches, index.Match{Worker: fmt.Sprintf("w%d", i), Blocks: 1})
		long.Unreachable = append(long.Unreachable, fmt.Sprintf("w%d", i))
		long.Signals = append(long.Signals, gateway.WorkerSignal{Worker: fmt.Sprintf("w%d", i)})
	}
	if _, _, err := decodeAnswer(appendAnswer(nil, 4, statusAnswered, &long), &a); err != nil {
		t.Fatalf("40 distinct workers, each in every list: %v", err)
	}
	for _, tc := range []struct {
		what string
		edit func(*gateway.PartitionAnswer)
	}{
		{"overlaps twice", func(a *gateway.PartitionAnswer) { a.Matches[37].Worker = "w3" }},
		{"unreachable twice", func(a *gateway.PartitionAnswer) { a.Unreachable[39] = "w0" }},
		{"signalled twice", func(a *gateway.PartitionAnswer) { a.Signals[20].Worker = "w21" }},
		{"signalled twice", func(a *gateway.PartitionAnswer) { a.Signals = a.Signals[:3]; a.Signals[2].Worker = "w1" }},
	} {
		b := gateway.PartitionAnswer{Partition: 1}
		b.Matches = slices.Clone(long.Matches)
		b.Unreachable = slices.Clone(long.Unreachable)
		b.Signals = slices.Clone(long.Signals)
		tc.edit(&b)
		if _, _, err := decodeAnswer(appendAnswer(nil, 4, statusAnswered, &b), &a); !errors.Is(err, ErrMalformed) || !strings.Contains(err.Error(), tc.what) {
			t.Errorf("a worker %s: %v", tc.what, err)
		}
	}
}

// TestWireClampsTokenUsage: an own engine's usage past [0, 1] goes out
// clamped, so the answer is not refused for it.
func TestWireClampsTokenUsage(t *testing.T) {
	for _, u := range []float64{1.25, math.Inf(1), math.NaN(), -0.5} {
		s := gateway.PartitionAnswer{Signals: []gateway.WorkerSignal{{Worker: "w", EngineSignal: picker.EngineSignal{TokenUsage: u, HasTokenUsage: true}}}}
		var a gateway.PartitionAnswer
		if _, _, err := decodeAnswer(appendAnswer(nil, 4, statusAnswered, &s), &a); err != nil || a.Signals[0].TokenUsage < 0 || a.Signals[0].TokenUsage > 1 {
			t.Errorf("usage %v: %+v, %v", u, a.Signals, err)
		}
	}
}

func FuzzPartitionQuery(f *testing.F) {
	f.Add(appendQuery(nil, 16, gateway.PartitionQuery{Model: "m", Prefix: []uint64{1, 2}, Loads: true}))
	f.Add([]byte{Version, 0, 2, 0, 0})
	f.Add([]byte{Version, 1, 0x80, 0x02, 0xff, 0xff, 0xff, 0xff, 0x0f})
	f.Fuzz(func(t *testing.T, b []byte) {
		var q gateway.PartitionQuery
		parts, err := decodeQuery(b, &q)
		if err != nil {
			return
		}
		if len(q.Prefix) > MaxHashes || len(q.Model) > MaxModelBytes || parts < 2 || parts > gateway.MaxPartitions {
			t.Fatalf("decoded past a bound: %d hashes, model of %d bytes, %d partitions", len(q.Prefix), len(q.Model), parts)
		}
		var q2 gateway.PartitionQuery
		parts2, err := decodeQuery(appendQuery(nil, parts, q), &q2)
		if err != nil || parts2 != parts || q2.Model != q.Model || q2.Loads != q.Loads || !slices.Equal(q2.Prefix, q.Prefix) {
			t.Fatalf("re-encoded query does not decode to itself: %v", err)
		}
	})
}

func FuzzPartitionAnswer(f *testing.F) {
	s := sampleAnswer()
	f.Add(appendAnswer(nil, 16, statusAnswered, &s))
	f.Add(appendAnswer(nil, 2, statusUnknownModel, &gateway.PartitionAnswer{Partition: 1}))
	f.Add([]byte{Version, 2, 0, 0, 0, 0xff, 0xff, 0xff, 0x0f})
	f.Fuzz(func(t *testing.T, b []byte) {
		var a gateway.PartitionAnswer
		st, parts, err := decodeAnswer(b, &a)
		if err != nil {
			return
		}
		if len(a.Matches)+len(a.Unreachable)+len(a.Signals) > len(b) {
			t.Fatalf("%d entries from %d bytes", len(a.Matches)+len(a.Unreachable)+len(a.Signals), len(b))
		}
		if parts < 2 || parts > gateway.MaxPartitions || a.Partition < 0 || a.Partition >= parts {
			t.Fatalf("partition %d of %d decoded", a.Partition, parts)
		}
		for what, names := range map[string][]string{
			"overlaps":    namesOf(a.Matches, func(m index.Match) string { return m.Worker }),
			"unreachable": a.Unreachable,
			"signals":     namesOf(a.Signals, func(s gateway.WorkerSignal) string { return s.Worker }),
		} {
			if len(names) != len(slices.Compact(slices.Sorted(slices.Values(names)))) {
				t.Fatalf("%s name a worker twice: %q", what, names)
			}
		}
		for _, s := range a.Signals {
			if s.HasTokenUsage && !(s.TokenUsage >= 0 && s.TokenUsage <= 1) {
				t.Fatalf("token usage %v decoded", s.TokenUsage)
			}
		}
		var a2 gateway.PartitionAnswer
		st2, parts2, err := decodeAnswer(appendAnswer(nil, parts, st, &a), &a2)
		if err != nil || st2 != st || parts2 != parts || !reflect.DeepEqual(a, a2) {
			t.Fatalf("re-encoded answer does not decode to itself: %v", err)
		}
	})
}

func namesOf[T any](xs []T, name func(T) string) []string {
	out := make([]string, len(xs))
	for i, x := range xs {
		out[i] = name(x)
	}
	return out
}
