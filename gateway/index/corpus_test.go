package index

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
	"reflect"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/kvrelay/kvrelay/gateway/index/tracegen"
	"github.com/kvrelay/kvrelay/proto/kvpb"
)

// The neutral indexer corpus of bench/indexers (issue 19.3): one replay plan
// (planReplay: the trace routed once, each worker's stores, LRU removals and
// lookups) written as a flat file that our index and the Rust and Go
// indexers each replay, in one order, on one thread. Its layout is in
// bench/indexers/README.md ("KVRIDX01"); every integer is little-endian.
// Each block carries the three hashes the indexers take: the engine's block
// hash (stores' parent and removals), the content hash (SMG's and Dynamo's
// lookups, our FindMatchesContent) and the prefix hash (llm-d's request key).

const corpusMagic = "KVRIDX01"

// Bounds on the counts a corpus declares, checked before anything is sized
// by them.
const (
	corpusMaxWorkers = 1024
	corpusMaxBlocks  = 1 << 20
)

const (
	corpusLookup uint8 = iota
	corpusStore
	corpusRemove
)

type corpusOp struct {
	kind      uint8
	worker    uint32
	hasParent bool
	parent    uint64   // store: the parent's engine hash
	engine    []uint64 // store, remove: engine hashes
	content   []uint64 // lookup, store
	prefix    []uint64 // lookup, store
}

func (op corpusOp) blocks() int { return max(len(op.engine), len(op.content)) }

type opsCorpus struct {
	blockSize uint32
	workers   uint32
	blockOps  uint64
	ops       []corpusOp
}

// corpusFromPlan serialises plan in the order the simulation made its ops.
func corpusFromPlan(plan replayPlan, bs int) opsCorpus {
	c := opsCorpus{blockSize: uint32(bs), workers: uint32(len(plan.workers))}
	next := make([]int, len(plan.workers))
	for _, w := range plan.order {
		op := plan.ops[w][next[w]]
		next[w]++
		o := corpusOp{worker: uint32(w)}
		switch {
		case op.batch == nil:
			o.kind = corpusLookup
			o.content = op.content
			o.prefix = chainOf(op.content)
		case op.batch.Events[0].GetStored() != nil:
			s := op.batch.Events[0].GetStored()
			o.kind = corpusStore
			if s.ParentBlockHash != nil {
				o.hasParent, o.parent = true, uint64(*s.ParentBlockHash)
			}
			o.content = op.prep.content[0]
			prev := uint64(0)
			for j, b := range s.Blocks {
				o.engine = append(o.engine, uint64(b.BlockHash))
				// planReplay names a block by its prefix hash ^ 0xe1e1e1e1.
				p := uint64(b.BlockHash) ^ 0xe1e1e1e1
				if j > 0 && p != ChainHash(prev, o.content[j]) {
					panic("corpus: a stored run is not one chain")
				}
				prev = p
				o.prefix = append(o.prefix, p)
			}
		default:
			o.kind = corpusRemove
			for _, h := range op.batch.Events[0].GetRemoved().BlockHashes {
				o.engine = append(o.engine, uint64(h))
			}
		}
		c.blockOps += uint64(o.blocks())
		c.ops = append(c.ops, o)
	}
	return c
}

func chainOf(content []uint64) []uint64 {
	out := make([]uint64, len(content))
	for i, h := range content {
		if i == 0 {
			out[i] = h
		} else {
			out[i] = ChainHash(out[i-1], h)
		}
	}
	return out
}

