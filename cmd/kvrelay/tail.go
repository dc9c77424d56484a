package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"maps"
	"math"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protojson"

	"github.com/kvrelay/kvrelay/internal/tlsconfig"
	"github.com/kvrelay/kvrelay/proto/kvpb"
)

func init() {
	register("tail", "subscribe to a relay (or an SMG servicer) and print its batches", runTail)
}

// subscribeFunc opens SubscribeKvEvents on one of the three service names.
type subscribeFunc func(ctx context.Context, cc *grpc.ClientConn, req *kvpb.SubscribeKvEventsRequest) (grpc.ServerStreamingClient[kvpb.KvEventBatch], error)

var tailServices = map[string]subscribeFunc{
	"vllm": func(ctx context.Context, cc *grpc.ClientConn, req *kvpb.SubscribeKvEventsRequest) (grpc.ServerStreamingClient[kvpb.KvEventBatch], error) {
		return kvpb.NewVllmEngineClient(cc).SubscribeKvEvents(ctx, req)
	},
	"sglang": func(ctx context.Context, cc *grpc.ClientConn, req *kvpb.SubscribeKvEventsRequest) (grpc.ServerStreamingClient[kvpb.KvEventBatch], error) {
		return kvpb.NewSglangSchedulerClient(cc).SubscribeKvEvents(ctx, req)
	},
	"tokenspeed": func(ctx context.Context, cc *grpc.ClientConn, req *kvpb.SubscribeKvEventsRequest) (grpc.ServerStreamingClient[kvpb.KvEventBatch], error) {
		return kvpb.NewTokenSpeedSchedulerClient(cc).SubscribeKvEvents(ctx, req)
	},
}

