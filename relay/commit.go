package relay

import (
	"bytes"
	"errors"
	"fmt"
	"time"

	"github.com/zeebo/xxh3"
	"google.golang.org/protobuf/proto"

	"github.com/kvrelay/kvrelay/proto/kvenc"
	"github.com/kvrelay/kvrelay/proto/kvpb"
)

// Committing an admitted batch: normalized once into its protobuf bytes,
// appended to the one history and applied to the record under the relay's
// lock, then fanned out to the subscribers (subscribe.go's fanOut).

// relay normalizes one batch and admits it: history, record, cursor, then
// every subscriber's queue. Admission never waits for a subscriber.
//
// The batch is written once, straight from the decoder into its protobuf
// wire form (no message is built), into the rank's reused buffer and then
// copied out at its exact size: the history keeps these bytes for a long
// time, every subscriber is sent them, and the record applies them.
func (r *Relay) relay(rk *rankState, seq uint64, payload []byte) {
	enc, drops, err := rk.norm.appendNormalized(rk.encBuf[:0], payload, seq, rk.rank)
	if err != nil {
		// Relay an empty batch under the sequence so that nobody sees a
		// gap for it: the payload does not decode, or (logged as an
		// error) holds a string proto3 cannot carry.
		enc = r.emptyBatch(rk, seq, err)
	}
	rk.encBuf = enc
	enc = bytes.Clone(enc)
	if cap(rk.encBuf) > maxKeptEncBuf {
		rk.encBuf = nil // one huge batch should not pin its buffer for ever
	}

	r.mu.Lock()
	got, err := r.rec.applyEncoded(enc)
	if err != nil {
		// The relay's own encoding did not decode: a defect, not an
		// engine's fault. The record is unchanged; relay the batch
		// empty, as an undecodable one, rather than send bytes the
		// record could not read.
		r.log.Error("the record could not apply a relayed batch; relaying it empty", "rank", rk.rank, "seq", seq, "err", err)
		// Cloned: emptyBatch writes in the rank's buffer, which the next
		// batch reuses, and these bytes go to the history.
		enc = bytes.Clone(r.emptyBatch(rk, seq, nil))
		got = applied{}
	}
	if len(got.reannounced) > 0 && r.cfg.SuppressReannounced {
		enc = withoutEvents(enc, got.reannounced)
		got.events -= len(got.reannounced) // they are not relayed
	}
	sum, n := r.rec.LiveDigest(rk.rank)
	digest := liveDigest{sum: sum, blocks: n, set: true}
	pos := r.hist.pushBatch(rk.rank, seq, enc, int64(len(enc)), digest)
	r.noteEvictions(rk, seq)
	rk.cursor, rk.hasCursor = seq, true
	startFixed := false
	if !rk.hasStart {
		rk.startedAt, rk.hasStart = seq, true
		if rk.recoveringStart {
			rk.unknownBefore, startFixed = seq-rk.startOrigin, true
		}
	}
	r.relayed++
	relayed := r.relayed
	r.fanOut(posBatch{pos: pos, enc: enc, digest: digest, live: true, rank: rk.rank, seq: seq})
	r.mu.Unlock()

	if startFixed {
		r.countUnknownBefore(rk, rk.unknownBefore)
	}

	rk.lastSeq, rk.lastHash, rk.hasLast = seq, xxh3.Hash(payload), true
	if len(got.reannounced) > 0 {
		r.metrics.reannounced.WithLabelValues(rk.label, fmt.Sprint(r.cfg.SuppressReannounced)).Add(float64(len(got.reannounced)))
	}
	r.metrics.batches.WithLabelValues(rk.label).Inc()
	r.metrics.events.WithLabelValues(rk.label).Add(float64(got.events))
	r.metrics.blocks.WithLabelValues(rk.label).Add(float64(got.storedBlocks))
	for _, d := range drops {
		r.metrics.drops.WithLabelValues(d.reason).Add(float64(d.n))
	}
	if relayed%summaryEvery == 0 {
		r.logSummary("relay summary")
	}
}

