// Package fleetsim measures routing policies in what users pay for: prefill
// work and time to first token. It replays one request trace against a
// simulated fleet once per policy, side by side, and reports each policy's
// prefix-cache hit rate, prefill tokens computed and modeled TTFT.
//
// # The model
//
// Every worker is one engine with one DP rank:
//
//   - a prefix cache (sim/prefixcache: the simulator's engine cache, LRU
//     leaf eviction, a fixed capacity in blocks);
//   - a FIFO prefill queue served at a fixed rate: a request's prefill takes
//     Overhead + uncached prompt tokens ÷ PrefillTokensPerSec, and its
//     cached prefix is what the cache holds when its prefill starts (not
//     when it was routed: a request queued behind its prefix's first use
//     finds it cached);
//   - after its prefill a request decodes for DecodeSeconds, in parallel
//     with other requests and without slowing prefill (decode is not
//     modeled beyond the time the request stays in flight and holds KV).
//
// TTFT is queueing plus prefill: the first token comes out when the prefill
// ends. The engine's load record, as the gateway would receive it on the
// event stream, is read at routing time: waiting uncached tokens (prompt
// tokens queued behind the running prefill that its cache does not hold
// at enqueue time) and KV token usage (the blocks the requests it is
// prefilling or decoding allocated ÷ capacity; a prefix they found cached
// is shared and not counted per request). The gateway's own in-flight count is
// the requests it routed that have not finished decoding. Events reach the
// index without delay (the relay's lag is milliseconds, against prefill
// seconds).
//
// Cache-aware policies run the gateway's own parts: the event index
// (gateway/index), fed by the caches' events, and the picker
// (gateway/picker), so a change to either shows here.
//
// # Workloads
//
// Chat: multi-turn sessions over shared system prompts (sim/workload),
// Poisson arrivals. Agentic: a few long shared contexts (a repository, a
// tool catalogue), tasks that grow by tool output step after step, and
// bursts: each step fans out into parallel sub-requests that arrive
// together.
package fleetsim
