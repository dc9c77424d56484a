package relay

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrelay/kvrelay/engines"
	"github.com/kvrelay/kvrelay/relay/zmqsource"
)

// Defaults, as in the Rust relay (relay-semantics §3.11).
const (
	// DefaultHistoryBatches matches the engines' replay ring (buffer_steps).
	DefaultHistoryBatches = 10_000
	// DefaultHistoryBytes is 256 MiB.
	DefaultHistoryBytes int64 = 256 << 20
	// DefaultRecordMaxEntries caps each rank's live-block record: about
	// 512 MiB at the ~255 bytes an entry costs, far above a GPU pool's
	// blocks, so only offload tiers of millions of blocks or removals the
	// relay never saw (a leak) reach it.
	DefaultRecordMaxEntries = 2 << 20
	// DefaultReplayTimeout bounds the wait for each replay reply.
	DefaultReplayTimeout = 5 * time.Second
	// DefaultPrimeRetry is how often the start replay is asked again until
	// the engine's ROUTER answers.
	DefaultPrimeRetry = time.Second
	// DefaultCatchUpDelay is how long after its feed connects a rank asks
	// the replay for what the live stream may have missed while the
	// subscription was reaching the publisher.
	DefaultCatchUpDelay = 500 * time.Millisecond
	// DefaultIdleProbe is how long a rank may be quiet before the relay asks
	// the replay whether it missed a batch that no later batch revealed.
	DefaultIdleProbe = 5 * time.Second
	// DefaultSubscriberBuffer is how many live batches a subscriber may fall
	// behind before it is refilled from the history.
	DefaultSubscriberBuffer = 4096
	// DefaultSubscriberBufferBytes bounds the encoded bytes a subscriber's
	// live queue holds: the batches are shared with the history, but a
	// queue keeps the ones the history dropped alive.
	DefaultSubscriberBufferBytes = 64 << 20

	// EnvHistoryBatches and EnvHistoryBytes override the history caps when
	// the configuration leaves them zero (SMG's variables).
	EnvHistoryBatches = "SMG_KV_EVENT_HISTORY_BATCHES"
	EnvHistoryBytes   = "SMG_KV_EVENT_HISTORY_BYTES"

	// maxReplayRounds bounds how often one gap's replay is resumed after a
	// truncated or non-contiguous answer. Every round must bring something
	// new, so this only matters against a pathological replay.
	maxReplayRounds = 64
	// maxUnansweredReplays is how many attempts in a row may bring nothing
	// (an error, or no reply before the timeout) before a gap's remaining
	// sequences are recorded as lost.
	maxUnansweredReplays = 2
	// recvErrorBackoff is the pause after a failed receive.
	recvErrorBackoff = 100 * time.Millisecond
	// catchUpTick is how often a rank checks its feed's connection and
	// its quiet time.
	catchUpTick = 100 * time.Millisecond
	// summaryEvery is how many relayed batches pass between info summaries.
	summaryEvery = 500
)

