package index

import (
	"fmt"
	"math/rand/v2"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// replayPathOps is replayOps for the pathIndex prototype: the events go in
// as the corpus holds them (engine and content hashes), the lookups into
// one reused result.
func replayPathOps(px *pathIndex, ops []corpusOp, dst *[]pathMatch, r *corpusReplay) {
	rd := px.newReader()
	for _, op := range ops {
		switch op.kind {
		case corpusStore:
			px.store(op.worker, op.hasParent, op.parent, op.engine, op.content)
		case corpusRemove:
			px.remove(op.worker, op.engine)
		default:
			s := time.Now()
			*dst = px.lookup(rd, *dst, op.content)
			lat := time.Since(s)
			r.lat = append(r.lat, lat)
			r.checksum += uint64(pathBest(*dst))
		}
	}
}

func pathBest(m []pathMatch) uint32 {
	var b uint32
	for _, x := range m {
		b = max(b, x.blocks)
	}
	return b
}

// replayCorpusPath is replayCorpus for the pathIndex prototype.
func replayCorpusPath(c opsCorpus, onStart func()) (*pathIndex, corpusReplay) {
	px := newPathIndex(int(c.workers))
	var r corpusReplay
	var dst []pathMatch
	r.lat = make([]time.Duration, 0, len(c.ops))
	runtime.GC()
	if onStart != nil {
		onStart()
	}
	var k corpusClock
	k.start()
	replayPathOps(px, c.ops, &dst, &r)
	k.stop(&r)
	return px, r
}

// pathLockstep applies ops to an Index and a pathIndex side by side and
// fails t at the first lookup whose answers differ in any worker.
func pathLockstep(t *testing.T, workers int, ops []corpusOp) (*Index, *pathIndex) {
	t.Helper()
	c := opsCorpus{blockSize: 128, workers: uint32(workers), ops: ops}
	ix := New(Options{BlockSize: 128})
	px := newPathIndex(workers)
	names := corpusWorkerNames(c)
	preps := corpusPreps(c, ops)
	var m Matches
	var dst []pathMatch
	rd := px.newReader()
	for i, op := range ops {
		switch op.kind {
		case corpusStore:
			ix.ApplyPrepared(names[op.worker], preps[i])
			px.store(op.worker, op.hasParent, op.parent, op.engine, op.content)
		case corpusRemove:
			ix.ApplyPrepared(names[op.worker], preps[i])
			px.remove(op.worker, op.engine)
		default:
			ix.FindMatchesContentInto(&m, op.content)
			// No write is in progress: the first attempt must hold.
			var ok bool
			if dst, ok = px.tryLookup(rd, dst[:0], op.content); !ok {
				t.Fatalf("op %d: a lookup between writes failed its attempt", i)
			}
			want := make(map[string]int)
			for _, x := range m.Workers {
				want[x.Worker] = x.Blocks
			}
			got := make(map[string]int)
			for _, x := range dst {
				if _, dup := got[names[x.w]]; dup {
					t.Fatalf("op %d: worker %d twice in the prototype's answer", i, x.w)
				}
				got[names[x.w]] = int(x.blocks)
			}
			if fmt.Sprint(got) != fmt.Sprint(want) {
				t.Fatalf("op %d: lookup of %d blocks: prototype %v, Index %v", i, len(op.content), got, want)
			}
		}
	}
	return ix, px
}

// pathChain is a test chain: content hashes of positions, each block's
// engine hash derived from its path (as planReplay does, a function of the
// prefix), so that two workers storing one path name its blocks alike.
func pathChain(content ...uint64) (engine []uint64) {
	for _, p := range chainOf(content) {
		engine = append(engine, p^0xe1e1e1e1)
	}
	return engine
}

func pathStore(w uint32, content []uint64, from int, parentless bool) corpusOp {
	eng := pathChain(content...)
	op := corpusOp{kind: corpusStore, worker: w, engine: eng[from:], content: content[from:]}
	if from > 0 && !parentless {
		op.hasParent, op.parent = true, eng[from-1]
	}
	return op
}

func pathRemove(w uint32, content []uint64, at ...int) corpusOp {
	eng := pathChain(content...)
	op := corpusOp{kind: corpusRemove, worker: w}
	for _, i := range at {
		op.engine = append(op.engine, eng[i])
	}
	return op
}

func pathLookup(content ...uint64) corpusOp {
	return corpusOp{kind: corpusLookup, content: content}
}

// TestPathIndexCases: the corpus's shapes, each checked against Index
// lookup by lookup, and against the depths written here.
func TestPathIndexCases(t *testing.T) {
	a := []uint64{1, 2, 3, 4, 5, 6}
	b := []uint64{1, 2, 3, 7, 8} // branches off a after 3 blocks
	c := []uint64{1, 2, 9}       // branches off a after 2, inside the branch point of b
	for _, tc := range []struct {
		name string
		ops  []corpusOp
		want map[uint32]uint32 // the last lookup's answer
	}{
		{"append turns", []corpusOp{pathStore(0, a[:3], 0, false), pathStore(0, a, 3, false), pathLookup(a...)},
			map[uint32]uint32{0: 6}},
		{"branch", []corpusOp{pathStore(0, a, 0, false), pathStore(1, b, 0, false), pathStore(2, b, 3, false),
			pathLookup(b...)}, map[uint32]uint32{0: 3, 1: 5}},
		{"branch of a branch point", []corpusOp{pathStore(0, a, 0, false), pathStore(1, b, 0, false),
			pathStore(1, c, 2, false), pathLookup(c...)}, map[uint32]uint32{0: 2, 1: 3}},
		{"middle removed leaves a hole", []corpusOp{pathStore(0, a, 0, false), pathStore(1, a, 0, false),
			pathRemove(0, a, 2), pathLookup(a...)}, map[uint32]uint32{0: 2, 1: 6}},
		{"hole re-stored", []corpusOp{pathStore(0, a, 0, false), pathRemove(0, a, 2, 4), pathLookup(a...),
			pathStore(0, a[:3], 2, false), pathLookup(a...), pathStore(0, a[:5], 4, false), pathLookup(a...)},
			map[uint32]uint32{0: 6}},
		{"head removed, tail kept", []corpusOp{pathStore(0, a, 0, false), pathRemove(0, a, 0), pathLookup(a...),
			pathStore(0, a[:1], 0, false), pathLookup(a...)}, map[uint32]uint32{0: 6}},
		{"worker drops out", []corpusOp{pathStore(0, a, 0, false), pathStore(1, b, 0, false),
			pathRemove(0, a, 0, 1, 2, 3, 4, 5), pathLookup(a...)}, map[uint32]uint32{1: 3}},
		{"parentless store files from the root", []corpusOp{pathStore(0, a, 0, false), pathStore(1, a, 3, true),
			pathLookup(a[3:]...), pathLookup(a...)}, map[uint32]uint32{0: 6}},
		{"a copy outlives one removal", []corpusOp{pathStore(0, a, 0, false), pathStore(0, a, 0, false),
			pathRemove(0, a, 1), pathLookup(a...)}, map[uint32]uint32{0: 6}},
		{"twins: two names of one position", []corpusOp{pathStore(0, a, 0, false),
			{kind: corpusStore, worker: 0, hasParent: true, parent: pathChain(a...)[1], engine: []uint64{99}, content: a[2:3]},
			pathRemove(0, a, 2), pathLookup(a...)}, map[uint32]uint32{0: 6}},
		{"all gone", []corpusOp{pathStore(0, a, 0, false), pathStore(1, b, 0, false), pathRemove(1, b, 0, 1, 2, 3, 4),
			pathRemove(0, a, 5, 4, 3, 2, 1, 0), pathLookup(a...)}, map[uint32]uint32{}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, px := pathLockstep(t, 3, tc.ops)
			got := map[uint32]uint32{}
			for _, x := range px.lookup(px.newReader(), nil, tc.ops[len(tc.ops)-1].content) {
				got[x.w] = x.blocks
			}
			if fmt.Sprint(got) != fmt.Sprint(tc.want) {
				t.Fatalf("last lookup: %v, want %v", got, tc.want)
			}
		})
	}
}

