package relay

import (
	"errors"
	"math"
	"testing"
)

// Issue 13.8 and 13.9: one batch with an absurd sequence is a new
// incarnation (subscribers resync, as for any restart), never a gap: no hole
// or lost count wider than the engine's replay window, nothing wrapped.
func TestAbsurdSequencesAreRestartsNotGaps(t *testing.T) {
	const window = 10_000 // the engines' default buffer_steps
	tests := []struct {
		name   string
		forged uint64
	}{
		{"the top of the counter, where cursor+1 wraps to 0", math.MaxUint64},
		{"a jump to 2^63", 1 << 63},
		{"a hole one wider than the replay window", 19 + 2*window + 2},
	}
	// Without a replay nothing of a gap is filled, so a gap one wider than
	// the window is a jump already.
	withoutReplay := uint64(19 + window + 2)
	tests = append(tests, struct {
		name   string
		forged uint64
	}{"a gap one wider than the window", withoutReplay})
	for _, tc := range tests {
		for _, replay := range []bool{true, false} {
			if tc.forged == withoutReplay && replay {
				continue // a gap the ring fills in part: see TestAGapAtTheEdgeOfTheWindowIsFilled
			}
			name := tc.name + map[bool]string{true: ", with a replay", false: ", without a replay"}[replay]
			t.Run(name, func(t *testing.T) {
				l := newLab(t, labOpts{noReplay: !replay})
				p := l.pubs[0]
				for i := 0; i < 20; i++ {
					p.publish(payload(0, stored(-1, int64(i+1))))
				}
				l.cursor(0, 19)
				s := l.subscribe(19)
				p.send(tc.forged, payload(0, stored(-1, 100)))
				if err := nextErr(t, s); !errors.Is(err, ErrDataLoss) {
					t.Fatalf("after the forged sequence: %v, want DATA_LOSS", err)
				}
				// The engine goes on counting: a regression from the forged
				// sequence, so a restart again, and the relay follows.
				after := l.subscribe(0)
				p.publish(payload(0, stored(-1, 21)))
				if err := nextErr(t, after); !errors.Is(err, ErrDataLoss) {
					t.Fatalf("after the engine's next batch: %v, want DATA_LOSS", err)
				}
				l.waitFor("the cursor back at 20", func() bool {
					l.r.mu.Lock()
					defer l.r.mu.Unlock()
					rk := l.r.ranks[0]
					return rk.hasCursor && rk.cursor == 20
				})
				m := l.m()
				if n := counter(m.restarts.WithLabelValues("0", string(sequenceJump))); n != 1 {
					t.Errorf("%v sequence_jump restarts, want 1", n)
				}
				if n := counter(m.gaps.WithLabelValues("0")); n != 0 {
					t.Errorf("%v gaps counted, want none", n)
				}
				if n := counter(m.lost.WithLabelValues("0")); n > window+20 {
					t.Errorf("%v batches counted lost; one message may account for the window (%d) at most", n, window)
				}
				if n := counter(m.unknownBeforeStart.WithLabelValues("0")); n > 2*window {
					t.Errorf("unknown_before_total %v; one message may account for the window (%d) at most", n, window)
				}
			})
		}
	}
}

// A gap within the replay window is still a gap, filled from the replay.
func TestAGapAtTheEdgeOfTheWindowIsFilled(t *testing.T) {
	l := newLab(t, labOpts{})
	p := l.pubs[0]
	// A ring larger than the relay's window (the engine config's
	// buffer_steps, 10,000 here) holds the whole gap.
	p.set(func(p *fakePub) { p.ringSize = 20_000 })
	p.publish(payload(0, stored(-1, 1)))
	l.cursor(0, 0)
	for i := 0; i < 10_000; i++ {
		p.hide(payload(0, stored(-1, int64(i+2))))
	}
	p.publish(payload(0, stored(-1, 10_002)))
	l.cursor(0, 10_001)
	m := l.m()
	if g, lost, rec := counter(m.gaps.WithLabelValues("0")), counter(m.lost.WithLabelValues("0")), counter(m.recovered.WithLabelValues("0")); g != 1 || lost != 0 || rec < 10_000 {
		t.Fatalf("gaps %v, lost %v, recovered %v; want one gap of 10,000 filled", g, lost, rec)
	}
}
