package relay

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	"github.com/kvrelay/kvrelay/internal/latencyprobe"
	"github.com/kvrelay/kvrelay/proto/kvpb"
	"github.com/kvrelay/kvrelay/relay/record"
)

// The errors Subscribe and Next end with. Each is wrapped in an error whose
// message says why, in words a gateway operator can act on; test for them
// with errors.Is.
var (
	// ErrOutOfRange: the cursor cannot be resumed from the history. The
	// client should resubscribe from zero (and then gets a snapshot). A
	// stale cursor is never answered with a snapshot.
	ErrOutOfRange = errors.New("out of range")
	// ErrDataLoss: a publisher restarted, or a subscriber fell behind
	// further than the history reaches back. Resubscribe from zero.
	ErrDataLoss = errors.New("data loss")
	// ErrDisabled: the engine does not publish KV events.
	ErrDisabled = errors.New("kv events disabled")
	// ErrClosed: Next on a closed Subscription.
	ErrClosed = errors.New("subscription closed")
)

// relayError carries a sentinel for errors.Is and a complete message, so
// that the message a gateway sees is the explanation alone.
type relayError struct {
	kind error
	msg  string
}

func (e *relayError) Error() string { return e.msg }
func (e *relayError) Unwrap() error { return e.kind }

func newError(kind error, format string, args ...any) error {
	return &relayError{kind: kind, msg: fmt.Sprintf(format, args...)}
}

// Subscription is one subscriber's stream: first a snapshot or history
// batches, then live batches, in the relay's log order, with no gap and no
// duplicate. The batches are shared with other subscribers and the history:
// treat them as read-only (clone before changing one).
type Subscription struct {
	r       *Relay
	snap    atomic.Pointer[pendingSnapshot] // a cut whose chunks are sent first, one at a time
	pending []posBatch                      // history: sent after the snapshot
	// digests: the subscriber asked for every relayed batch's live digest
	// (SubscribeKvEventsRequest.live_digests).
	digests bool

	mu      sync.Mutex
	queue   []posBatch
	qhead   int
	qbytes  int // encoded bytes from qhead on
	lagged  bool
	err     error
	closed  bool
	lastPos uint64 // the newest log position delivered or already pending
	notify  chan struct{}

	// cutPos is the log position a snapshot was cut at (the tip when
	// Subscribe returned); delivered is the position of the batch Next
	// returned last. Both are read and written by the goroutine calling
	// Next only.
	cutPos, delivered uint64
	// deliveredLive is the batch NextEncoded returned last when it was a
	// live one (LiveKey), under the same rule.
	deliveredLive posBatch
}

