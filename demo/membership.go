package demo

import (
	"context"
	"fmt"
	"time"

	"github.com/kvrelay/kvrelay/gateway"
	"github.com/kvrelay/kvrelay/gateway/membership"
)

// The membership step: the second worker is drained while traffic flows
// (as POST /v1/workers/drain does), leaves once its tracked requests end,
// and is added again (POST /v1/workers): it resubscribes, and the check
// after it compares its rebuilt index with its engine. The table says what
// routing did meanwhile.

// routesPerWorker counts the demo's routed requests per worker, in
// d.workers order.
func (d *demo) routesPerWorker() []int { return append([]int(nil), d.routed...) }

func (d *demo) membershipFault() fault {
	b := d.workers[1]
	var drained, rejoined []int
	var left time.Duration
	return fault{
		name: "drain and rejoin",
		inject: func(ctx context.Context, f *faultRun) error {
			set, err := membership.New(d.gw.gw, membership.Options{DrainTimeout: quiesceTimeout, Logger: d.log.With("component", "membership")})
			if err != nil {
				return err
			}
			defer set.Close()
			var ws []gateway.Worker
			for _, w := range d.workers {
				ws = append(ws, gateway.Worker{ID: w.id, Addr: w.proxy.addr(), Service: w.kind.service, Model: model})
			}
			// The demo's workers, as if added through the admin API.
			if err := set.Adopt(membership.SourceAdmin, ws); err != nil {
				return err
			}
			start, before := time.Now(), d.routesPerWorker()
			if err := set.Drain(b.id); err != nil {
				return err
			}
			gone := func() bool { return len(set.Members()) == len(d.workers)-1 }
			for !gone() {
				if time.Since(start) > quiesceTimeout {
					return fmt.Errorf("%s did not leave within %s", b.id, quiesceTimeout)
				}
				if err := d.traffic(ctx, 1); err != nil {
					return err
				}
			}
			left = time.Since(start)
			if err := d.traffic(ctx, 15); err != nil {
				return err
			}
			drained = minus(d.routesPerWorker(), before)
			before = d.routesPerWorker()
			if err := set.Add(ws[1]); err != nil {
				return err
			}
			if err := d.traffic(ctx, 25); err != nil {
				return err
			}
			rejoined = minus(d.routesPerWorker(), before)
			return nil
		},
		describe: func(_ *faultRun, x delta) string {
			return fmt.Sprintf("%s drained (its in-flight requests finished in %s, then it left); while out: %d routes to %s, %d to %s; added back: it resubscribed (snapshots: %d) and took %d of %d routes",
				b.id, left.Round(10*time.Millisecond), drained[0], d.workers[0].id, drained[1], b.id, x.Snapshots, rejoined[1], rejoined[0]+rejoined[1])
		},
	}
}

func minus(a, b []int) []int {
	out := make([]int, len(a))
	for i := range a {
		out[i] = a[i] - b[i]
	}
	return out
}
