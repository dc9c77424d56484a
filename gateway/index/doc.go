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
// The forward map, prefix hash → holders, is stored as runs (forward.go): a
// run is a stretch of consecutive positions of one chain, kept as two
// parallel arrays, the positions' prefix hashes and their holder words. A
// holder word is one worker id inline (the common case) or a bitset over
// worker slots. A lookup finds the request's block 0 through a heads table
// (prefix hash → run), then walks the run comparing the request's next
// prefix hash with the run's next one, a sequential read, and goes back to
// the heads table only where the request leaves the run (a branch, or a full
// run). Each worker drops out at the position it stops holding: exactly the
// number of consecutive leading blocks it holds, so a hole stops a worker
// there. A new turn of a conversation is appended to its run.
//
// Every prefix hash has at most one position: right after its predecessor's
// position, or as the head of a run of its own, and writers check both
// before adding it (a per-shard filter of the heads answers most of the
// second check without probing the heads table). Runs are split into
// 2^ShardBits shards by their head's top bits. Writers serialise on a
// shard's mutex (two at most, taken in shard order); readers take no lock:
// the heads table is read under the shard's seqlock version and a run under
// its own, and a read that saw a change is redone.
//
// Each worker has, per DP rank, a reverse table engine hash → position (run
// and offset, packed in 32 bits) and copies per tier, 14 bytes a slot,
// written only by that worker's Apply, which resolves parents and removals
// and counts physical copies (a removal takes one copy; the worker holds the
// prefix while any copy on any indexed tier is left). A run counts the
// reverse entries that name it and the runs branched off it, and is freed
// when neither is left: a branch's parent run outlives it, so a block
// appended at a run's end needs no look at the heads. The 32-bit
// position caps a shard at 2^(24-ShardBits)-1 live runs (16.7 M runs in
// all); a block that would need a run beyond it is not indexed and counted
// (WorkerCounters.UnindexedBlocks; the gateway exports it as
// kvrelay_gateway_index_unindexed_blocks_total), the index then
// under-reporting its worker, never over-reporting.
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
