package main

import (
	"bytes"
	"context"
	"io"
	"maps"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kvrelay/kvrelay/proto/kvpb"
	"github.com/kvrelay/kvrelay/testkit/kvstream"
)

func rankBatch(rank int32, seq uint64, ts float64) *kvpb.KvEventBatch {
	b := kvstream.StoreTokens(seq, 2, []uint32{1, 2})
	b.DpRank, b.Timestamp = &rank, ts
	return b
}

// tailOnce runs `kvrelay tail` against e and returns its exit code, its
// output and the request e got.
func tailOnce(t *testing.T, e *kvstream.Engine, args ...string) (int, string, string, *kvpb.SubscribeKvEventsRequest) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	var out, errOut bytes.Buffer
	code := dispatch(ctx, append([]string{"tail", "--addr", e.Addr}, args...), strings.NewReader(""), &out, &errOut)
	var req *kvpb.SubscribeKvEventsRequest
	select {
	case req = <-e.Requests:
	default:
	}
	return code, out.String(), errOut.String(), req
}

// tail resumes per rank: the cursor file it writes as it goes holds each
// rank's last printed sequence, and the next run sends them as rank_cursors
// (start_sequence_number rank 0's, for relays that predate them).
func TestTailResumesPerRankFromItsCursorFile(t *testing.T) {
	verifyNoLeaks(t)
	e := kvstream.Start(t)
	file := filepath.Join(t.TempDir(), "cursors")
	for _, b := range []*kvpb.KvEventBatch{rankBatch(0, 5, 1764806400.25), rankBatch(1, 7, 0), rankBatch(1, 8, 0)} {
		e.Batches <- b
	}
	code, out, errOut, req := tailOnce(t, e, "--cursor-file", file, "-n", "3")
	if code != 0 {
		t.Fatalf("exit %d: %s", code, errOut)
	}
	if req == nil || req.GetStartSequenceNumber() != 0 || len(req.GetRankCursors()) != 0 {
		t.Fatalf("first run asked %v, want the whole state", req)
	}
	if !strings.Contains(errOut, "waiting for a first batch") {
		t.Errorf("no word of waiting on stderr: %q", errOut)
	}
	if !strings.Contains(out, "seq=5 rank=0 ts=2025-12-04T00:00:00.250Z") || !strings.Contains(out, "seq=7 rank=1 ts=none") {
		t.Errorf("timestamps not in RFC 3339:\n%s", out)
	}
	got, err := os.ReadFile(file)
	if err != nil || string(got) != "0:5,1:8\n" {
		t.Fatalf("cursor file %q (%v), want 0:5,1:8", got, err)
	}

	e = kvstream.Start(t) // the first run's stream may still be draining
	e.Batches <- rankBatch(0, 6, 0)
	code, _, errOut, req = tailOnce(t, e, "--cursor-file", file, "-n", "1")
	if code != 0 {
		t.Fatalf("second run: exit %d: %s", code, errOut)
	}
	if want := map[int32]uint64{0: 5, 1: 8}; req == nil || req.GetStartSequenceNumber() != 5 || !maps.Equal(req.GetRankCursors(), want) {
		t.Fatalf("second run asked %v, want rank_cursors %v", req, want)
	}
	if !strings.Contains(errOut, "from after 0:5,1:8") {
		t.Errorf("stderr does not say where it resumes: %q", errOut)
	}
	if got, _ := os.ReadFile(file); string(got) != "0:6,1:8\n" {
		t.Errorf("cursor file after the second run: %q", got)
	}
}

func TestTailFromForms(t *testing.T) {
	verifyNoLeaks(t)
	tests := []struct {
		from      string
		start     uint64
		perRank   map[int32]uint64
		wantError string
	}{
		{from: "12", start: 12},
		{from: "0:3,1:4", start: 3, perRank: map[int32]uint64{0: 3, 1: 4}},
		{from: "1:9", start: 0, perRank: map[int32]uint64{1: 9}},
		{from: "x", wantError: `--from: "x": want N or RANK:SEQ`},
		{from: "0:1,0:2", wantError: "rank 0 is given twice"},
		{from: "-1:2", wantError: "want RANK:SEQ"},
		{from: "0:", wantError: "want RANK:SEQ"},
	}
	for _, tt := range tests {
		t.Run(tt.from, func(t *testing.T) {
			// One engine each: a batch is taken by whichever subscriber
			// reads first, and the last run's may not have noticed yet
			// that its client left.
			e := kvstream.Start(t)
			if tt.wantError == "" {
				e.Batches <- rankBatch(0, 100, 0)
			}
			code, out, errOut, req := tailOnce(t, e, "--from", tt.from, "-n", "1", "--raw-ts")
			if tt.wantError != "" {
				if code != 2 || !strings.Contains(errOut, tt.wantError) {
					t.Fatalf("exit %d, stderr %q, want 2 and %q", code, errOut, tt.wantError)
				}
				return
			}
			if code != 0 || req == nil {
				t.Fatalf("exit %d, request %v: %s", code, req, errOut)
			}
			if req.GetStartSequenceNumber() != tt.start || !maps.Equal(req.GetRankCursors(), tt.perRank) {
				t.Fatalf("asked start %d cursors %v, want %d %v", req.GetStartSequenceNumber(), req.GetRankCursors(), tt.start, tt.perRank)
			}
			if !strings.Contains(out, "ts=0.000") {
				t.Errorf("--raw-ts printed %q", out)
			}
		})
	}
}

// An unreadable cursor file is named, not taken for "from zero".
func TestTailRefusesABadCursorFile(t *testing.T) {
	file := filepath.Join(t.TempDir(), "cursors")
	if err := os.WriteFile(file, []byte("rank zero\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	var errOut bytes.Buffer
	code := dispatch(context.Background(), []string{"tail", "--addr", "127.0.0.1:1", "--cursor-file", file}, strings.NewReader(""), io.Discard, &errOut)
	if code != 2 || !strings.Contains(errOut.String(), "--cursor-file "+file) {
		t.Fatalf("exit %d, stderr %q", code, errOut.String())
	}
}
