package relay

import (
	"context"
	"errors"
	"slices"
	"testing"
)

// Live batches wait on the socket while the start replay runs. When the
// engine's ring has moved past some of them by the time it answers, the
// relay writes those off (a hole, or unknown_before) and relays the ring;
// their live copies then arrive below the cursor. They are the same
// incarnation's old batches, not a restart: the engine still holds the
// batch at the cursor. (CI: TestExactnessAgainstTheSimulatedEngine
// sglang/array6 took a queued live 1 behind a primed 2..29 for a restart.)
// A publisher that did restart is still one, and without the engine's
// answer the admission table's verdict stands.
func TestLiveBatchesAStartReplayRanPastAreStaleNotARestart(t *testing.T) {
	cases := []struct {
		name string
		// ring is the engine's replay ring (and the relay's buffer_steps);
		// the engine has published 0..9 when the relay starts, so the ring
		// holds 10-ring..9.
		ring int
		// liveFrom..9 wait on the live socket, queued while the start
		// replay was being answered (0: none).
		liveFrom uint64
		// Once the relay has primed: the publisher restarts and publishes
		// its sequence 0.
		restart bool
		// With restart: the new incarnation first published this many
		// batches its live socket lost, so its ring holds a different batch
		// at the relay's cursor when the live 0 arrives.
		republished int
		// Once the relay has primed, it takes live 10 and 11; then an
		// earlier sequence comes: the live stream itself went back.
		wentBack bool
		// The replay stops answering once the start replay is answered.
		replayDown bool

		wantRestart bool          // a restart, for wantReason
		wantReason  restartReason // counter_restarted when empty
		// Without a restart: the batches skipped as stale and as
		// duplicates, and the start the relay wrote off.
		wantStale, wantDuplicates, wantUnknown, wantLost float64
	}{
		// The CI case: the ring lost 0..1 (a hole within its reach), and
		// the queued 1 read as counter_restarted.
		{name: "the ring lost 0..1, live 1..9 queued", ring: 8, liveFrom: 1,
			wantStale: 1, wantDuplicates: 8, wantUnknown: 2, wantLost: 2},
		// The ring lost more than its reach (unknown_before 6, no hole):
		// the queued 3..5 read as sequence_regression.
		{name: "the ring lost 0..5, live 3..9 queued", ring: 4, liveFrom: 3,
			wantStale: 3, wantDuplicates: 4, wantUnknown: 6, wantLost: 0},
		// A restart right after priming, before any live batch: the new
		// ring holds nothing at the cursor.
		{name: "the publisher restarted after priming", ring: 8, restart: true, wantRestart: true},
		// A restart whose new ring has moved past the cursor: the engine
		// answers at the cursor, with another batch.
		{name: "the publisher restarted and published past the cursor", ring: 8, restart: true, republished: 12,
			wantRestart: true},
		// Below the last live batch: a restart without asking the engine.
		{name: "the live stream went back", ring: 8, wentBack: true, wantRestart: true, wantReason: sequenceRegression},
		// The engine does not answer: nothing tells an old batch from a
		// restart, and the admission table's verdict stands.
		{name: "live 1..9 queued, the replay then down", ring: 8, liveFrom: 1, replayDown: true, wantRestart: true},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			payloads := make([][]byte, 10)
			for i := range payloads {
				payloads[i] = payload(0, stored(-1, int64(100+i)))
			}
			queue := c.liveFrom > 0
			l := newLab(t, labOpts{noCatchUp: true, bufferSteps: c.ring, beforeRun: func(l *lab) {
				p := l.pubs[0]
				p.ringSize = c.ring
				for _, b := range payloads {
					p.hide(b)
				}
				// Runs on the rank's goroutine, in the start replay.
				p.afterAnswer = func(from uint64) {
					if from != 0 || !queue {
						return
					}
					queue = false
					if c.replayDown {
						p.set(func(p *fakePub) { p.down = true })
					}
					for seq := c.liveFrom; seq < 10; seq++ {
						p.send(seq, payloads[seq])
					}
				}
			}})
			p := l.pubs[0]
			m := l.m()
			if c.wantRestart {
				reason := c.wantReason
				if reason == "" {
					reason = counterRestarted
				}
				l.cursor(0, 9)
				s := l.subscribe(0)
				cursor := uint64(9)
				switch {
				case c.restart && c.republished > 0:
					p.restart(0)
					var first []byte
					for i := range c.republished {
						b := payload(0, stored(-1, int64(200+i)))
						if i == 0 {
							first = b
						}
						p.hide(b)
					}
					p.send(0, first)
				case c.restart:
					p.restart(0)
					p.publish(payload(0, stored(-1, 200)))
				case c.wentBack:
					p.publish(payload(0, stored(-1, 110)))
					p.publish(payload(0, stored(-1, 111)))
					l.cursor(0, 11)
					cursor = 11
					p.send(5, payloads[5])
				}
				l.waitFor("the restart", func() bool { return l.r.Status().Ranks[0].Restarts == 1 })
				if got := counter(m.restarts.WithLabelValues("0", string(reason))); got != 1 {
					t.Fatalf("restarts{%s} = %v, want 1", reason, got)
				}
				asked := slices.Contains(p.askedFrom(), cursor)
				switch {
				case c.wentBack && asked:
					t.Fatalf("the replay was asked from the cursor %d (%v) for a batch below the last live one", cursor, p.askedFrom())
				case c.republished > 0 && (!asked || !slices.Equal(p.upToLimits(), []int{1})):
					t.Fatalf("asked from %v, reply limits %v: want the cursor's batch asked for alone (from %d, limit 1)",
						p.askedFrom(), p.upToLimits(), cursor)
				}
				if c.restart {
					// Subscribed before the restart: ended.
					ctx, cancel := context.WithTimeout(context.Background(), patience)
					defer cancel()
					for {
						if _, err := s.Next(ctx); err != nil {
							if !errors.Is(err, ErrDataLoss) {
								t.Fatalf("the subscription ended with %v, want data loss", err)
							}
							break
						}
					}
				}
				return
			}
			// The queued batches are taken before the next live one.
			p.publish(payload(0, stored(-1, 110)))
			l.cursor(0, 10)
			st := l.r.Status()
			if rs := st.Ranks[0]; rs.Restarts != 0 || st.Generation != 0 {
				t.Fatalf("restarts %d, generation %d: an old batch was taken for a restart", rs.Restarts, st.Generation)
			}
			// One head request per stale batch, the batch at the cursor alone.
			if limits := p.upToLimits(); len(limits) != int(c.wantStale) || slices.ContainsFunc(limits, func(n int) bool { return n != 1 }) {
				t.Fatalf("reply limits of the stale checks %v, want %v requests for one reply", limits, c.wantStale)
			}
			l.counts("stale/duplicates/unknown_before/lost", []float64{c.wantStale, c.wantDuplicates, c.wantUnknown, c.wantLost},
				m.stale.WithLabelValues("0"), m.duplicates.WithLabelValues("0"), m.unknownBefore.WithLabelValues("0"), m.lost.WithLabelValues("0"))
			chunk := next(t, l.subscribe(0))
			if describe(chunk) != "0:10 snap 0/1" || chunk.GetSnapshot().GetBlocks() != uint64(11-c.wantUnknown) {
				t.Fatalf("snapshot %s %v, want 0:10 with %v blocks", describe(chunk), chunk.GetSnapshot(), 11-c.wantUnknown)
			}
		})
	}
}