// Config configures one relay: one engine, all of its DP ranks.
type Config struct {
	Engine engines.Engine
	// KV is the engine's resolved --kv-events-config. With KV.Enabled false
	// the relay relays nothing and every Subscribe returns ErrDisabled.
	KV engines.Config
	// DPSize is the number of data-parallel ranks; rank r publishes at the
	// endpoint engines.ConnectEndpoint(KV.Endpoint, r).
	DPSize int
	// HistoryBatches and HistoryBytes cap the history window; zero takes
	// the environment (EnvHistoryBatches, EnvHistoryBytes) or the defaults.
	HistoryBatches int
	HistoryBytes   int64
	// RecordMaxEntries caps each rank's live (tier, hash) entries in the
	// record that snapshots are cut from; past it the oldest-stored go
	// (record.SetMaxEntries) and the rank's snapshots say they are
	// incomplete. Zero: DefaultRecordMaxEntries; negative: no cap.
	RecordMaxEntries int
	// ReplayTimeout bounds the wait for each replay reply (priming gets
	// twice this overall). Zero: DefaultReplayTimeout.
	ReplayTimeout time.Duration
	// PrimeRetry is the pause between start replays the engine did not
	// answer. Zero: DefaultPrimeRetry.
	PrimeRetry time.Duration
	// CatchUpDelay and IdleProbe schedule the catch-up replay (see
	// Relay.catchUp). Zero: the defaults; negative: off.
	CatchUpDelay time.Duration
	IdleProbe    time.Duration
	// SubscriberBuffer is each subscriber's live queue. Zero:
	// DefaultSubscriberBuffer.
	SubscriberBuffer int
	// ReportModeFull: the engine's requests may ask for vLLM's
	// kv_cache_report_mode "full", which re-announces prefix-cache hits as
	// stores without removals. The record then takes stores that match
	// record.IsReannouncement for re-announcements, not new copies, so it
	// and its snapshots keep the exact live set. Off by default: the rule
	// would take a genuine second copy of a whole chain from block 0 for one.
	ReportModeFull bool
	// SuppressReannounced (needs ReportModeFull) leaves the stores the record
	// took for re-announcements out of the stream and the history. Off by
	// default: the stream stays the engine's, batch for batch. On, for a
	// gateway that counts physical copies per store (SMG's, kvrelay's): there
	// every re-announcement is one more copy that no removal ever takes.
	SuppressReannounced bool
	// SubscriberBufferBytes bounds the encoded bytes of that queue; past
	// either bound the subscriber is refilled from the history later.
	// Zero: DefaultSubscriberBufferBytes.
	SubscriberBufferBytes int
	Logger                *slog.Logger
	// Instance names this relay in its metrics (label "relay"), so several
	// relays, even of one engine, can share a registry. Default: the
	// engine's name.
	Instance string
	// Registerer receives the relay's metrics; nil registers nowhere.
	Registerer prometheus.Registerer
	// Transport opens each rank's sockets. Nil: ZeroMQ (relay/zmqsource).
	// Tests inject in-memory publishers here.
	Transport Transport

	// Bounds on what an engine's sockets can make the relay hold. Zero
	// takes the default.
	//
	// MaxMessageBytes is the largest ZeroMQ message (and frame) accepted;
	// a peer that declares more is disconnected before anything is
	// allocated (zmqsource.DefaultMaxMessageBytes, 64 MiB).
	MaxMessageBytes int64
	// QueueBytes bounds each rank's incoming queue by bytes, besides the
	// engine config's hwm in messages (zmqsource.DefaultQueueBytes,
	// 128 MiB); it must hold at least one message of MaxMessageBytes.
	QueueBytes int64
	// ReplayMaxBatches, ReplayMaxBytes and ReplayMaxTime bound one replay
	// answer (defaults: twice the engine's buffer_steps, 256 MiB, 30 s).
	ReplayMaxBatches int
	ReplayMaxBytes   int64
	ReplayMaxTime    time.Duration
}

// zmqLimits are the bounds the ZeroMQ transport applies.
func (c *Config) zmqLimits() zmqLimits {
	return zmqLimits{maxMessageBytes: c.MaxMessageBytes, queueBytes: c.QueueBytes,
		replayMaxBatches: c.ReplayMaxBatches, replayMaxBytes: c.ReplayMaxBytes, replayMaxTime: c.ReplayMaxTime}
}

// window is the engine's replay ring in batches: no replay reaches further
// back, so no gap wider than it can be filled or is recorded as a hole.
func (c *Config) window() uint64 {
	if c.KV.BufferSteps > 0 {
		return uint64(c.KV.BufferSteps)
	}
	return engines.DefaultBufferSteps
}

