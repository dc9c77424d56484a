package bench

import (
	"encoding/binary"
	"errors"
	"fmt"
	"hash/fnv"
	"math/rand/v2"
	"os"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvrelay/kvrelay/gateway/index"
	"github.com/kvrelay/kvrelay/proto/kvpb"
	"github.com/kvrelay/kvrelay/testkit/testnats"
)

// The partitioned gateway tier (issue 31.3, docs/partitioned-tier.md):
// instead of every replica applying every worker's events, the tier's P
// partitions each own the workers a hash of the worker's name assigns to
// them and apply only their events. A route hashes the request once and
// scatters the prefix hashes to every partition; each answers with its
// workers' overlaps, and the merge is the full index's answer, because a
// worker's overlap depends on that worker's blocks only.
//
// BenchmarkPartitionedTier (tier_test.go) measures the groups in process;
// this file adds the scatter over a real NATS server and its answer check.
// It simulates the tier with the real index, the fleet-scale study's
// stream (fleetscale.go's generators) and a real NATS server for the
// scatter, and measures what the design note needs: the tier's CPU per
// fleet batch and heap at 1, 4 and 16 partitions against one full copy
// (16 full copies are 16 times that), the lookup CPU a route costs summed
// over the partitions, and the scatter's wall time over NATS on loopback
// beside a local lookup on a full copy.

// tierPartition assigns a worker to one of parts partitions by rendezvous
// hashing: the partition whose hash with the worker's name is highest. A
// partition added or removed moves only the workers it gains or loses.
func tierPartition(worker string, parts int) int {
	best, bestH := 0, uint64(0)
	for p := range parts {
		h := fnv.New64a()
		h.Write([]byte(worker))
		h.Write([]byte{byte(p), byte(p >> 8)})
		if v := h.Sum64(); p == 0 || v > bestH {
			best, bestH = p, v
		}
	}
	return best
}

// mergeMatches merges the partitions' answers into one, ordered as the
// index orders its own: deepest first, then by name.
func mergeMatches(dst *index.Matches, parts []index.Matches) {
	dst.Workers = dst.Workers[:0]
	dst.RequestBlocks = 0
	for _, m := range parts {
		dst.RequestBlocks = max(dst.RequestBlocks, m.RequestBlocks)
		dst.Workers = append(dst.Workers, m.Workers...)
	}
	slices.SortFunc(dst.Workers, func(a, b index.Match) int {
		if a.Blocks != b.Blocks {
			return b.Blocks - a.Blocks
		}
		return strings.Compare(a.Worker, b.Worker)
	})
}

// A partition's answer on the wire: uvarint request blocks, uvarint count,
// then per worker uvarint name length, name, uvarint blocks. The request:
// the prefix hashes, 8 bytes each, little-endian.
func appendMatches(b []byte, m *index.Matches) []byte {
	b = binary.AppendUvarint(b, uint64(m.RequestBlocks))
	b = binary.AppendUvarint(b, uint64(len(m.Workers)))
	for _, w := range m.Workers {
		b = binary.AppendUvarint(b, uint64(len(w.Worker)))
		b = append(b, w.Worker...)
		b = binary.AppendUvarint(b, uint64(w.Blocks))
	}
	return b
}

var errBadAnswer = errors.New("bench: tier: malformed partition answer")

func decodeMatches(b []byte, dst *index.Matches) error {
	next := func() (uint64, error) {
		v, n := binary.Uvarint(b)
		if n <= 0 {
			return 0, errBadAnswer
		}
		b = b[n:]
		return v, nil
	}
	rb, err := next()
	if err != nil {
		return err
	}
	n, err := next()
	if err != nil || n > uint64(len(b)) { // each entry takes at least 2 bytes
		return errBadAnswer
	}
	dst.RequestBlocks, dst.Workers = int(rb), dst.Workers[:0]
	for range n {
		l, err := next()
		if err != nil || l > uint64(len(b)) {
			return errBadAnswer
		}
		name := string(b[:l])
		b = b[l:]
		blocks, err := next()
		if err != nil {
			return err
		}
		dst.Workers = append(dst.Workers, index.Match{Worker: name, Blocks: int(blocks)})
	}
	return nil
}