// TestPathIndexDifferential: random event streams over a tree of chains
// (branches, parent-less stores, repeats, removals anywhere in a chain,
// unknown removals), every lookup compared with Index's; at the end every
// block is removed and the prototype must hold no run, child entry or
// coverage.
func TestPathIndexDifferential(t *testing.T) {
	for seed := range uint64(40) {
		t.Run(fmt.Sprint(seed), func(t *testing.T) {
			rng := rand.New(rand.NewPCG(seed, 7))
			const workers = 5
			// A tree of chains: each new chain copies a prefix of an older one
			// and goes on with new or reused contents.
			var chains [][]uint64
			for range 12 {
				var ch []uint64
				if len(chains) > 0 && rng.IntN(3) > 0 {
					old := chains[rng.IntN(len(chains))]
					ch = slices.Clone(old[:rng.IntN(len(old))+1])
				}
				for n := rng.IntN(12) + 1; n > 0; n-- {
					ch = append(ch, uint64(rng.IntN(6)+1))
				}
				chains = append(chains, ch)
			}
			var ops []corpusOp
			for range 400 {
				ch := chains[rng.IntN(len(chains))]
				w := uint32(rng.IntN(workers))
				switch k := rng.IntN(10); {
				case k < 4:
					from := rng.IntN(len(ch))
					to := from + 1 + rng.IntN(len(ch)-from)
					ops = append(ops, pathStore(w, ch[:to], from, rng.IntN(8) == 0))
				case k < 7:
					var at []int
					for range rng.IntN(4) + 1 {
						at = append(at, rng.IntN(len(ch)))
					}
					ops = append(ops, pathRemove(w, ch, at...))
				default:
					n := rng.IntN(len(ch)) + 1
					q := slices.Clone(ch[:n])
					if rng.IntN(3) == 0 {
						q = append(q, uint64(rng.IntN(6)+1))
					}
					ops = append(ops, pathLookup(q...))
				}
			}
			// Then everything goes: each chain's blocks, from every worker,
			// as often as stored (copies).
			for w := range uint32(workers) {
				for _, ch := range chains {
					all := make([]int, len(ch))
					for i := range all {
						all[i] = i
					}
					for range 40 {
						ops = append(ops, pathRemove(w, ch, all...))
					}
				}
			}
			// Parent-less stores filed blocks under other paths: their engine
			// hashes are the chain's, so the loops above took them too.
			ops = append(ops, pathLookup(chains[0]...))
			_, px := pathLockstep(t, workers, ops)
			if n := px.liveRuns(); n != 0 || px.kids.n != 0 {
				t.Fatalf("all removed: %d live runs, %d child entries", n, px.kids.n)
			}
			for w := range px.workers {
				if wk := &px.workers[w]; wk.rev.n != 0 || len(wk.twins) != 0 || len(wk.rev.copies) != 0 {
					t.Fatalf("worker %d: %d reverse entries, %d twins, %d copy counts left", w, wk.rev.n, len(wk.twins), len(wk.rev.copies))
				}
			}
			checkPathArrays(t, px)
			if px.content != 0 {
				t.Fatalf("all removed: %d positions of content arrays counted", px.content)
			}
		})
	}
}

