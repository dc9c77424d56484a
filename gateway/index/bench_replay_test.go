package index

import (
	"container/list"
	"fmt"
	"maps"
	"os"
	"runtime"
	"strconv"
	"sync"
	"testing"
	"time"
	"unsafe"

	"github.com/kvrelay/kvrelay/gateway/index/tracegen"
	"github.com/kvrelay/kvrelay/proto/kvpb"
)

// The trace-replay benchmark (issue 9, item 2), in the style of Dynamo's
// mooncake_bench: a workload of requests is first routed once through a
// simulation (cache-aware: the deepest holder with the fewest requests, else
// the least-used worker), which records per worker the exact op stream an
// engine with an LRU cache of fixed capacity would cause: a find-matches for
// the request, stored events for the blocks it lacked (chained by parent,
// 64 blocks an event) and removed events for what the LRU evicts. The timed
// part replays those streams into a fresh index from GOMAXPROCS goroutines,
// each owning a subset of the workers (per-worker order kept, workers
// interleaved), open loop. Block ops = looked-up request blocks + stored
// blocks + removed blocks, as in SMG's and Dynamo's definition.

type replayOp struct {
	find    []uint32 // request tokens, for a lookup
	content []uint64 // the request's content hashes, for a lookup with hashed input
	batch   *kvpb.KvEventBatch
	prep    *Prepared // batch with its content hashes, for hashed input
	blocks  int
}

// replayInput says what the timed replay hands the index.
type replayInput int

const (
	// hashedInput: stores and lookups arrive with their blocks' content
	// hashes computed (ApplyPrepared, FindMatchesContent), as the anchors'
	// benchmarks feed SMG's and Dynamo's indexes. The prefix chain, the
	// reverse maps and the lookups are timed; hashing tokens is not.
	hashedInput replayInput = iota
	// tokenInput: stores and lookups carry token ids (Apply, FindMatches),
	// so every block is also XXH3-hashed inside the timed part.
	tokenInput
)

func (in replayInput) String() string {
	if in == tokenInput {
		return "token-input"
	}
	return "hashed-input"
}

type replayPlan struct {
	workers []WorkerID
	ops     [][]replayOp // by worker
	order   []int        // the worker of each op, in the order the simulation made them (corpus.go's file keeps it)
	blocks  int64
	finds   int
}

type simWorker struct {
	lru  *list.List // engine hashes, least recent first
	pos  map[int64]*list.Element
	reqs int
}

