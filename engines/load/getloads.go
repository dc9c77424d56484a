package load

import (
	"context"
	"fmt"
	"math"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/kvrelay/kvrelay/proto/kvpb"
)

// getLoads reads the engine servicer's GetLoads: every rank's
// SchedulerLoad, converted as SMG's servicers convert it for their own
// streams (smg-grpc-servicer 0.14.1 load_record.engine_load_from).
type getLoads struct {
	conn   grpc.ClientConnInterface
	method string
	// newResponse and convert are the engine's message and mapping.
	newResponse func() proto.Message
	convert     func(proto.Message) (map[int32]*kvpb.EngineLoad, error)
}

// NewGetLoads reads GetLoads from the servicer behind conn, under the
// engine's full service name (vllm.grpc.engine.VllmEngine,
// sglang.grpc.scheduler.SglangScheduler or
// tokenspeed.grpc.scheduler.TokenSpeedScheduler).
func NewGetLoads(conn grpc.ClientConnInterface, service string) (Fetcher, error) {
	g := &getLoads{conn: conn, method: "/" + service + "/GetLoads"}
	switch service {
	case kvpb.VllmEngine_ServiceDesc.ServiceName:
		g.newResponse = func() proto.Message { return &kvpb.VllmGetLoadsResponse{} }
		g.convert = func(m proto.Message) (map[int32]*kvpb.EngineLoad, error) {
			return byRank(m.(*kvpb.VllmGetLoadsResponse).GetLoads(), fromVllm)
		}
	case kvpb.SglangScheduler_ServiceDesc.ServiceName:
		g.newResponse = func() proto.Message { return &kvpb.SglangGetLoadsResponse{} }
		g.convert = func(m proto.Message) (map[int32]*kvpb.EngineLoad, error) {
			return byRank(m.(*kvpb.SglangGetLoadsResponse).GetLoads(), FromSglang)
		}
	case kvpb.TokenSpeedScheduler_ServiceDesc.ServiceName:
		g.newResponse = func() proto.Message { return &kvpb.TokenSpeedGetLoadsResponse{} }
		g.convert = func(m proto.Message) (map[int32]*kvpb.EngineLoad, error) {
			return byRank(m.(*kvpb.TokenSpeedGetLoadsResponse).GetLoads(), fromTokenSpeed)
		}
	default:
		return nil, fmt.Errorf("load: no GetLoads is known for service %q", service)
	}
	return g, nil
}

// byRank converts every rank's report. A rank reported twice keeps its
// last report. A report naming more than maxRanks ranks, or a negative
// rank, is not an engine's: it is refused as malformed rather than kept.
func byRank[L interface{ GetDpRank() int32 }](loads []L, convert func(L) *kvpb.EngineLoad) (map[int32]*kvpb.EngineLoad, error) {
	if len(loads) > maxRanks {
		return nil, fmt.Errorf("%w: GetLoads: %d ranks, more than %d", ErrMalformed, len(loads), maxRanks)
	}
	out := make(map[int32]*kvpb.EngineLoad, len(loads))
	for i, l := range loads {
		if l.GetDpRank() < 0 {
			return nil, fmt.Errorf("%w: GetLoads: load %d has dp_rank %d", ErrMalformed, i, l.GetDpRank())
		}
		out[l.GetDpRank()] = convert(l)
	}
	return out, nil
}

func (g *getLoads) Name() string { return "getloads" }

