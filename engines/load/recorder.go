package load

import (
	"math"
	"time"

	"google.golang.org/protobuf/encoding/protowire"

	"github.com/kvrelay/kvrelay/proto/kvpb"
)

// The stream's pacing, SMG's (relay-semantics.md §3.9).
const (
	// HeartbeatInterval is the silence after which a load_only batch goes
	// out.
	HeartbeatInterval = time.Second
	// HeartbeatBackoff is the interval once two heartbeats in a row
	// carried an unchanged record.
	HeartbeatBackoff = 5 * time.Second
	// LoadTick is the quiet a stream must have had before a changed record
	// goes out as a load_only batch: SMG's streams check for a change
	// after this long without a batch, so a busy stream's changes ride on
	// its batches instead.
	LoadTick = 100 * time.Millisecond
)

// Source is what a Recorder reads: a Poller, or a test's own.
type Source interface {
	// LatestAt is rank's record if one is fresh at now.
	LatestAt(rank int32, now time.Time) (*Reading, bool)
	Now() time.Time
}

// Field numbers in KvEventBatch and EngineLoad the recorder writes.
const (
	batchSequence = 1
	batchTime     = 2
	batchRank     = 4
	batchLoad     = 8
	loadAge       = 7
	loadSample    = 8
	loadOnly      = 9
)

// Recorder numbers and paces one subscriber stream's load records, as SMG's
// LoadRecorder does: the record of the batch's rank on every batch (the
// telemetry on the stream's first record only), and a load_only batch when
// the record moved or after HeartbeatInterval of silence (HeartbeatBackoff
// once two heartbeats in a row were unchanged), never before the stream's
// first batch. It writes bytes: a stream appends Stamp's field to the
// batch's shared encoding instead of re-marshalling it. One goroutine only.
type Recorder struct {
	src    Source
	sample uint64
	// last is the record last sent, for the change check.
	last       *kvpb.EngineLoad
	lastSentAt time.Time
	// idle counts heartbeats in a row with an unchanged record.
	idle int
	// The rank and sequence of the last batch sent: what a heartbeat names.
	lastRank    int32
	lastHasRank bool
	lastSeq     uint64
	started     bool
	// pending: a changed record waits for LoadTick of quiet.
	pending bool
	// noRecordUntil: Heartbeat found no fresh record; Due is no earlier
	// than this, or a waiting stream would be woken again at once for as
	// long as the source stays down (a busy loop per stream).
	noRecordUntil time.Time
}

// NewRecorder is a recorder over src for one stream.
func NewRecorder(src Source) *Recorder {
	return &Recorder{src: src, lastSentAt: src.Now()}
}

// Stamp appends to dst the KvEventBatch field 8 (the load record) for a
// batch of rank (hasRank false: the batch names none, and rank 0's record
// is used) with sequence seq that is about to go out, and notes it went.
// Without a fresh record it appends nothing: the batch goes without one.
func (r *Recorder) Stamp(dst []byte, rank int32, hasRank bool, seq uint64) []byte {
	r.lastRank, r.lastHasRank, r.lastSeq, r.started = rank, hasRank, seq, true
	now := r.src.Now()
	r.lastSentAt = now
	r.idle = 0
	r.pending = false
	r.noRecordUntil = time.Time{}
	rd, ok := r.src.LatestAt(rank, now)
	if !ok {
		return dst
	}
	r.sample++
	r.last = rd.Load
	body := rd.Core
	if r.sample == 1 {
		body = rd.Full
	}
	return appendRecord(dst, body, ageMS(now, rd.At), r.sample, false)
}

// Due is when Heartbeat should be asked next: when the heartbeat is due if
// nothing changes, or sooner when a changed record waits for LoadTick of
// quiet; the zero time before the stream's first batch (none is due then).
func (r *Recorder) Due() time.Time {
	if !r.started {
		return time.Time{}
	}
	var at time.Time
	switch {
	case r.pending:
		at = r.lastSentAt.Add(LoadTick)
	case r.idle >= 2:
		at = r.lastSentAt.Add(HeartbeatBackoff)
	default:
		at = r.lastSentAt.Add(HeartbeatInterval)
	}
	if r.noRecordUntil.After(at) {
		return r.noRecordUntil
	}
	return at
}

