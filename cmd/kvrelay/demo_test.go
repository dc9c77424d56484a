package main

import (
	"bytes"
	"context"
	"strings"
	"testing"
)

// The demo itself is tested in package demo; these are the command's flag
// errors, which must be reported before anything starts.
func TestDemoFlagErrors(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--requests", "-5"}, "--requests must be ≥ 0"},
		{[]string{"--duration", "0s"}, "--duration must be positive"},
		{[]string{"--rate", "0"}, "--rate must be in"},
		{[]string{"--rate", "NaN"}, "--rate must be in"},
		{[]string{"extra"}, `unexpected argument "extra"`},
		{[]string{"--seed", "x"}, "invalid value"},
	} {
		t.Run(strings.Join(tc.args, " "), func(t *testing.T) {
			var stdout, stderr bytes.Buffer
			code := dispatch(context.Background(), append([]string{"demo"}, tc.args...), nil, &stdout, &stderr)
			if code != 2 {
				t.Errorf("exit code %d, want 2", code)
			}
			if !strings.Contains(stderr.String(), tc.want) {
				t.Errorf("stderr %q does not contain %q", stderr.String(), tc.want)
			}
			if stdout.Len() != 0 {
				t.Errorf("stdout %q, want nothing", stdout.String())
			}
		})
	}
}

func TestIsTerminal(t *testing.T) {
	if isTerminal(&bytes.Buffer{}) {
		t.Error("a buffer is not a terminal")
	}
}
