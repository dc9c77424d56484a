// Package pyenv finds the Python interpreter that runs the interop peers:
// the venv that `make venv` builds from testdata/requirements.txt, with
// pyzmq, msgspec and the SMG packages in it.
package pyenv

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"testing"
)

// RepoRoot is the repository's top directory, found from this file's path so
// tests in any package can reach testdata/.
func RepoRoot() string {
	_, file, _, _ := runtime.Caller(0)
	return filepath.Clean(filepath.Join(filepath.Dir(file), "..", "..", ".."))
}

// Python returns the venv interpreter. KVRELAY_PYTHON (set by the Makefile)
// wins; otherwise the repository's .venv is used.
//
// A missing interpreter skips the test when nobody asked for the interop
// peers (a plain `go test` on a fresh checkout), and fails it when someone
// did: KVRELAY_PYTHON set explicitly (as `make test` does) or CI=true. The
// interop tests are the point of a full run, so a full run must never pass
// by skipping them.
func Python(t testing.TB) string {
	t.Helper()
	py, err := interpreter(os.Getenv("KVRELAY_PYTHON"), os.Getenv("CI"))
	switch {
	case err == nil:
		return py
	case errors.Is(err, errNoVenv):
		t.Skip(err.Error())
	default:
		t.Fatal(err.Error())
	}
	return ""
}

// errNoVenv marks a missing interpreter nobody asked for.
var errNoVenv = errors.New("no interop venv")

// interpreter resolves the interpreter from the environment's KVRELAY_PYTHON
// and CI values; errNoVenv when the default venv is missing and neither asks
// for it.
func interpreter(explicit, ci string) (string, error) {
	py := explicit
	if py == "" {
		py = filepath.Join(RepoRoot(), ".venv", "bin", "python")
	}
	_, err := os.Stat(py)
	switch {
	case err == nil:
		return py, nil
	case explicit == "" && ci != "true":
		return "", fmt.Errorf("skipping the interop test: %w at %s (run `make venv` to build it, or set KVRELAY_PYTHON to an interpreter with pyzmq, msgspec and the SMG packages)", errNoVenv, py)
	}
	return "", fmt.Errorf("interop peer interpreter %s: %w (run `make venv`, or set KVRELAY_PYTHON)", py, err)
}

// Script is the path of a peer script under testdata/.
func Script(parts ...string) string {
	return filepath.Join(append([]string{RepoRoot(), "testdata"}, parts...)...)
}

// Command builds a command that runs a testdata script with the venv's
// interpreter; the caller starts it and owns its lifetime.
func Command(t testing.TB, script string, args ...string) *exec.Cmd {
	t.Helper()
	return exec.Command(Python(t), append([]string{"-u", script}, args...)...)
}