// checkPathArrays checks the content arrays' counts against the arrays:
// content, the live runs' capacities; pooled, the free lists', each array
// in its own class's list; outside are arrays a test took from getArray.
func checkPathArrays(t *testing.T, px *pathIndex, outside ...[]uint64) {
	t.Helper()
	content, pooled := 0, 0
	for _, a := range outside {
		content += cap(a)
	}
	for i := uint32(1); i < px.nruns; i++ {
		content += cap(px.run(i).h)
	}
	for c := range px.arrays {
		for _, p := range px.arrays[c] {
			if p == nil {
				t.Fatalf("free list of class %d holds nil", c)
			}
			pooled += pxClassCap(c)
		}
	}
	if content != px.content || pooled != px.pooled {
		t.Fatalf("counted content %d, pooled %d; the arrays hold %d, %d", px.content, px.pooled, content, pooled)
	}
}

// TestPathArrayClasses: every request gets the smallest class that fits it,
// at most a quarter larger than asked past the smallest class, and a
// class's capacity is in that class.
func TestPathArrayClasses(t *testing.T) {
	for n := 1; n <= 1<<17; n++ {
		c := pxClass(n)
		if got := pxClassCap(c); got < n || (c > 0 && pxClassCap(c-1) >= n) || (n > pxMinCap && 4*got > 5*n) {
			t.Fatalf("n %d: class %d of capacity %d (the class below: %d)", n, c, got, pxClassCap(max(c-1, 0)))
		}
		if pxClass(pxClassCap(c)) != c {
			t.Fatalf("class %d: its capacity %d is in class %d", c, pxClassCap(c), pxClass(pxClassCap(c)))
		}
	}
	if c := pxClass(pxMaxRunLen); c >= pxClasses || pxClassCap(c) < pxMaxRunLen {
		t.Fatalf("a full run's class %d (capacity %d), %d classes", c, pxClassCap(c), pxClasses)
	}
}

