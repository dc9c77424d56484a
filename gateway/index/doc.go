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
// The forward map, prefix hash → holders, is split into 2^ShardBits shards by
// the hash's top bits, each an open-addressing table (12-byte slots) whose
// writers serialise on a mutex and whose readers take no lock (a seqlock). A
// holder set is one worker id inline in the slot (the common case) or a
// bitset over worker slots. A lookup walks the request's prefix hashes in
// order, intersecting the candidate set with each block's holders, and gives
// each worker the position where it dropped out: exactly the number of
// consecutive leading blocks it holds, so a hole stops a worker there.
//
// Each worker has, per DP rank, a reverse table engine hash → (prefix hash,
// copies per tier), 18 bytes a slot, written only by that worker's Apply, which resolves
// parents and removals and counts physical copies (a removal takes one copy;
// the worker holds the prefix while any copy on any indexed tier is left).
//
// Tables are not powers of two: a hash picks its slot by a multiply-high,
// and tables grow by a quarter, so memory per indexed block stays within a
// narrow band (about 36–48 bytes with 128 workers) instead of doubling in
// steps.
//
// Pruning by TTL and by a maximum entry count (to 90 %) follows SMG's G1
// indexer; Run calls Prune every 30 s. Embedding:
//
//	ix := index.New(index.Options{TTL: 10 * time.Minute})
//	go ix.Run(ctx)
//	ix.Apply("grpc://w1:50051", batch) // from the monitor
//	m := ix.FindMatches(tokenIDs, index.Namespace{})
//	for _, w := range m.Workers { fmt.Println(w.Worker, w.Blocks) }
package index
