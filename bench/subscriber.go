package bench

import (
	"context"
	"fmt"
	"math"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	"github.com/kvrelay/kvrelay/proto/kvpb"
)

// The publisher's block hash layout (bench/publisher.py): top bit set, the
// rank in bits 56..62, the publisher's sequence in bits 8..55, the block's
// index in the store in bits 0..7.
const (
	hashMarker = uint64(1) << 63
	seqBits    = 48
)

func decodeBlockHash(h uint64) (rank int, seq uint64, j int, ok bool) {
	if h&hashMarker == 0 {
		return 0, 0, 0, false
	}
	return int(h>>56) & 0x7f, (h >> 8) & (1<<seqBits - 1), int(h & 0xff), true
}

func encodeBlockHash(rank int, seq uint64, j int) uint64 {
	return hashMarker | uint64(rank)<<56 | seq<<8 | uint64(j)
}

// batchSummary is what the subscriber reads from one KvEventBatch.
type batchSummary struct {
	timestamp float64
	snapshot  bool
	blocks    int    // stored blocks, every stored event
	firstHash uint64 // the first stored block's hash
	hasHash   bool
}

// summarize reads a serialized KvEventBatch without building it: the fields
// the bench needs, and enough checking that a malformed message is an error.
func summarize(b []byte) (batchSummary, error) {
	var s batchSummary
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			return s, fmt.Errorf("batch: bad tag: %w", protowire.ParseError(n))
		}
		b = b[n:]
		switch {
		case num == 2 && typ == protowire.Fixed64Type:
			v, n := protowire.ConsumeFixed64(b)
			if n < 0 {
				return s, fmt.Errorf("batch timestamp: %w", protowire.ParseError(n))
			}
			s.timestamp = math.Float64frombits(v)
			b = b[n:]
		case num == 3 && typ == protowire.BytesType:
			ev, n := protowire.ConsumeBytes(b)
			if n < 0 {
				return s, fmt.Errorf("batch event: %w", protowire.ParseError(n))
			}
			if err := s.event(ev); err != nil {
				return s, err
			}
			b = b[n:]
		case num == 7:
			s.snapshot = true
			fallthrough
		default:
			n := protowire.ConsumeFieldValue(num, typ, b)
			if n < 0 {
				return s, fmt.Errorf("batch field %d: %w", num, protowire.ParseError(n))
			}
			b = b[n:]
		}
	}
	return s, nil
}

func (s *batchSummary) event(b []byte) error {
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			return fmt.Errorf("event: bad tag: %w", protowire.ParseError(n))
		}
		b = b[n:]
		if num == 2 && typ == protowire.BytesType {
			st, n := protowire.ConsumeBytes(b)
			if n < 0 {
				return fmt.Errorf("stored event: %w", protowire.ParseError(n))
			}
			if err := s.stored(st); err != nil {
				return err
			}
			b = b[n:]
			continue
		}
		n = protowire.ConsumeFieldValue(num, typ, b)
		if n < 0 {
			return fmt.Errorf("event field %d: %w", num, protowire.ParseError(n))
		}
		b = b[n:]
	}
	return nil
}

func (s *batchSummary) stored(b []byte) error {
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			return fmt.Errorf("stored: bad tag: %w", protowire.ParseError(n))
		}
		b = b[n:]
		if num == 1 && typ == protowire.BytesType {
			blk, n := protowire.ConsumeBytes(b)
			if n < 0 {
				return fmt.Errorf("stored block: %w", protowire.ParseError(n))
			}
			s.blocks++
			if !s.hasHash {
				h, err := blockHash(blk)
				if err != nil {
					return err
				}
				s.firstHash, s.hasHash = h, true
			}
			b = b[n:]
			continue
		}
		n = protowire.ConsumeFieldValue(num, typ, b)
		if n < 0 {
			return fmt.Errorf("stored field %d: %w", num, protowire.ParseError(n))
		}
		b = b[n:]
	}
	return nil
}

