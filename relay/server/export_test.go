package server

import "github.com/kvrelay/kvrelay/engines/load"

// StampForBench is the per-batch stamping of the send path (runStamped),
// for the benchmark that measures it alone.
func StampForBench(rec *load.Recorder, slab *SuffixSlab, payload []byte) []byte {
	seq, rank, hasRank, err := batchKey(payload)
	if err != nil {
		return nil
	}
	return (*suffixSlab)(slab).stamp(rec, rank, hasRank, seq)
}

// SuffixSlab is the send path's record allocator.
type SuffixSlab suffixSlab