func (c *Config) resolve() error {
	if c.DPSize < 1 {
		return fmt.Errorf("relay: DP size %d: need at least one rank", c.DPSize)
	}
	if c.HistoryBatches < 0 {
		return fmt.Errorf("relay: history of %d batches: must not be negative", c.HistoryBatches)
	}
	if c.HistoryBytes < 0 {
		return fmt.Errorf("relay: history of %d bytes: must not be negative", c.HistoryBytes)
	}
	if c.SuppressReannounced && !c.ReportModeFull {
		return errors.New("relay: suppressing re-announced stores needs report mode full (the record tells them apart)")
	}
	if c.ReplayTimeout < 0 || c.PrimeRetry < 0 || c.SubscriberBuffer < 0 {
		return errors.New("relay: timeouts and buffer sizes must not be negative")
	}
	if c.MaxMessageBytes < 0 || c.QueueBytes < 0 || c.ReplayMaxBatches < 0 || c.ReplayMaxBytes < 0 || c.ReplayMaxTime < 0 {
		return errors.New("relay: message, queue and replay limits must not be negative")
	}
	if c.MaxMessageBytes == 0 {
		c.MaxMessageBytes = zmqsource.DefaultMaxMessageBytes
	}
	if c.QueueBytes == 0 {
		c.QueueBytes = max(zmqsource.DefaultQueueBytes, c.MaxMessageBytes)
	}
	if c.QueueBytes < c.MaxMessageBytes {
		return fmt.Errorf("relay: a queue of %d bytes cannot hold one message of the %d-byte maximum", c.QueueBytes, c.MaxMessageBytes)
	}
	if c.ReplayMaxBytes == 0 {
		c.ReplayMaxBytes = zmqsource.DefaultReplayMaxBytes
	}
	if c.ReplayMaxTime == 0 {
		c.ReplayMaxTime = zmqsource.DefaultReplayMaxTime
	}
	if c.ReplayMaxBatches == 0 {
		c.ReplayMaxBatches = 2 * int(c.window())
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	if c.Instance == "" {
		c.Instance = c.Engine.Name
	}
	if c.HistoryBatches == 0 {
		n, err := envInt(EnvHistoryBatches, DefaultHistoryBatches)
		if err != nil {
			return err
		}
		c.HistoryBatches = int(n)
	}
	if c.HistoryBytes == 0 {
		n, err := envInt(EnvHistoryBytes, int64(DefaultHistoryBytes))
		if err != nil {
			return err
		}
		c.HistoryBytes = n
	}
	if c.ReplayTimeout == 0 {
		c.ReplayTimeout = DefaultReplayTimeout
	}
	if c.CatchUpDelay == 0 {
		c.CatchUpDelay = DefaultCatchUpDelay
	}
	if c.IdleProbe == 0 {
		c.IdleProbe = DefaultIdleProbe
	}
	if c.PrimeRetry == 0 {
		c.PrimeRetry = DefaultPrimeRetry
	}
	if c.SubscriberBuffer == 0 {
		c.SubscriberBuffer = DefaultSubscriberBuffer
	}
	if c.SubscriberBufferBytes <= 0 {
		c.SubscriberBufferBytes = DefaultSubscriberBufferBytes
	}
	if c.RecordMaxEntries == 0 {
		c.RecordMaxEntries = DefaultRecordMaxEntries
	}
	if c.KV.Enabled && c.KV.Endpoint == "" {
		return errors.New("relay: events are enabled but the endpoint is empty")
	}
	return nil
}

// envInt reads a positive integer from the environment: trimmed, and empty
// means the default. Anything else that is not a positive integer is an
// error naming the variable: SMG's relay only warns and falls back, which
// hides a typo behind a history of the wrong size.
func envInt(name string, def int64) (int64, error) {
	raw := strings.TrimSpace(os.Getenv(name))
	if raw == "" {
		return def, nil
	}
	v, err := strconv.ParseUint(raw, 10, 62)
	if err != nil || v == 0 {
		return 0, fmt.Errorf("relay: $%s=%q: want a positive integer (unset it for the default, %d)", name, raw, def)
	}
	return int64(v), nil
}
