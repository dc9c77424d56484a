//go:build indexerbench

package index

// Entry points of bench/indexers/run.sh (issue 19.3), behind the
// indexerbench tag: they need a full Mooncake trace, which CI does not have.
//
//	go test -c -tags indexerbench -o ix.test ./gateway/index
//	KVRELAY_CORPUS_TRACE=conversation_trace.jsonl KVRELAY_CORPUS_OUT=c.kvr ./ix.test -test.run IndexerCorpusWrite
//	KVRELAY_CORPUS=c.kvr ./ix.test -test.run IndexerCorpusReplay -test.v   # prints one "RESULT {json}" line
//
// KVRELAY_CORPUS_LOOKUP=alloc makes the replay's lookups FindMatchesContent
// (a new result each) instead of FindMatchesContentInto into one result.
// KVRELAY_CORPUS_STALLS=path logs every lookup slower than
// KVRELAY_CORPUS_STALL_NS (default 5000) with the thread's CPU time, page
// faults and context switches around it (Linux; see stallProbe).

import (
	"encoding/json"
	"fmt"
	"os"
	"runtime/pprof"
	"slices"
	"testing"
	"time"

	"github.com/kvrelay/kvrelay/gateway/index/tracegen"
)

// TestIndexerCorpusWrite derives the neutral corpus from a Mooncake trace:
// hash id = 512 tokens = 4 blocks of 128 (length factor 4), the trace
// duplicated KVRELAY_CORPUS_DUP times (default 4) over disjoint id spaces,
// routed over 128 workers each with an LRU cache of 512 blocks, exactly as
// BenchmarkReplayMooncake plans it.
func TestIndexerCorpusWrite(t *testing.T) {
	trace, out := os.Getenv("KVRELAY_CORPUS_TRACE"), os.Getenv("KVRELAY_CORPUS_OUT")
	if trace == "" || out == "" {
		t.Skip("set KVRELAY_CORPUS_TRACE and KVRELAY_CORPUS_OUT")
	}
	f, err := os.Open(trace)
	if err != nil {
		t.Fatal(err)
	}
	recs, err := tracegen.ReadMooncake(f)
	f.Close()
	if err != nil {
		t.Fatal(err)
	}
	dup := envInt("KVRELAY_CORPUS_DUP", 4)
	reqs, err := tracegen.ExpandMooncake(recs, tracegen.ExpandConfig{BlockSize: 128, LengthFactor: 4, Duplication: dup})
	if err != nil {
		t.Fatal(err)
	}
	plan := planReplay(reqs, 128, 128, 65536/128)
	c := corpusFromPlan(plan, 128)
	w, err := os.Create(out)
	if err != nil {
		t.Fatal(err)
	}
	if err := writeCorpus(w, c); err != nil {
		t.Fatal(err)
	}
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	var kinds [3]int
	var blocks [3]uint64
	for _, op := range c.ops {
		kinds[op.kind]++
		blocks[op.kind] += uint64(op.blocks())
	}
	fmt.Printf("CORPUS {\"records\":%d,\"duplication\":%d,\"requests\":%d,\"workers\":128,\"block_size\":128,\"capacity_blocks\":512,"+
		"\"lookups\":%d,\"lookup_blocks\":%d,\"stores\":%d,\"stored_blocks\":%d,\"removes\":%d,\"removed_blocks\":%d,\"block_ops\":%d}\n",
		len(recs), dup, len(reqs), kinds[0], blocks[0], kinds[1], blocks[1], kinds[2], blocks[2], c.blockOps)
}

// TestIndexerCorpusReplay replays KVRELAY_CORPUS into our index on one
// goroutine and prints the result line run.sh collects; with
// KVRELAY_CORPUS_CPUPROFILE it CPU-profiles the timed part.
func lookupName(allocating bool) string {
	if allocating {
		return "kvrelay gateway/index FindMatchesContent"
	}
	return "kvrelay gateway/index FindMatchesContentInto"
}

// openCorpusFromEnv opens the corpus file KVRELAY_CORPUS names, or skips
// t; the caller closes it.
func openCorpusFromEnv(t *testing.T) *os.File {
	t.Helper()
	path := os.Getenv("KVRELAY_CORPUS")
	if path == "" {
		t.Skip("set KVRELAY_CORPUS")
	}
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	return f
}

// corpusFromEnv reads the corpus file KVRELAY_CORPUS names, or skips t.
func corpusFromEnv(t *testing.T) opsCorpus {
	t.Helper()
	f := openCorpusFromEnv(t)
	defer f.Close()
	c, err := readCorpus(f)
	if err != nil {
		t.Fatalf("%s: %v", f.Name(), err)
	}
	return c
}

