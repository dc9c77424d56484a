package load

import (
	"testing"
	"time"

	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/testing/protocmp"

	"github.com/google/go-cmp/cmp"

	"github.com/kvrelay/kvrelay/proto/kvpb"
)

// fakeSource is a Source on a hand-moved clock.
type fakeSource struct {
	now      time.Time
	readings map[int32]*Reading
}

func (f *fakeSource) LatestAt(rank int32, _ time.Time) (*Reading, bool) {
	r, ok := f.readings[rank]
	return r, ok
}
func (f *fakeSource) Now() time.Time { return f.now }

func (f *fakeSource) set(rank int32, l *kvpb.EngineLoad) {
	f.readings[rank] = &Reading{Load: l, At: f.now, Core: marshalCore(l), Full: marshal(l)}
}

func newFake() *fakeSource {
	return &fakeSource{now: time.Unix(1000, 0), readings: map[int32]*Reading{}}
}

func withTelemetry(running uint32) *kvpb.EngineLoad {
	return &kvpb.EngineLoad{
		RunningRequests: running, WaitingRequests: 2, TokenUsage: 0.25, GenThroughput: 100,
		WaitingUncachedTokens: proto.Uint32(7), CacheHitRate: proto.Float64(0.5),
		NumUsedTokens: proto.Int32(10), Queues: &kvpb.EngineQueues{Waiting: 2},
	}
}

// decodeBatch reads back a batch made of a base encoding and Stamp's field.
func decodeBatch(t *testing.T, b []byte) *kvpb.KvEventBatch {
	t.Helper()
	out := &kvpb.KvEventBatch{}
	if err := proto.Unmarshal(b, out); err != nil {
		t.Fatalf("stamped batch does not decode: %v", err)
	}
	return out
}

func encodedBatch(t *testing.T, seq uint64, rank int32) []byte {
	t.Helper()
	b, err := proto.Marshal(&kvpb.KvEventBatch{SequenceNumber: seq, DpRank: proto.Int32(rank), Timestamp: 1})
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func TestStampKeepsTelemetryOnFirstRecordOnly(t *testing.T) {
	src := newFake()
	src.set(0, withTelemetry(3))
	rec := NewRecorder(src)

	first := decodeBatch(t, rec.Stamp(encodedBatch(t, 5, 0), 0, true, 5))
	src.now = src.now.Add(30 * time.Millisecond)
	second := decodeBatch(t, rec.Stamp(encodedBatch(t, 6, 0), 0, true, 6))

	wantFirst := withTelemetry(3)
	wantFirst.Sample = 1
	if d := cmp.Diff(wantFirst, first.GetLoad(), protocmp.Transform()); d != "" {
		t.Errorf("first record (-want +got):\n%s", d)
	}
	wantSecond := withTelemetry(3)
	CoreOnly(wantSecond)
	wantSecond.Sample, wantSecond.AgeMs = 2, 30
	if d := cmp.Diff(wantSecond, second.GetLoad(), protocmp.Transform()); d != "" {
		t.Errorf("second record (-want +got):\n%s", d)
	}
	if second.GetSequenceNumber() != 6 || second.GetDpRank() != 0 {
		t.Errorf("stamping changed the batch: seq %d rank %d", second.GetSequenceNumber(), second.GetDpRank())
	}
}

func TestStampWithoutRecordLeavesBatchAlone(t *testing.T) {
	src := newFake()
	src.set(1, withTelemetry(3))
	rec := NewRecorder(src)
	base := encodedBatch(t, 9, 0)
	got := rec.Stamp(append([]byte(nil), base...), 0, true, 9)
	if string(got) != string(base) {
		t.Fatalf("a rank without a record got bytes appended")
	}
	if rec.Sample() != 0 {
		t.Fatalf("sample = %d without a record, want 0", rec.Sample())
	}
}

func TestHeartbeats(t *testing.T) {
	type step struct {
		advance time.Duration
		load    *kvpb.EngineLoad // set before the check; nil keeps the last
		want    bool             // a heartbeat goes out
	}
	base := withTelemetry(3)
	tests := []struct {
		name   string
		before bool // no batch sent yet
		steps  []step
	}{
		{"none before the first batch", true, []step{{advance: 10 * time.Second}, {load: withTelemetry(9)}}},
		{"silence then backoff", false, []step{
			{advance: 999 * time.Millisecond},
			{advance: time.Millisecond, want: true},
			{advance: time.Second, want: true},
			{advance: time.Second},     // two unchanged: 5 s now
			{advance: 3 * time.Second}, // 4 s
			{advance: time.Second, want: true},
			{advance: 4 * time.Second},
			{advance: time.Second, want: true},
		}},
		{"change goes out at once and resets backoff", false, []step{
			{advance: time.Second, want: true},
			{advance: time.Second, want: true},
			{advance: 100 * time.Millisecond, load: withTelemetry(4), want: true},
			{advance: 900 * time.Millisecond},
			{advance: 100 * time.Millisecond, want: true},
		}},
		{"a change waits for the stream to be quiet", false, []step{
			{advance: 50 * time.Millisecond, load: withTelemetry(4)},
			{advance: 50 * time.Millisecond, want: true},
		}},
		{"under the thresholds is no change", false, []step{
			{advance: 100 * time.Millisecond, load: func() *kvpb.EngineLoad {
				l := withTelemetry(3)
				l.TokenUsage += 0.004
				l.GenThroughput += 4
				return l
			}()},
		}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			src := newFake()
			src.set(2, base)
			rec := NewRecorder(src)
			if !tc.before {
				rec.Stamp(nil, 2, true, 41)
			}
			for i, s := range tc.steps {
				src.now = src.now.Add(s.advance)
				if s.load != nil {
					src.set(2, s.load)
				}
				hb := rec.Heartbeat()
				if (hb != nil) != s.want {
					t.Fatalf("step %d: heartbeat %v, want %v", i, hb != nil, s.want)
				}
				if hb == nil {
					continue
				}
				b := decodeBatch(t, hb)
				if b.GetSequenceNumber() != 41 || b.GetDpRank() != 2 || len(b.GetEvents()) != 0 {
					t.Fatalf("step %d: heartbeat names seq %d rank %d with %d events, want 41, 2, none", i, b.GetSequenceNumber(), b.GetDpRank(), len(b.GetEvents()))
				}
				if want := float64(src.now.UnixNano()) / 1e9; b.GetTimestamp() != want {
					t.Fatalf("step %d: heartbeat timestamp %v, want the relay's clock %v", i, b.GetTimestamp(), want)
				}
				if !b.GetLoad().GetLoadOnly() || b.GetLoad().CacheHitRate == nil || b.GetLoad().GetSample() != rec.Sample() {
					t.Fatalf("step %d: heartbeat record %v: want load_only with telemetry and sample %d", i, b.GetLoad(), rec.Sample())
				}
			}
		})
	}
}