// Subscribe opens a stream for req (relay-semantics §3.7 and issue #4):
//
//   - start_sequence_number is rank 0's last applied batch. 0 gets the whole
//     history when it holds every rank's batches from sequence 0, else a
//     snapshot of the live-block record cut at every rank's cursor, else
//     (nothing relayed yet) live batches only. Non-zero gets the batches after
//     that batch's position in the interleaved log where that is provably
//     exact for every other rank (at worst another rank repeats the batch at
//     its own cursor), else ErrOutOfRange (see provenAfterRank0).
//   - rank_cursors, when set, resumes every rank exactly after its own
//     cursor; an unlisted rank counts as cursor 0, which can be served only if
//     the history holds that rank from its first batch (or the rank has
//     relayed nothing yet). A snapshot would reset every rank at the client,
//     so anything else is ErrOutOfRange, and the client comes back from zero.
//
// Then live batches follow.
func (r *Relay) Subscribe(ctx context.Context, req *kvpb.SubscribeKvEventsRequest) (*Subscription, error) {
	if !r.cfg.KV.Enabled {
		return nil, newError(ErrDisabled, "%s", r.cfg.Engine.DisabledMessage)
	}
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	s := &Subscription{r: r, notify: make(chan struct{}, 1), digests: req.GetLiveDigests()}
	begin := time.Now()

	r.mu.Lock()
	var (
		cut     recordCut
		cursors map[int32]uint64
		unknown map[int32]uint64
		reprime bool
		err     error
		served  string
	)
	switch {
	case len(req.GetRankCursors()) > 0:
		s.pending, err = r.resumeRanks(req.GetRankCursors())
		served = "history"
	case req.GetStartSequenceNumber() != 0:
		s.pending, err = r.resumeRank0(req.GetStartSequenceNumber())
		served = "history"
	default:
		var ranks []int32
		complete := true
		for _, rk := range r.ranks {
			if !rk.hasCursor {
				reprime = reprime || rk.replayEndpoint != ""
				continue
			}
			ranks = append(ranks, rk.rank)
			complete = complete && r.hist.completeFrom0(rk.rank)
		}
		switch {
		case len(ranks) == 0:
			served = "live"
		case complete:
			s.pending, _ = r.hist.batchesAfter(nil, 0, 0, nil)
			served = "history"
		default:
			cut, cursors, unknown = r.cutLocked(ranks)
			served = "snapshot"
		}
	}
	if err != nil {
		r.mu.Unlock()
		r.metrics.served.WithLabelValues("out_of_range").Inc()
		r.log.Info("subscriber refused", "err", err)
		return nil, err
	}
	s.lastPos = r.hist.tip()
	s.cutPos = s.lastPos
	r.subs[s] = struct{}{}
	locked := time.Since(begin)
	r.mu.Unlock()

	r.metrics.served.WithLabelValues(served).Inc()
	r.metrics.subscribers.Inc()
	if reprime {
		r.triggerReprime()
	}
	if cut != nil {
		// The chunks are ordered on the first Next, not here: the server
		// sends the response headers once Subscribe returns, and a gateway
		// gives the headers only a short deadline (SMG: 2 s), while
		// ordering a million-block state takes a few hundred ms. Each chunk
		// is encoded only when the subscriber is ready for it, so one that
		// never reads holds one chunk, not the whole snapshot (a
		// million-block snapshot is hundreds of MB encoded).
		r.metrics.snapshotLock.Observe(locked.Seconds())
		s.snap.Store(&pendingSnapshot{cut: cut, cursors: cursors, unknown: unknown, begin: begin, locked: locked})
	}
	return s, nil
}

// pendingSnapshot is a cut taken under the admission lock, and the stream
// of its chunks once the first Next planned it.
type pendingSnapshot struct {
	cut     recordCut
	cursors map[int32]uint64
	unknown map[int32]uint64
	begin   time.Time
	locked  time.Duration
	stream  *record.ChunkStream
}

// nextSnapshotChunk is the next chunk of the pending snapshot, encoded now
// (record.ChunkStream.NextEncoded: straight to the wire form, no message);
// nil when there is none (left). Only Next calls it; whoever swaps the
// snapshot out (this at its end, or Close) releases the cut, exactly once.
func (s *Subscription) nextSnapshotChunk() []byte {
	p := s.snap.Load()
	if p == nil {
		return nil
	}
	if p.stream == nil {
		p.stream = p.cut.Stream(p.cursors, p.unknown, unixSeconds(time.Now()))
		if p.stream != nil {
			s.r.log.Info("serving a snapshot", "chunks", p.stream.Count(), "ranks", len(p.cursors),
				"lock", p.locked, "planned", time.Since(p.begin))
		}
	}
	var b []byte
	if p.stream != nil {
		b = p.stream.NextEncoded()
	}
	if (b == nil || p.stream.Left() == 0) && s.snap.CompareAndSwap(p, nil) {
		// The last chunk is out (or Close released the cut under us, and
		// Next then sees closed): let the record write in place again.
		p.cut.Release()
		s.r.metrics.snapshotTotal.Observe(time.Since(p.begin).Seconds())
	}
	return b
}

// cutLocked captures the record of ranks at their cursors. Called with r.mu
// held, which makes the cut exact: nothing is admitted between it and the
// subscriber's log position.
func (r *Relay) cutLocked(ranks []int32) (recordCut, map[int32]uint64, map[int32]uint64) {
	cursors := make(map[int32]uint64, len(ranks))
	unknown := make(map[int32]uint64, len(ranks))
	for _, rank := range ranks {
		rk := r.ranks[rank]
		cursors[rank] = rk.cursor
		unknown[rank] = rk.unknownBefore
	}
	return r.rec.cut(ranks), cursors, unknown
}

// LiveKey is the rank and sequence of the batch NextEncoded returned last
// when that was a live batch, queued as it was relayed; ok is false after a
// snapshot chunk or a batch from the history. The server marks the latency
// probe's last stages with it. Call it from the goroutine that calls Next.
func (s *Subscription) LiveKey() (rank int32, seq uint64, ok bool) {
	l := s.deliveredLive
	return l.rank, l.seq, l.live
}