// TestPathArrayPool: arrays given back are reused, from a class up to
// pxPoolUp above the one asked for; the free lists stop taking arrays at
// their bound (a share of the content arrays in use), and the counts match
// the arrays throughout.
func TestPathArrayPool(t *testing.T) {
	px := newPathIndex(1)
	var live [][]uint64
	for i := range 4000 {
		live = append(live, px.getArray(1+i%300))
	}
	checkPathArrays(t, px, live...)
	// Give back every other array: the free lists keep them up to their
	// bound, a share of the content arrays in use (which falls as they come
	// back, so the first bound is the most they hold).
	before, back := px.content, 0
	for i := 0; i < len(live); i += 2 {
		back += cap(live[i])
		px.putArray(live[i])
		live[i] = nil
	}
	checkPathArrays(t, px, live...)
	if px.content != before-back || px.pooled > max(pxPoolMin, before/pxPoolShare) ||
		px.pooled < min(back, px.content/pxPoolShare)-pxClassCap(pxClass(300)) {
		t.Fatalf("content %d → %d, %d given back: pooled %d", before, px.content, back, px.pooled)
	}
	// A request finds an array of its class, else one up to pxPoolUp classes above.
	c := pxClass(100)
	for k := range pxClasses {
		px.arrays[k] = px.arrays[k][:0]
	}
	px.pooled = 0
	px.putArray(make([]uint64, 0, pxClassCap(c+pxPoolUp)))
	px.content += pxClassCap(c + pxPoolUp) // as if it had come from getArray
	if a := px.getArray(100); cap(a) != pxClassCap(c+pxPoolUp) || px.pooled != 0 {
		t.Fatalf("got an array of %d (pooled %d), want the pooled one of %d", cap(a), px.pooled, pxClassCap(c+pxPoolUp))
	}
	px.putArray(make([]uint64, 0, pxClassCap(c+pxPoolUp+1)))
	px.content += pxClassCap(c + pxPoolUp + 1)
	if a := px.getArray(100); cap(a) != pxClassCap(c) || px.pooled != pxClassCap(c+pxPoolUp+1) {
		t.Fatalf("got an array of %d (pooled %d), want a new one of %d", cap(a), px.pooled, pxClassCap(c))
	}
}

// TestPathIndexSampleCorpus: the Mooncake sample corpus replayed into both,
// every lookup compared, and the replay's checksum equal to Index's.
func TestPathIndexSampleCorpus(t *testing.T) {
	c, _ := sampleCorpus(t, 2, 16, 64)
	pathLockstep(t, int(c.workers), c.ops)
	_, want := replayCorpus(c, replayOptions{})
	_, got := replayCorpusPath(c, nil)
	if got.checksum != want.checksum || want.checksum == 0 {
		t.Fatalf("checksum: prototype %d, Index %d", got.checksum, want.checksum)
	}
}