// Heartbeat is an encoded load_only KvEventBatch when one is due (the
// record moved since the last one sent and the stream has been quiet for
// LoadTick, or it has been silent for the heartbeat interval), else nil.
func (r *Recorder) Heartbeat() []byte {
	if !r.started {
		return nil
	}
	now := r.src.Now()
	rd, ok := r.src.LatestAt(r.lastRank, now)
	if !ok {
		// No record, no heartbeat (SMG's rule). Ask again a heartbeat
		// interval on: a record that comes back changed wakes the stream
		// through Updated sooner.
		r.noRecordUntil = now.Add(HeartbeatInterval)
		return nil
	}
	r.noRecordUntil = time.Time{}
	changed := r.last == nil || Changed(r.last, rd.Load)
	if changed && now.Sub(r.lastSentAt) < LoadTick {
		r.pending = true // the stream is not quiet yet: ask again at Due
		return nil
	}
	r.pending = false
	if !changed && now.Before(r.Due()) {
		return nil
	}
	r.sample++
	r.last = rd.Load
	r.lastSentAt = now
	if changed {
		r.idle = 0
	} else {
		r.idle++
	}
	b := make([]byte, 0, 32+len(rd.Full))
	b = protowire.AppendTag(b, batchSequence, protowire.VarintType)
	b = protowire.AppendVarint(b, r.lastSeq)
	b = protowire.AppendTag(b, batchTime, protowire.Fixed64Type)
	b = protowire.AppendFixed64(b, math.Float64bits(float64(now.UnixNano())/1e9)) // the relay's clock, as SMG's
	if r.lastHasRank {
		b = protowire.AppendTag(b, batchRank, protowire.VarintType)
		b = protowire.AppendVarint(b, uint64(int64(r.lastRank)))
	}
	return appendRecord(b, rd.Full, ageMS(now, rd.At), r.sample, true)
}

// Sample is the number of records this stream has sent.
func (r *Recorder) Sample() uint64 { return r.sample }

func ageMS(now, at time.Time) uint64 {
	d := now.Sub(at)
	if d <= 0 {
		return 0
	}
	return min(uint64(d/time.Millisecond), math.MaxUint32)
}

// appendRecord appends KvEventBatch field 8: body (an encoded EngineLoad
// without fields 7-9) followed by age_ms, sample and load_only. Protobuf
// takes fields in any order, so the per-stream ones go last.
func appendRecord(dst, body []byte, age, sample uint64, only bool) []byte {
	n := len(body)
	if age != 0 {
		n += 1 + protowire.SizeVarint(age)
	}
	n += 1 + protowire.SizeVarint(sample)
	if only {
		n += 2
	}
	if dst == nil {
		dst = make([]byte, 0, 1+protowire.SizeVarint(uint64(n))+n)
	}
	dst = protowire.AppendTag(dst, batchLoad, protowire.BytesType)
	dst = protowire.AppendVarint(dst, uint64(n))
	dst = append(dst, body...)
	if age != 0 {
		dst = protowire.AppendTag(dst, loadAge, protowire.VarintType)
		dst = protowire.AppendVarint(dst, age)
	}
	dst = protowire.AppendTag(dst, loadSample, protowire.VarintType)
	dst = protowire.AppendVarint(dst, sample)
	if only {
		dst = protowire.AppendTag(dst, loadOnly, protowire.VarintType)
		dst = protowire.AppendVarint(dst, 1)
	}
	return dst
}

// Changed says whether the record moved enough from last to be worth a
// load_only batch, by SMG's thresholds: any running, waiting, queued-work or
// admission-window change; KV usage (and active usage, falling back to
// usage) by more than half a percent; the generation rate by more than 50
// tok/s or 5 % of the larger value; engine silence crossing a whole second
// (known versus unknown counts); the step-report flag or the pending
// prefill tokens changing.
func Changed(last, cur *kvpb.EngineLoad) bool {
	if last.GetRunningRequests() != cur.GetRunningRequests() ||
		last.GetWaitingRequests() != cur.GetWaitingRequests() ||
		!sameOptional(last.WaitingUncachedTokens, cur.WaitingUncachedTokens) ||
		last.GetMaxRunningRequests() != cur.GetMaxRunningRequests() ||
		math.Abs(last.GetTokenUsage()-cur.GetTokenUsage()) > 0.005 ||
		math.Abs(active(last)-active(cur)) > 0.005 {
		return true
	}
	d := math.Abs(last.GetGenThroughput() - cur.GetGenThroughput())
	if d > 50 || d > 0.05*max(last.GetGenThroughput(), cur.GetGenThroughput()) {
		return true
	}
	if (last.EngineSilenceMs == nil) != (cur.EngineSilenceMs == nil) ||
		last.GetEngineSilenceMs()/1000 != cur.GetEngineSilenceMs()/1000 {
		return true
	}
	return !sameOptional(last.EngineReportsSteps, cur.EngineReportsSteps) ||
		!sameOptional(last.PrefillPendingTokens, cur.PrefillPendingTokens)
}

func sameOptional[T comparable](a, b *T) bool {
	if a == nil || b == nil {
		return a == nil && b == nil
	}
	return *a == *b
}

func active(l *kvpb.EngineLoad) float64 {
	if l.ActiveTokenUsage != nil {
		return *l.ActiveTokenUsage
	}
	return l.GetTokenUsage()
}
