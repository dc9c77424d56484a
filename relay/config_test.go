package relay

import (
	"context"
	"encoding/json"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrelay/kvrelay/engines"
)

func TestNewValidatesItsConfig(t *testing.T) {
	kv := engines.Config{Enabled: true, Endpoint: "tcp://*:5557"}
	tests := []struct {
		name string
		cfg  Config
		want string
	}{
		{"no ranks", Config{KV: kv}, "DP size 0"},
		{"negative history", Config{KV: kv, DPSize: 1, HistoryBatches: -1}, "must not be negative"},
		{"negative bytes", Config{KV: kv, DPSize: 1, HistoryBytes: -1}, "must not be negative"},
		{"no endpoint", Config{KV: engines.Config{Enabled: true}, DPSize: 1}, "endpoint is empty"},
		{"bad rank endpoint", Config{KV: engines.Config{Enabled: true, Endpoint: "ipc:///tmp/kv"}, DPSize: 2}, "rank 1"},
		{"negative message size", Config{KV: kv, DPSize: 1, MaxMessageBytes: -1}, "must not be negative"},
		{"queue below one message", Config{KV: kv, DPSize: 1, MaxMessageBytes: 1000, QueueBytes: 999}, "cannot hold one message"},
		{"negative replay time", Config{KV: kv, DPSize: 1, ReplayMaxTime: -time.Second}, "must not be negative"},
	}
	for _, tc := range tests {
		tc.cfg.Logger = quietLogger()
		_, err := New(tc.cfg)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: %v, want an error containing %q", tc.name, err, tc.want)
		}
	}
}

// The engine-side limits default to what README's Limits table states.
func TestEngineSideLimitsDefaults(t *testing.T) {
	for _, tc := range []struct {
		steps       int
		wantReplies int
	}{{0, 20_000}, {10_000, 20_000}, {25, 50}} {
		cfg := Config{KV: engines.Config{Enabled: true, Endpoint: "tcp://*:5557", BufferSteps: tc.steps}, DPSize: 1, Logger: quietLogger()}
		if err := cfg.resolve(); err != nil {
			t.Fatal(err)
		}
		if cfg.MaxMessageBytes != 64<<20 || cfg.QueueBytes != 128<<20 || cfg.ReplayMaxBatches != tc.wantReplies ||
			cfg.ReplayMaxBytes != 256<<20 || cfg.ReplayMaxTime != 30*time.Second {
			t.Errorf("buffer_steps %d: %+v", tc.steps, cfg.zmqLimits())
		}
	}
}

func TestHistoryLimitsComeFromTheEnvironmentWhenUnset(t *testing.T) {
	tests := []struct {
		batches, bytes string
		wantN          int
		wantB          int64
		wantErr        string // substring of New's error; "" for none
	}{
		{"", "", DefaultHistoryBatches, DefaultHistoryBytes, ""},
		{" 500 ", "1048576", 500, 1 << 20, ""},
		{"abc", "", 0, 0, `$SMG_KV_EVENT_HISTORY_BATCHES="abc": want a positive integer`},
		{"", "-3", 0, 0, `$SMG_KV_EVENT_HISTORY_BYTES="-3": want a positive integer`},
		{"0", "", 0, 0, `$SMG_KV_EVENT_HISTORY_BATCHES="0": want a positive integer`},
	}
	for _, tc := range tests {
		t.Setenv(EnvHistoryBatches, tc.batches)
		t.Setenv(EnvHistoryBytes, tc.bytes)
		r, err := New(Config{DPSize: 1, Logger: quietLogger()})
		if tc.wantErr != "" {
			if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
				t.Errorf("env %q/%q: error %v, want one containing %s", tc.batches, tc.bytes, err, tc.wantErr)
			}
			continue
		}
		if err != nil {
			t.Fatal(err)
		}
		if r.cfg.HistoryBatches != tc.wantN || r.cfg.HistoryBytes != tc.wantB {
			t.Errorf("env %q/%q: %d/%d, want %d/%d", tc.batches, tc.bytes, r.cfg.HistoryBatches, r.cfg.HistoryBytes, tc.wantN, tc.wantB)
		}
	}
	t.Setenv(EnvHistoryBatches, "77")
	r, err := New(Config{DPSize: 1, HistoryBatches: 12, Logger: quietLogger()})
	if err != nil || r.cfg.HistoryBatches != 12 {
		t.Fatalf("an explicit limit beats the environment: %v %d", err, r.cfg.HistoryBatches)
	}
}