func writeCorpus(w io.Writer, c opsCorpus) error {
	bw := bufio.NewWriterSize(w, 64<<10)
	var buf []byte
	u8 := func(v uint8) { buf = append(buf, v) }
	u32 := func(v uint32) { buf = binary.LittleEndian.AppendUint32(buf, v) }
	u64 := func(v uint64) { buf = binary.LittleEndian.AppendUint64(buf, v) }
	buf = append(buf, corpusMagic...)
	u32(c.blockSize)
	u32(c.workers)
	u64(uint64(len(c.ops)))
	u64(c.blockOps)
	for _, op := range c.ops {
		u8(op.kind)
		u32(op.worker)
		u32(uint32(op.blocks()))
		switch op.kind {
		case corpusLookup:
			for i := range op.content {
				u64(op.content[i])
				u64(op.prefix[i])
			}
		case corpusStore:
			if op.hasParent {
				u8(1)
			} else {
				u8(0)
			}
			u64(op.parent)
			for i := range op.engine {
				u64(op.engine[i])
				u64(op.content[i])
				u64(op.prefix[i])
			}
		case corpusRemove:
			for _, h := range op.engine {
				u64(h)
			}
		}
		if _, err := bw.Write(buf); err != nil {
			return fmt.Errorf("corpus: write: %w", err)
		}
		buf = buf[:0]
	}
	if _, err := bw.Write(buf); err != nil {
		return fmt.Errorf("corpus: write: %w", err)
	}
	if err := bw.Flush(); err != nil {
		return fmt.Errorf("corpus: write: %w", err)
	}
	return nil
}

// readCorpus parses a corpus. A truncated or inconsistent file is an error
// naming what is wrong and where; no declared count sizes an allocation
// before it is checked against the bounds above.
func readCorpus(r io.Reader) (opsCorpus, error) { return streamCorpus(r, 0, nil) }

// streamCorpus is readCorpus handing the operations to each, chunk at a
// time, instead of keeping them (each nil: keeps them all, as readCorpus);
// the returned corpus then has none. each must not keep the slice it is
// given (it is reused), only what its operations point to.
func streamCorpus(r io.Reader, chunk int, each func(c opsCorpus, ops []corpusOp)) (opsCorpus, error) {
	br := bufio.NewReaderSize(r, 64<<10)
	var scratch [8]byte
	read := func(n int) ([]byte, error) {
		if _, err := io.ReadFull(br, scratch[:n]); err != nil {
			if errors.Is(err, io.EOF) {
				err = io.ErrUnexpectedEOF
			}
			return nil, err
		}
		return scratch[:n], nil
	}
	var c opsCorpus
	var err error
	u8 := func() uint8 {
		if err != nil {
			return 0
		}
		var b []byte
		if b, err = read(1); err != nil {
			return 0
		}
		return b[0]
	}
	u32 := func() uint32 {
		if err != nil {
			return 0
		}
		var b []byte
		if b, err = read(4); err != nil {
			return 0
		}
		return binary.LittleEndian.Uint32(b)
	}
	u64 := func() uint64 {
		if err != nil {
			return 0
		}
		var b []byte
		if b, err = read(8); err != nil {
			return 0
		}
		return binary.LittleEndian.Uint64(b)
	}
	hashes := func(n uint32) []uint64 {
		out := make([]uint64, n)
		for i := range out {
			out[i] = u64()
		}
		return out
	}
	magic, err := read(len(corpusMagic))
	if err != nil {
		return c, fmt.Errorf("corpus: header: %w", err)
	}
	if string(magic) != corpusMagic {
		return c, fmt.Errorf("corpus: magic %q, want %q", magic, corpusMagic)
	}
	c.blockSize, c.workers = u32(), u32()
	nops, blockOps := u64(), u64()
	if err != nil {
		return c, fmt.Errorf("corpus: header: %w", err)
	}
	if c.blockSize == 0 || c.workers == 0 || c.workers > corpusMaxWorkers {
		return c, fmt.Errorf("corpus: block size %d, %d workers (1 to %d)", c.blockSize, c.workers, corpusMaxWorkers)
	}
	for i := uint64(0); i < nops; i++ {
		op := corpusOp{kind: u8(), worker: u32()}
		n := u32()
		if err != nil {
			return c, fmt.Errorf("corpus: op %d of %d: %w", i, nops, err)
		}
		if op.worker >= c.workers {
			return c, fmt.Errorf("corpus: op %d: worker %d, the corpus has %d", i, op.worker, c.workers)
		}
		if n == 0 || n > corpusMaxBlocks {
			return c, fmt.Errorf("corpus: op %d: %d blocks (1 to %d)", i, n, corpusMaxBlocks)
		}
		switch op.kind {
		case corpusLookup:
			op.content, op.prefix = make([]uint64, n), make([]uint64, n)
			for j := range n {
				op.content[j], op.prefix[j] = u64(), u64()
			}
		case corpusStore:
			hp := u8()
			op.hasParent, op.parent = hp == 1, u64()
			if hp > 1 {
				return c, fmt.Errorf("corpus: op %d: has_parent %d (0 or 1)", i, hp)
			}
			op.engine, op.content, op.prefix = make([]uint64, n), make([]uint64, n), make([]uint64, n)
			for j := range n {
				op.engine[j], op.content[j], op.prefix[j] = u64(), u64(), u64()
			}
		case corpusRemove:
			op.engine = hashes(n)
		default:
			return c, fmt.Errorf("corpus: op %d: unknown kind %d", i, op.kind)
		}
		if err != nil {
			return c, fmt.Errorf("corpus: op %d of %d: %w", i, nops, err)
		}
		c.blockOps += uint64(n)
		c.ops = append(c.ops, op)
		if each != nil && (len(c.ops) == chunk || i+1 == nops) {
			each(c, c.ops)
			clear(c.ops)
			c.ops = c.ops[:0]
		}
	}
	if c.blockOps != blockOps {
		return c, fmt.Errorf("corpus: header says %d block ops, the operations hold %d", blockOps, c.blockOps)
	}
	if _, err := br.ReadByte(); err != io.EOF {
		return c, fmt.Errorf("corpus: data after operation %d", nops)
	}
	return c, nil
}

