// Package natsevents carries a relay's KV-cache event batches over NATS
// JetStream, so that gateway replicas can build their indexes from one
// stream instead of each dialling every worker (kvrelay serve --nats,
// kvrelay gateway --nats-events). Both halves live here, as they share the
// names, the snapshot object format and the exactness argument; nothing of
// NATS is in package relay or gateway/monitor.
//
// # Sink (the relay's side)
//
// A Sink is one more subscriber of its relay, through relay.Subscribe, the
// API the gRPC server uses. It publishes each batch's encoded bytes, as the
// relay encoded them for every subscriber (with live digests), to
// <prefix>.<WorkerToken(worker)>.<rank> (default prefix kvrelay.events) on
// one stream (default KVRELAY_EVENTS, created if missing: limits
// retention, 1 h max age, file storage, 10 min duplicate window). A batch's
// Nats-Msg-Id is worker.rank.sequence.timestamp: an engine stamps every
// batch and counts from 0 again only in a new process, later, so the id
// names one engine batch whichever relay run publishes it, and a restarted
// relay's re-publication of the engine's replayed history is dropped by
// the stream. Snapshot chunks carry no id: publishing a snapshot again is
// a new resync point, which consumers may apply again.
//
// Publishing is asynchronous with a bounded window (MaxPending acks
// outstanding). The relay never waits on the sink: a sink that falls
// behind is refilled from the relay's history or ended with DATA_LOSS like
// any subscriber. Any failure (a publish not acknowledged, NATS lost, the
// relay's DATA_LOSS) ends the pass, and the next pass subscribes from zero
// again, so the stream's next messages are a snapshot (or the engine's
// complete history): whatever a hole in the stream lost, a snapshot
// follows it, and a consumer applies it as it would on gRPC (clear, then
// the chunks).
//
// # Snapshots for late replicas
//
// After each (re)subscription and then every SnapshotEvery, the sink cuts
// the relay's record (Relay.SnapshotAt, which also tells the log position
// of the cut) and, once it has published the last batch at or below that
// position, stores the chunks in the object store bucket <stream>_SNAPSHOTS
// under the worker's token, with the stream sequence of that batch's
// message (in the object and in its metadata). The chunks then hold every
// batch of the worker stored at or below that sequence and none above, so
// snapshot + the worker's messages after it is exactly what a gRPC
// subscriber from zero gets. A cut is never taken while the subscription's
// own snapshot is arriving, so a tail never starts inside one. A batch
// the stream held already (a restarted relay re-publishes the engine's
// replayed history) keeps the earlier run's sequence, possibly below a
// cut the batch follows, where a reader of the cut would never see it. So
// a cut is taken only when every configured rank of the relay is settled,
// none of its later batches able to be a duplicate: the stream held
// nothing of the rank when the pass began, or the rank had a new message
// in the pass, or the duplicate of its newest stored batch was answered
// (see passAcks). A rank that has not primed yet is therefore covered or
// has nothing to hide, and the first cut after a restart comes as soon as
// the last rank settles, not a period later (issue 30).
//
// # Source (the gateway's side)
//
// A Source's Open is a monitor.StreamOpener: each subscription the monitor
// makes for a worker is served from the snapshot object then an ordered
// consumer on the worker's subjects from the next sequence, and goes
// through the monitor's admission unchanged (stale, gap, restart, snapshot
// rules), once the source has checked it against the worker's stream: a
// snapshot, object or on the stream, is read whole and checked before its
// first chunk is handed on, and one that breaks a bound is refused without
// touching the worker's blocks (guard.go). Where that cannot be exact it serves the worker's own gRPC
// stream instead, with the monitor's cursors: NATS unreachable, no
// snapshot of the worker, the stream no longer holding the snapshot's
// tail, or a stale snapshot object: the one there when NATS came back (or
// was unreachable at start; the sinks may have lost messages meanwhile),
// when the worker's sink went silent, or the one the worker's index
// diverged from the relay's live digest on (repair.go). An object is told
// by its NUID, so any object written since serves, and the source asks
// the sink for one (request.go) rather than wait for its period. Losing NATS ends
// every JetStream-served subscription at once, and the monitor resubscribes
// over gRPC from its cursors; a worker on gRPC checks every SwitchBackEvery
// whether JetStream could serve it exactly, and if so ends its gRPC stream
// so the next subscription comes from JetStream (a snapshot: the worker's
// blocks are replaced, not merged). kvrelay_gateway_events_source{worker,
// source="nats"|"grpc"} says which one each worker is on.
//
// # Silent sinks
//
// A sink that stops publishing while the gateway's own connection stays up
// (its relay killed, its connection partitioned from NATS, or failing to
// start a pass for longer than the bound) leaves a stream that just stops moving; over gRPC the
// monitor would have seen the stream break. So a sink announces itself
// every AliveEvery (1 s, kvrelay serve --nats-alive-every) while a pass is
// publishing, on core NATS at <prefix>-alive.<token> (not captured by the
// stream's <prefix>.>, so never stored), with its incarnation, pass and
// the stream sequence of its newest stored message, and its interval,
// taken only when the stream bears it out (the incarnation is the one the
// sink stamps on its stream messages, the sequence one of the worker's; see
// alive.go). A
// source whose worker's sink, once heard, has been silent for longer than
// 3 of its intervals (SilentAfter) ends that worker's JetStream
// subscription; the monitor resubscribes and Open serves the gRPC stream,
// the fallback above, counted in
// kvrelay_gateway_events_sink_silent_total{worker}. The worker returns by
// the switch-back rule once the sink announces again and a snapshot object
// written since the silence was found is there (the restarted pass writes
// one). A replica that reconnects to NATS restarts every sink's
// clock. A worker whose sink never announced is served as before: that is
// a relay from before announcements (or with them off), and treating it as
// silent would send every worker of a fleet being upgraded to gRPC at once;
// the price is that such a sink's death goes unnoticed, as it did before.
// Not covered: a sink stuck inside a pass still announces; the sequence it
// announces is logged at a silence but not acted on, as a sequence that
// stops moving is also what an idle engine looks like.
//
// # Engine load
//
// Load records are added per subscriber by the relay's gRPC server, so the
// batches the sink publishes carry none, and must not: a stored record
// would be replayed to a late replica as current, and a load_only batch
// repeats a sequence, so the duplicate window would drop it. A sink given
// the relay's load sources (SinkOptions.Loads) publishes each relayed
// rank's record beside the stream on core NATS, <prefix>-load.<token>.<rank>,
// on a change or on silence with SMG's servicer's rules; a Source hands the
// newest one to each JetStream-served subscription as a load_only batch,
// aged by the time it waited (see loads.go). The monitor takes them as it
// takes a gRPC stream's, so overlap decay and the KV-pressure thresholds
// act the same on either path.
package natsevents