// TestPathIndexConcurrentReaders: lookups run, lock-free, while one writer
// applies stores and removals that append to, branch off, re-cover, free
// and reuse runs; the race detector must find no unsynchronised access.
// A lookup reads each run it enters whole, under the run's version, which
// the writer holds odd from its first change to the run in an event to the
// event's end: each run is seen as it was between two events, though two
// runs of one path may be seen between different events (as Index's
// readers see its runs). So a lookup during which at most one event ran,
// and that event changed one run, must give exactly the answer of the
// state before or after that event: every such lookup is checked (the
// writer counts its events; the states, and the runs each event changed,
// are recomputed afterwards by a sequential replay). A torn read, a
// half-written run, or a freed and reused one gives an answer neither
// state gave.
func TestPathIndexConcurrentReaders(t *testing.T) {
	const workers = 5
	stable := []uint64{1, 2, 3, 4, 5, 6, 7, 8}
	rng := rand.New(rand.NewPCG(3, 9))
	var chains [][]uint64
	for range 10 {
		ch := slices.Clone(stable[:rng.IntN(len(stable))+1])
		for n := rng.IntN(10) + 1; n > 0; n-- {
			ch = append(ch, uint64(rng.IntN(4)+1))
		}
		chains = append(chains, ch)
	}
	for range 4 {
		var ch []uint64
		for n := rng.IntN(10) + 1; n > 0; n-- {
			ch = append(ch, uint64(rng.IntN(4)+20))
		}
		chains = append(chains, ch)
	}
	ops := []corpusOp{pathStore(0, stable, 0, false)}
	for range 4 { // rounds, each ending with everything but worker 0's chain removed
		for range 300 {
			ch := chains[rng.IntN(len(chains))]
			w := uint32(rng.IntN(workers-1) + 1)
			if rng.IntN(3) > 0 {
				from := rng.IntN(len(ch))
				ops = append(ops, pathStore(w, ch[:from+1+rng.IntN(len(ch)-from)], from, rng.IntN(8) == 0))
			} else {
				ops = append(ops, pathRemove(w, ch, rng.IntN(len(ch)), rng.IntN(len(ch))))
			}
		}
		for w := uint32(1); w < workers; w++ {
			for _, ch := range chains {
				all := make([]int, len(ch))
				for i := range all {
					all[i] = i
				}
				for range copiesCap {
					ops = append(ops, pathRemove(w, ch, all...))
				}
			}
		}
	}
	// The rounds again, worker 0 keeping its chain: more events for the
	// readers to overlap, over runs freed and reused.
	for n := len(ops); len(ops) < 10*n; {
		ops = append(ops, ops[1:n]...)
	}
	queries := append(slices.Clone(chains), stable)
	answer := func(m []pathMatch) string {
		x := slices.Clone(m)
		slices.SortFunc(x, func(a, b pathMatch) int { return int(a.w) - int(b.w) })
		return fmt.Sprint(x)
	}
	type record struct {
		q, from, to int
		got         string
	}
	px := newPathIndex(workers)
	var applied, retries, kidRetries atomic.Int64
	done := make(chan struct{})
	recs := make(chan []record, 2)
	var ready sync.WaitGroup
	ready.Add(2)
	for g := range 2 {
		go func() {
			ready.Done()
			rd := px.newReader()
			var dst []pathMatch
			var out []record
			rng := rand.New(rand.NewPCG(uint64(g), 1))
			for {
				select {
				case <-done:
					retries.Add(int64(rd.retries))
					kidRetries.Add(int64(rd.kidRetries))
					recs <- out
					return
				default:
				}
				q := rng.IntN(len(queries))
				from := int(applied.Load())
				dst = px.lookup(rd, dst, queries[q])
				// The event in progress when the lookup ended may have been
				// seen: its state is a candidate too.
				to := min(int(applied.Load())+1, len(ops))
				out = append(out, record{q: q, from: from, to: to, got: answer(dst)})
			}
		}()
	}
	ready.Wait()
	for _, op := range ops {
		if op.kind == corpusStore {
			px.store(op.worker, op.hasParent, op.parent, op.engine, op.content)
		} else {
			px.remove(op.worker, op.engine)
		}
		applied.Add(1)
	}
	close(done)
	all := append(<-recs, <-recs...)
	if len(all) == 0 {
		t.Fatal("the readers made no lookup")
	}
	if n := px.liveRuns(); n != 1 {
		t.Fatalf("%d live runs after every other chain went, want worker 0's 1", n)
	}
	// Every state's answers, by a sequential replay (checked against Index
	// by the tests above).
	ref := newPathIndex(workers)
	rd := ref.newReader()
	changed := make([]int, len(ops)) // runs each event changed
	j := 0
	ref.onSettle = func(n int) { changed[j] = n }
	states := make([][]string, len(ops)+1)
	need := make([]bool, len(ops)+1)
	for _, r := range all {
		if r.to-r.from <= 1 {
			need[r.from], need[r.to] = true, true
		}
	}
	for ; j <= len(ops); j++ {
		if need[j] {
			states[j] = make([]string, len(queries))
			for q := range queries {
				states[j][q] = answer(ref.lookup(rd, nil, queries[q]))
			}
		}
		if j < len(ops) {
			if op := ops[j]; op.kind == corpusStore {
				ref.store(op.worker, op.hasParent, op.parent, op.engine, op.content)
			} else {
				ref.remove(op.worker, op.engine)
			}
		}
	}
	checked := 0
	for _, r := range all {
		if r.to-r.from > 1 || r.from < len(ops) && changed[r.from] > 1 {
			continue
		}
		checked++
		if got := r.got; got != states[r.from][r.q] && got != states[r.to][r.q] {
			t.Fatalf("lookup of %v during event %d: %s; the state before gave %s, after %s",
				queries[r.q], r.from, got, states[r.from][r.q], states[r.to][r.q])
		}
	}
	// At 2 vCPUs under load most lookups overlap at most one event; ask
	// for a sample large enough to have met runs changing under it.
	if checked < 1000 {
		t.Fatalf("only %d of %d lookups overlapped at most one event that changed one run", checked, len(all))
	}
	t.Logf("%d lookups (%d attempts redone, %d for the child table), %d checked against the states around them, over %d events",
		len(all), retries.Load(), kidRetries.Load(), checked, len(ops))
}