func runTail(ctx context.Context, args []string, _ io.Reader, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("tail", flag.ContinueOnError)
	addr := fs.String("addr", "", "relay or servicer address HOST:PORT, or grpcs://HOST:PORT for TLS")
	service := fs.String("service", "vllm", "service flavour: vllm, sglang or tokenspeed")
	from := fs.String("from", "", "resume after these batches: N (rank 0's last applied sequence, as SMG's gateway resumes) or per rank RANK:SEQ,RANK:SEQ (e.g. 0:120,1:97; what --cursor-file holds); empty: the relay's whole state")
	cursorFile := fs.String("cursor-file", "", "keep each rank's last printed sequence in this file as the stream goes, and resume from it on start when --from is not given")
	asJSON := fs.Bool("json", false, "print each batch as one JSON line")
	rawTS := fs.Bool("raw-ts", false, "print timestamps as the engine's epoch seconds instead of RFC 3339")
	limit := fs.Int("n", 0, "stop after this many batches (0: until the stream ends)")
	var clientTLS tlsconfig.Client
	tlsconfig.RegisterClientFlags(fs, "tls-", "the relay", &clientTLS)
	if code, stop := parseFlags(fs, args, stdout, stderr); stop {
		return code
	}
	if *addr == "" {
		fmt.Fprintln(stderr, "kvrelay tail: --addr is required")
		return 2
	}
	open, ok := tailServices[*service]
	if !ok {
		fmt.Fprintf(stderr, "kvrelay tail: --service %q: want vllm, sglang or tokenspeed\n", *service)
		return 2
	}
	fromText, fromWhere := *from, "--from"
	if fromText == "" && *cursorFile != "" {
		b, err := os.ReadFile(*cursorFile)
		switch {
		case err == nil:
			fromText, fromWhere = strings.TrimSpace(string(b)), "--cursor-file "+*cursorFile
		case !errors.Is(err, os.ErrNotExist):
			fmt.Fprintf(stderr, "kvrelay tail: --cursor-file: %v\n", err)
			return 2
		}
	}
	req, cursors, err := parseTailFrom(fromText)
	if err != nil {
		fmt.Fprintf(stderr, "kvrelay tail: %s: %v\n", fromWhere, err)
		return 2
	}
	target, useTLS, err := tlsconfig.ParseTarget(*addr)
	if err != nil {
		fmt.Fprintf(stderr, "kvrelay tail: --addr: %v\n", err)
		return 2
	}
	creds := insecure.NewCredentials()
	dialer, err := tlsconfig.ClientFor(clientTLS, useTLS, nil)
	if err != nil {
		fmt.Fprintf(stderr, "kvrelay tail: --tls-*: %v\n", err)
		return 2
	}
	if dialer != nil {
		creds = dialer.Credentials()
	}
	cc, err := grpc.NewClient(target, grpc.WithTransportCredentials(creds))
	if err != nil {
		fmt.Fprintf(stderr, "kvrelay tail: --addr %q: %v\n", *addr, err)
		return 2
	}
	defer cc.Close()
	stream, err := open(ctx, cc, req)
	if err != nil {
		st := status.Convert(err)
		fmt.Fprintf(stderr, "stream ended: %s: %s\n", st.Code(), st.Message())
		return 1
	}
	// The call returns before the server has answered: say what was asked
	// and that nothing came yet, so a quiet engine does not look like a
	// hung command.
	resume := "the relay's whole state"
	if fromText != "" {
		resume = "after " + formatCursors(cursors)
	}
	fmt.Fprintf(stderr, "kvrelay tail: subscribed to %s (%s) from %s; waiting for a first batch\n", *addr, *service, resume)
	keep := &cursorKeeper{path: *cursorFile, cursors: cursors}
	defer func() {
		if err := keep.flush(); err != nil {
			fmt.Fprintf(stderr, "kvrelay tail: --cursor-file: %v\n", err)
		}
	}()
	n := 0
	for {
		b, err := stream.Recv()
		if err != nil {
			if errors.Is(err, io.EOF) {
				fmt.Fprintln(stderr, "stream ended: OK")
				return 0
			}
			st := status.Convert(err)
			if ctx.Err() != nil {
				fmt.Fprintln(stderr, "stream ended: interrupted")
				return 0
			}
			fmt.Fprintf(stderr, "stream ended: %s: %s\n", st.Code(), st.Message())
			return 1
		}
		if *asJSON {
			line, err := protojson.MarshalOptions{}.Marshal(b)
			if err != nil {
				fmt.Fprintf(stderr, "kvrelay tail: encode batch: %v\n", err)
				return 1
			}
			fmt.Fprintf(stdout, "%s\n", line)
		} else {
			fmt.Fprintln(stdout, summarizeBatch(b, *rawTS))
		}
		keep.note(b)
		if err := keep.maybeFlush(); err != nil {
			fmt.Fprintf(stderr, "kvrelay tail: --cursor-file: %v\n", err)
			return 1
		}
		n++
		if *limit > 0 && n >= *limit {
			return 0
		}
	}
}

// parseTailFrom reads --from: "" (from zero), "N" (rank 0's cursor, the
// SMG form) or "RANK:SEQ,..." (rank_cursors, with start_sequence_number
// set to rank 0's for relays that predate them).
func parseTailFrom(text string) (*kvpb.SubscribeKvEventsRequest, map[int32]uint64, error) {
	cursors := map[int32]uint64{}
	req := &kvpb.SubscribeKvEventsRequest{}
	if text == "" {
		return req, cursors, nil
	}
	if !strings.Contains(text, ":") {
		seq, err := strconv.ParseUint(text, 10, 64)
		if err != nil {
			return nil, nil, fmt.Errorf("%q: want N or RANK:SEQ,RANK:SEQ", text)
		}
		cursors[0] = seq
		req.StartSequenceNumber = seq
		return req, cursors, nil
	}
	for _, part := range strings.Split(text, ",") {
		r, q, ok := strings.Cut(strings.TrimSpace(part), ":")
		rank, rerr := strconv.ParseInt(r, 10, 32)
		seq, qerr := strconv.ParseUint(q, 10, 64)
		if !ok || rerr != nil || qerr != nil || rank < 0 {
			return nil, nil, fmt.Errorf("%q: want RANK:SEQ with a rank ≥ 0 and a sequence number, in %q", part, text)
		}
		if _, dup := cursors[int32(rank)]; dup {
			return nil, nil, fmt.Errorf("rank %d is given twice in %q", rank, text)
		}
		cursors[int32(rank)] = seq
	}
	req.StartSequenceNumber = cursors[0]
	req.RankCursors = maps.Clone(cursors)
	return req, cursors, nil
}

