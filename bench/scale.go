package bench

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"runtime/pprof"
	"slices"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/vmihailenco/msgpack/v5"

	"github.com/kvrelay/kvrelay/engines"
	"github.com/kvrelay/kvrelay/engines/vllm"
	"github.com/kvrelay/kvrelay/proto/kvpb"
	"github.com/kvrelay/kvrelay/relay"
)

// ScaleResults is part 2 of issue 7 for the relay.
type ScaleResults struct {
	Snapshot []SnapshotPoint `json:"snapshot"`
	Resume   []ResumePoint   `json:"resume"`
	Fanout   []FanoutPoint   `json:"fanout"`
}

// SnapshotPoint is the relay at a number of live blocks.
type SnapshotPoint struct {
	Blocks        int     `json:"live_blocks"`
	HeapBytes     int64   `json:"heap_bytes"` // live heap of the relay after a GC
	BytesPerBlock float64 `json:"heap_bytes_per_block"`
	LockMs        float64 `json:"lock_ms"`     // median time under the admission lock
	LockMaxMs     float64 `json:"lock_max_ms"` // worst of the repetitions
	TotalMs       float64 `json:"total_ms"`    // median from Subscribe to the last chunk read: cut, order, encode, and decode (Next decodes the wire form)
	Chunks        int     `json:"chunks"`
	Reps          int     `json:"reps"`
}

// ResumePoint is a subscriber resuming from a cursor a whole window back.
type ResumePoint struct {
	Window        int     `json:"window_batches"`
	HeapBytes     int64   `json:"heap_bytes"` // the relay's live heap with the window full
	Batches       int     `json:"batches_resumed"`
	Ms            float64 `json:"ms"` // median, call start to the last resumed batch over gRPC
	BatchesPerSec float64 `json:"batches_per_s"`
	Reps          int     `json:"reps"`
}

// FanoutPoint is one burst relayed to some gRPC subscribers.
type FanoutPoint struct {
	Subscribers   int     `json:"subscribers"` // 0: ingest only
	Batches       int     `json:"batches"`
	Seconds       float64 `json:"seconds"`
	PerSubscriber float64 `json:"per_subscriber_batches_per_s"`
	Aggregate     float64 `json:"aggregate_batches_per_s"`
	BlocksPerSec  float64 `json:"aggregate_blocks_per_s"`
	// CPUSeconds is the bench process's CPU time over the burst (relay,
	// server and subscribers); BatchesPerCPU is deliveries per CPU second,
	// a figure a busy host does not distort as it does the wall clock.
	CPUSeconds    float64 `json:"cpu_seconds"`
	BatchesPerCPU float64 `json:"batches_per_cpu_second"`
	Profile       string  `json:"profile,omitempty"`
}

// payloadEncoder writes vLLM's msgpack batches in the layout of its msgspec
// structs (tagged maps, "type" first), the same stream as the publisher's.
type payloadEncoder struct {
	buf    bytes.Buffer
	enc    *msgpack.Encoder
	tokens []uint32
	// With a LoRA name, stores carry it and loraID (a namespaced stream).
	loraName string
	loraID   int64
}

func newPayloadEncoder() *payloadEncoder {
	e := &payloadEncoder{tokens: make([]uint32, storeBlocks*blockSize)}
	for i := range e.tokens {
		e.tokens[i] = uint32((i*7919 + 17) % 151_936)
	}
	e.enc = msgpack.NewEncoder(&e.buf)
	return e
}

// batch is rank's batch seq: a 64-block store, and with evict > 0 and
// seq >= evict, the removal of what rank stored evict batches earlier.
func (e *payloadEncoder) batch(rank int, seq uint64, evict int, ts time.Time) []byte {
	e.buf.Reset()
	w := e.enc
	removes := evict > 0 && seq >= uint64(evict)
	_ = w.EncodeArrayLen(3)
	_ = w.EncodeFloat64(float64(ts.UnixNano()) / 1e9)
	n := 1
	if removes {
		n = 2
	}
	_ = w.EncodeArrayLen(n)
	_ = w.EncodeMapLen(8)
	_ = w.EncodeString("type")
	_ = w.EncodeString("BlockStored")
	_ = w.EncodeString("block_hashes")
	_ = w.EncodeArrayLen(storeBlocks)
	for j := range storeBlocks {
		_ = w.EncodeUint(encodeBlockHash(rank, seq, j))
	}
	_ = w.EncodeString("parent_block_hash")
	_ = w.EncodeNil()
	_ = w.EncodeString("token_ids")
	_ = w.EncodeArrayLen(len(e.tokens))
	for _, t := range e.tokens {
		_ = w.EncodeUint(uint64(t))
	}
	_ = w.EncodeString("block_size")
	_ = w.EncodeInt(blockSize)
	_ = w.EncodeString("lora_id")
	if e.loraName != "" {
		_ = w.EncodeInt(e.loraID)
	} else {
		_ = w.EncodeNil()
	}
	_ = w.EncodeString("medium")
	_ = w.EncodeString("GPU")
	_ = w.EncodeString("lora_name")
	if e.loraName != "" {
		_ = w.EncodeString(e.loraName)
	} else {
		_ = w.EncodeNil()
	}
	if removes {
		_ = w.EncodeMapLen(3)
		_ = w.EncodeString("type")
		_ = w.EncodeString("BlockRemoved")
		_ = w.EncodeString("block_hashes")
		_ = w.EncodeArrayLen(storeBlocks)
		for j := range storeBlocks {
			_ = w.EncodeUint(encodeBlockHash(rank, seq-uint64(evict), j))
		}
		_ = w.EncodeString("medium")
		_ = w.EncodeString("GPU")
	}
	_ = w.EncodeInt(int64(rank))
	return bytes.Clone(e.buf.Bytes())
}

