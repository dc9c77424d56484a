package latencyprobe

import (
	"testing"
)

type mark struct {
	stage Stage
	rank  int32
	seq   uint64
}

func TestInstallRestoreAndMark(t *testing.T) {
	Mark(Received, 0, 1) // no probe: nothing to call, no panic

	var outer []mark
	restoreOuter := Install(func(s Stage, r int32, q uint64) { outer = append(outer, mark{s, r, q}) })
	Mark(Decoded, 1, 7)

	var inner []mark
	restoreInner := Install(func(s Stage, r int32, q uint64) { inner = append(inner, mark{s, r, q}) })
	Mark(Written, 0, 9)
	restoreInner()
	Mark(Queued, 1, 8)
	restoreOuter()
	Mark(Dequeued, 0, 10) // uninstalled: nobody sees it

	wantOuter := []mark{{Decoded, 1, 7}, {Queued, 1, 8}}
	wantInner := []mark{{Written, 0, 9}}
	if len(outer) != len(wantOuter) || outer[0] != wantOuter[0] || outer[1] != wantOuter[1] {
		t.Errorf("outer probe saw %v, want %v", outer, wantOuter)
	}
	if len(inner) != 1 || inner[0] != wantInner[0] {
		t.Errorf("inner probe saw %v, want %v", inner, wantInner)
	}
}

func TestStageNames(t *testing.T) {
	for _, tc := range []struct {
		stage Stage
		want  string
	}{
		{Received, "received"}, {Decoded, "decoded"}, {Queued, "queued"},
		{Dequeued, "dequeued"}, {Written, "written"}, {NumStages, "unknown"},
	} {
		if got := tc.stage.String(); got != tc.want {
			t.Errorf("Stage(%d).String() = %q, want %q", tc.stage, got, tc.want)
		}
	}
}

// BenchmarkMarkUninstalled is what the daemon pays per mark: no probe.
func BenchmarkMarkUninstalled(b *testing.B) {
	for i := range b.N {
		Mark(Queued, 1, uint64(i))
	}
}