// LogPosition is the relay log position of the batch Next or NextEncoded
// returned last (a snapshot chunk's is the position its cut was taken at),
// 0 before the first. Positions grow within one relay process; compare
// them with SnapshotAt's. Call it from the goroutine that calls Next.
func (s *Subscription) LogPosition() uint64 { return s.delivered }

// SnapshotAt is Snapshot and the log position it was cut at: the cut holds
// every batch at or below that position and none above it, so a subscriber
// that forwards its batches elsewhere (the JetStream sink) knows which of
// them the snapshot already covers.
func (r *Relay) SnapshotAt() ([]*kvpb.KvEventBatch, uint64) {
	r.mu.Lock()
	var ranks []int32
	for _, rk := range r.ranks {
		if rk.hasCursor {
			ranks = append(ranks, rk.rank)
		}
	}
	pos := r.hist.tip()
	if len(ranks) == 0 {
		r.mu.Unlock()
		return nil, pos
	}
	cut, cursors, unknown := r.cutLocked(ranks)
	r.mu.Unlock()
	defer cut.Release()
	return cut.Chunks(cursors, unknown, unixSeconds(time.Now())), pos
}

// Ranks lists the relay's configured DP ranks (none with KV events off),
// whether or not they have relayed anything yet: what a snapshot must
// account for to be of the whole relay.
func (r *Relay) Ranks() []int32 {
	out := make([]int32, len(r.ranks))
	for i, rk := range r.ranks {
		out[i] = rk.rank
	}
	return out
}

// Snapshot is the live-block record of every rank that relayed anything,
// cut at the ranks' cursors and encoded as snapshot chunks (nil before
// anything was relayed). It is what a cursor-0 subscriber gets when the
// history is not complete; tests compare it with an engine's true live set.
func (r *Relay) Snapshot() []*kvpb.KvEventBatch {
	r.mu.Lock()
	var ranks []int32
	for _, rk := range r.ranks {
		if rk.hasCursor {
			ranks = append(ranks, rk.rank)
		}
	}
	if len(ranks) == 0 {
		r.mu.Unlock()
		return nil
	}
	cut, cursors, unknown := r.cutLocked(ranks)
	r.mu.Unlock()
	defer cut.Release()
	return cut.Chunks(cursors, unknown, unixSeconds(time.Now()))
}

func unixSeconds(t time.Time) float64 { return float64(t.UnixNano()) / 1e9 }

// rankWindowCheck resolves cursor c (non-zero) of rank against the window:
// the log position after which the rank's batches follow, or why not. A
// rank with a cursor but nothing left in the window sits just past its
// cursor.
func (r *Relay) rankWindowCheck(rank int32, c uint64) (pos uint64, err error) {
	rk := r.ranks[rank]
	ep := rk.endpoint
	first, last, ok := r.hist.rankBounds(rank)
	if !ok {
		if !rk.hasCursor {
			if r.hist.len() == 0 {
				return 0, newError(ErrOutOfRange, "the relay for %s holds no history yet (it started after the publisher); resubscribe from zero", ep)
			}
			return 0, newError(ErrOutOfRange, "the relay for %s holds no history of rank %d yet; resubscribe from zero", ep, rank)
		}
		first, last = rk.cursor+1, rk.cursor
	}
	switch {
	case c > last:
		// Same code as SMG's relay (the gateway resets on OUT_OF_RANGE);
		// the message says what is known instead of guessing a restart.
		return 0, newError(ErrOutOfRange, "cursor %d of rank %d is ahead of anything relayed from %s (last sequence %d): it was not issued by this publisher run (an earlier run, or another relay); resubscribe from zero", c, rank, rk.endpoint, last)
	case c+1 < first && rk.hasStart && c+1 < rk.startedAt:
		return 0, newError(ErrOutOfRange, "the relay for %s (rank %d) started at sequence %d and holds nothing before it; resubscribe from zero", rk.endpoint, rank, rk.startedAt)
	case c+1 < first:
		return 0, newError(ErrOutOfRange, "the relay for %s keeps history of rank %d from sequence %d, after cursor %d; resubscribe from zero for a state snapshot", rk.endpoint, rank, first, c)
	case c < first:
		// The cursor's own batch has left the window, so everything the
		// window holds came after it.
		return r.hist.firstPos() - 1, nil
	}
	return r.hist.rankPos(rank, c), nil
}

