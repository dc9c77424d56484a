package server

import (
	"context"
	"errors"
	"time"

	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	"github.com/kvrelay/kvrelay/engines/load"
	"github.com/kvrelay/kvrelay/proto/kvpb"
)

// untilStream is a Stream that can wait for its next batch and for the
// load's own events at once (relay.Subscription.NextEncodedUntil).
type untilStream interface {
	NextEncodedUntil(ctx context.Context, wake <-chan struct{}, due <-chan time.Time) ([]byte, error)
}

// runStamped is run for a service with a load source: every batch goes out
// with its rank's record appended (the shared encoding is not copied; the
// record rides as a second buffer of the same message), and while the
// stream is quiet a load_only batch goes out when the record changes or
// the heartbeat is due (load.Recorder has SMG's rules). The event path
// costs one scan of the batch's top-level fields and the record's bytes;
// the waits happen only when no batch is queued.
func (p *pump) runStamped(ctx context.Context, sub Stream, src LoadSource) error {
	rec := load.NewRecorder(src)
	until, canWait := sub.(untilStream)
	enc, encoded := sub.(encodedStream)
	keyed, _ := sub.(liveKeyed)
	timer := time.NewTimer(time.Hour)
	timer.Stop()
	defer timer.Stop()
	// armed is when the timer is set to fire (zero: not set). Every batch
	// moves the heartbeat's due time later; resetting the timer for each
	// would cost the event path a timer operation per batch, so it is only
	// re-armed when the due time moved earlier (the backoff ended) or after
	// it fired, which costs at most one early wake per heartbeat.
	var armed time.Time
	var slab suffixSlab
	// wake is taken before each read of the record (Stamp, Heartbeat), as
	// Updated asks: a change published after the read closes it, so the
	// wait below cannot miss it.
	wake := src.Updated()
	for {
		var (
			payload []byte
			err     error
		)
		switch {
		case canWait:
			if at := rec.Due(); !at.IsZero() && (armed.IsZero() || at.Before(armed)) {
				timer.Reset(max(at.Sub(src.Now()), 0))
				armed = at
			}
			var due <-chan time.Time
			if !armed.IsZero() {
				due = timer.C
			}
			payload, err = until.NextEncodedUntil(ctx, wake, due)
			if payload == nil && err == nil && !src.Now().Before(armed) {
				armed = time.Time{} // it fired (or is about to): re-arm from Due
			}
		case encoded:
			payload, err = enc.NextEncoded(ctx)
		default:
			var b *kvpb.KvEventBatch
			if b, err = sub.Next(ctx); err == nil {
				payload, err = proto.Marshal(b)
			}
		}
		if err != nil {
			return err
		}
		if payload == nil {
			// Woken with nothing queued: the record changed, or the
			// heartbeat is due.
			wake = src.Updated()
			if hb := rec.Heartbeat(); hb != nil {
				if err := p.send(nil, hb, nil); err != nil {
					return err
				}
			}
			continue
		}
		lrank, lseq, live := liveKey(nil, keyed)
		rank, seq, hasRank := lrank, lseq, live
		if !live {
			// History and snapshot chunks: read the key off the bytes.
			if seq, rank, hasRank, err = batchKey(payload); err != nil {
				return err
			}
		}
		wake = src.Updated()
		suffix := slab.stamp(rec, rank, hasRank, seq)
		if err := p.sendMarked(nil, payload, suffix, lrank, lseq, live); err != nil {
			return err
		}
	}
}

// suffixSlab carves the records' bytes out of larger blocks: the transport
// keeps each record until its message is written, so none can be reused,
// but one allocation serves many batches.
type suffixSlab struct{ buf []byte }

// slabSize holds some tens of records; a record with telemetry is at most
// a few hundred bytes.
const slabSize = 8 << 10

func (s *suffixSlab) stamp(rec *load.Recorder, rank int32, hasRank bool, seq uint64) []byte {
	if cap(s.buf)-len(s.buf) < 512 {
		s.buf = make([]byte, 0, slabSize)
	}
	start := len(s.buf)
	out := rec.Stamp(s.buf[start:start:cap(s.buf)], rank, hasRank, seq)
	if len(out) > 0 && cap(out) == cap(s.buf)-start {
		// Written in place: the slab's bytes up to here are handed out.
		s.buf = s.buf[:start+len(out)]
		return out[:len(out):len(out)]
	}
	return out
}

var errBadBatch = errors.New("server: a relayed batch does not parse")

// batchKey reads a batch encoding's sequence number (field 1) and DP rank
// (field 4) without decoding its events: a scan of the top-level fields.
func batchKey(b []byte) (seq uint64, rank int32, hasRank bool, err error) {
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			return 0, 0, false, errBadBatch
		}
		b = b[n:]
		if typ == protowire.VarintType && (num == 1 || num == 4) {
			v, m := protowire.ConsumeVarint(b)
			if m < 0 {
				return 0, 0, false, errBadBatch
			}
			if num == 1 {
				seq = v
			} else {
				rank, hasRank = int32(v), true
			}
			b = b[m:]
			continue
		}
		m := protowire.ConsumeFieldValue(num, typ, b)
		if m < 0 {
			return 0, 0, false, errBadBatch
		}
		b = b[m:]
	}
	return seq, rank, hasRank, nil
}
