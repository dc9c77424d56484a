package pyenv

import (
	"errors"
	"path/filepath"
	"testing"
)

func TestInterpreterTellsAMissingVenvFromAWrongPath(t *testing.T) {
	missing := filepath.Join(t.TempDir(), "python")
	present := filepath.Join(RepoRoot(), "go.mod") // any file that exists stands in for the interpreter
	tests := []struct {
		name     string
		explicit string
		want     string // "ok", "missing" (prereq: skip or fail) or "fail"
	}{
		{"explicit interpreter present", present, "ok"},
		{"explicit interpreter missing always fails", missing, "fail"},
	}
	if _, err := interpreter(""); err != nil {
		// Only meaningful where the default venv is absent.
		tests = append(tests, struct{ name, explicit, want string }{"default venv missing is a missing prerequisite", "", "missing"})
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := interpreter(tt.explicit)
			got := "ok"
			switch {
			case errors.Is(err, errNoVenv):
				got = "missing"
			case err != nil:
				got = "fail"
			}
			if got != tt.want {
				t.Fatalf("interpreter(%q) = %s (%v), want %s", tt.explicit, got, err, tt.want)
			}
		})
	}
}