func TestIndexerCorpusReplay(t *testing.T) {
	c := corpusFromEnv(t)
	var onStart func()
	if prof := os.Getenv("KVRELAY_CORPUS_CPUPROFILE"); prof != "" {
		pf, err := os.Create(prof)
		if err != nil {
			t.Fatal(err)
		}
		onStart = func() {
			if err := pprof.StartCPUProfile(pf); err != nil {
				t.Fatal(err)
			}
		}
		defer func() {
			pprof.StopCPUProfile()
			pf.Close()
		}()
	}
	allocating := false
	switch mode := os.Getenv("KVRELAY_CORPUS_LOOKUP"); mode {
	case "", "into":
	case "alloc":
		allocating = true
	default:
		t.Fatalf("KVRELAY_CORPUS_LOOKUP=%q: want into or alloc", mode)
	}
	probe, finish, err := stallProbeFromEnv()
	if err != nil {
		t.Fatal(err)
	}
	ix, r := replayCorpus(c, replayOptions{allocating: allocating, onStart: onStart, probe: probe})
	if err := finish(); err != nil {
		t.Fatal(err)
	}
	printCorpusResult(t, lookupName(allocating), c.blockOps, ix, r)
}

// printCorpusResult prints the line run.sh collects, with what the index
// allocated, the page faults and collector cycles of the timed part, and
// the index's bytes and recycling pool at the end (extra keys: table.py
// reads the ones it knows).
func printCorpusResult(t *testing.T, name string, blockOps uint64, ix *Index, r corpusReplay) {
	t.Helper()
	slices.Sort(r.lat)
	rank := func(p float64) time.Duration { // nearest rank, as the Rust harness
		i := int(p/100*float64(len(r.lat)) + 0.999999)
		return r.lat[min(max(i, 1), len(r.lat))-1]
	}
	st := ix.Stats()
	p := &ix.pool
	p.mu.Lock()
	pool := map[string]int{"body_gets": p.bodyGets, "body_hits": p.bodyHits, "rev_gets": p.revGets, "rev_hits": p.revHits,
		"puts": p.puts, "kept": p.kept, "held_bytes": p.held[kindBody] + p.held[kindRev]}
	p.mu.Unlock()
	line, err := json.Marshal(map[string]any{
		"indexer": "kvrelay", "name": name, "version": "this tree",
		"block_ops": blockOps, "lookups": len(r.lat), "cpu_s": r.cpu.Seconds(), "wall_s": r.wall.Seconds(),
		"p50_ns": rank(50).Nanoseconds(), "p99_ns": rank(99).Nanoseconds(), "checksum": r.checksum, "apply_errors": 0,
		"alloc_bytes": r.allocBytes, "minor_faults": r.faults, "gc_cycles": r.gcs,
		"index_bytes": st.MemoryBytes, "memberships": st.Memberships, "pool": pool,
	})
	if err != nil {
		t.Fatal(err)
	}
	fmt.Printf("RESULT %s\n", line)
}

// TestIndexerCorpusReplayStream replays KVRELAY_CORPUS as
// TestIndexerCorpusReplay does, but reads it KVRELAY_CORPUS_CHUNK
// operations at a time (default 16,384) and builds each chunk's batches
// just before replaying it, with the clock stopped: the heap then holds the
// index and one chunk, not the ~900 MB of the whole corpus and its batches,
// so the collector runs during the replay as it would in a gateway, and the
// index's fresh arrays reuse memory it freed instead of faulting in new
// pages. GOGC applies as usual.
func TestIndexerCorpusReplayStream(t *testing.T) {
	f := openCorpusFromEnv(t)
	defer f.Close()
	var (
		ix    *Index
		names []WorkerID
		r     corpusReplay
		m     Matches
		k     corpusClock
	)
	c, err := streamCorpus(f, envInt("KVRELAY_CORPUS_CHUNK", 16384), func(c opsCorpus, ops []corpusOp) {
		if ix == nil {
			ix = New(Options{BlockSize: int(c.blockSize)})
			names = corpusWorkerNames(c)
		}
		preps := corpusPreps(c, ops)
		k.start()
		replayOps(ix, names, ops, preps, &m, &r, replayOptions{})
		k.stop(&r)
	})
	if err != nil {
		t.Fatalf("%s: %v", f.Name(), err)
	}
	printCorpusResult(t, lookupName(false)+" (streamed)", c.blockOps, ix, r)
}
