package server

import (
	"context"
	"errors"
	"time"

	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	"github.com/kvrelay/kvrelay/internal/latencyprobe"
	"github.com/kvrelay/kvrelay/proto/kvpb"
	"github.com/kvrelay/kvrelay/relay/load"
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
	for {
		var (
			payload []byte
			err     error
		)
		switch {
		case canWait:
			var due <-chan time.Time
			if at := rec.Due(); !at.IsZero() {
				timer.Reset(max(at.Sub(src.Now()), 0))
				due = timer.C
			}
			payload, err = until.NextEncodedUntil(ctx, src.Updated(), due)
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
			if hb := rec.Heartbeat(); hb != nil {
				if err := p.send(nil, hb, nil); err != nil {
					return err
				}
			}
			continue
		}
		seq, rank, hasRank, err := batchKey(payload)
		if err != nil {
			return err
		}
		suffix := rec.Stamp(nil, rank, hasRank, seq)
		lrank, lseq, live := liveKey(nil, keyed)
		if live {
			latencyprobe.Mark(latencyprobe.Dequeued, lrank, lseq)
		}
		if err := p.send(nil, payload, suffix); err != nil {
			return err
		}
		if live {
			latencyprobe.Mark(latencyprobe.Written, lrank, lseq)
		}
	}
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