func planReplay(reqs []tracegen.Request, workers, bs, capacity int) replayPlan {
	sim := New(Options{BlockSize: bs})
	p := replayPlan{ops: make([][]replayOp, workers)}
	state := make([]*simWorker, workers)
	index := map[WorkerID]int{}
	for w := range workers {
		p.workers = append(p.workers, fmt.Sprintf("worker-%03d", w))
		index[p.workers[w]] = w
		state[w] = &simWorker{lru: list.New(), pos: map[int64]*list.Element{}}
	}
	// Load, for the spill gate: the requests each worker received among the
	// last window arrivals (as if each lasted that long).
	const spillMargin = 2
	window := 2 * workers
	busy := make([]int, workers)
	var recent []int
	for _, r := range reqs {
		n := len(r.Tokens) / bs
		if n == 0 {
			continue
		}
		m := sim.FindMatches(r.Tokens, Namespace{})
		w := -1
		for _, x := range m.Workers {
			if x.Blocks < m.Best() {
				break
			}
			if c := index[x.Worker]; w < 0 || busy[c] < busy[w] {
				w = c
			}
		}
		// SMG's spill gate: a holder loaded above 1.5× the mean (and by more
		// than a margin) loses the request to the least-loaded worker. Without
		// it every session of a shared prompt would follow the prompt's first
		// worker, a quarter of the fleet would take all the traffic, and no
		// block would ever be held by two workers.
		mean := float64(min(len(recent), window)) / float64(workers)
		if w >= 0 && float64(busy[w]) > 1.5*mean && float64(busy[w]) > mean+spillMargin {
			w = -1
		}
		if w < 0 {
			for c := range state {
				if w < 0 || busy[c] < busy[w] || busy[c] == busy[w] && state[c].reqs < state[w].reqs {
					w = c
				}
			}
		}
		// A request keeps its worker busy for the next window arrivals.
		if len(recent) >= window {
			busy[recent[len(recent)-window]]--
		}
		recent = append(recent, w)
		busy[w]++
		st := state[w]
		st.reqs++
		p.ops[w] = append(p.ops[w], replayOp{find: r.Tokens, content: ContentHashes(r.Tokens, bs, BaseSeed), blocks: n})
		p.order = append(p.order, w)
		p.blocks += int64(n)
		p.finds++
		hs := PrefixHashes(r.Tokens, bs, Namespace{})
		ehOf := func(j int) int64 { return int64(hs[j] ^ 0xe1e1e1e1) }
		var run *kvpb.KvBlocksStored
		flush := func() {
			if run != nil {
				b := batch(0, &kvpb.KvCacheEvent{Data: &kvpb.KvCacheEvent_Stored{Stored: run}})
				sim.Apply(p.workers[w], b)
				p.ops[w] = append(p.ops[w], replayOp{batch: b, prep: Prepare(b), blocks: len(run.Blocks)})
				p.order = append(p.order, w)
				p.blocks += int64(len(run.Blocks))
				run = nil
			}
		}
		for j := range n {
			eh := ehOf(j)
			if _, ok := st.pos[eh]; ok {
				flush()
				continue
			}
			if run == nil || len(run.Blocks) == 64 {
				flush()
				run = &kvpb.KvBlocksStored{}
				if j > 0 {
					parent := ehOf(j - 1)
					run.ParentBlockHash = &parent
				}
			}
			run.Blocks = append(run.Blocks, &kvpb.KvBlock{BlockHash: eh, TokenIds: r.Tokens[j*bs : (j+1)*bs], BlockSize: int32(bs)})
		}
		flush()
		// The request's blocks become the most recent, its last block first
		// in line for eviction: engines free a finished request's blocks tail
		// first (vLLM queues them in reverse; SGLang's radix cache evicts
		// leaves), so a cached chain shrinks from its end.
		for j := n - 1; j >= 0; j-- {
			eh := ehOf(j)
			if e, ok := st.pos[eh]; ok {
				st.lru.MoveToBack(e)
			} else {
				st.pos[eh] = st.lru.PushBack(eh)
			}
		}
		var evict []int64
		for st.lru.Len() > capacity {
			e := st.lru.Front()
			eh := e.Value.(int64)
			st.lru.Remove(e)
			delete(st.pos, eh)
			evict = append(evict, eh)
		}
		if len(evict) > 0 {
			b := batch(0, removed(unspec, evict...))
			sim.Apply(p.workers[w], b)
			p.ops[w] = append(p.ops[w], replayOp{batch: b, prep: Prepare(b), blocks: len(evict)})
			p.order = append(p.order, w)
			p.blocks += int64(len(evict))
		}
	}
	return p
}

// replay runs plan into a fresh index and returns it, the wall time and the
// lookup latencies.
func replay(plan replayPlan, bs int, in replayInput) (*Index, time.Duration, []time.Duration) {
	ix := New(Options{BlockSize: bs})
	g := runtime.GOMAXPROCS(0)
	lat := make([][]time.Duration, g)
	var wg sync.WaitGroup
	start := time.Now()
	for gi := range g {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var mine []int
			for w := gi; w < len(plan.workers); w += g {
				mine = append(mine, w)
			}
			next := make([]int, len(plan.workers))
			for left := true; left; {
				left = false
				for _, w := range mine {
					if next[w] == len(plan.ops[w]) {
						continue
					}
					left = true
					op := plan.ops[w][next[w]]
					next[w]++
					switch {
					case op.batch != nil && in == hashedInput:
						ix.ApplyPrepared(plan.workers[w], op.prep)
					case op.batch != nil:
						ix.Apply(plan.workers[w], op.batch)
					case in == hashedInput:
						t0 := time.Now()
						_ = ix.FindMatchesContent(op.content)
						lat[gi] = append(lat[gi], time.Since(t0))
					default:
						t0 := time.Now()
						_ = ix.FindMatches(op.find, Namespace{})
						lat[gi] = append(lat[gi], time.Since(t0))
					}
				}
			}
		}()
	}
	wg.Wait()
	el := time.Since(start)
	var all []time.Duration
	for _, l := range lat {
		all = append(all, l...)
	}
	return ix, el, all
}

func envInt(name string, def int) int {
	if v, err := strconv.Atoi(os.Getenv(name)); err == nil && v > 0 {
		return v
	}
	return def
}

