package natsevents

import (
	"errors"
	"fmt"
	"strconv"
	"strings"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrelay/kvrelay/proto/kvpb"
)

// Defence in depth (issue 29). NATS's permissions (deploy/nats/kvrelay.conf)
// keep anyone but a worker's relay off its subjects; whatever they let
// through, a Source accepts a snapshot or a batch for a worker only when it
// is consistent with itself and with the worker's stream, and checks a
// whole snapshot BEFORE its chunk 0 reaches the monitor, which clears the
// worker's blocks on it. A forged chunk claiming 10 M blocks and 2³²−1
// chunks, or a cursor far ahead, is refused without clearing anything.
//
// The checks of a snapshot (object or stream) are:
//
//   - chunk indices 0, 1, … in order with no gap, every chunk declaring
//     the same count and the same block total as chunk 0;
//   - 1 to maxSnapshotChunks (65,536) chunks, at most maxSnapshotBlocks
//     (8 Mi) blocks declared, and exactly the declared blocks stored by
//     the chunks' events;
//   - ranks ascending, a rank's chunks stamped with consecutive sequences
//     (the relay stamps the first ones 0 when a rank has more chunks than
//     sequences: 0, 0, 1, 2 is consecutive);
//   - at most maxSnapshotRanks ranks, and the encoded chunks at most
//     SourceOptions.MaxSnapshotBytes (2 GiB) in all;
//   - no chunk's sequence above what the stream allows its rank: for an
//     object, the engine sequence of the stream's newest message of that
//     rank (every batch a cut covers was published before it); on the
//     stream, at most maxSequenceJump (2^20) above the last sequence this
//     subscription delivered for the rank.
//
// An object must also declare a stream sequence the stream has reached.
// A batch on the stream must carry the rank its subject names, and move
// its rank's sequence by at most maxSequenceJump.
//
// A refusal is counted in kvrelay_gateway_events_rejected_total{worker,
// reason} and logged at a limited rate; the worker keeps its blocks and
// cursors, its JetStream subscription ends, the snapshot object it was
// served from is not served again, a new one is asked of the sink, and
// the worker follows its gRPC stream meanwhile (as after a divergence,
// repair.go).

// Bounds of a snapshot, whoever publishes it.
const (
	// maxSnapshotBlocks bounds the blocks a snapshot may declare: 4 times
	// the relay record's default cap (2 Mi entries), copies counted.
	maxSnapshotBlocks = 8 << 20
	// maxSnapshotRanks bounds the distinct ranks one snapshot may hold
	// (each costs the source a look-up of the stream's newest message of
	// the rank, for an object).
	maxSnapshotRanks = 1024
	// maxSequenceJump bounds how far ahead of the last sequence of its
	// rank a batch or chunk on the stream may be: a relay stamps the
	// engine's own sequences, which move by one per batch, and a relay
	// cannot lose a million batches and still publish without a snapshot
	// object to restart from.
	maxSequenceJump = 1 << 20
	// maxTrackedRanks bounds the ranks a subscription remembers the last
	// sequence of; a batch of one more rank is refused.
	maxTrackedRanks = 4096
	// DefaultMaxSnapshotBytes bounds a snapshot's encoded size (the
	// object, or a snapshot's chunks on the stream together).
	DefaultMaxSnapshotBytes = 2 << 30
)

// Reasons of a refusal, the reason label of
// kvrelay_gateway_events_rejected_total.
const (
	reasonChunkCount      = "chunk_count"      // count 0, above the cap, or not chunk 0's
	reasonChunkOrder      = "chunk_order"      // an index out of order, a gap, a batch inside a snapshot
	reasonChunkIncomplete = "chunk_incomplete" // the stream stopped before the last chunk
	reasonBlocks          = "blocks"           // declared blocks above the cap, or not chunk 0's
	reasonBlocksStored    = "blocks_stored"    // stored blocks not the declared count
	reasonRanks           = "ranks"            // ranks descending, or too many
	reasonSequence        = "sequence"         // a rank's chunk sequences not consecutive
	reasonSequenceAhead   = "sequence_ahead"   // a sequence beyond what the stream allows
	reasonSize            = "size"             // a snapshot above MaxSnapshotBytes
	reasonObjectSequence  = "object_sequence"  // an object's stream sequence beyond the stream's last
	reasonRankSubject     = "rank_subject"     // a batch's rank not its subject's
	reasonMalformed       = "malformed"        // an object that does not decode
)

