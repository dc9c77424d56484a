package main

import (
	"flag"
	"fmt"
	"math"

	"github.com/kvrelay/kvrelay/relay"
	"github.com/kvrelay/kvrelay/relay/server"
)

// serverLimitFlags are the subscriber limits of `kvrelay serve`; they apply
// to every listener (each listener counts its own subscribers).
type serverLimitFlags struct {
	server.Limits
	// RecordMaxEntries caps each rank's live-block record (relay.Config).
	RecordMaxEntries int
	perConn          uint
}

func addServerLimitFlags(fs *flag.FlagSet) *serverLimitFlags {
	d := server.DefaultLimits
	l := &serverLimitFlags{}
	fs.UintVar(&l.perConn, "max-streams-per-conn", uint(d.MaxStreamsPerConn), "concurrent gRPC calls on one connection, proxied ones included (HTTP/2 MAX_CONCURRENT_STREAMS)")
	fs.IntVar(&l.MaxSubscribersPerPeer, "max-subscribers-per-peer", d.MaxSubscribersPerPeer, "SubscribeKvEvents streams one client IP may hold open on a listener; more get RESOURCE_EXHAUSTED")
	fs.IntVar(&l.MaxSubscribers, "max-subscribers", d.MaxSubscribers, "SubscribeKvEvents streams a listener holds open; more get RESOURCE_EXHAUSTED")
	fs.DurationVar(&l.SendStall, "subscriber-stall-timeout", d.SendStall, "end a stream (RESOURCE_EXHAUSTED) whose client has read nothing for this long while a batch waited")
	fs.IntVar(&l.MaxSendMsgBytes, "max-send-msg-bytes", d.MaxSendMsgBytes, "largest gRPC message sent; gateways must accept as much (a batch is never split)")
	fs.IntVar(&l.RecordMaxEntries, "record-max-entries", relay.DefaultRecordMaxEntries, "live blocks per rank kept for snapshots; past it the oldest-stored go and the rank's snapshots are marked incomplete (-1: no cap)")
	return l
}

// validate checks the values and fills Limits.MaxStreamsPerConn.
func (l *serverLimitFlags) validate() error {
	switch {
	case l.perConn < 1 || l.perConn > math.MaxUint32:
		return fmt.Errorf("--max-streams-per-conn %d: want 1..%d", l.perConn, uint64(math.MaxUint32))
	case l.MaxSubscribersPerPeer < 1:
		return fmt.Errorf("--max-subscribers-per-peer %d: want at least 1", l.MaxSubscribersPerPeer)
	case l.MaxSubscribers < 1:
		return fmt.Errorf("--max-subscribers %d: want at least 1", l.MaxSubscribers)
	case l.SendStall <= 0:
		return fmt.Errorf("--subscriber-stall-timeout %v: want a positive duration", l.SendStall)
	case l.RecordMaxEntries == 0 || l.RecordMaxEntries < -1:
		return fmt.Errorf("--record-max-entries %d: want a positive count, or -1 for no cap", l.RecordMaxEntries)
	case l.MaxSendMsgBytes < 4<<20:
		return fmt.Errorf("--max-send-msg-bytes %d: want at least 4194304 (gRPC's default; snapshot chunks are sized to fit it)", l.MaxSendMsgBytes)
	}
	l.MaxStreamsPerConn = uint32(l.perConn)
	return nil
}