func TestChangedThresholds(t *testing.T) {
	mod := func(f func(*kvpb.EngineLoad)) *kvpb.EngineLoad { l := withTelemetry(3); f(l); return l }
	tests := []struct {
		name string
		cur  *kvpb.EngineLoad
		want bool
	}{
		{"same", withTelemetry(3), false},
		{"telemetry only", mod(func(l *kvpb.EngineLoad) { l.CacheHitRate = proto.Float64(0.9) }), false},
		{"running", withTelemetry(4), true},
		{"queued work unknown", mod(func(l *kvpb.EngineLoad) { l.WaitingUncachedTokens = nil }), true},
		{"usage 0.006", mod(func(l *kvpb.EngineLoad) { l.TokenUsage += 0.006 }), true},
		{"active usage", mod(func(l *kvpb.EngineLoad) { l.ActiveTokenUsage = proto.Float64(0.3) }), true},
		{"rate 5% of 100 is under 50", mod(func(l *kvpb.EngineLoad) { l.GenThroughput = 105 }), false},
		{"rate 6%", mod(func(l *kvpb.EngineLoad) { l.GenThroughput = 106.5 }), true},
		{"silence known", mod(func(l *kvpb.EngineLoad) { l.EngineSilenceMs = proto.Uint32(10) }), true},
		{"prefill pending", mod(func(l *kvpb.EngineLoad) { l.PrefillPendingTokens = proto.Uint32(1) }), true},
	}
	for _, tc := range tests {
		if got := Changed(withTelemetry(3), tc.cur); got != tc.want {
			t.Errorf("%s: Changed = %v, want %v", tc.name, got, tc.want)
		}
	}
}

func TestAppendRecordIsOneField(t *testing.T) {
	l := withTelemetry(1)
	b := appendRecord(nil, marshal(l), 12, 3, true)
	num, typ, n := protowire.ConsumeTag(b)
	if num != batchLoad || typ != protowire.BytesType || n < 0 {
		t.Fatalf("tag %d/%d", num, typ)
	}
	body, m := protowire.ConsumeBytes(b[n:])
	if m < 0 || n+m != len(b) {
		t.Fatalf("field 8 length does not cover the appended bytes")
	}
	got := &kvpb.EngineLoad{}
	if err := proto.Unmarshal(body, got); err != nil {
		t.Fatal(err)
	}
	l.AgeMs, l.Sample, l.LoadOnly = 12, 3, true
	if d := cmp.Diff(l, got, protocmp.Transform()); d != "" {
		t.Fatalf("(-want +got):\n%s", d)
	}
}

// TestRecorderWithoutRecordIsNotDueAtOnce: while the source has no fresh
// record, Heartbeat sends nothing; Due must then move on, or a stream
// waiting until Due is woken at once, again and again, for as long as the
// source is down (runStamped spun a core per quiet stream).
func TestRecorderWithoutRecordIsNotDueAtOnce(t *testing.T) {
	src := newFake()
	src.set(0, withTelemetry(1))
	r := NewRecorder(src)
	r.Stamp(nil, 0, true, 1)
	delete(src.readings, 0) // aged out: the source went away
	for i := range 3 {
		src.now = r.Due()
		if hb := r.Heartbeat(); hb != nil {
			t.Fatalf("check %d: heartbeat without a fresh record: %x", i, hb)
		}
		if due := r.Due(); !due.After(src.now) {
			t.Fatalf("check %d: Due %v is not after now %v with no record: a waiting stream would spin", i, due, src.now)
		}
	}
	src.set(0, withTelemetry(1))
	src.now = r.Due()
	hb := r.Heartbeat()
	if hb == nil {
		t.Fatal("no heartbeat at Due once the record is back")
	}
	if got := decodeBatch(t, hb).GetLoad(); !got.GetLoadOnly() || got.GetRunningRequests() != 1 {
		t.Fatalf("heartbeat once the record is back: %v", got)
	}
}
