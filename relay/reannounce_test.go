package relay

import (
	"testing"
)

// Under report mode "full" the stream stays the engine's, batch for batch,
// unless the suppression stage is on: then the stores the record took for
// re-announcements leave the batches (history and live), every batch keeps
// its place and sequence, and the counter says which were left out.
func TestReannouncedStoresLeaveTheStreamOnlyWithTheSuppressionStage(t *testing.T) {
	for _, tc := range []struct {
		name     string
		suppress bool
		want     string
		events   float64 // kvrelay_events_relayed_total: the events the stream carried
	}{
		{"faithful by default", false, "[1 2 3] [1 2] [4] [1 2 3]", 4},
		{"suppressed", true, "[1 2 3] [4]", 2},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l := newLab(t, labOpts{reportModeFull: true, suppress: tc.suppress})
			s := l.subscribe(0)
			l.pubs[0].publish(payload(0, stored(-1, 1, 2, 3)))
			l.pubs[0].publish(payload(0, stored(-1, 1, 2), stored(2, 4))) // a hit re-announced, then the request's new block
			l.pubs[0].publish(payload(0, stored(-1, 1, 2, 3)))            // a hit re-announced alone
			for name, sub := range map[string]*Subscription{"live": s, "history": nil} {
				if sub == nil {
					sub = l.subscribe(0)
				}
				b0, b1, b2 := next(t, sub), next(t, sub), next(t, sub)
				if got := describe(b0) + " " + describe(b1) + " " + describe(b2); got != "0:0 0:1 0:2" {
					t.Fatalf("%s: batches %s, want 0:0 0:1 0:2", name, got)
				}
				if h := storedHashes(b0, b1, b2); h != tc.want {
					t.Fatalf("%s: stores %q, want %q", name, h, tc.want)
				}
			}
			label := map[bool]string{false: "false", true: "true"}[tc.suppress]
			l.counts("reannounced", []float64{2}, l.m().reannounced.WithLabelValues("0", label))
			l.counts("events relayed", []float64{tc.events}, l.m().events.WithLabelValues("0"))
			if st := l.r.Status(); st.RecordBlocks != 4 {
				t.Fatalf("record blocks %d, want 4", st.RecordBlocks)
			}
		})
	}
}