func runReplay(b *testing.B, reqs []tracegen.Request, bs, capacityTokens int) {
	plan := planReplay(reqs, 128, bs, capacityTokens/bs)
	for _, in := range []replayInput{hashedInput, tokenInput} {
		b.Run(in.String(), func(b *testing.B) { runPlan(b, plan, bs, in) })
	}
}

func runPlan(b *testing.B, plan replayPlan, bs int, in replayInput) {
	b.ResetTimer()
	var el time.Duration
	var lat []time.Duration
	var ix *Index
	cpu0 := cpuTime()
	for range b.N {
		var e time.Duration
		var l []time.Duration
		ix, e, l = replay(plan, bs, in)
		el += e
		lat = append(lat, l...)
	}
	b.StopTimer()
	cpu := cpuTime() - cpu0
	ops := float64(plan.blocks) * float64(b.N)
	procs := runtime.GOMAXPROCS(0)
	b.ReportMetric(ops/el.Seconds(), "block-ops/s")
	b.ReportMetric(ops/el.Seconds()/float64(procs), "block-ops/s/core")
	if cpu > 0 {
		b.ReportMetric(ops/cpu.Seconds(), "block-ops/cpu-s")
	}
	if len(lat) > 0 {
		reportLatency(b, lat)
	}
	st := ix.Stats()
	if st.Memberships > 0 {
		b.ReportMetric(float64(st.MemoryBytes)/float64(st.Memberships), "est-B/worker-block")
		mb := memoryBreakdown(ix)
		per := func(n int) float64 { return float64(n) / float64(st.Memberships) }
		b.ReportMetric(per(mb.reverse), "rev-B/block")
		b.ReportMetric(mb.reverseLoad, "rev-load")
		b.ReportMetric(per(mb.runHeaders), "runhdr-B/block")
		b.ReportMetric(per(mb.arrays), "arrays-B/block")
		b.ReportMetric(per(mb.pooled), "pooled-B/block")
		b.ReportMetric(per(mb.other), "other-B/block")
		b.ReportMetric(float64(mb.entries)/float64(max(mb.runs, 1)), "held-positions/run")
	}
	b.ReportMetric(float64(plan.blocks), "block-ops/replay")
}

// BenchmarkReplaySynthetic: seeded sessions × turns over shared system
// prompts, 128 workers, block sizes 16 and 128. Scale with
// KVRELAY_REPLAY_SESSIONS (default 200, CI size).
func BenchmarkReplaySynthetic(b *testing.B) {
	sessions := envInt("KVRELAY_REPLAY_SESSIONS", 200)
	for _, bs := range []int{16, 128} {
		b.Run(fmt.Sprintf("bs%d", bs), func(b *testing.B) {
			reqs, err := tracegen.Synthetic(tracegen.SyntheticConfig{
				Seed: 42, Sessions: sessions, Turns: 5, PrefixPool: 32,
				PrefixBlocks: 2048 / bs, TurnBlocks: 512 / bs, BlockSize: bs,
			})
			if err != nil {
				b.Fatal(err)
			}
			runReplay(b, reqs, bs, 65536)
		})
	}
}

// BenchmarkReplayMooncake replays a Mooncake JSONL trace (hash id = 512
// tokens = 4 blocks of 128, duplication 20 as in Dynamo's runs). The default
// is a 60-record sample in the trace format made for CI; point
// KVRELAY_MOONCAKE_TRACE at a real trace for figures.
func BenchmarkReplayMooncake(b *testing.B) {
	path := os.Getenv("KVRELAY_MOONCAKE_TRACE")
	if path == "" {
		path = "tracegen/testdata/sample_mooncake.jsonl"
	}
	f, err := os.Open(path)
	if err != nil {
		b.Fatal(err)
	}
	recs, err := tracegen.ReadMooncake(f)
	f.Close()
	if err != nil {
		b.Fatal(err)
	}
	reqs, err := tracegen.ExpandMooncake(recs, tracegen.ExpandConfig{
		BlockSize: 128, LengthFactor: 4, Duplication: envInt("KVRELAY_MOONCAKE_DUP", 20),
	})
	if err != nil {
		b.Fatal(err)
	}
	runReplay(b, reqs, 128, 65536)
}