func appendHashes(b []byte, hs []uint64) []byte {
	for _, h := range hs {
		b = binary.LittleEndian.AppendUint64(b, h)
	}
	return b
}

func decodeHashes(b []byte, dst []uint64) []uint64 {
	dst = dst[:0]
	for len(b) >= 8 {
		dst = append(dst, binary.LittleEndian.Uint64(b))
		b = b[8:]
	}
	return dst
}

// tierFleet is the simulated fleet's stream: fill batches and steady
// batches per worker, generated once so every partitioning applies the
// same events.
type tierFleet struct {
	wl     FleetWorkload
	docs   [][]uint32
	names  []string
	fill   [][]*kvpb.KvEventBatch // per worker
	steady []tierBatch            // in arrival order
}

type tierBatch struct {
	worker int
	b      *kvpb.KvEventBatch
}

func newTierFleet(workers int, quick bool) *tierFleet {
	f := &tierFleet{wl: fleetWorkload(quick)}
	f.docs = fleetDocs(&f.wl)
	rng := rand.New(rand.NewPCG(uint64(workers), 31))
	tails := make([]tailState, workers)
	f.names = make([]string, workers)
	f.fill = make([][]*kvpb.KvEventBatch, workers)
	for w := range workers {
		f.names[w] = workerName(w)
		f.fill[w] = docBatches(&f.wl, f.docs, docOf(&f.wl, w))
		for (len(tails[w].fifo)+1)*f.wl.StoreBlocks <= f.wl.CacheBlocks-f.wl.DocBlocks {
			f.fill[w] = append(f.fill[w], nextBatch(&f.wl, f.docs, w, &tails[w], rng))
		}
	}
	for range f.wl.SteadySteps {
		for w := range workers {
			f.steady = append(f.steady, tierBatch{w, nextBatch(&f.wl, f.docs, w, &tails[w], rng)})
		}
	}
	return f
}

// scatterTier is one partitioning of the fleet.
type scatterTier struct {
	parts      []*index.Index
	owner      []int   // partition of each worker
	heap       []int64 // heap each partition holds after the fill and the steady stream
	applyCPU   time.Duration
	applied    int
	pairs      int64
	partCPU    []time.Duration
	partEvents []int
}

func buildScatterTier(f *tierFleet, parts int) *scatterTier {
	t := &scatterTier{owner: make([]int, len(f.names)), heap: make([]int64, parts),
		partCPU: make([]time.Duration, parts), partEvents: make([]int, parts)}
	for w, n := range f.names {
		t.owner[w] = tierPartition(n, parts)
	}
	// Each partition is built alone so its heap is its own.
	for p := range parts {
		before := heapInUse()
		ix := index.New(index.Options{BlockSize: f.wl.BlockSize})
		for w, n := range f.names {
			if t.owner[w] == p {
				for _, b := range f.fill[w] {
					ix.Apply(n, b)
				}
			}
		}
		t.parts = append(t.parts, ix)
		t.heap[p] = heapInUse() - before
	}
	// The steady stream: every batch goes to its worker's partition only,
	// on one locked thread so the thread's CPU clock is the apply's.
	runtime.LockOSThread()
	for _, sb := range f.steady {
		p := t.owner[sb.worker]
		c0 := threadCPU()
		t.parts[p].Apply(f.names[sb.worker], sb.b)
		d := threadCPU() - c0
		t.partCPU[p] += d
		t.applyCPU += d
		t.partEvents[p]++
	}
	runtime.UnlockOSThread()
	t.applied = len(f.steady)
	for _, ix := range t.parts {
		t.pairs += int64(ix.Stats().Memberships)
	}
	return t
}