// resumeRank0 serves an SMG-style cursor: rank 0's last applied batch,
// and nothing about the other ranks. Serving what follows that batch's
// place in the log is exact for the other ranks only where the relay can
// prove that every one of their batches the client lacks lies after that
// place; otherwise the cursor is refused, and the client comes back from
// zero for a snapshot (see provenAfterRank0).
func (r *Relay) resumeRank0(c uint64) ([]posBatch, error) {
	pos, err := r.rankWindowCheck(0, c)
	if err != nil {
		return nil, err
	}
	if err := r.provenAfterRank0(c, pos); err != nil {
		return nil, err
	}
	out, _ := r.hist.batchesAfter(nil, pos, 0, nil)
	return out, nil
}

// provenAfterRank0 checks that resuming after log position pos, where rank
// 0's cursor c resolved, is exact for every other rank, for a gateway that
// keeps a cursor per rank as SMG's does. That gateway reads a rank's first
// batch on a new connection below its cursor as a restarted publisher, and
// clears the worker's whole index (SMG 1.13, measured by
// TestSMGGatewayResumeOnTheSameKvrelay): so no rank may be served a batch
// the client applied, except the one at its cursor, which is dropped as
// stale. Two things must hold:
//
//   - the client read this relay's log up to rank 0's batch c, so it holds
//     every batch before that place. The relay knows it when batch c is in
//     the window and this relay's live socket delivered rank 0's batch
//     liveFrom <= c: batch c was published after this relay subscribed, so
//     no earlier relay (one killed before this one started on the same
//     ports) can have sent it. A relay that primed the ranks from the
//     engines' replays after a restart primes them in whatever order the
//     replays answer, and another rank's later batches can sit before c;
//   - every other rank has at most one entry after that place: the client
//     then either lacks it or holds it as its cursor. With more, it may
//     have applied several of them, and no cursor of its own says which.
//
// Anything else is ErrOutOfRange: the gateway comes back from zero for a
// snapshot. A client that sends rank_cursors is resumed exactly instead.
func (r *Relay) provenAfterRank0(c, pos uint64) error {
	if len(r.ranks) == 1 {
		return nil // the cursor is the only rank's own
	}
	rk0 := r.ranks[0]
	readHere := rk0.hasLiveFrom && c >= rk0.liveFrom && pos >= r.hist.firstPos() &&
		!r.hist.at(pos).hole() && r.hist.at(pos).first == c
	if !readHere {
		return newError(ErrOutOfRange, "cursor %d names rank 0's batch only, and this relay for %s did not serve it (it came from the engine's replay when the relay started), "+
			"so which batches of the other %d ranks the client lacks is unknown; resubscribe from zero for a state snapshot, or resume with rank_cursors (kvrelay tail --from 0:N,1:M)",
			c, rk0.endpoint, len(r.ranks)-1)
	}
	for _, rk := range r.ranks[1:] {
		if n := r.hist.rankEntriesAfter(rk.rank, pos); n > 1 {
			return newError(ErrOutOfRange, "cursor %d names rank 0's batch only, and rank %d (%s) relayed %d batches after it, some of which the client may have applied; "+
				"resubscribe from zero for a state snapshot, or resume with rank_cursors (kvrelay tail --from 0:N,1:M)", c, rk.rank, rk.endpoint, n)
		}
	}
	return nil
}

// resumeRanks serves a kvrelay client's per-rank cursors.
func (r *Relay) resumeRanks(cursors map[int32]uint64) ([]posBatch, error) {
	for rank := range cursors {
		if rank < 0 || int(rank) >= len(r.ranks) {
			return nil, newError(ErrOutOfRange, "the relay for %s has no DP rank %d (it follows %d ranks); resubscribe from zero", r.ranks[0].endpoint, rank, len(r.ranks))
		}
	}
	after := make([]uint64, len(r.ranks)) // serve a rank's batches with seq > after
	all := make([]bool, len(r.ranks))     // serve all of the rank's batches
	for _, rk := range r.ranks {
		c := cursors[rk.rank]
		if c != 0 {
			if _, err := r.rankWindowCheck(rk.rank, c); err != nil {
				return nil, err
			}
			after[rk.rank] = c
			continue
		}
		switch {
		case !rk.hasCursor:
			// Nothing relayed yet: its first batch comes live.
		case r.hist.completeFrom0(rk.rank):
			all[rk.rank] = true
		default:
			first, _, _ := r.hist.rankBounds(rk.rank)
			return nil, newError(ErrOutOfRange, "the relay for %s does not hold rank %d from the publisher's first batch (it keeps history from sequence %d); resubscribe from zero for a state snapshot", rk.endpoint, rk.rank, first)
		}
	}
	keep := func(e *entry) bool { return all[e.rank] || e.first > after[e.rank] }
	out, _ := r.hist.batchesAfter(nil, 0, 0, keep)
	return out, nil
}