// replayOptions vary replayCorpus's timed part.
type replayOptions struct {
	// allocating: the lookups are FindMatchesContent, a new result each,
	// instead of FindMatchesContentInto one result (an A/B in one binary).
	allocating bool
	// onStart, if set, runs right before the timed part (a CPU profile's start).
	onStart func()
	// probe, if set, is called around every lookup, outside its timed
	// window (the stall diagnosis of the indexerbench harness).
	probe lookupProbe
}

// lookupProbe observes each timed lookup: before runs right before its
// clock starts, after right after it stops, with its wall time and blocks.
type lookupProbe interface {
	before()
	after(wall time.Duration, blocks int)
}

// corpusReplay is what one replay of a corpus into our index measured.
type corpusReplay struct {
	cpu, wall time.Duration
	lat       []time.Duration
	checksum  uint64 // sum over lookups of the best prefix depth
	// Over the timed part: heap bytes allocated, minor page faults taken
	// (process-wide) and collector cycles completed.
	allocBytes, faults uint64
	gcs                uint32
}

// corpusPreps builds the Prepared of every apply operation of ops (nil for
// a lookup), as the gateway's decoder would hand them to the index.
func corpusPreps(c opsCorpus, ops []corpusOp) []*Prepared {
	preps := make([]*Prepared, len(ops))
	for i, op := range ops {
		switch op.kind {
		case corpusStore:
			s := &kvpb.KvBlocksStored{Blocks: make([]*kvpb.KvBlock, len(op.engine))}
			if op.hasParent {
				p := int64(op.parent)
				s.ParentBlockHash = &p
			}
			for j, h := range op.engine {
				s.Blocks[j] = &kvpb.KvBlock{BlockHash: int64(h), BlockSize: int32(c.blockSize)}
			}
			b := batch(0, &kvpb.KvCacheEvent{Data: &kvpb.KvCacheEvent_Stored{Stored: s}})
			preps[i] = &Prepared{batch: b, content: [][]uint64{op.content}}
		case corpusRemove:
			hs := make([]int64, len(op.engine))
			for j, h := range op.engine {
				hs[j] = int64(h)
			}
			preps[i] = &Prepared{batch: batch(0, removed(unspec, hs...))}
		}
	}
	return preps
}

// corpusClock measures a timed part: CPU and wall time, heap bytes
// allocated, minor faults and collector cycles between start and stop,
// summed over as many parts as it is started and stopped for.
type corpusClock struct {
	cpu0            time.Duration
	t0              time.Time
	alloc0, faults0 uint64
	gc0             uint32
}