func (t *scatterTier) totalHeap() (sum, most int64) {
	for _, h := range t.heap {
		sum += h
		most = max(most, h)
	}
	return sum, most
}

// tierRequests are routed questions: a shared document and a new
// question, as the fleet-scale study routes.
func tierRequests(f *tierFleet, n int) [][]uint32 {
	rng := rand.New(rand.NewPCG(7, 31))
	out := make([][]uint32, n)
	for i := range out {
		q := make([]uint32, 4*f.wl.BlockSize)
		for j := range q {
			q[j] = rng.Uint32N(151_936)
		}
		d := i % f.wl.SharedDocs
		// Half the requests stop part way into the document, so depths vary.
		doc := f.docs[d]
		if i%2 == 1 {
			doc = doc[:len(doc)/2]
		}
		out[i] = append(slices.Clip(doc), q...)
	}
	return out
}

// TestTierPartitionAnswersUnchanged checks the design's claim: the merged
// answer of 4 and 16 partitions is the full index's, request by request,
// and the NATS scatter returns the same.
func TestTierPartitionAnswersUnchanged(t *testing.T) {
	f := newTierFleet(96, true)
	full := buildScatterTier(f, 1)
	reqs := tierRequests(f, 40)
	for _, parts := range []int{4, 16} {
		tb := buildScatterTier(f, parts)
		if tb.pairs != full.pairs {
			t.Fatalf("%d partitions hold %d (worker, block) pairs, the full index %d", parts, tb.pairs, full.pairs)
		}
		nonEmpty := 0
		for _, c := range tb.partEvents {
			if c > 0 {
				nonEmpty++
			}
		}
		if nonEmpty < parts/2 {
			t.Fatalf("%d partitions: only %d received events; the assignment does not spread workers", parts, nonEmpty)
		}
		sc := startScatter(t, tb.parts)
		answers := make([]index.Matches, parts)
		var merged, viaNATS index.Matches
		for i, r := range reqs {
			hs := index.PrefixHashes(r, f.wl.BlockSize, index.Namespace{})
			want := full.parts[0].FindMatchesHashes(hs)
			if len(want.Workers) == 0 {
				t.Fatalf("request %d matched no worker: the check would be empty", i)
			}
			for p, ix := range tb.parts {
				ix.FindMatchesHashesInto(&answers[p], hs)
			}
			mergeMatches(&merged, answers)
			if !slices.Equal(merged.Workers, want.Workers) || merged.RequestBlocks != want.RequestBlocks {
				t.Fatalf("%d partitions, request %d: merged %d workers (best %d), full index %d (best %d)",
					parts, i, len(merged.Workers), merged.Best(), len(want.Workers), want.Best())
			}
			if err := sc.lookup(hs, &viaNATS); err != nil {
				t.Fatal(err)
			}
			if !slices.Equal(viaNATS.Workers, want.Workers) {
				t.Fatalf("%d partitions, request %d: the NATS scatter's answer differs from the full index's", parts, i)
			}
		}
	}
}

func FuzzTierDecodeMatches(f *testing.F) {
	f.Add(appendMatches(nil, &index.Matches{RequestBlocks: 3, Workers: []index.Match{{Worker: "w", Blocks: 2}}}))
	f.Add([]byte{0xff, 0xff, 0xff})
	f.Fuzz(func(t *testing.T, b []byte) {
		var m index.Matches
		if err := decodeMatches(b, &m); err != nil {
			return
		}
		again := appendMatches(nil, &m)
		var m2 index.Matches
		if err := decodeMatches(again, &m2); err != nil || !slices.Equal(m.Workers, m2.Workers) || m.RequestBlocks != m2.RequestBlocks {
			t.Fatalf("re-encoded answer does not decode to itself: %v", err)
		}
	})
}