// TestPathKidsConcurrentProbes checks the child table's readers against one
// writer: keys that stay in the table are probed (get) while the writer
// inserts and deletes others around them, so that deletions shift entries
// back past the probes. The keys probed and churned all have their home in
// one window of the table, so that the clusters there are long and every
// deletion moves keys a probe is after. A probe may fail (the caller redoes
// its attempt) or name a wrong child (the caller's identity check rejects
// it), but it must never report a key that stays as absent. It also counts
// the probes that failed, of keys present and absent: only a change to a
// group of slots a probe read may fail it.
func TestPathKidsConcurrentProbes(t *testing.T) {
	const (
		size   = 4096 // slots, fixed by the filler keys
		window = 96   // slots where the probed and churned keys have their home
		stay   = 8
		churn  = 96
		absent = 8
	)
	var kt pxKids
	rng := rand.New(rand.NewPCG(5, 7))
	type key struct {
		parent, off uint32
		c           uint64
	}
	shift := uint8(64 - bitsLen(size-1))
	home := func(k key) int { return int(pxKidHash(uint64(k.parent)<<32|uint64(k.off), k.c) >> shift) }
	// keys[0:stay] stay, then churn, then absent (never stored) ones, all
	// homed in [size/2, size/2+window); fillers elsewhere fill the table
	// to half, so that it never grows while probed.
	var keys, fillers []key
	for id := uint32(1); len(keys) < stay+churn+absent || len(fillers) < size/2; id++ {
		k := key{id, uint32(rng.IntN(4)), rng.Uint64()}
		if h := home(k); h >= size/2 && h < size/2+window {
			if len(keys) < stay+churn+absent {
				keys = append(keys, k)
			}
		} else if h < size/4 || h >= size*3/4 {
			if len(fillers) < size/2 {
				fillers = append(fillers, k)
			}
		}
	}
	for i, k := range fillers {
		kt.put(k.parent, k.off, k.c, uint32(1_000_000+i))
	}
	if len(kt.s) != size {
		t.Fatalf("table of %d slots, want %d", len(kt.s), size)
	}
	// The churned keys first, then the ones that stay: these land past
	// their homes, behind churned ones, and move back as those go.
	in := make([]bool, churn)
	for i := range churn {
		k := keys[stay+i]
		kt.put(k.parent, k.off, k.c, uint32(stay+i+1))
		in[i] = true
	}
	for i := range stay {
		kt.put(keys[i].parent, keys[i].off, keys[i].c, uint32(i+1))
	}
	var done atomic.Bool
	var probes, failed, wrong, lost, misses, missFailed atomic.Int64
	var wg sync.WaitGroup
	wg.Add(1)
	started := make(chan struct{})
	go func() {
		defer wg.Done()
		rng := rand.New(rand.NewPCG(1, 2))
		var n, f, w, l, m, mf int64
		close(started)
		for !done.Load() {
			if rng.IntN(4) == 0 {
				k := keys[stay+churn+rng.IntN(absent)]
				child, ok := kt.get(k.parent, k.off, k.c)
				m++
				switch {
				case !ok:
					mf++
				case child != 0:
					w++
				}
				continue
			}
			i := rng.IntN(stay)
			k := keys[i]
			child, ok := kt.get(k.parent, k.off, k.c)
			n++
			switch {
			case !ok:
				f++
			case child == 0:
				l++
			case child != uint32(i+1):
				w++
			}
		}
		probes.Add(n)
		failed.Add(f)
		wrong.Add(w)
		lost.Add(l)
		misses.Add(m)
		missFailed.Add(mf)
	}()
	<-started
	ops := 3_000_000
	if raceEnabled {
		ops = 300_000
	}
	for range ops {
		i := rng.IntN(churn)
		k := keys[stay+i]
		if in[i] {
			kt.del(k.parent, k.off, k.c)
		} else {
			kt.put(k.parent, k.off, k.c, uint32(stay+i+1))
		}
		in[i] = !in[i]
	}
	done.Store(true)
	wg.Wait()
	if probes.Load() == 0 {
		t.Fatal("no probe ran")
	}
	if lost.Load() != 0 {
		t.Fatalf("%d of %d probes reported a key that stays as absent", lost.Load(), probes.Load())
	}
	for i := range stay {
		if c, ok := kt.get(keys[i].parent, keys[i].off, keys[i].c); !ok || c != uint32(i+1) {
			t.Fatalf("key %d: child %d, %v after the writer stopped", i, c, ok)
		}
	}
	t.Logf("during %d changes: %d probes of keys that stay, %d failed (%.3f%%); %d of absent keys, %d failed (%.3f%%); %d named another child",
		ops, probes.Load(), failed.Load(), 100*float64(failed.Load())/float64(probes.Load()),
		misses.Load(), missFailed.Load(), 100*float64(missFailed.Load())/float64(max(1, misses.Load())), wrong.Load())
}