// memFeed is a rank's live stream fed from memory.
type memFeed struct{ ch chan relay.Message }

func (f *memFeed) Recv(ctx context.Context) (relay.Message, error) {
	select {
	case m := <-f.ch:
		return m, nil
	case <-ctx.Done():
		return relay.Message{}, ctx.Err()
	}
}
func (f *memFeed) Connected() bool { return true }
func (f *memFeed) Close() error    { return nil }

// memRelay is a relay whose ranks read from memory.
type memRelay struct {
	relay *relay.Relay
	feeds []*memFeed
	reg   *prometheus.Registry
}

func newMemRelay(ranks, history int) (*memRelay, error) {
	m := &memRelay{reg: prometheus.NewRegistry()}
	for range ranks {
		m.feeds = append(m.feeds, &memFeed{ch: make(chan relay.Message, 1024)})
	}
	r, err := relay.New(relay.Config{
		Engine: vllm.Engine, DPSize: ranks, HistoryBatches: history, HistoryBytes: 64 << 30,
		KV:     engines.Config{Enabled: true, Publisher: "zmq", Endpoint: "tcp://127.0.0.1:1"},
		Logger: quietLog, Registerer: m.reg,
		Transport: func(rank int32, _, _ string, _ time.Duration) (relay.Feed, relay.Replayer, error) {
			return m.feeds[rank], nil, nil
		},
	})
	if err != nil {
		return nil, fmt.Errorf("bench: relay: %w", err)
	}
	m.relay = r
	return m, nil
}

// waitRelayed waits until the relay has relayed n batches in all.
func (m *memRelay) waitRelayed(ctx context.Context, n uint64) error {
	deadline := time.Now().Add(5 * time.Minute)
	for m.relay.Status().Relayed < n {
		if ctx.Err() != nil {
			return ctx.Err()
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("bench: relay stuck at %d of %d batches", m.relay.Status().Relayed, n)
		}
		time.Sleep(2 * time.Millisecond)
	}
	return nil
}

// histogramSum reads a histogram's sum and count from the registry.
func (m *memRelay) histogramSum(name string) (float64, uint64) {
	fams, err := m.reg.Gather()
	if err != nil {
		return 0, 0
	}
	for _, f := range fams {
		if f.GetName() != name {
			continue
		}
		var sum float64
		var n uint64
		for _, mt := range f.GetMetric() {
			sum += mt.GetHistogram().GetSampleSum()
			n += mt.GetHistogram().GetSampleCount()
		}
		return sum, n
	}
	return 0, 0
}

func heapInUse() int64 {
	runtime.GC()
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return int64(ms.HeapAlloc)
}

func runScale(ctx context.Context, env *environment) (*ScaleResults, []string, error) {
	sc := &ScaleResults{}
	var profiles []string
	blocks := []int{10_000, 100_000, 1_000_000}
	windows := []int{100, 1_000, 10_000}
	subs := []int{0, 1, 4, 16}
	burst, reps := 8_000, 5
	if env.quick {
		blocks, windows, subs, burst, reps = []int{10_000}, []int{100}, []int{0, 1, 4}, 300, 1
	}
	for _, n := range blocks {
		p, err := snapshotPoint(ctx, n, reps)
		if err != nil {
			return nil, nil, err
		}
		env.log.Info("snapshot", "blocks", n, "lock_ms", p.LockMs, "total_ms", p.TotalMs, "bytes_per_block", p.BytesPerBlock)
		sc.Snapshot = append(sc.Snapshot, p)
	}
	for _, w := range windows {
		p, err := resumePoint(ctx, w, min(reps, 3))
		if err != nil {
			return nil, nil, err
		}
		env.log.Info("resume", "window", w, "ms", p.Ms)
		sc.Resume = append(sc.Resume, p)
	}
	for _, n := range subs {
		p, err := fanoutRun(ctx, env, n, burst, !env.quick)
		if err != nil {
			return nil, nil, err
		}
		env.log.Info("fanout", "subscribers", n, "aggregate", p.Aggregate)
		if p.Profile != "" {
			profiles = append(profiles, p.Profile)
		}
		sc.Fanout = append(sc.Fanout, p)
	}
	return sc, profiles, nil
}