var rejectReasons = []string{reasonChunkCount, reasonChunkOrder, reasonChunkIncomplete, reasonBlocks, reasonBlocksStored,
	reasonRanks, reasonSequence, reasonSequenceAhead, reasonSize, reasonObjectSequence, reasonRankSubject, reasonMalformed}

func newRejectCounter() *prometheus.CounterVec {
	return prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvrelay_gateway_events_rejected_total",
		Help: "Snapshots and batches read from JetStream that were refused as inconsistent with themselves or the worker's stream (a forged or corrupt message), by reason; the worker keeps its blocks and follows its gRPC stream until another snapshot object is written."},
		[]string{"worker", "reason"})
}

// refusal is a snapshot or batch refused, with the reason label.
type refusal struct {
	reason string
	err    error
}

func (r *refusal) Error() string { return r.reason + ": " + r.err.Error() }
func (r *refusal) Unwrap() error { return r.err }

func refuse(reason, format string, args ...any) error {
	return &refusal{reason: reason, err: fmt.Errorf(format, args...)}
}

// refusalReason is err's reason label, or "" if err is not a refusal.
func refusalReason(err error) string {
	var r *refusal
	if errors.As(err, &r) {
		return r.reason
	}
	return ""
}

// snapshotCheck follows one snapshot's chunks, in the order they are
// applied; add refuses the first one that breaks a bound, finish a
// snapshot that ends short or stores other than its declared blocks. It
// allocates nothing per chunk but the ranks it has seen.
type snapshotCheck struct {
	// maxBytes bounds the chunks' encoded sizes together.
	maxBytes uint64
	// ceiling, if set, is the highest sequence a chunk of rank may carry
	// (false: no bound is known for the rank).
	ceiling func(rank int32) (uint64, bool, error)

	started        bool
	count, next    uint32
	blocks, stored uint64
	bytes          uint64
	rank           int32
	seq            uint64
	ranks          int
}

// add checks the next chunk, b, whose encoding took size bytes.
func (c *snapshotCheck) add(b *kvpb.KvEventBatch, size int) error {
	snap := b.GetSnapshot()
	if snap == nil {
		return refuse(reasonChunkOrder, "a batch (rank %d, sequence %d) where chunk %d of %d was due", b.GetDpRank(), b.GetSequenceNumber(), c.next, c.count)
	}
	rank, seq := b.GetDpRank(), b.GetSequenceNumber()
	if !c.started {
		if snap.GetIndex() != 0 {
			return refuse(reasonChunkOrder, "the snapshot starts at chunk %d, not 0", snap.GetIndex())
		}
		if n := snap.GetCount(); n == 0 || n > maxSnapshotChunks {
			return refuse(reasonChunkCount, "%d chunks declared, want 1 to %d", n, maxSnapshotChunks)
		}
		if n := snap.GetBlocks(); n > maxSnapshotBlocks {
			return refuse(reasonBlocks, "%d blocks declared, at most %d taken", n, maxSnapshotBlocks)
		}
		c.count, c.blocks = snap.GetCount(), snap.GetBlocks()
	} else {
		if c.next >= c.count {
			return refuse(reasonChunkCount, "a chunk after the %d declared", c.count)
		}
		if snap.GetIndex() != c.next {
			return refuse(reasonChunkOrder, "chunk %d where chunk %d was due", snap.GetIndex(), c.next)
		}
		if snap.GetCount() != c.count {
			return refuse(reasonChunkCount, "chunk %d declares %d chunks, chunk 0 %d", c.next, snap.GetCount(), c.count)
		}
		if snap.GetBlocks() != c.blocks {
			return refuse(reasonBlocks, "chunk %d declares %d blocks, chunk 0 %d", c.next, snap.GetBlocks(), c.blocks)
		}
	}
	newRank := !c.started || rank != c.rank
	switch {
	case c.started && rank < c.rank:
		return refuse(reasonRanks, "chunk %d is of rank %d, after rank %d", c.next, rank, c.rank)
	case !newRank && seq != c.seq+1 && (seq != 0 || c.seq != 0):
		return refuse(reasonSequence, "chunk %d of rank %d carries sequence %d after %d", c.next, rank, seq, c.seq)
	}
	if newRank {
		if c.ranks++; c.ranks > maxSnapshotRanks {
			return refuse(reasonRanks, "more than %d ranks in one snapshot", maxSnapshotRanks)
		}
	}
	if c.ceiling != nil {
		top, ok, err := c.ceiling(rank)
		if err != nil {
			return err
		}
		if ok && seq > top {
			return refuse(reasonSequenceAhead, "chunk %d of rank %d carries sequence %d, beyond %d, the most the worker's stream allows", c.next, rank, seq, top)
		}
	}
	c.bytes += uint64(size)
	if c.bytes > c.maxBytes {
		return refuse(reasonSize, "the snapshot's chunks take more than %d bytes", c.maxBytes)
	}
	c.stored += storedBlocks(b)
	if c.stored > c.blocks {
		return refuse(reasonBlocksStored, "the chunks up to %d store %d blocks, %d declared", c.next, c.stored, c.blocks)
	}
	c.started, c.rank, c.seq = true, rank, seq
	c.next++
	return nil
}