// TestReplayPlanIsExact checks the benchmark's own premise: replaying the
// plan from many goroutines leaves the index equal to the simulation's.
func TestReplayPlanIsExact(t *testing.T) {
	reqs, err := tracegen.Synthetic(tracegen.SyntheticConfig{Seed: 1, Sessions: 60, Turns: 3, PrefixPool: 4, PrefixBlocks: 8, TurnBlocks: 4, BlockSize: 16})
	if err != nil {
		t.Fatal(err)
	}
	plan := planReplay(reqs, 8, 16, 24)
	seq := New(Options{BlockSize: 16})
	evictions := 0
	for w, ops := range plan.ops {
		for _, op := range ops {
			if op.batch != nil {
				seq.Apply(plan.workers[w], op.batch)
				if op.batch.Events[0].GetRemoved() != nil {
					evictions++
				}
			}
		}
	}
	if evictions == 0 {
		t.Errorf("the plan evicts nothing; capacity too large for the test")
	}
	used := 0
	for _, ops := range plan.ops {
		if len(ops) > 0 {
			used++
		}
	}
	if st := seq.Stats(); used < len(plan.workers) || st.Entries >= st.Memberships {
		t.Errorf("%d of %d workers used, %d entries for %d memberships: the spill gate should spread shared prompts", used, len(plan.workers), st.Entries, st.Memberships)
	}
	for _, in := range []replayInput{hashedInput, tokenInput} {
		ix, _, lat := replay(plan, 16, in)
		if len(lat) != plan.finds {
			t.Errorf("%v: %d lookups, planned %d", in, len(lat), plan.finds)
		}
		for _, w := range plan.workers {
			a, b := ix.LiveSet(w), seq.LiveSet(w)
			if len(a) != len(b) {
				t.Fatalf("%v: %s: %d live blocks after parallel replay, %d sequentially", in, w, len(a), len(b))
			}
			for i := range a {
				if a[i] != b[i] || a[i].Copies != 1 {
					t.Fatalf("%v: %s: live block %d: %+v vs %+v", in, w, i, a[i], b[i])
				}
			}
		}
		for _, r := range reqs[:50] {
			want := matchMap(seq.FindMatches(r.Tokens, Namespace{}))
			for name, got := range map[string]Matches{
				"tokens":  ix.FindMatches(r.Tokens, Namespace{}),
				"content": ix.FindMatchesContent(ContentHashes(r.Tokens, 16, BaseSeed)),
				"prefix":  ix.FindMatchesHashes(PrefixHashes(r.Tokens, 16, Namespace{})),
			} {
				if g := matchMap(got); !maps.Equal(g, want) {
					t.Fatalf("%v: matches by %s differ: %v vs %v", in, name, g, want)
				}
			}
		}
	}
}

// indexMemory splits the index's memory estimate (Stats().MemoryBytes) by
// structure, to see what a block costs where.
type indexMemory struct {
	reverse     int     // workers' reverse tables (14 B a slot)
	reverseLoad float64 // their entries ÷ slots
	runHeaders  int     // run headers (their chunks)
	arrays      int     // run arrays in use (content, stamps, coverage)
	pooled      int     // arrays kept for reuse (run arrays and reverse tables)
	other       int     // child and heads tables, run directory, hole bitmaps, free lists, refs
	runs        int     // live runs
	entries     int     // held positions
}

func memoryBreakdown(ix *Index) indexMemory {
	var m indexMemory
	f := &ix.fw
	f.mu.Lock()
	live := f.liveRuns()
	m.runs = live
	m.entries = f.entries()
	m.runHeaders = f.chunks * int(unsafe.Sizeof(runChunk{}))
	m.arrays = f.bytes
	f.eachRun(func(_ uint32, r *run) { m.arrays += len(r.body.Load().cov) * int(unsafe.Sizeof(cover{})) })
	m.runHeaders += live * runBodyBytes
	m.other = f.memBytes() - m.runHeaders - m.arrays
	f.mu.Unlock()
	m.pooled = ix.pool.heldBytes()
	entries, slots := 0, 0
	ix.wmu.RLock()
	for _, ws := range ix.workers {
		ws.mu.Lock()
		for _, rt := range ws.ranks {
			m.reverse += rt.bytes()
			entries += rt.n
			slots += len(rt.slots)
		}
		m.other += len(ws.refs) * 16
		ws.mu.Unlock()
	}
	ix.wmu.RUnlock()
	if slots > 0 {
		m.reverseLoad = float64(entries) / float64(slots)
	}
	return m
}