// emptyBatch is the wire form of an empty batch at rank's seq, what the
// relay sends in place of a batch it cannot relay, so that the sequence has
// no gap. cause is the normalizer's error (nil when the caller logged its
// own): an undecodable payload is counted and its warning throttled; a batch
// that decoded but cannot be encoded is a different fault and logged as an
// error.
func (r *Relay) emptyBatch(rk *rankState, seq uint64, cause error) []byte {
	switch {
	case cause == nil:
	case errors.Is(cause, kvenc.ErrInvalidUTF8):
		r.log.Error("encoding a relayed batch failed; relaying it empty", "rank", rk.rank, "seq", seq, "err", cause)
	default:
		r.metrics.undecodable.WithLabelValues(rk.label).Inc()
		if now := time.Now(); now.Sub(rk.undecodableLoggedAt) >= undecodableLogEvery {
			r.log.Warn("undecodable batch; relaying it empty", "rank", rk.rank, "seq", seq, "err", cause,
				"not_logged_since_last", rk.undecodableSuppressed)
			rk.undecodableLoggedAt, rk.undecodableSuppressed = now, 0
		} else {
			rk.undecodableSuppressed++
		}
	}
	// Cannot fail: an empty batch has no string to be invalid.
	enc, _ := kvenc.AppendBatch(rk.encBuf[:0], &kvpb.KvEventBatch{SequenceNumber: seq, DpRank: proto.Int32(rk.rank)})
	return enc
}

// maxKeptEncBuf is the largest encoding buffer a rank keeps between batches.
const maxKeptEncBuf = 4 << 20

// withoutEvents is the batch enc without the events at the indexes drop
// (ascending), re-encoded: the stage that keeps report-mode
// re-announcements out of the stream (Config.SuppressReannounced). The
// batch keeps its sequence, so a batch left empty still closes its place in
// the rank's sequence. It is rare (a request asked for report mode "full"
// and the relay was told to suppress it), so it decodes the batch.
func withoutEvents(enc []byte, drop []int) []byte {
	b := &kvpb.KvEventBatch{}
	if err := proto.Unmarshal(enc, b); err != nil {
		// Cannot happen for bytes the record just applied; keep the
		// engine's batch rather than lose its sequence.
		return enc
	}
	kept := b.Events[:0]
	for i, ev := range b.Events {
		if len(drop) > 0 && drop[0] == i {
			drop = drop[1:]
			continue
		}
		kept = append(kept, ev)
	}
	clear(b.Events[len(kept):])
	b.Events = kept
	out, err := kvenc.AppendBatch(nil, b)
	if err != nil {
		return enc // as above: these strings encoded a moment ago
	}
	return out
}

// noteEvictions marks the rank's snapshots incomplete once its record hit
// the cap: entries stored before seq may be missing, as after a late join.
// Called with r.mu held.
func (r *Relay) noteEvictions(rk *rankState, seq uint64) {
	n := r.rec.evictedFrom(rk.rank)
	if n == rk.recordEvicted {
		return
	}
	if n > rk.recordEvicted {
		r.metrics.recordEvicted.WithLabelValues(rk.label).Add(float64(n - rk.recordEvicted))
		if !rk.warnedEviction || time.Since(rk.lastEvictionWarn) > time.Minute {
			r.log.Warn("live-block record at its cap: evicted the oldest-stored blocks; snapshots of this rank are marked incomplete",
				"rank", rk.rank, "evicted_total", n, "cap_entries", r.cfg.RecordMaxEntries)
			rk.warnedEviction, rk.lastEvictionWarn = true, time.Now()
		}
		if seq > rk.unknownBefore {
			rk.unknownBefore = seq
			r.metrics.unknownBefore.WithLabelValues(rk.label).Set(float64(seq))
		}
	}
	rk.recordEvicted = n
}