func (k *corpusClock) start() {
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	k.alloc0, k.gc0, k.faults0 = ms.TotalAlloc, ms.NumGC, minorFaults()
	k.cpu0, k.t0 = cpuTime(), time.Now()
}

func (k *corpusClock) stop(r *corpusReplay) {
	r.wall += time.Since(k.t0)
	r.cpu += cpuTime() - k.cpu0
	f := minorFaults()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	r.allocBytes += ms.TotalAlloc - k.alloc0
	r.gcs += ms.NumGC - k.gc0
	r.faults += f - k.faults0
}

// replayOps applies or looks up ops in order on the calling goroutine (the
// timed part of a replay).
func replayOps(ix *Index, names []WorkerID, ops []corpusOp, preps []*Prepared, m *Matches, r *corpusReplay, opts replayOptions) {
	for i, op := range ops {
		if op.kind != corpusLookup {
			ix.ApplyPrepared(names[op.worker], preps[i])
			continue
		}
		if opts.probe != nil {
			opts.probe.before()
		}
		s := time.Now()
		if opts.allocating {
			*m = ix.FindMatchesContent(op.content)
		} else {
			ix.FindMatchesContentInto(m, op.content)
		}
		lat := time.Since(s)
		if opts.probe != nil {
			opts.probe.after(lat, len(op.content))
		}
		r.lat = append(r.lat, lat)
		r.checksum += uint64(m.Best())
	}
}

func corpusWorkerNames(c opsCorpus) []WorkerID {
	names := make([]WorkerID, c.workers)
	for i := range names {
		names[i] = fmt.Sprintf("worker-%03d", i)
	}
	return names
}

// replayCorpus replays c into a fresh index on the calling goroutine, as
// the Rust harness does: every batch, Prepared and lookup is built first;
// the timed part is ApplyPrepared and FindMatchesContentInto in corpus order,
// every lookup into the same Matches (as SMG's score_into reuses its output),
// so that lookups allocate nothing.
func replayCorpus(c opsCorpus, opts replayOptions) (*Index, corpusReplay) {
	ix := New(Options{BlockSize: int(c.blockSize)})
	names := corpusWorkerNames(c)
	preps := corpusPreps(c, c.ops)
	var r corpusReplay
	var m Matches
	r.lat = make([]time.Duration, 0, len(c.ops))
	// Collect the setup's garbage (the decoded corpus file, the batches
	// built above) before the clock starts: otherwise the collector's
	// cycles over it fall inside the timed replay and are charged to the
	// index, which the Rust harnesses, with no collector, never pay for
	// their own setup.
	runtime.GC()
	if opts.onStart != nil {
		opts.onStart()
	}
	var k corpusClock
	k.start()
	replayOps(ix, names, c.ops, preps, &m, &r, opts)
	k.stop(&r)
	return ix, r
}

func sampleCorpus(t testing.TB, dup, workers, capacity int) (opsCorpus, replayPlan) {
	f, err := os.Open("tracegen/testdata/sample_mooncake.jsonl")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	recs, err := tracegen.ReadMooncake(f)
	if err != nil {
		t.Fatal(err)
	}
	reqs, err := tracegen.ExpandMooncake(recs, tracegen.ExpandConfig{BlockSize: 128, LengthFactor: 4, Duplication: dup})
	if err != nil {
		t.Fatal(err)
	}
	plan := planReplay(reqs, workers, 128, capacity)
	return corpusFromPlan(plan, 128), plan
}

