package placementsync

import (
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

func TestPeerLimiter(t *testing.T) {
	newL := func() *peerLimiter {
		return newPeerLimiter("placement", 100, 1000, 1000, 5000, time.Minute,
			prometheus.NewCounterVec(prometheus.CounterOpts{Name: "x"}, []string{"kind", "reason"}))
	}
	t0 := time.Unix(1000, 0)
	for _, tc := range []struct {
		name  string
		steps []struct {
			peer string
			n    int
			at   time.Duration
			want string
		}
	}{
		{"burst, then broken, then backoff, then back", []struct {
			peer string
			n    int
			at   time.Duration
			want string
		}{
			{"a", 1000, 0, admitted},
			{"a", 1, 0, brokeBound},
			{"a", 1, 30 * time.Second, inBackoff},
			{"b", 500, 30 * time.Second, admitted}, // others unaffected
			{"a", 1000, 61 * time.Second, admitted},
		}},
		{"the rate refills", []struct {
			peer string
			n    int
			at   time.Duration
			want string
		}{
			{"a", 1000, 0, admitted},
			{"a", 100, time.Second, admitted},
			{"a", 101, 2 * time.Second, brokeBound},
		}},
		{"the total", []struct {
			peer string
			n    int
			at   time.Duration
			want string
		}{
			{"a", 1000, 0, admitted}, {"b", 1000, 0, admitted}, {"c", 1000, 0, admitted},
			{"d", 1000, 0, admitted}, {"e", 1000, 0, admitted},
			{"f", 1, 0, overTotal},
			{"f", 1000, 10 * time.Second, admitted}, // not backed off
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l := newL()
			for i, s := range tc.steps {
				if got := l.admit(s.peer, s.n, t0.Add(s.at)); got != s.want {
					t.Fatalf("step %d (%s %d at %v): %q, want %q", i, s.peer, s.n, s.at, got, s.want)
				}
			}
		})
	}
}