func TestMetricsRegisterOnTheGivenRegistry(t *testing.T) {
	reg := prometheus.NewRegistry()
	if _, err := New(Config{Engine: engineForTest(), DPSize: 1, Registerer: reg, Logger: quietLogger()}); err != nil {
		t.Fatal(err)
	}
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	names := map[string]bool{}
	for _, mf := range mfs {
		names[mf.GetName()] = true
		if !strings.HasPrefix(mf.GetName(), "kvrelay_") {
			t.Errorf("metric %s lacks the kvrelay_ prefix", mf.GetName())
		}
	}
	for _, want := range []string{"kvrelay_history_entries", "kvrelay_record_blocks", "kvrelay_subscribers", "kvrelay_subscriber_lag_batches"} {
		if !names[want] {
			t.Errorf("missing %s", want)
		}
	}
	// A second relay of the same engine needs its own instance name.
	if _, err := New(Config{Engine: engineForTest(), DPSize: 1, Registerer: reg, Logger: quietLogger()}); err == nil {
		t.Error("a duplicate registration must be an error")
	}
	if _, err := New(Config{Engine: engineForTest(), DPSize: 1, Registerer: reg, Logger: quietLogger(), Instance: "vllm-b"}); err != nil {
		t.Errorf("a second instance: %v", err)
	}
}

func TestStatusIsJSONWithNullsForNone(t *testing.T) {
	l := newLab(t, labOpts{ranks: 2, noReplay: true})
	l.pubs[1].restart(3)
	l.pubs[1].publish(payload(1, stored(-1, 7)))
	l.cursor(1, 3)
	raw, err := json.Marshal(l.r.Status())
	if err != nil {
		t.Fatal(err)
	}
	var st struct {
		Ranks []map[string]any `json:"ranks"`
	}
	if err := json.Unmarshal(raw, &st); err != nil {
		t.Fatal(err)
	}
	r0, r1 := st.Ranks[0], st.Ranks[1]
	if r0["cursor"] != nil || r1["cursor"] != 3.0 || r1["window_first"] != 0.0 || r1["unknown_before"] != 3.0 ||
		r1["holes"] != 1.0 || r1["hole_sequences"] != 3.0 || r1["record_blocks"] != 1.0 || r1["connected"] != true {
		t.Fatalf("status %s", raw)
	}
}

func TestRunReportsATransportThatCannotOpenAndJoinsWhatItStarted(t *testing.T) {
	pub := newFakePub(0)
	r, err := New(Config{
		Engine: engineForTest(), DPSize: 2, Logger: quietLogger(),
		KV: engines.Config{Enabled: true, Endpoint: "tcp://*:5557"},
		Transport: func(rank int32, endpoint, _ string, _ time.Duration) (Feed, Replayer, error) {
			if rank == 1 {
				return nil, nil, errors.New("no such device")
			}
			return pub, nil, nil
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	err = r.Run(context.Background())
	if err == nil || !strings.Contains(err.Error(), "rank 1 at tcp://127.0.0.1:5558") {
		t.Fatalf("Run: %v", err)
	}
	if err := r.Run(context.Background()); err == nil {
		t.Fatal("a second Run must be refused")
	}
}

func TestReadyWaitsForEveryRanksFeed(t *testing.T) {
	l := newLab(t, labOpts{ranks: 2, noReplay: true})
	l.waitFor("ready", l.r.Ready)
	l.pubs[1].connected.Store(false)
	if l.r.Ready() {
		t.Fatal("ready with rank 1 disconnected")
	}
	if st := l.r.Status(); st.Ready || st.Ranks[1].Connected || !st.Ranks[0].Connected {
		t.Fatalf("status %+v", st)
	}
}