// TestCorpusRoundTripAndReplay: the corpus carries the plan whole (written
// and read back it is the same), and replaying it with content hashes only
// gives every lookup the answer the plan's token-level replay gives.
func TestCorpusRoundTripAndReplay(t *testing.T) {
	c, plan := sampleCorpus(t, 2, 16, 64)
	var kinds [3]int
	for _, op := range c.ops {
		kinds[op.kind]++
	}
	if kinds[corpusLookup] != plan.finds || kinds[corpusStore] == 0 || kinds[corpusRemove] == 0 {
		t.Fatalf("corpus ops by kind %v, plan has %d lookups: want lookups, stores and removals", kinds, plan.finds)
	}
	if int64(c.blockOps) != plan.blocks {
		t.Fatalf("corpus holds %d block ops, plan %d", c.blockOps, plan.blocks)
	}
	var buf bytes.Buffer
	if err := writeCorpus(&buf, c); err != nil {
		t.Fatal(err)
	}
	back, err := readCorpus(bytes.NewReader(buf.Bytes()))
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(back, c) {
		t.Fatal("corpus read back differs from the one written")
	}
	// The reference: the plan's own batches, with tokens, in the same order.
	ref := New(Options{BlockSize: 128})
	next := make([]int, len(plan.workers))
	var want uint64
	for _, w := range plan.order {
		op := plan.ops[w][next[w]]
		next[w]++
		if op.batch != nil {
			ref.Apply(plan.workers[w], op.batch)
		} else {
			want += uint64(ref.FindMatches(op.find, Namespace{}).Best())
		}
	}
	ix, r := replayCorpus(back, replayOptions{})
	if r.checksum != want || want == 0 {
		t.Fatalf("replayed corpus: lookups' best depths sum to %d, the token replay to %d", r.checksum, want)
	}
	if len(r.lat) != plan.finds {
		t.Fatalf("%d lookups timed, %d planned", len(r.lat), plan.finds)
	}
	for _, w := range plan.workers {
		if a, b := ix.LiveSet(w), ref.LiveSet(w); !reflect.DeepEqual(a, b) {
			t.Fatalf("%s: live set after the corpus replay differs from the token replay's (%d vs %d blocks)", w, len(a), len(b))
		}
	}
}

func TestReadCorpusRejects(t *testing.T) {
	c, _ := sampleCorpus(t, 1, 4, 64)
	var buf bytes.Buffer
	if err := writeCorpus(&buf, c); err != nil {
		t.Fatal(err)
	}
	good := buf.Bytes()
	patch := func(off int, v uint32) []byte {
		b := bytes.Clone(good)
		binary.LittleEndian.PutUint32(b[off:], v)
		return b
	}
	const firstOp = 8 + 4 + 4 + 8 + 8
	for _, tc := range []struct {
		name string
		in   []byte
		want string
	}{
		{"empty", nil, "header"},
		{"magic", append([]byte("KVRIDX02"), good[8:]...), "magic"},
		{"workers", patch(12, corpusMaxWorkers+1), "workers"},
		{"truncated", good[:len(good)-3], "unexpected EOF"},
		{"worker out of range", patch(firstOp+1, 4), "worker 4"},
		{"huge block count", patch(firstOp+5, 1<<31), "blocks"},
		{"kind", append(append(bytes.Clone(good[:firstOp]), 9), good[firstOp+1:]...), "unknown kind 9"},
		{"trailing data", append(bytes.Clone(good), 0), "data after"},
		{"total", func() []byte { b := bytes.Clone(good); b[24]++; return b }(), "block ops"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := readCorpus(bytes.NewReader(tc.in))
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("readCorpus: %v, want an error containing %q", err, tc.want)
			}
		})
	}
}

// FuzzReadCorpus: no input may panic, hang or allocate by an unchecked count.
func FuzzReadCorpus(f *testing.F) {
	c, _ := sampleCorpus(f, 1, 4, 64)
	c.ops = c.ops[:min(len(c.ops), 6)]
	c.blockOps = 0
	for _, op := range c.ops {
		c.blockOps += uint64(op.blocks())
	}
	var buf bytes.Buffer
	if err := writeCorpus(&buf, c); err != nil {
		f.Fatal(err)
	}
	f.Add(buf.Bytes())
	f.Add([]byte(corpusMagic))
	f.Fuzz(func(t *testing.T, in []byte) {
		got, err := readCorpus(bytes.NewReader(in))
		if err != nil {
			return
		}
		var out bytes.Buffer
		if err := writeCorpus(&out, got); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(out.Bytes(), in) {
			t.Fatalf("a corpus that reads does not write back the same bytes")
		}
	})
}