// snapshotPoint fills a one-rank relay with n live blocks (64-block stores,
// nothing evicted) and takes snapshots from it.
func snapshotPoint(ctx context.Context, n, reps int) (SnapshotPoint, error) {
	p := SnapshotPoint{Blocks: n, Reps: reps}
	before := heapInUse()
	// A short history so that a cursor-0 subscriber gets a snapshot, not
	// the history.
	m, err := newMemRelay(1, 16)
	if err != nil {
		return p, err
	}
	rctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- m.relay.Run(rctx) }()
	defer func() { cancel(); <-done }()
	enc := newPayloadEncoder()
	batches := (n + storeBlocks - 1) / storeBlocks
	now := time.Now()
	for seq := range batches {
		select {
		case m.feeds[0].ch <- relay.Message{Seq: uint64(seq), Payload: enc.batch(0, uint64(seq), 0, now)}:
		case <-ctx.Done():
			return p, ctx.Err()
		}
	}
	if err := m.waitRelayed(ctx, uint64(batches)); err != nil {
		return p, err
	}
	if got := m.relay.Status().RecordBlocks; got != uint64(batches*storeBlocks) {
		return p, fmt.Errorf("bench: the record holds %d blocks, want %d", got, batches*storeBlocks)
	}
	p.HeapBytes = heapInUse() - before
	p.BytesPerBlock = float64(p.HeapBytes) / float64(batches*storeBlocks)
	var locks, totals []time.Duration
	for range reps {
		sum0, _ := m.histogramSum("kvrelay_snapshot_lock_seconds")
		start := time.Now()
		s, err := m.relay.Subscribe(ctx, &kvpb.SubscribeKvEventsRequest{})
		if err != nil {
			return p, fmt.Errorf("bench: snapshot subscribe: %w", err)
		}
		// The whole snapshot is done when its last chunk is read: the relay
		// cuts under the lock in Subscribe and orders and encodes the chunks
		// on the first Next.
		chunks, count := 0, uint32(1)
		for uint32(chunks) < count {
			nctx, ncancel := context.WithTimeout(ctx, 30*time.Second)
			b, err := s.Next(nctx)
			ncancel()
			if err != nil || b.GetSnapshot() == nil {
				break
			}
			count = b.GetSnapshot().GetCount()
			chunks++
		}
		totals = append(totals, time.Since(start))
		sum1, _ := m.histogramSum("kvrelay_snapshot_lock_seconds")
		locks = append(locks, time.Duration((sum1-sum0)*1e9))
		p.Chunks = chunks
		s.Close()
	}
	if p.Chunks == 0 {
		return p, fmt.Errorf("bench: a cursor-0 subscriber at %d blocks got no snapshot", n)
	}
	slices.Sort(locks)
	slices.Sort(totals)
	p.LockMs, p.LockMaxMs, p.TotalMs = ms(quantile(locks, 0.5)), ms(locks[len(locks)-1]), ms(quantile(totals, 0.5))
	return p, nil
}