// natsScatter is the tier's lookup over NATS: one responder connection per
// partition, each on its own subject, and a requester that sends the
// prefix hashes to all and merges the answers.
type natsScatter struct {
	req     *nats.Conn
	parts   int
	inbox   string
	replies chan *nats.Msg
	buf     []byte
	answers []index.Matches
}

func startScatter(tb testing.TB, parts []*index.Index) *natsScatter {
	tb.Helper()
	srv := testnats.Start(tb, testnats.Config{NoJetStream: true})
	for p, ix := range parts {
		nc, err := nats.Connect(srv.URL(), nats.Name(fmt.Sprintf("tier-partition-%d", p)))
		if err != nil {
			tb.Fatal(err)
		}
		tb.Cleanup(nc.Close)
		var (
			mu  sync.Mutex
			hs  []uint64
			m   index.Matches
			out []byte
		)
		if _, err := nc.Subscribe("kvrelay.bench.tier.lookup."+strconv.Itoa(p), func(msg *nats.Msg) {
			mu.Lock()
			defer mu.Unlock()
			hs = decodeHashes(msg.Data, hs)
			ix.FindMatchesHashesInto(&m, hs)
			out = appendMatches(out[:0], &m)
			if err := msg.Respond(out); err != nil {
				tb.Error(err)
			}
		}); err != nil {
			tb.Fatal(err)
		}
		if err := nc.Flush(); err != nil {
			tb.Fatal(err)
		}
	}
	nc, err := nats.Connect(srv.URL(), nats.Name("tier-front"))
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(nc.Close)
	s := &natsScatter{req: nc, parts: len(parts), inbox: nats.NewInbox(), replies: make(chan *nats.Msg, len(parts)), answers: make([]index.Matches, len(parts))}
	if _, err := nc.ChanSubscribe(s.inbox, s.replies); err != nil {
		tb.Fatal(err)
	}
	if err := nc.Flush(); err != nil {
		tb.Fatal(err)
	}
	return s
}

// lookup scatters one request and merges the answers. One request at a
// time: the replies carry no request id.
func (s *natsScatter) lookup(hs []uint64, dst *index.Matches) error {
	s.buf = appendHashes(s.buf[:0], hs)
	for p := range s.parts {
		if err := s.req.PublishRequest("kvrelay.bench.tier.lookup."+strconv.Itoa(p), s.inbox, s.buf); err != nil {
			return fmt.Errorf("bench: tier: scatter: %w", err)
		}
	}
	timeout := time.NewTimer(10 * time.Second)
	defer timeout.Stop()
	for p := range s.parts {
		select {
		case msg := <-s.replies:
			if err := decodeMatches(msg.Data, &s.answers[p]); err != nil {
				return err
			}
		case <-timeout.C:
			return fmt.Errorf("bench: tier: scatter: %d of %d partitions answered in 10 s", p, s.parts)
		}
	}
	mergeMatches(dst, s.answers)
	return nil
}

