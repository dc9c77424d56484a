package interop

import (
	"context"
	"fmt"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/testing/protocmp"

	"github.com/kvrelay/kvrelay/proto/kvpb"
	"github.com/kvrelay/kvrelay/testkit/enginepeer"
)

// TestTailReadsPythonRelay runs `kvrelay tail --json` against SMG's Python
// relay fed by a two-rank vLLM peer: our client decodes the stream the
// Python servicer encodes, and every printed batch is exactly the batch
// the peer published under that rank and sequence.
func TestTailReadsPythonRelay(t *testing.T) {
	const want = 24      // batches tail prints before it exits
	bin := kvrelayBin(t) // first: a tree that does not build fails before anything starts
	peer := enginepeer.Start(t, enginepeer.Options{Engine: enginepeer.VLLM, DPSize: 2})
	py, pyAddr := startPyRelay(t, "vllm", peer.PubEndpoint(0), peer.ReplayEndpoint(0), 2)

	tail := startProc(t, "kvrelay tail", exec.Command(bin, "tail",
		"--addr", pyAddr, "--service", "vllm", "--json", "-n", strconv.Itoa(want)))

	// PUB/SUB gives no "subscriber attached" signal, and the Python relay
	// opens its sockets only when tail subscribes: publish a varied stream,
	// alternating ranks, until tail has printed its batches and exited. Each
	// batch is self-contained, so wherever the relay joins, every batch it
	// forwards must come out whole.
	var (
		mu   sync.Mutex
		sent = map[[2]uint64]published{}
	)
	ctx, stop := context.WithCancel(context.Background())
	pubDone := make(chan error, 1)
	go func() {
		for i := 0; ctx.Err() == nil; i++ {
			rank := i % 2
			evs := generatedBatch(i)
			peerEvs := make([]enginepeer.Event, len(evs))
			for j, e := range evs {
				peerEvs[j] = e.peer()
			}
			ts := 1_700_000_000 + float64(i)/4
			res, err := peer.PublishAt(rank, ts, peerEvs...)
			if err != nil {
				pubDone <- fmt.Errorf("publish %d: %w", i, err)
				return
			}
			mu.Lock()
			sent[[2]uint64{uint64(rank), res.Seq}] = published{rank: rank, seq: res.Seq, ts: ts, events: evs}
			mu.Unlock()
			if i > 20_000 {
				pubDone <- fmt.Errorf("tail printed too little after %d batches", i)
				return
			}
			select {
			case <-ctx.Done():
			case <-time.After(20 * time.Millisecond):
			}
		}
		pubDone <- nil
	}()
	waitFor(t, waitTimeout, func() (bool, string) {
		done, _ := tail.exited()
		return done, fmt.Sprintf("kvrelay tail has printed %d of %d lines", len(tail.snapshotLines()), want)
	}, tail, py)
	stop()
	if err := <-pubDone; err != nil {
		t.Fatal(err)
	}
	if _, err := tail.exited(); err != nil {
		t.Fatalf("kvrelay tail failed: %v\n%s", err, tail.tail(20))
	}

	var batches []*kvpb.KvEventBatch
	for _, line := range tail.snapshotLines() {
		if !strings.HasPrefix(line, "{") {
			continue // stderr's "stream ended" notes
		}
		b := &kvpb.KvEventBatch{}
		if err := protojson.Unmarshal([]byte(line), b); err != nil {
			t.Fatalf("tail printed a line that is not a KvEventBatch: %v\n%s", err, line)
		}
		batches = append(batches, b)
	}
	if len(batches) != want {
		t.Fatalf("tail printed %d batches, want %d:\n%s", len(batches), want, tail.tail(want+5))
	}

	mu.Lock()
	defer mu.Unlock()
	lastSeq := map[int32]uint64{}
	var lastID uint64
	ranks := map[int32]int{}
	for i, b := range batches {
		rank := b.GetDpRank()
		ranks[rank]++
		p, ok := sent[[2]uint64{uint64(rank), b.GetSequenceNumber()}]
		if !ok {
			t.Fatalf("batch %d: rank %d seq %d was never published", i, rank, b.GetSequenceNumber())
		}
		// The Python relay numbers events once per call across every rank,
		// from 1; with nothing dropped, ids run on without a gap.
		first := b.GetEvents()[0].GetEventId()
		if i > 0 && first != lastID+1 {
			t.Errorf("batch %d: first event_id %d, want %d (ids run on across ranks within a call)", i, first, lastID+1)
		}
		lastID = first + uint64(len(b.GetEvents())) - 1
		if diff := cmp.Diff(expectedBatch(p, first), b, protocmp.Transform()); diff != "" {
			t.Errorf("batch %d (rank %d seq %d) differs from what was published (-published +tail):\n%s", i, rank, b.GetSequenceNumber(), diff)
		}
		// Native per-rank sequences, contiguous after the rank's first.
		if prev, seen := lastSeq[rank]; seen && b.GetSequenceNumber() != prev+1 {
			t.Errorf("batch %d: rank %d went from seq %d to %d", i, rank, prev, b.GetSequenceNumber())
		}
		lastSeq[rank] = b.GetSequenceNumber()
	}
	if len(ranks) != 2 {
		t.Errorf("tail saw ranks %v, want both 0 and 1", ranks)
	}
}