// checkRev checks t against model (engine hash → position) and the
// linear-probing invariant: every entry is reachable from its home without
// crossing an empty slot.
func checkRev(t *testing.T, r *pxRev, model map[uint64][2]uint32) {
	t.Helper()
	if r.n != len(model) {
		t.Fatalf("%d entries, the model has %d", r.n, len(model))
	}
	n := len(r.keys)
	for i, m := range r.keys {
		if m == 0 {
			continue
		}
		for h := pxRevHome(m, n); h != i; h = (h + 1) % n {
			if r.keys[h] == 0 {
				t.Fatalf("slot %d: an empty slot %d between it and its home %d", i, h, pxRevHome(m, n))
			}
		}
	}
	for k, want := range model {
		i := r.find(k)
		if i < 0 {
			t.Fatalf("key %#x not found", k)
		}
		if run, off := r.pos(i); run != want[0] || off != want[1] {
			t.Fatalf("key %#x: position (%d, %d), want (%d, %d)", k, run, off, want[0], want[1])
		}
	}
}

// TestPathRevTable: the reverse table against a map, with keys that share
// homes (and the zero key, whose mixed form is 0 and which has no slot),
// through growth and deletions that shift entries back across the table's
// end.
func TestPathRevTable(t *testing.T) {
	for seed := range uint64(20) {
		rng := rand.New(rand.NewPCG(seed, 3))
		var r pxRev
		model := map[uint64][2]uint32{}
		var keys []uint64
		for range 3000 {
			switch k := rng.IntN(10); {
			case k < 5 || len(keys) == 0:
				key := uint64(rng.IntN(400)) // small keys, zero among them
				if rng.IntN(2) == 0 {
					key = rng.Uint64()
				}
				i, found := r.upsert(key)
				if _, in := model[key]; in != found {
					t.Fatalf("seed %d: upsert %#x found %v, model %v", seed, key, found, in)
				}
				if !found {
					p := [2]uint32{1 + rng.Uint32N(pxMaxRuns-1), rng.Uint32N(pxMaxRunLen + 1)}
					r.setPos(i, p[0], p[1])
					model[key] = p
					keys = append(keys, key)
				}
			default:
				j := rng.IntN(len(keys))
				key := keys[j]
				keys[j] = keys[len(keys)-1]
				keys = keys[:len(keys)-1]
				i := r.find(key)
				if i < 0 {
					t.Fatalf("seed %d: %#x not found", seed, key)
				}
				r.del(i)
				delete(model, key)
				if r.find(key) >= 0 {
					t.Fatalf("seed %d: %#x found after its deletion", seed, key)
				}
			}
			checkRev(t, &r, model)
		}
	}
}