// BenchmarkTier measures the partitioned tier at 1, 4 and 16 partitions
// on one fleet. Run it with -benchtime=1x: each sub-benchmark builds its
// partitions once and reports its own figures. KVRELAY_TIER_WORKERS sets
// the fleet (default 1,024 workers of 2,048 cached blocks).
//
//	go test -run '^$' -bench '^BenchmarkTier$' -benchtime=1x ./bench/
func BenchmarkTier(b *testing.B) {
	workers := 1024
	if v, err := strconv.Atoi(os.Getenv("KVRELAY_TIER_WORKERS")); err == nil && v > 0 {
		workers = v
	}
	f := newTierFleet(workers, false)
	reqs := tierRequests(f, 2000)
	hashes := make([][]uint64, len(reqs))
	for i, r := range reqs {
		hashes[i] = index.PrefixHashes(r, f.wl.BlockSize, index.Namespace{})
	}
	var full *scatterTier
	for _, parts := range []int{1, 4, 16} {
		b.Run(fmt.Sprintf("partitions=%d", parts), func(b *testing.B) {
			var tb *scatterTier
			for range b.N {
				tb = buildScatterTier(f, parts)
			}
			if parts == 1 {
				full = tb
			}
			sumHeap, mostHeap := tb.totalHeap()
			b.ReportMetric(float64(tb.pairs), "pairs")
			b.ReportMetric(tb.applyCPU.Seconds()/float64(tb.applied)*1e6, "tier-apply-cpu-us/batch")
			b.ReportMetric(float64(sumHeap)/(1<<20), "tier-heap-MiB")
			b.ReportMetric(float64(mostHeap)/(1<<20), "largest-partition-heap-MiB")
			var mostCPU time.Duration
			for _, c := range tb.partCPU {
				mostCPU = max(mostCPU, c)
			}
			b.ReportMetric(mostCPU.Seconds()/float64(tb.applied)*1e6, "busiest-partition-cpu-us/fleet-batch")
			if full != nil {
				fullHeap, _ := full.totalHeap()
				// Today's tier: 16 replicas, each a full copy.
				b.ReportMetric(float64(sumHeap)/float64(16*fullHeap), "heap-vs-16-full-copies")
				b.ReportMetric(tb.applyCPU.Seconds()/(16*full.applyCPU.Seconds()), "apply-cpu-vs-16-full-copies")
			}

			// Lookup: the partitions' summed thread CPU per route (what the
			// tier spends), against one full copy's.
			answers := make([]index.Matches, parts)
			var merged index.Matches
			cpus := make([]time.Duration, 0, len(hashes))
			runtime.LockOSThread()
			for _, hs := range hashes {
				c0 := threadCPU()
				for p, ix := range tb.parts {
					ix.FindMatchesHashesInto(&answers[p], hs)
				}
				mergeMatches(&merged, answers)
				cpus = append(cpus, threadCPU()-c0)
			}
			runtime.UnlockOSThread()
			slices.Sort(cpus)
			b.ReportMetric(us(quantile(cpus, 0.5)), "lookup-cpu-p50-us")
			b.ReportMetric(us(quantile(cpus, 0.99)), "lookup-cpu-p99-us")

			// The scatter over NATS on loopback, wall clock, against a local
			// lookup on a full copy in the same loop (interleaved).
			sc := startScatter(b, tb.parts)
			var viaNATS, local index.Matches
			walls := make([]time.Duration, 0, len(hashes))
			locals := make([]time.Duration, 0, len(hashes))
			for i, hs := range hashes {
				t0 := time.Now()
				if err := sc.lookup(hs, &viaNATS); err != nil {
					b.Fatal(err)
				}
				walls = append(walls, time.Since(t0))
				t0 = time.Now()
				full.parts[0].FindMatchesHashesInto(&local, hs)
				locals = append(locals, time.Since(t0))
				if !slices.Equal(viaNATS.Workers, local.Workers) {
					b.Fatalf("request %d: the scatter's answer differs from the full index's", i)
				}
			}
			// The scatter's CPU on this machine, every process's part in it
			// (front, the partitions' lookups, the NATS server: all in this
			// process), per route.
			c0 := processCPU()
			for _, hs := range hashes {
				if err := sc.lookup(hs, &viaNATS); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric((processCPU()-c0).Seconds()/float64(len(hashes))*1e6, "scatter-cpu-us/route")
			slices.Sort(walls)
			slices.Sort(locals)
			b.ReportMetric(us(quantile(walls, 0.5)), "scatter-wall-p50-us")
			b.ReportMetric(us(quantile(walls, 0.99)), "scatter-wall-p99-us")
			b.ReportMetric(us(quantile(locals, 0.5)), "local-full-wall-p50-us")
			b.ReportMetric(us(quantile(locals, 0.99)), "local-full-wall-p99-us")
			runtime.KeepAlive(tb)
		})
	}
}