// fanOut offers a newly relayed batch to every subscriber. Called with r.mu
// held; it never blocks: a full queue marks the subscriber lagged, and it is
// refilled from the history later.
func (r *Relay) fanOut(pb posBatch) {
	// Before the first append: a subscriber's pump may take the batch as
	// soon as it is in its queue.
	latencyprobe.Mark(latencyprobe.Queued, pb.rank, pb.seq)
	r.tip.Store(pb.pos)
	for s := range r.subs {
		s.mu.Lock()
		if s.err == nil && !s.closed && !s.lagged {
			if len(s.queue)-s.qhead < r.cfg.SubscriberBuffer && s.qbytes+len(pb.enc) <= r.cfg.SubscriberBufferBytes {
				s.queue = append(s.queue, pb)
				s.qbytes += len(pb.enc)
			} else {
				s.lagged = true
				r.metrics.lagged.Inc()
			}
		}
		s.mu.Unlock()
		s.wake()
	}
}

func (s *Subscription) wake() {
	select {
	case s.notify <- struct{}{}:
	default:
	}
}

// end finishes the stream with err once what is queued has been delivered.
// Called with r.mu held.
func (s *Subscription) end(err error, reason string) {
	s.mu.Lock()
	if s.err == nil {
		s.err = err
	}
	s.mu.Unlock()
	if _, ok := s.r.subs[s]; ok {
		delete(s.r.subs, s)
		s.r.metrics.subscribers.Dec()
		s.r.metrics.ended.WithLabelValues(reason).Inc()
	}
	s.wake()
}

// Next returns the stream's next batch, waiting for one. It ends with
// ErrDataLoss (restart, or the subscriber fell behind beyond the history),
// ErrClosed, or ctx's error.
func (s *Subscription) Next(ctx context.Context) (*kvpb.KvEventBatch, error) {
	enc, err := s.NextEncoded(ctx)
	if err != nil {
		return nil, err
	}
	b := &kvpb.KvEventBatch{}
	if err := proto.Unmarshal(enc, b); err != nil {
		return nil, fmt.Errorf("relay: decoding a relayed batch: %w", err)
	}
	return b, nil
}

// NextEncoded is Next for a sender: it returns the batch's protobuf
// encoding, written once for every subscriber (a snapshot chunk's is made
// for this subscriber alone, straight from the record). No message is
// built on the relay's path. The server sends the bytes as they are.
func (s *Subscription) NextEncoded(ctx context.Context) ([]byte, error) {
	return s.NextEncodedUntil(ctx, nil, nil)
}