// TestPathRevWrap: entries whose homes are the table's last slot wrap to
// its start, and deleting the first of them moves the others back across
// the end.
func TestPathRevWrap(t *testing.T) {
	var r pxRev
	r.upsert(1)
	r.del(r.find(1))
	n := len(r.keys)
	var last []uint64 // keys whose home is slot n-1
	for k := uint64(2); len(last) < 3; k++ {
		if pxRevHome(k*pxMul, n) == n-1 {
			last = append(last, k)
		}
	}
	model := map[uint64][2]uint32{}
	for j, k := range last {
		i, _ := r.upsert(k)
		r.setPos(i, uint32(j+1), uint32(j))
		model[k] = [2]uint32{uint32(j + 1), uint32(j)}
	}
	if len(r.keys) != n || r.find(last[1]) != 0 || r.find(last[2]) != 1 {
		t.Fatalf("table of %d: slots %d, %d, want 0, 1", len(r.keys), r.find(last[1]), r.find(last[2]))
	}
	r.del(r.find(last[0]))
	delete(model, last[0])
	if r.find(last[1]) != n-1 || r.find(last[2]) != 0 || r.keys[1] != 0 {
		t.Fatalf("after the deletion: slots %d, %d (want %d, 0), slot 1 %#x", r.find(last[1]), r.find(last[2]), n-1, r.keys[1])
	}
	checkRev(t, &r, model)
}

// TestPathRevPacking: a position at the limits of its 31 bits comes back
// whole, copies or not, and copies count up to copiesCap and come off one a
// removal.
func TestPathRevPacking(t *testing.T) {
	var r pxRev
	for _, k := range []uint64{0, 1, ^uint64(0)} {
		for _, p := range [][2]uint32{{1, 0}, {pxMaxRuns - 1, pxMaxRunLen}, {pxMaxRuns - 1, 0}, {1, pxMaxRunLen}} {
			i, found := r.upsert(k)
			if found {
				t.Fatalf("key %#x: found before it went in", k)
			}
			r.setPos(i, p[0], p[1])
			for range copiesCap + 3 {
				if j, found := r.upsert(k); !found || j != i {
					t.Fatalf("key %#x: upsert again gave slot %d (found %v), want %d", k, j, found, i)
				}
				r.addCopy(i, k)
				if run, off := r.pos(i); run != p[0] || off != p[1] {
					t.Fatalf("key %#x with copies: (%d, %d), want %v", k, run, off, p)
				}
			}
			drops := 0
			for r.dropCopy(r.find(k), k) {
				drops++
			}
			if drops != copiesCap-1 || len(r.copies) != 0 {
				t.Fatalf("key %#x: %d copies taken (want %d), %d left counted", k, drops, copiesCap-1, len(r.copies))
			}
			if run, off := r.pos(r.find(k)); run != p[0] || off != p[1] {
				t.Fatalf("key %#x: (%d, %d), want %v", k, run, off, p)
			}
			r.del(r.find(k))
			if r.find(k) >= 0 || r.n != 0 {
				t.Fatalf("key %#x: still found after its deletion (%d entries)", k, r.n)
			}
		}
	}
}

// TestPathIndexLongChain: a chain longer than a run can hold goes on in
// children of full runs (a reverse slot names offsets up to pxMaxRunLen),
// stored in one event and in pieces, branched off at and around a run's
// end, with holes; every lookup checked against Index.
func TestPathIndexLongChain(t *testing.T) {
	long := make([]uint64, 2*pxMaxRunLen+40)
	for i := range long {
		long[i] = uint64(i%7 + 1)
	}
	branch := func(at int) []uint64 { return append(slices.Clone(long[:at]), 99) }
	L := pxMaxRunLen
	ops := []corpusOp{
		pathStore(0, long, 0, false),
		pathLookup(long...),
		pathStore(1, long[:L-1], 0, false),
		pathStore(1, long[:L+5], L-1, false), // across the first run's end
		pathStore(2, branch(L), 0, false),    // a branch right after a full run
		pathStore(3, branch(L-1), 0, false),  // and one inside it
		pathStore(3, branch(2*L), 0, false),
		pathLookup(long...), pathLookup(branch(L)...), pathLookup(branch(L - 1)...), pathLookup(branch(2 * L)...),
		pathRemove(0, long, L-1, L, 2*L+1),
		pathRemove(1, long, 3),
		pathLookup(long...), pathLookup(branch(L)...),
		pathStore(0, long[:L+1], L-1, false), // the holes refilled
		pathLookup(long...),
	}
	_, px := pathLockstep(t, 4, ops)
	if px.liveRuns() < 3 {
		t.Fatalf("%d live runs: the long chain was not split", px.liveRuns())
	}
}