// formatCursors is the RANK:SEQ,... form, ranks in order.
func formatCursors(cursors map[int32]uint64) string {
	ranks := slices.Sorted(maps.Keys(cursors))
	parts := make([]string, len(ranks))
	for i, r := range ranks {
		parts[i] = fmt.Sprintf("%d:%d", r, cursors[r])
	}
	return strings.Join(parts, ",")
}

// cursorKeeper follows each rank's last printed sequence, as a gateway's
// cursors do (a snapshot's first chunk starts them over), and writes them
// to path at most every cursorFlushEvery and at the end.
type cursorKeeper struct {
	path      string
	cursors   map[int32]uint64
	dirty     bool
	lastWrite time.Time
}

const cursorFlushEvery = 200 * time.Millisecond

func (k *cursorKeeper) note(b *kvpb.KvEventBatch) {
	if l := b.GetLoad(); l != nil && l.GetLoadOnly() {
		return // a load report carries no batch of the engine's
	}
	if s := b.GetSnapshot(); s != nil && s.GetIndex() == 0 {
		clear(k.cursors)
	}
	k.cursors[b.GetDpRank()] = b.GetSequenceNumber()
	k.dirty = true
}

func (k *cursorKeeper) maybeFlush() error {
	if time.Since(k.lastWrite) < cursorFlushEvery {
		return nil
	}
	return k.flush()
}

// flush writes the file whole (a temporary file renamed over it), so a
// tail killed mid-write leaves the previous cursors, never half of them.
func (k *cursorKeeper) flush() error {
	if k.path == "" || !k.dirty {
		return nil
	}
	tmp := k.path + ".tmp"
	if err := os.WriteFile(tmp, []byte(formatCursors(k.cursors)+"\n"), 0o644); err != nil {
		return err
	}
	if err := os.Rename(tmp, k.path); err != nil {
		return err
	}
	k.dirty, k.lastWrite = false, time.Now()
	return nil
}

// summarizeBatch is the one-line human form of a batch; its timestamp in
// RFC 3339 (UTC, milliseconds), or as epoch seconds with rawTS.
func summarizeBatch(b *kvpb.KvEventBatch, rawTS bool) string {
	var stored, blocks, removed, cleared int
	for _, ev := range b.GetEvents() {
		switch {
		case ev.GetStored() != nil:
			stored++
			blocks += len(ev.GetStored().GetBlocks())
		case ev.GetRemoved() != nil:
			removed += len(ev.GetRemoved().GetBlockHashes())
		case ev.GetCleared() != nil:
			cleared++
		}
	}
	var sb strings.Builder
	fmt.Fprintf(&sb, "seq=%d", b.GetSequenceNumber())
	if b.DpRank != nil {
		fmt.Fprintf(&sb, " rank=%d", b.GetDpRank())
	}
	fmt.Fprintf(&sb, " ts=%s stores=%d blocks=%d removed=%d cleared=%d", formatTS(b.GetTimestamp(), rawTS), stored, blocks, removed, cleared)
	if s := b.GetSnapshot(); s != nil {
		fmt.Fprintf(&sb, " snapshot=%d/%d live_blocks=%d unknown_before=%d", s.GetIndex()+1, s.GetCount(), s.GetBlocks(), s.GetUnknownBefore())
	}
	if l := b.GetLoad(); l != nil && l.GetLoadOnly() {
		sb.WriteString(" load_only")
	}
	return sb.String()
}

// formatTS renders an engine timestamp (epoch seconds; 0: none).
func formatTS(ts float64, raw bool) string {
	switch {
	case raw:
		return strconv.FormatFloat(ts, 'f', 3, 64)
	case ts == 0:
		return "none"
	}
	sec, frac := math.Modf(ts)
	return time.Unix(int64(sec), int64(frac*1e9)).UTC().Format("2006-01-02T15:04:05.000Z07:00")
}