// resumePoint fills a relay whose history holds window batches, then
// resumes a gRPC subscriber from the oldest batch in it.
func resumePoint(ctx context.Context, window, reps int) (ResumePoint, error) {
	p := ResumePoint{Window: window, Reps: reps}
	before := heapInUse()
	m, err := newMemRelay(1, window)
	if err != nil {
		return p, err
	}
	sr, err := serveRelay(ctx, m.relay)
	if err != nil {
		return p, err
	}
	defer sr.stop()
	enc := newPayloadEncoder()
	total := window + 64 // the window has rolled
	now := time.Now()
	for seq := range total {
		select {
		case m.feeds[0].ch <- relay.Message{Seq: uint64(seq), Payload: enc.batch(0, uint64(seq), evictWindow, now)}:
		case <-ctx.Done():
			return p, ctx.Err()
		}
	}
	if err := m.waitRelayed(ctx, uint64(total)); err != nil {
		return p, err
	}
	p.HeapBytes = heapInUse() - before
	cursor := uint64(total - window) // the oldest batch the window holds
	want := uint64(total) - 1 - cursor
	p.Batches = int(want)
	var times []time.Duration
	for range reps {
		sub := newSubscriber(1)
		sub.startStep([]uint64{cursor + 1})
		sctx, cancel := context.WithCancel(ctx)
		opened := make(chan error, 1)
		start := time.Now()
		go sub.runRequest(sctx, sr.addr(), &kvpb.SubscribeKvEventsRequest{StartSequenceNumber: cursor}, opened)
		if err := <-opened; err != nil {
			cancel()
			<-sub.done
			return p, err
		}
		got := sub.waitFor(ctx, want, time.Minute)
		elapsed := time.Since(start)
		cancel()
		<-sub.done
		if got < want {
			_, serr := sub.status()
			return p, fmt.Errorf("bench: resume from %d over a %d-batch window gave %d of %d batches (%v)", cursor, window, got, want, serr)
		}
		times = append(times, elapsed)
	}
	slices.Sort(times)
	med := quantile(times, 0.5)
	p.Ms = ms(med)
	p.BatchesPerSec = float64(want) / med.Seconds()
	return p, nil
}

// fanoutRun relays a burst of batches, as fast as the relay takes them,
// to n gRPC subscribers (n = 0: ingest alone), with profile under the CPU
// profiler.
func fanoutRun(ctx context.Context, env *environment, n, burst int, profile bool) (FanoutPoint, error) {
	p := FanoutPoint{Subscribers: n, Batches: burst}
	m, err := newMemRelay(dpSize, max(burst, relay.DefaultHistoryBatches))
	if err != nil {
		return p, err
	}
	sr, err := serveRelay(ctx, m.relay)
	if err != nil {
		return p, err
	}
	defer sr.stop()
	var subs []*subscriber
	sctx, cancel := context.WithCancel(ctx)
	defer func() {
		cancel()
		for _, s := range subs {
			<-s.done
		}
	}()
	first := make([]uint64, dpSize)
	for range n {
		s := newSubscriber(dpSize)
		s.startStep(first)
		opened := make(chan error, 1)
		go s.runRequest(sctx, sr.addr(), &kvpb.SubscribeKvEventsRequest{}, opened)
		subs = append(subs, s)
		if err := <-opened; err != nil {
			return p, err
		}
	}
	// Encode first, so that the clock sees only the relay and the subscribers.
	enc := newPayloadEncoder()
	msgs := make([]relay.Message, burst)
	now := time.Now()
	for i := range msgs {
		seq := uint64(i / dpSize)
		msgs[i] = relay.Message{Seq: seq, Payload: enc.batch(i%dpSize, seq, evictWindow, now)}
	}
	var prof *os.File
	if profile {
		p.Profile = filepath.Join(env.out, fmt.Sprintf("fanout-%d.cpu.pprof", n))
		prof, err = os.Create(p.Profile)
		if err != nil {
			return p, fmt.Errorf("bench: profile: %w", err)
		}
		if err := pprof.StartCPUProfile(prof); err != nil {
			prof.Close()
			return p, fmt.Errorf("bench: profile: %w", err)
		}
	}
	cpu0 := processCPU()
	start := time.Now()
	feedErr := make(chan error, 1)
	go func() {
		for i, msg := range msgs {
			select {
			case m.feeds[i%dpSize].ch <- msg:
			case <-ctx.Done():
				feedErr <- ctx.Err()
				return
			}
		}
		feedErr <- nil
	}()
	if err := <-feedErr; err != nil {
		return p, err
	}
	if n == 0 {
		if err := m.waitRelayed(ctx, uint64(burst)); err != nil {
			return p, err
		}
	}
	for _, s := range subs {
		if got := s.waitFor(ctx, uint64(burst), 2*time.Minute); got < uint64(burst) {
			_, serr := s.status()
			return p, fmt.Errorf("bench: fan-out to %d: a subscriber got %d of %d batches (%v)", n, got, burst, serr)
		}
	}
	elapsed := time.Since(start)
	p.CPUSeconds = (processCPU() - cpu0).Seconds()
	if prof != nil {
		pprof.StopCPUProfile()
		prof.Close()
	}
	p.Seconds = elapsed.Seconds()
	p.PerSubscriber = float64(burst) / p.Seconds
	p.Aggregate = p.PerSubscriber * float64(max(n, 1))
	p.BlocksPerSec = p.Aggregate * storeBlocks
	if p.CPUSeconds > 0 {
		p.BatchesPerCPU = float64(burst*max(n, 1)) / p.CPUSeconds
	}
	return p, nil
}

// processCPU is the bench process's user and system time.
func processCPU() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
