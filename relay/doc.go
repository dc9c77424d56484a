// Package relay follows every data-parallel rank of one inference engine's
// KV-cache event publisher and serves the events to any number of
// subscribers (gateways), with recovery on both sides.
//
// # Per rank: admission
//
// Each rank has its own ZeroMQ PUB socket and its own sequence counter, so
// each rank gets its own goroutine and its own state machine. It keeps a
// cursor (the last sequence relayed or given up on), and for every live
// batch it applies the admission table of SMG's Rust relay:
//
//	no cursor yet              accept (a first batch past 1 without the
//	                           engine's startup clear "joined late": replay
//	                           0..seq-1 first)
//	seq == cursor+1            accept
//	seq >  cursor+1            gap: replay cursor+1.. from the rank's ROUTER
//	                           BEFORE relaying this batch or anything later
//	seq <= 1 < 2 <= cursor     restart (counter back at its start)
//	seq <  cursor              restart (regression)
//	seq == cursor, clear first restart (the engine's startup clear), unless
//	                           the bytes are the batch relayed last: a
//	                           redelivery, skipped
//	seq == cursor              duplicate, skipped
//
// A replay is checked for contiguity. An answer cut short (SGLang drops
// replies beyond its send high-water mark, end marker included) is asked for
// again from the next missing sequence, and a sequence is declared lost only
// when two answers in a row lack it; what the first of them gave past it is
// kept, in case the engine's ring moved on in between. An attempt that
// brought nothing (no connection, or no reply, within ReplayTimeout) is made
// once more before the rest is written off. What no replay gives is recorded
// as a hole, and the cursor moves past it, so a loss never becomes a dead
// end. unknown_before is set with the first batch a start recovery relays,
// under the same lock as the cursor.
// Replies beyond the live batch are relayed at once; their live copies, still
// queued on the socket, are recognised by payload hash and skipped.
// The live copies of what a replay wrote off (the ring no longer held them)
// may be queued too, and read as a regression: before such a batch, past
// the last live one, is taken for a restart, the replay is asked for the
// batch at the cursor alone, and if the engine still holds the batch
// relayed last, byte for byte, it did not restart and the batch is skipped
// as stale.
//
// Before its first live batch a rank "primes": it asks the replay for
// everything from 0, every PrimeRetry until the ROUTER answers. Sequences
// that no replay can give before the first one relayed are unknown_before.
// A first live batch at sequence 1 also asks for 0 (the engines count from
// 0); a replay without 0 is taken for a counter that starts at 1, as SMG's
// mock engine does, and costs nothing.
//
// A gap shows only when a later batch arrives. So CatchUpDelay after its feed
// connects, and whenever it has been quiet for IdleProbe, a rank asks the
// replay from its own cursor: batches past it were missed (a slow joiner, a
// burst's tail dropped at the PUB's high-water mark) and are relayed; a
// different batch at the cursor, or none at or after it, means the publisher
// restarted unseen (reason replay_mismatch).
//
// A batch so far ahead of the cursor that the hole left after the engine's
// replay ring (buffer_steps) gave its part would be wider than the ring is
// not a gap either: one forged or corrupt sequence could make it 2^63 long,
// and a subscriber missing that much needs a resync anyway. It starts a new
// incarnation (reason sequence_jump), recovered like a late join from the
// ring only. No hole or lost count is ever wider than the ring, and nothing
// computes cursor+1, so a batch at 2^64-1 is followed by a regression, not
// a wrap.
//
// A restart clears that rank's live-block record, normalizer and cursor, and
// ends every subscriber with ErrDataLoss.
//
// # One encoding per batch
//
// A rank's goroutine writes each batch once, in its protobuf wire form,
// straight from the msgpack decoder (engines/wire's AppendNormalized: no
// message per block). Those bytes are what the history keeps, what every
// subscriber is sent as they are, and what the live-block record applies;
// no message is built on the relay's path (Subscription.Next decodes one
// for a caller that asks).
//
// # Shared: history, record, fan-out
//
// Every relayed batch, of any rank, goes under one lock (the admission lock)
// into one interleaved history log, into the live-block record (which a
// snapshot is cut from), and into every subscriber's bounded queue. Each
// history entry has a log position; positions only grow. A subscriber is a
// position in that log: it is served the entries after it, so a snapshot cut
// under the lock is followed by exactly the batches admitted after it. A
// subscriber whose queue overflows is refilled from the history by position,
// or ended with ErrDataLoss when the history no longer reaches back;
// admission never waits for a subscriber.
//
// A rank's restart clears the whole history window (not only that rank's
// entries): every subscriber is ended anyway and SMG's gateways then come
// back from zero, and a client still holding an old-incarnation cursor must
// not be served entries of the new incarnation that happen to carry the same
// numbers.
//
// A client's cursor names a place in that log only if the client read this
// relay's log: an SMG-style cursor (rank 0's alone) is served only where the
// relay can prove that is exact for every rank, and refused otherwise (see
// provenAfterRank0). Each entry also keeps its rank's live digest after it,
// sent to subscribers that ask (an anti-entropy check for gateways); and
// with report mode "full" one optional stage between the record and the log
// leaves the record's re-announced stores out (Config.SuppressReannounced).
package relay
