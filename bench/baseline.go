package bench

import (
	"context"
	"encoding/binary"
	"math"
	"sync"
	"time"

	"github.com/kvrelay/kvrelay/relay/zmqsource"
)

// directFeed is the side-by-side's control: no relay, the bench reads the
// publisher's PUB sockets itself with relay/zmqsource (kvrelay's own socket
// code). Its latency is the floor the host puts under both relays: the
// publisher's send, one loopback hop, and one wake-up of a reader.
type directFeed struct {
	pub *publisher
}

func startDirect(_ context.Context, _ *environment, pub *publisher) (relayProc, error) {
	return &directFeed{pub: pub}, nil
}

func (d *directFeed) addr() string { return "" }
func (d *directFeed) pid() int     { return 0 }
func (d *directFeed) stop()        {}

// feed reads every rank into s until ctx ends.
func (d *directFeed) feed(ctx context.Context, s *subscriber, opened chan<- error) {
	defer close(s.done)
	var wg sync.WaitGroup
	for rank, r := range d.pub.ranks {
		zs := zmqsource.NewSubscriber(zmqsource.SubscriberOptions{Endpoint: r.Pub, Logger: quietLog})
		wg.Go(func() {
			defer zs.Close()
			for {
				m, err := zs.Recv(ctx)
				if err != nil {
					return
				}
				now := time.Now()
				ts, ok := payloadTimestamp(m.Payload)
				if !ok {
					s.mu.Lock()
					s.other++
					s.mu.Unlock()
					continue
				}
				s.record(batchSummary{timestamp: ts, blocks: storeBlocks, hasHash: true,
					firstHash: encodeBlockHash(rank, m.Seq, 0)}, now)
			}
		})
	}
	close(opened)
	wg.Wait()
}

// payloadTimestamp reads the batch ts of the publisher's envelope, a
// msgpack array whose first element is a float64.
func payloadTimestamp(p []byte) (float64, bool) {
	if len(p) < 10 || p[0]&0xf0 != 0x90 || p[1] != 0xcb {
		return 0, false
	}
	return math.Float64frombits(binary.BigEndian.Uint64(p[2:10])), true
}
