package pyenv

import (
	"errors"
	"path/filepath"
	"strings"
	"testing"
)

func TestInterpreterSkipsOnlyWhenNobodyAskedForTheVenv(t *testing.T) {
	missing := filepath.Join(t.TempDir(), "python")
	present := filepath.Join(RepoRoot(), "go.mod") // any file that exists stands in for the interpreter
	tests := []struct {
		name     string
		explicit string
		ci       string
		want     string // "ok", "skip" or "fail"
	}{
		{"explicit interpreter present", present, "", "ok"},
		{"explicit interpreter missing fails (make test)", missing, "", "fail"},
		{"explicit interpreter missing fails on CI", missing, "true", "fail"},
	}
	if _, err := interpreter("", ""); err != nil {
		// Only meaningful where the default venv is absent.
		tests = append(tests,
			struct{ name, explicit, ci, want string }{"default venv missing skips", "", "", "skip"},
			struct{ name, explicit, ci, want string }{"default venv missing on CI fails", "", "true", "fail"},
		)
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := interpreter(tt.explicit, tt.ci)
			got := "ok"
			switch {
			case errors.Is(err, errNoVenv):
				got = "skip"
			case err != nil:
				got = "fail"
			}
			if got != tt.want {
				t.Fatalf("interpreter(%q, %q) = %s (%v), want %s", tt.explicit, tt.ci, got, err, tt.want)
			}
			if got == "skip" && (!strings.Contains(err.Error(), "make venv") || !strings.Contains(err.Error(), "KVRELAY_PYTHON")) {
				t.Fatalf("skip message %q does not say how to get the venv", err)
			}
		})
	}
}