// complete says whether every declared chunk was added.
func (c *snapshotCheck) complete() bool { return c.started && c.next == c.count }

// finish checks the snapshot once no chunk is left to add.
func (c *snapshotCheck) finish() error {
	if !c.complete() {
		return refuse(reasonChunkIncomplete, "%d of %d chunks", c.next, c.count)
	}
	if c.stored != c.blocks {
		return refuse(reasonBlocksStored, "the chunks store %d blocks, %d declared", c.stored, c.blocks)
	}
	return nil
}

// storedBlocks counts the blocks b's events store (a relay's snapshot
// chunk writes each physical copy as a block of its own).
func storedBlocks(b *kvpb.KvEventBatch) uint64 {
	var n uint64
	for _, ev := range b.GetEvents() {
		n += uint64(len(ev.GetStored().GetBlocks()))
	}
	return n
}

// subjectRank is the rank a message's subject (<prefix>.<token>.<rank>)
// names.
func subjectRank(subject string) (int32, error) {
	tail := subject[strings.LastIndexByte(subject, '.')+1:]
	r, err := strconv.ParseInt(tail, 10, 32)
	if err != nil {
		return 0, fmt.Errorf("subject %q names no rank", subject)
	}
	return int32(r), nil
}

// checkSubject refuses a batch whose rank is not its subject's.
func checkSubject(subject string, b *kvpb.KvEventBatch) error {
	r, err := subjectRank(subject)
	if err != nil {
		return &refusal{reason: reasonRankSubject, err: err}
	}
	if r != b.GetDpRank() {
		return refuse(reasonRankSubject, "rank %d on subject %s", b.GetDpRank(), subject)
	}
	return nil
}

// rankCursors is the last sequence a subscription delivered per rank, for
// the jump bound.
type rankCursors map[int32]uint64

// ceiling is the highest sequence rank may carry next: maxSequenceJump
// past its last one; false when the rank has none yet.
func (rc rankCursors) ceiling(rank int32) (uint64, bool, error) {
	last, ok := rc[rank]
	if !ok {
		if len(rc) >= maxTrackedRanks {
			return 0, false, refuse(reasonRanks, "rank %d is one more than the %d a subscription tracks", rank, maxTrackedRanks)
		}
		return 0, false, nil
	}
	return last + maxSequenceJump, true, nil
}

// checkBatch refuses a batch on the stream whose rank's sequence jumps
// beyond the bound.
func (rc rankCursors) checkBatch(b *kvpb.KvEventBatch) error {
	top, ok, err := rc.ceiling(b.GetDpRank())
	if err != nil {
		return err
	}
	if ok && b.GetSequenceNumber() > top {
		return refuse(reasonSequenceAhead, "rank %d jumps from sequence %d to %d, more than %d ahead", b.GetDpRank(), rc[b.GetDpRank()], b.GetSequenceNumber(), maxSequenceJump)
	}
	return nil
}