func blockHash(b []byte) (uint64, error) {
	var h uint64
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			return 0, fmt.Errorf("block: bad tag: %w", protowire.ParseError(n))
		}
		b = b[n:]
		if num == 1 && typ == protowire.VarintType {
			v, n := protowire.ConsumeVarint(b)
			if n < 0 {
				return 0, fmt.Errorf("block hash: %w", protowire.ParseError(n))
			}
			h = v
			b = b[n:]
			continue
		}
		n = protowire.ConsumeFieldValue(num, typ, b)
		if n < 0 {
			return 0, fmt.Errorf("block field %d: %w", num, protowire.ParseError(n))
		}
		b = b[n:]
	}
	return h, nil
}

// rawMessage receives a response's bytes unparsed.
type rawMessage struct{ b []byte }

// rawCodec marshals requests with protobuf and hands responses over as
// bytes, reusing the receive buffer.
type rawCodec struct{}

func (rawCodec) Name() string { return "proto" }

func (rawCodec) Marshal(v any) (mem.BufferSlice, error) {
	m, ok := v.(proto.Message)
	if !ok {
		return nil, fmt.Errorf("bench codec: cannot marshal %T", v)
	}
	b, err := proto.Marshal(m)
	if err != nil {
		return nil, fmt.Errorf("bench codec: %w", err)
	}
	return mem.BufferSlice{mem.SliceBuffer(b)}, nil
}

func (rawCodec) Unmarshal(data mem.BufferSlice, v any) error {
	r, ok := v.(*rawMessage)
	if !ok {
		return fmt.Errorf("bench codec: cannot unmarshal into %T", v)
	}
	r.b = r.b[:0]
	for _, buf := range data {
		r.b = append(r.b, buf.ReadOnlyData()...)
	}
	return nil
}

const vllmSubscribeMethod = "/vllm.grpc.engine.VllmEngine/SubscribeKvEvents"

// sample is one received batch of the publisher's stream.
type sample struct {
	rank    uint8
	seq     uint64
	latency time.Duration // receive time minus the batch timestamp
	sentAt  float64       // the batch timestamp, unix seconds
}

// subscriber reads one relay's stream and records every batch of the
// publisher's pattern. Snapshot chunks and batches without a recognisable
// first block (a relay's own batches) are counted, not sampled.
type subscriber struct {
	ranks int

	mu        sync.Mutex
	samples   []sample
	seen      [][]uint64 // per rank, a bitmap of sequences received
	fromSeq   []uint64   // per rank, the current step's first sequence
	inStep    []uint64   // per rank, distinct sequences >= fromSeq received
	dups      uint64
	other     uint64
	blocks    uint64
	batches   uint64
	streamErr error
	ended     bool
	done      chan struct{}
}

func newSubscriber(ranks int) *subscriber {
	return &subscriber{
		ranks:   ranks,
		seen:    make([][]uint64, ranks),
		fromSeq: make([]uint64, ranks),
		inStep:  make([]uint64, ranks),
		done:    make(chan struct{}),
	}
}

// run subscribes at addr from sequence 0 and reads until ctx ends or the
// stream does. opened is closed once the call is established.
func (s *subscriber) run(ctx context.Context, addr string, opened chan<- error) {
	s.runRequest(ctx, addr, &kvpb.SubscribeKvEventsRequest{}, opened)
}

// runRequest is run with a request of the caller's.
func (s *subscriber) runRequest(ctx context.Context, addr string, req *kvpb.SubscribeKvEventsRequest, opened chan<- error) {
	defer close(s.done)
	fail := func(err error) {
		s.mu.Lock()
		s.streamErr, s.ended = err, true
		s.mu.Unlock()
	}
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDefaultCallOptions(grpc.ForceCodecV2(rawCodec{}), grpc.MaxCallRecvMsgSize(64<<20)))
	if err != nil {
		opened <- fmt.Errorf("dial %s: %w", addr, err)
		fail(err)
		return
	}
	defer conn.Close()
	stream, err := conn.NewStream(ctx, &grpc.StreamDesc{ServerStreams: true}, vllmSubscribeMethod)
	if err == nil {
		err = stream.SendMsg(req)
	}
	if err == nil {
		err = stream.CloseSend()
	}
	if err == nil {
		// The headers come first from both relays; waiting for them means
		// the relay has the call and (for Python) has opened its sockets.
		_, err = stream.Header()
	}
	if err != nil {
		opened <- fmt.Errorf("subscribe at %s: %w", addr, err)
		fail(err)
		return
	}
	close(opened)
	var msg rawMessage
	for {
		if err := stream.RecvMsg(&msg); err != nil {
			if ctx.Err() != nil {
				err = nil
			}
			fail(err)
			return
		}
		now := time.Now()
		sum, err := summarize(msg.b)
		if err != nil {
			fail(err)
			return
		}
		s.record(sum, now)
	}
}

