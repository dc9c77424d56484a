package relay

import (
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/kvrelay/kvrelay/engines"
	"github.com/kvrelay/kvrelay/engines/wire"
)

// The failure counters exist at 0 for every rank (and every reason) from
// the start, before any event: alerts on them and rate() need the series.
func TestFailureCountersExistAtZeroFromTheStart(t *testing.T) {
	for _, startupClear := range []bool{false, true} {
		reg := prometheus.NewRegistry()
		eng := engineForTest()
		eng.StartupClear = startupClear
		if _, err := New(Config{Engine: eng, KV: engines.Config{Enabled: true, Endpoint: "tcp://*:5557"}, DPSize: 2,
			Registerer: reg, Logger: quietLogger()}); err != nil {
			t.Fatal(err)
		}
		mfs, err := reg.Gather()
		if err != nil {
			t.Fatal(err)
		}
		series := map[string]map[string]float64{} // name -> label string -> value
		for _, mf := range mfs {
			for _, m := range mf.GetMetric() {
				if series[mf.GetName()] == nil {
					series[mf.GetName()] = map[string]float64{}
				}
				series[mf.GetName()][labelString(m)] = m.GetCounter().GetValue()
			}
		}
		want := map[string][]string{}
		for _, rank := range []string{"0", "1"} {
			for _, name := range []string{"kvrelay_publisher_gaps_total", "kvrelay_batches_lost_total", "kvrelay_batches_relayed_total"} {
				want[name] = append(want[name], "rank="+rank)
			}
			reasons := []string{"sequence_regression", "counter_restarted", "replay_mismatch", "sequence_jump"}
			if startupClear {
				reasons = append(reasons, "startup_clear")
			}
			for _, reason := range reasons {
				want["kvrelay_publisher_restarts_total"] = append(want["kvrelay_publisher_restarts_total"], "rank="+rank+",reason="+reason)
			}
		}
		for _, reason := range wire.DropReasons() {
			want["kvrelay_events_dropped_total"] = append(want["kvrelay_events_dropped_total"], "reason="+reason.String())
		}
		for name, labelSets := range want {
			for _, ls := range labelSets {
				v, ok := series[name][ls]
				if !ok {
					t.Errorf("startup_clear=%v: %s{%s} does not exist before the first event (have %v)", startupClear, name, ls, series[name])
				} else if v != 0 {
					t.Errorf("%s{%s} = %v, want 0", name, ls, v)
				}
			}
		}
		if _, ok := series["kvrelay_publisher_restarts_total"]["rank=0,reason=startup_clear"]; ok && !startupClear {
			t.Error("a startup_clear series for an engine that never starts with a clear")
		}
	}
}

// labelString is a series' labels other than the relay's constant ones.
func labelString(m *dto.Metric) string {
	s := ""
	for _, lp := range m.GetLabel() {
		if lp.GetName() == "engine" || lp.GetName() == "relay" {
			continue
		}
		if s != "" {
			s += ","
		}
		s += lp.GetName() + "=" + lp.GetValue()
	}
	return s
}