// NextEncodedUntil is NextEncoded that also returns, with no batch and no
// error, when wake or due fires before a batch is ready: a sender that has
// something of its own to send while the stream is quiet (the load
// heartbeats) waits on both at once. Nil channels never fire.
func (s *Subscription) NextEncodedUntil(ctx context.Context, wake <-chan struct{}, due <-chan time.Time) ([]byte, error) {
	for {
		s.mu.Lock()
		closed := s.closed
		s.mu.Unlock()
		if closed {
			return nil, ErrClosed
		}
		s.deliveredLive = posBatch{}
		if enc := s.nextSnapshotChunk(); enc != nil {
			s.delivered = s.cutPos
			return enc, nil
		}
		if len(s.pending) > 0 {
			pb := s.pending[0]
			s.pending[0] = posBatch{}
			s.pending = s.pending[1:]
			s.delivered = pb.pos
			return s.out(pb)
		}
		s.mu.Lock()
		if s.qhead < len(s.queue) {
			pb := s.queue[s.qhead]
			s.queue[s.qhead] = posBatch{}
			s.qhead++
			s.qbytes -= len(pb.enc)
			switch {
			case s.qhead == len(s.queue):
				s.queue, s.qhead = s.queue[:0], 0
			case s.qhead >= 1024 && 2*s.qhead >= len(s.queue):
				// A subscriber that keeps up but never quite empties its
				// queue would otherwise keep the consumed front forever.
				n := copy(s.queue, s.queue[s.qhead:])
				clear(s.queue[n:])
				s.queue, s.qhead = s.queue[:n], 0
			}
			dup := pb.pos <= s.lastPos
			if !dup {
				s.lastPos = pb.pos
			}
			s.mu.Unlock()
			if dup {
				continue
			}
			s.r.metrics.lag.Observe(float64(s.r.tip.Load() - pb.pos))
			s.delivered = pb.pos
			if pb.live {
				s.deliveredLive = posBatch{live: true, rank: pb.rank, seq: pb.seq}
			}
			return s.out(pb)
		}
		err, lagged, closed := s.err, s.lagged, s.closed
		s.mu.Unlock()
		switch {
		case closed:
			return nil, ErrClosed
		case err != nil:
			return nil, err
		case lagged:
			if err := s.refill(); err != nil {
				return nil, err
			}
			continue
		}
		select {
		case <-s.notify:
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-wake:
			return nil, nil
		case <-due:
			return nil, nil
		}
	}
}

// out is what NextEncoded returns for pb: the shared bytes, or, for a
// subscriber that asked for live digests, a copy of them with the batch's
// digest fields appended (a protobuf decoder merges appended fields into
// the message, so this is the batch with live_digest and live_blocks set;
// the shared bytes are left untouched).
func (s *Subscription) out(pb posBatch) ([]byte, error) {
	if !s.digests || !pb.digest.set {
		return pb.enc, nil
	}
	enc := pb.enc
	out := make([]byte, len(enc), len(enc)+2*(1+binary.MaxVarintLen64))
	copy(out, enc)
	out = protowire.AppendTag(out, liveDigestField, protowire.Fixed64Type)
	out = protowire.AppendFixed64(out, pb.digest.sum)
	out = protowire.AppendTag(out, liveBlocksField, protowire.VarintType)
	out = protowire.AppendVarint(out, pb.digest.blocks)
	return out, nil
}

// The field numbers of KvEventBatch.live_digest and live_blocks.
var (
	liveDigestField = (&kvpb.KvEventBatch{}).ProtoReflect().Descriptor().Fields().ByName("live_digest").Number()
	liveBlocksField = (&kvpb.KvEventBatch{}).ProtoReflect().Descriptor().Fields().ByName("live_blocks").Number()
)

// refill takes a lagged subscriber's next batches from the history, by log
// position, or ends it if the history no longer reaches back.
func (s *Subscription) refill() error {
	r := s.r
	r.mu.Lock()
	defer r.mu.Unlock()
	s.mu.Lock()
	if s.err != nil || s.closed {
		s.mu.Unlock()
		return nil // Next reports it
	}
	last := s.lastPos
	s.mu.Unlock()
	if last+1 < r.hist.firstPos() {
		behind := r.hist.tip() - last
		s.end(newError(ErrDataLoss, "subscriber of %s fell %d batches behind and the history no longer reaches back; resubscribe from zero", r.ranks[0].endpoint, behind), "fell_behind")
		return nil
	}
	batches, looked := r.hist.batchesAfter(nil, last, r.cfg.SubscriberBuffer, nil)
	s.mu.Lock()
	s.queue = append(s.queue[:0], batches...)
	s.qhead = 0
	s.qbytes = 0
	for _, pb := range batches {
		s.qbytes += len(pb.enc)
	}
	if looked >= r.hist.tip() {
		s.lagged = false
	}
	s.mu.Unlock()
	r.metrics.refilled.Inc()
	return nil
}

// Close ends the subscription; a Next in progress or later returns
// ErrClosed.
func (s *Subscription) Close() {
	r := s.r
	r.mu.Lock()
	if _, ok := r.subs[s]; ok {
		delete(r.subs, s)
		r.metrics.subscribers.Dec()
		r.metrics.ended.WithLabelValues("closed").Inc()
	}
	r.mu.Unlock()
	s.mu.Lock()
	s.closed = true
	s.queue, s.qhead, s.qbytes = nil, 0, 0
	s.mu.Unlock()
	if p := s.snap.Swap(nil); p != nil {
		p.cut.Release()
	}
	s.wake()
}
