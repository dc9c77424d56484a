package monitor

import (
	"context"
	"sync/atomic"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"

	"github.com/kvrelay/kvrelay/proto/kvpb"
)

// cannedStream serves its batches, then ends with err.
type cannedStream struct {
	batches []*kvpb.KvEventBatch
	err     error
}

func (c *cannedStream) Header() (metadata.MD, error) { return metadata.MD{}, nil }

func (c *cannedStream) Recv() (*kvpb.KvEventBatch, error) {
	if len(c.batches) == 0 {
		return nil, c.err
	}
	b := c.batches[0]
	c.batches = c.batches[1:]
	return b, nil
}

// TestOpenStreamReplacesTheCallAndFallsBackOnIt: with Options.OpenStream,
// a subscription's batches come from the opener and go through the same
// admission; when that stream ends, the next subscription may use the gRPC
// call the opener was handed, and it carries the cursors the opener's
// batches left.
func TestOpenStreamReplacesTheCallAndFallsBackOnIt(t *testing.T) {
	var opened atomic.Int32
	r := newRig(t, func(o *Options) {
		o.OpenStream = func(ctx context.Context, w Worker, req *kvpb.SubscribeKvEventsRequest, viaGRPC SubscribeFunc) (BatchStream, error) {
			if opened.Add(1) == 1 {
				return &cannedStream{
					batches: []*kvpb.KvEventBatch{batch(0, 0, stored(16, 1)), batch(0, 1, stored(16, 2)), batch(0, 1)},
					err:     statusErr(codes.Unavailable, "canned stream over"),
				}, nil
			}
			return viaGRPC(ctx, req)
		}
	})
	r.sink.expect(t, "apply r0 s0", "apply r0 s1") // the repeat of 1 is stale
	c := r.srv.next(t)
	if got := c.req.GetRankCursors()[0]; got != 1 || c.req.GetStartSequenceNumber() != 1 {
		t.Fatalf("the gRPC call after the opener's stream carries start %d, rank 0 cursor %d; want 1 and 1", c.req.GetStartSequenceNumber(), got)
	}
	c.answer(t).send(t, batch(0, 2, stored(16, 3)))
	r.sink.expect(t, "apply r0 s2")
	r.sink.quiet(t)
	if got := r.counter(t, "batches", "stale"); got != 1 {
		t.Errorf("stale batches = %v, want 1 (admission applies to the opener's batches)", got)
	}
}
