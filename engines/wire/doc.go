// Package wire decodes the KV-cache event batches vLLM, SGLang and TokenSpeed
// publish over ZeroMQ and normalizes them into the proto batches
// (kvpb.KvEventBatch) gateways index.
//
// # Pipeline
//
// A payload goes through two stages inside Normalizer.Normalize:
//
//  1. Decode. A streaming msgpack walk (vmihailenco/msgpack/v5 Decoder
//     primitives over a bytes.Reader, plus hand-rolled loops for the token
//     and hash arrays, which are most of the bytes) reads the envelope — [ts, events,
//     rank?] with the rank omitted, nil or followed by extra elements, or a
//     map {ts, events, data_parallel_rank|attn_dp_rank} — and every event,
//     whether a tagged map (any key order, unknown keys skipped) or a
//     tag-first array of any schema generation (missing trailing slots are
//     absent, extra ones skipped). Hashes fold to int64 (an integer keeps its
//     64-bit pattern, bytes keep their last eight bytes big-endian), bigram
//     token cells fold to their first word, unknown tags become
//     unknown_type, and a known event with an unreadable required field
//     becomes malformed. Hashes and tokens land in per-normalizer slabs that
//     are reused batch after batch. Every declared length is checked against
//     the bytes left before anything is allocated for it, and values are
//     skipped iteratively, so hostile input can neither allocate gigabytes
//     nor exhaust the stack; working memory stays within a small multiple
//     (about 40× in the worst case of tiny events) of the payload size, so
//     the subscriber should cap message sizes. Only a payload whose envelope
//     is not a batch or whose msgpack is truncated or invalid is an error
//     (ErrUndecodable, no event id consumed); bytes after a complete
//     envelope are ignored.
//
//  2. Normalize. Per event, in batch order, the gates of smg's relays apply:
//     residency-agent ownership, non-local locality, the medium→tier table,
//     the attention-group policy (with a pre-pass that learns the batch's
//     groups first), placeholders, block alignment (including the Rust
//     relay's tail alignment for sliding-window stores) and self-referencing
//     chains. Each drop is counted by reason and costs only its event; event
//     ids advance once per input event either way. Admitted events update a
//     compact per-rank record (rank → tier → hash → {namespace id, copies})
//     that provides namespace inheritance from a parent, copy counting capped
//     at 8, duplicate-store counting and per-rank clears. Only namespaced
//     blocks are recorded, and a Bloom filter per table lets the other
//     stores and the removals skip it for blocks it never held.
//
// The output's blocks, block pointers, tokens and extra keys come from one
// slab each per batch, so a batch costs a handful of allocations whatever its
// block count.
//
// # Two outputs
//
// Normalize returns the batch as messages (kvpb.KvEventBatch), fresh each
// call, for callers that keep or inspect it. AppendNormalized runs the same
// decode and gates (they share one planning step, so the two cannot disagree
// on what is forwarded) and appends the batch's protobuf wire bytes instead,
// written by proto/kvenc straight from the decoder's hash and token slabs:
// no message per block, no allocation per batch in the steady state. Its
// bytes equal proto.Marshal's of Normalize's batch; the differential test
// over the golden vectors and FuzzAppendNormalizedMatchesMarshal hold it to
// that.
//
// # Where we differ from smg
//
// SGLang's salted array store (#30827) carries {"cache_salt": s} as its 8th
// element, where vLLM's array has lora_name. smg cannot tell the engines apart
// there and loses the salt; a Normalizer knows its Dialect, so under SGLang a
// map in that slot is read as the store's metadata and the salt is kept.
//
// Where smg's Rust and Python relays disagree we follow Rust (tail alignment,
// window-only ranks), except that a msgpack bool is never read as a hash or
// an integer (as in the Python relay; msgspec never writes one there). The
// socket's rank wins over the payload's, as in the Python relay.
package wire
