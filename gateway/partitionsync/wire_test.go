package partitionsync

import (
	"encoding/binary"
	"errors"
	"math"
	"reflect"
	"slices"
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
	nan := gateway.PartitionAnswer{Signals: []gateway.WorkerSignal{{Worker: "w", EngineSignal: picker.EngineSignal{TokenUsage: math.NaN(), HasTokenUsage: true}}}}
	if _, _, err := decodeAnswer(appendAnswer(nil, 4, statusAnswered, &nan), &a); !errors.Is(err, ErrMalformed) {
		t.Errorf("a NaN token usage: %v", err)
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
		var a2 gateway.PartitionAnswer
		st2, parts2, err := decodeAnswer(appendAnswer(nil, parts, st, &a), &a2)
		if err != nil || st2 != st || parts2 != parts || !reflect.DeepEqual(a, a2) {
			t.Fatalf("re-encoded answer does not decode to itself: %v", err)
		}
	})
}
