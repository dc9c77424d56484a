package prereq

import (
	"errors"
	"strings"
	"testing"
)

func TestRequiredBySwitchOrCI(t *testing.T) {
	tests := []struct {
		env, ci string
		want    bool
	}{
		{"", "", false},
		{"0", "", false},
		{"1", "", true},
		{"", "true", true},
		{"", "false", false},
	}
	for _, tt := range tests {
		if got := required(tt.env, tt.ci); got != tt.want {
			t.Errorf("required(%q, %q) = %v, want %v", tt.env, tt.ci, got, tt.want)
		}
	}
}

func TestMessageNamesTheCommand(t *testing.T) {
	msg := message("the engine release vllm-0.34.0", "make engines", errors.New("no .sha256"))
	for _, want := range []string{"vllm-0.34.0", "`make engines`", "no .sha256"} {
		if !strings.Contains(msg, want) {
			t.Errorf("%q does not say %q", msg, want)
		}
	}
}
