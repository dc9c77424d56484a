// Package index is the gateway's per-model prefix index: which workers hold
// which prefixes of a request, learned from the engines' KV-cache events.
//
// # Block identity (compatible with SMG's gateway)
//
// The index does not match on the engines' block_hash, which differs between
// engines and hash schemes. It re-hashes every block from its token ids:
//
//   - content hash: XXH3-64 (seed 1337, or the namespace seed) over the
//     block's token ids, each a 4-byte little-endian u32 (ContentHash);
//   - prefix hash: block 0's is its bare content hash; block i's is XXH3-64,
//     seed 1337, over the previous prefix hash and block i's content hash,
//     both u64 little-endian (ChainHash);
//   - namespace seed: 1337 + XXH3-64(lora_name, seed 0) + XXH3-64(cache_salt,
//     seed 1), wrapping, an empty string contributing nothing (NamespaceSeed),
//     so the same tokens under another adapter or salt are another block.
//
// A request's token ids cut into full blocks (PrefixHashes) and an engine's
// stored blocks therefore name the same prefix hashes here as in SMG. The
// engine's block_hash is kept only to resolve a stored event's parent and a
// removal.
//
// # Structure
//
// The forward map (forward.go) says which workers hold which prefixes. A
// position's identity is its path from the root: positions are stored as
// runs, a run being a stretch of consecutive positions of one chain that
// hangs after a position of its parent run (or off the root) and keeps its
// positions' content hashes. A child table, (parent position, first content
// hash) → run, finds where a chain leaves a run (a branch, or after a full
// run of 256), the root's children included; a store looks there only where
// its chain leaves a run, and appends at a run's end with no look, so every
// path has one position. Coverage is kept per (run, worker): how many
// positions the worker holds from the run's start (lead), and a bitmap of
// those it holds past a hole. A lookup enters the run of the request's
// block 0, compares the request with the run's content in place, takes each
// worker still alive to min(lead, matched), and follows the child the
// request's next block names: exactly the number of consecutive leading
// blocks each worker holds, a hole stopping a worker there. By content
// hashes (FindMatches, FindMatchesContent) the comparison is direct; by
// prefix hashes (FindMatchesHashes) the walk chains the run's content from
// the run's head prefix hash (ChainHash) and finds a child through a heads
// table (head prefix hash → run).
//
// The forward map has one writer at a time (held over an event's forward
// pass, settled every 64 blocks); readers take no lock: each run has a
// seqlock version its writer holds odd over its changes, its arrays are
// published through an atomic pointer and replaced, never resized in
// place, run headers sit in chunks that never move, the tables carry a
// version, and a run found through a table is checked to be that child. A
// lookup that saw a change is redone.
//
// Each worker has, per DP rank, a reverse table engine hash → position (run
// id and offset, packed in 32 bits) and copies per tier, 14 bytes a slot,
// written only by that worker's Apply, which resolves parents and removals
// and counts physical copies (a removal takes one copy; the worker holds the
// prefix while any copy on any indexed tier is left). This reverse pass runs
// under the worker's lock only, outside the forward map's, so workers do it
// in parallel. A run counts the reverse entries that name it and its live
// children, and is freed when neither is left: a child's parent outlives it.
// The 32-bit position caps the live runs at 2^24-2; a block that would need
// a run beyond it is not indexed and counted (WorkerCounters.UnindexedBlocks;
// the gateway exports it as kvrelay_gateway_index_unindexed_blocks_total),
// the index then under-reporting its worker, never over-reporting.
//
// The content hashes of a stored batch can be computed before the index is
// touched (Prepare, ApplyPrepared), as SMG's monitor does, and a caller that
// keeps a request's content or prefix hashes can look up with them
// (FindMatchesContent, FindMatchesHashes). Each lookup has an Into form
// (FindMatchesInto, …) that writes into a caller's Matches and reuses its
// array, so that a caller keeping one per goroutine looks up without
// allocating.
//
// Pruning by TTL and by a maximum entry count (to 90 %) follows SMG's G1
// indexer (an entry is a held position; pruning clears its holders, and the
// position stays while a reverse entry names it); Run calls Prune every 30 s. Embedding:
//
//	ix := index.New(index.Options{TTL: 10 * time.Minute})
//	go ix.Run(ctx)
//	ix.Apply("grpc://w1:50051", batch) // from the monitor
//	m := ix.FindMatches(tokenIDs, index.Namespace{})
//	for _, w := range m.Workers { fmt.Println(w.Worker, w.Blocks) }
package index
