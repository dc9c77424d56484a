// Package bench measures kvrelay against SMG's Python relay on this machine
// and draws the scale curves of BENCHMARKS.md; `kvrelay bench` runs it.
//
// # Side by side
//
// One Python publisher (bench/publisher.py: pyzmq, vLLM's msgspec layout,
// payloads encoded once and patched per batch so that Python can keep up)
// publishes the same stream shape to each relay in turn: 64-block stores of
// 16-token blocks on 2 DP ranks, each batch also evicting the blocks its rank
// stored 512 batches earlier, so the live set stays bounded as in a full
// engine cache. The relays run as their own processes (the kvrelay binary's
// serve subcommand, and testdata/smg/py_relay_server.py around
// smg_grpc_servicer.kv_relay.relay), so their CPU time and peak RSS come from
// /proc/<pid>. One Go gRPC subscriber reads each; it decodes only the fields
// it needs (timestamp, first block hash, block count) straight from the wire,
// so it costs the same for both and stays out of the way.
//
// The rate is ramped. A step passes when every published batch arrives
// within the drain time and the latency at the end of the step has not grown
// (the subscriber keeps up); the sustained rate is the highest passing
// step's delivered rate. Latency is publisher-to-subscriber: the publisher
// writes time.time() into the batch ts, both relays carry it as
// KvEventBatch.timestamp, and the subscriber on the same host subtracts it
// from its clock. The 1,000 and 10,000 batches/s steps always run, for the
// latency table.
//
// # Scale curves
//
// An in-process relay fed from memory (relay.Config.Transport) gives the
// record's memory and the snapshot's lock and total time against live
// blocks, resume-from-cursor time against the history window, and fan-out
// throughput against gRPC subscribers (relay/server on loopback). The
// gateway's route latency (gateway/index FindMatches plus gateway/picker
// Pick) is measured against worker count and prompt length.
//
// # Fleet scale
//
// `--only fleetscale` (never part of a default run: it takes minutes)
// sweeps simulated workers through one gateway replica's index (heap per
// (worker, block), process CPU per applied batch, route latency), a relay's
// CPU per batch against 1–16 gateway subscribers, fits each curve and
// extrapolates it to 10,000 workers and 16 replicas; the NATS and
// JetStream load there is computed with gateway/placementsync's encoders
// and the encoded batch size (fleetscale.go).
//
// Nothing here asserts a timing: the numbers are reported, compared with the
// goals of issue 7, and left to the reader.
package bench
