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
	if err := decodeQuery(appendQuery(nil, q), &q2); err != nil || !reflect.DeepEqual(q, q2) {
		t.Fatalf("query: got %+v, %v; want %+v", q2, err, q)
	}
	a := sampleAnswer()
	var a2 gateway.PartitionAnswer
	st, err := decodeAnswer(appendAnswer(nil, statusAnswered, &a), &a2)
	if err != nil || st != statusAnswered || !reflect.DeepEqual(a, a2) {
		t.Fatalf("answer: got %+v (status %d, %v); want %+v", a2, st, err, a)
	}
}

// TestWireRefusesWhatBreaksABound: each bound is refused with an error
// naming it, before anything is allocated from the declared size.
func TestWireRefusesWhatBreaksABound(t *testing.T) {
	var q gateway.PartitionQuery
	tooMany := binary.AppendUvarint([]byte{Version, 0, 1, 'm'}, MaxHashes+1)
	if err := decodeQuery(tooMany, &q); !errors.Is(err, ErrTooLarge) {
		t.Errorf("more than MaxHashes hashes: %v", err)
	}
	short := binary.AppendUvarint([]byte{Version, 0, 1, 'm'}, 4)
	short = binary.LittleEndian.AppendUint64(short, 1)
	if err := decodeQuery(short, &q); !errors.Is(err, ErrMalformed) {
		t.Errorf("4 hashes declared, 1 sent: %v", err)
	}
	if err := decodeQuery([]byte{2, 0, 0, 0}, &q); !errors.Is(err, ErrVersion) {
		t.Errorf("version 2: %v", err)
	}
	longModel := binary.AppendUvarint([]byte{Version, 0}, MaxModelBytes+1)
	if err := decodeQuery(longModel, &q); !errors.Is(err, ErrTooLarge) {
		t.Errorf("a model name over MaxModelBytes: %v", err)
	}

	var a gateway.PartitionAnswer
	// A count of a billion overlaps in a 10-byte message.
	huge := binary.AppendUvarint([]byte{Version, 0, 0, 0}, 1e9)
	if _, err := decodeAnswer(huge, &a); !errors.Is(err, ErrTooLarge) || cap(a.Matches) > 0 {
		t.Errorf("a billion overlaps declared: %v (room for %d)", err, cap(a.Matches))
	}
	s := sampleAnswer()
	good := appendAnswer(nil, statusAnswered, &s)
	if _, err := decodeAnswer(good[:len(good)-1], &a); err == nil {
		t.Error("a truncated answer decoded")
	}
	if _, err := decodeAnswer(append(slices.Clip(good), 0), &a); !errors.Is(err, ErrMalformed) {
		t.Errorf("trailing bytes: %v", err)
	}
	nan := gateway.PartitionAnswer{Signals: []gateway.WorkerSignal{{Worker: "w", EngineSignal: picker.EngineSignal{TokenUsage: math.NaN(), HasTokenUsage: true}}}}
	if _, err := decodeAnswer(appendAnswer(nil, statusAnswered, &nan), &a); !errors.Is(err, ErrMalformed) {
		t.Errorf("a NaN token usage: %v", err)
	}
	zero := gateway.PartitionAnswer{Matches: []index.Match{{Worker: "w", Blocks: 0}}}
	if _, err := decodeAnswer(appendAnswer(nil, statusAnswered, &zero), &a); !errors.Is(err, ErrMalformed) {
		t.Errorf("an overlap of 0 blocks: %v", err)
	}
	far := binary.AppendUvarint([]byte{Version}, gateway.MaxPartitions)
	if _, err := decodeAnswer(far, &a); !errors.Is(err, ErrTooLarge) {
		t.Errorf("partition %d: %v", gateway.MaxPartitions, err)
	}
}

func FuzzPartitionQuery(f *testing.F) {
	f.Add(appendQuery(nil, gateway.PartitionQuery{Model: "m", Prefix: []uint64{1, 2}, Loads: true}))
	f.Add([]byte{Version, 0, 0, 0})
	f.Add([]byte{Version, 1, 0xff, 0xff, 0xff, 0xff, 0x0f})
	f.Fuzz(func(t *testing.T, b []byte) {
		var q gateway.PartitionQuery
		if err := decodeQuery(b, &q); err != nil {
			return
		}
		if len(q.Prefix) > MaxHashes || len(q.Model) > MaxModelBytes {
			t.Fatalf("decoded past a bound: %d hashes, model of %d bytes", len(q.Prefix), len(q.Model))
		}
		var q2 gateway.PartitionQuery
		if err := decodeQuery(appendQuery(nil, q), &q2); err != nil || q2.Model != q.Model || q2.Loads != q.Loads || !slices.Equal(q2.Prefix, q.Prefix) {
			t.Fatalf("re-encoded query does not decode to itself: %v", err)
		}
	})
}

func FuzzPartitionAnswer(f *testing.F) {
	s := sampleAnswer()
	f.Add(appendAnswer(nil, statusAnswered, &s))
	f.Add(appendAnswer(nil, statusUnknownModel, &gateway.PartitionAnswer{Partition: 1}))
	f.Add([]byte{Version, 0, 0, 0, 0xff, 0xff, 0xff, 0x0f})
	f.Fuzz(func(t *testing.T, b []byte) {
		var a gateway.PartitionAnswer
		st, err := decodeAnswer(b, &a)
		if err != nil {
			return
		}
		if len(a.Matches)+len(a.Unreachable)+len(a.Signals) > len(b) {
			t.Fatalf("%d entries from %d bytes", len(a.Matches)+len(a.Unreachable)+len(a.Signals), len(b))
		}
		var a2 gateway.PartitionAnswer
		st2, err := decodeAnswer(appendAnswer(nil, st, &a), &a2)
		if err != nil || st2 != st || !reflect.DeepEqual(a, a2) {
			t.Fatalf("re-encoded answer does not decode to itself: %v", err)
		}
	})
}