func (s *subscriber) record(sum batchSummary, now time.Time) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.batches++
	s.blocks += uint64(sum.blocks)
	rank, seq, j, ok := decodeBlockHash(sum.firstHash)
	if sum.snapshot || !sum.hasHash || !ok || j != 0 || rank >= s.ranks {
		s.other++
		return
	}
	words := s.seen[rank]
	w := seq / 64
	for uint64(len(words)) <= w {
		words = append(words, 0)
	}
	s.seen[rank] = words
	bit := uint64(1) << (seq % 64)
	if words[w]&bit != 0 {
		s.dups++
		return
	}
	words[w] |= bit
	if seq >= s.fromSeq[rank] {
		s.inStep[rank]++
	}
	sent := sum.timestamp
	lat := now.Sub(time.Unix(0, int64(sent*1e9)))
	s.samples = append(s.samples, sample{rank: uint8(rank), seq: seq, latency: lat, sentAt: sent})
}

// startStep forgets the samples so far and counts arrivals from the given
// per-rank sequences on.
func (s *subscriber) startStep(first []uint64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.samples = s.samples[:0]
	for r := range s.inStep {
		s.fromSeq[r] = first[r]
		s.inStep[r] = 0
		// Count what already arrived of the new step (a fast relay).
		words := s.seen[r]
		for seq := first[r]; seq < uint64(len(words))*64; seq++ {
			if words[seq/64]&(1<<(seq%64)) != 0 {
				s.inStep[r]++
			}
		}
	}
}

// received is the number of distinct batches of the current step so far.
func (s *subscriber) received() uint64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	var n uint64
	for _, c := range s.inStep {
		n += c
	}
	return n
}

// stepSamples returns the samples of batches in [first, last] per rank.
func (s *subscriber) stepSamples(first, last []uint64) []sample {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]sample, 0, len(s.samples))
	for _, x := range s.samples {
		if x.seq >= first[x.rank] && x.seq <= last[x.rank] {
			out = append(out, x)
		}
	}
	return out
}

func (s *subscriber) status() (ended bool, err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.ended, s.streamErr
}

// waitFor waits until want batches of the step have arrived, the stream has
// ended, or the timeout passes; it returns how many arrived.
func (s *subscriber) waitFor(ctx context.Context, want uint64, timeout time.Duration) uint64 {
	deadline := time.Now().Add(timeout)
	for {
		got := s.received()
		ended, _ := s.status()
		if got >= want || ended || time.Now().After(deadline) || ctx.Err() != nil {
			return got
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// waitProgressing waits until want batches of the step have arrived or the
// stream has ended, for as long as the stream makes progress: it gives up
// once no batch at all (of this step or an earlier one still queued) has
// arrived for stall, or after limit. It returns how many of the step
// arrived.
func (s *subscriber) waitProgressing(ctx context.Context, want uint64, stall, limit time.Duration) uint64 {
	deadline := time.Now().Add(limit)
	total, lastChange := s.total(), time.Now()
	for {
		got := s.received()
		ended, _ := s.status()
		now := time.Now()
		if n := s.total(); n != total {
			total, lastChange = n, now
		}
		if got >= want || ended || now.Sub(lastChange) >= stall || now.After(deadline) || ctx.Err() != nil {
			return got
		}
		time.Sleep(10 * time.Millisecond)
	}
}