func (g *getLoads) Fetch(ctx context.Context, maxBytes int64) (map[int32]*kvpb.EngineLoad, error) {
	// Every section: SGLang's servicer takes an empty list as "all", but
	// TokenSpeed's as "core".
	req := &kvpb.VllmGetLoadsRequest{Include: []string{"all"}}
	resp := g.newResponse()
	err := g.conn.Invoke(ctx, g.method, req, resp, grpc.MaxCallRecvMsgSize(int(min(maxBytes, math.MaxInt32))))
	switch status.Code(err) {
	case codes.OK:
		loads, err := g.convert(resp)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", g.method, err)
		}
		return loads, nil
	case codes.ResourceExhausted:
		return nil, fmt.Errorf("%w: %s: %w", ErrTooLarge, g.method, err)
	case codes.Unimplemented:
		return nil, fmt.Errorf("%w: %s: %w", ErrRefused, g.method, err)
	case codes.DeadlineExceeded:
		return nil, fmt.Errorf("%s: %w: %w", g.method, context.DeadlineExceeded, err)
	case codes.Internal:
		if ctx.Err() == nil {
			// A response that does not parse is INTERNAL on the client.
			return nil, fmt.Errorf("%w: %s: %w", ErrMalformed, g.method, err)
		}
	}
	return nil, fmt.Errorf("load: %s: %w", g.method, err)
}

// unsigned is a count as the record's uint32 takes it: negative reads as 0.
func unsigned(v int32) uint32 { return uint32(max(v, 0)) }

// common is the part of the record every engine's report fills alike.
func common(running, waiting, maxRunning, used, maxTotal int32, usage, rate, hit float64) *kvpb.EngineLoad {
	return &kvpb.EngineLoad{
		RunningRequests:    unsigned(running),
		WaitingRequests:    unsigned(waiting),
		TokenUsage:         usage,
		GenThroughput:      rate,
		MaxRunningRequests: unsigned(maxRunning),
		CacheHitRate:       proto.Float64(hit),
		NumUsedTokens:      proto.Int32(used),
		MaxTotalNumTokens:  proto.Int32(maxTotal),
	}
}

// fromVllm: vLLM's servicer reports its queued token work on GetLoads, so
// the record carries it.
func fromVllm(l *kvpb.VllmSchedulerLoad) *kvpb.EngineLoad {
	r := common(l.GetNumRunningReqs(), l.GetNumWaitingReqs(), l.GetMaxRunningRequests(), l.GetNumUsedTokens(),
		l.GetMaxTotalNumTokens(), l.GetTokenUsage(), l.GetGenThroughput(), l.GetCacheHitRate())
	r.WaitingUncachedTokens = proto.Uint32(unsigned(l.GetNumWaitingUncachedTokens()))
	return r
}

// FromSglang is SGLang's report as the record: the queued token work and
// every section the report carries. Exported for the /v1/loads reader,
// which reads the same shape as JSON.
func FromSglang(l *kvpb.SglangSchedulerLoad) *kvpb.EngineLoad {
	r := common(l.GetNumRunningReqs(), l.GetNumWaitingReqs(), l.GetMaxRunningRequests(), l.GetNumUsedTokens(),
		l.GetMaxTotalNumTokens(), l.GetTokenUsage(), l.GetGenThroughput(), l.GetCacheHitRate())
	r.WaitingUncachedTokens = proto.Uint32(unsigned(l.GetNumWaitingUncachedTokens()))
	r.Memory = l.GetMemory()
	r.Speculative = l.GetSpeculative()
	r.Lora = l.GetLora()
	r.Disaggregation = l.GetDisaggregation()
	r.Queues = l.GetQueues()
	return r
}

// fromTokenSpeed: TokenSpeed's scheduler reports no queued token work, so
// the record leaves it unset, as its servicer's does; it alone reports
// active (non-evictable) usage.
func fromTokenSpeed(l *kvpb.TokenSpeedSchedulerLoad) *kvpb.EngineLoad {
	r := common(l.GetNumRunningReqs(), l.GetNumWaitingReqs(), l.GetMaxRunningRequests(), l.GetNumUsedTokens(),
		l.GetMaxTotalNumTokens(), l.GetTokenUsage(), l.GetGenThroughput(), l.GetCacheHitRate())
	r.ActiveTokenUsage = l.ActiveTokenUsage
	r.Memory = l.GetMemory()
	r.Queues = l.GetQueues()
	return r
}
