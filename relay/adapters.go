package relay

import (
	"context"
	"errors"
	"log/slog"
	"time"

	"github.com/kvrelay/kvrelay/engines/wire"
	"github.com/kvrelay/kvrelay/internal/latencyprobe"
	"github.com/kvrelay/kvrelay/relay/record"
	"github.com/kvrelay/kvrelay/relay/zmqsource"
)

// zmqLimits are the bounds on what the engine side may make the relay hold
// (see Config). Zero fields take zmqsource's defaults.
type zmqLimits struct {
	maxMessageBytes  int64
	queueBytes       int64
	replayMaxBatches int
	replayMaxBytes   int64
	replayMaxTime    time.Duration
}

// zmqTransport opens ZeroMQ sockets: a SUB per rank and, with a replay
// endpoint, a DEALER per replay request.
func zmqTransport(topic string, hwm int, lim zmqLimits, log *slog.Logger) Transport {
	return func(rank int32, endpoint, replayEndpoint string, replayTimeout time.Duration) (Feed, Replayer, error) {
		feed := zmqFeed{zmqsource.NewSubscriber(zmqsource.SubscriberOptions{
			Endpoint: endpoint, Topic: topic, RcvHWM: hwm, Logger: log.With("rank", rank),
			MaxMessageBytes: lim.maxMessageBytes, QueueBytes: lim.queueBytes,
		})}
		if replayEndpoint == "" {
			return feed, nil, nil
		}
		return feed, zmqReplayer{&zmqsource.Replayer{
			Endpoint: replayEndpoint, PerReply: replayTimeout, Logger: log.With("rank", rank),
			MaxMessageBytes: lim.maxMessageBytes, MaxReplies: lim.replayMaxBatches,
			MaxBytes: lim.replayMaxBytes, MaxTime: lim.replayMaxTime,
		}}, nil
	}
}

type zmqFeed struct{ s *zmqsource.Subscriber }

func (f zmqFeed) sourceStats() sourceStats {
	st := f.s.Stats()
	return sourceStats{received: st.Received, short: st.Short, badSequence: st.BadSequence, dropped: st.Dropped,
		oversized: st.Oversized, reconnects: st.Reconnects, queuedBytes: st.QueuedBytes}
}

func (z zmqReplayer) replayStats() replayBoundStats {
	st := z.r.Stats()
	return replayBoundStats{oversized: st.Oversized, outOfRange: st.OutOfRange, tooMany: st.TooMany,
		tooBig: st.TooBig, tooLong: st.TooLong}
}

func (f zmqFeed) Recv(ctx context.Context) (Message, error) {
	m, err := f.s.Recv(ctx)
	return Message{Seq: m.Seq, Payload: m.Payload}, err
}
func (f zmqFeed) Connected() bool { return f.s.Connected() }
func (f zmqFeed) Close() error    { return f.s.Close() }

func (f zmqFeed) Ready() <-chan struct{}       { return f.s.Ready() }
func (f zmqFeed) ConnChanged() <-chan struct{} { return f.s.ConnChanged() }
func (f zmqFeed) TryRecv() (Message, bool) {
	m, ok := f.s.TryRecv()
	return Message{Seq: m.Seq, Payload: m.Payload}, ok
}

type zmqReplayer struct{ r *zmqsource.Replayer }

func (z zmqReplayer) Replay(ctx context.Context, from uint64) ([]Message, bool, error) {
	return z.messages(z.r.Replay(ctx, from))
}

func (z zmqReplayer) ReplayUpTo(ctx context.Context, from uint64, n int) ([]Message, bool, error) {
	return z.messages(z.r.ReplayUpTo(ctx, from, n))
}

func (zmqReplayer) messages(msgs []zmqsource.Message, complete bool, err error) ([]Message, bool, error) {
	out := make([]Message, len(msgs))
	for i, m := range msgs {
		out[i] = Message{Seq: m.Seq, Payload: m.Payload}
	}
	return out, complete, err
}

// wireNormalizer adapts engines/wire.
type wireNormalizer struct{ n *wire.Normalizer }

func newWireNormalizer(d wire.Dialect) normalizer { return wireNormalizer{wire.NewNormalizer(d)} }

func (w wireNormalizer) appendNormalized(dst, payload []byte, seq uint64, rank int32) ([]byte, []dropCount, error) {
	out, drops, err := w.n.AppendNormalized(dst, payload, seq, rank)
	latencyprobe.Mark(latencyprobe.Decoded, rank, seq)
	// An undecodable payload drops nothing: it is relayed empty as a
	// whole. A batch that decoded but could not be encoded had its events
	// normalized, and their drops happened.
	if drops.Total() == 0 || errors.Is(err, wire.ErrUndecodable) {
		return out, nil, err
	}
	var counts []dropCount
	for _, reason := range wire.DropReasons() {
		if n := drops[reason]; n != 0 {
			counts = append(counts, dropCount{reason: reason.String(), n: n})
		}
	}
	return out, counts, err
}

func (w wireNormalizer) reset() { w.n.Reset() }

// recordAdapter adapts relay/record.
type recordAdapter struct{ *record.Record }

func newRecordAdapter(reportModeFull bool, maxEntries int) liveRecord {
	rec := record.New()
	if reportModeFull {
		rec.DetectReannouncements()
	}
	if maxEntries > 0 {
		rec.SetMaxEntries(uint64(maxEntries))
	}
	return recordAdapter{rec}
}

func (a recordAdapter) applyEncoded(enc []byte) (applied, error) {
	got, err := a.ApplyEncoded(enc)
	return applied{reannounced: got.Reannounced, events: got.Events, storedBlocks: got.StoredBlocks}, err
}

func (a recordAdapter) evictedFrom(rank int32) uint64 { return a.EvictedFrom(rank) }

func (a recordAdapter) cut(ranks []int32) recordCut { return a.Cut(ranks) }

func (a recordAdapter) stats() (map[int32]uint64, uint64, uint64) {
	st := a.Stats()
	per := make(map[int32]uint64, len(st.Ranks))
	for _, rs := range st.Ranks {
		per[rs.Rank] = rs.Blocks
	}
	return per, st.Blocks, st.Entries
}
