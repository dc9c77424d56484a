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

	"github.com/kvrelay/kvrelay/testkit/prereq"
)

// RepoRoot is the repository's top directory, found from this file's path so
// tests in any package can reach testdata/.
func RepoRoot() string {
	_, file, _, _ := runtime.Caller(0)
	return filepath.Clean(filepath.Join(filepath.Dir(file), "..", ".."))
}

// Python returns the venv interpreter. KVRELAY_PYTHON (set by the Makefile)
// wins; otherwise the repository's .venv is used.
//
// A missing default venv is a missing prerequisite (package prereq): a plain
// `go test` on a fresh checkout skips, naming `make venv`; `make test` and CI
// fail. A KVRELAY_PYTHON that names nothing always fails: someone asked for
// that interpreter.
func Python(t testing.TB) string {
	t.Helper()
	py, err := interpreter(os.Getenv("KVRELAY_PYTHON"))
	switch {
	case err == nil:
		return py
	case errors.Is(err, errNoVenv):
		prereq.Missing(t, "the interop venv (pyzmq, msgspec, the SMG packages)", "make venv", err)
	default:
		t.Fatal(err.Error())
	}
	return ""
}

// errNoVenv marks a missing default interpreter.
var errNoVenv = errors.New("no interop venv")

// interpreter resolves the interpreter from KVRELAY_PYTHON's value;
// errNoVenv when it is empty and the default venv is missing.
func interpreter(explicit string) (string, error) {
	py := explicit
	if py == "" {
		py = filepath.Join(RepoRoot(), ".venv", "bin", "python")
	}
	_, err := os.Stat(py)
	switch {
	case err == nil:
		return py, nil
	case explicit == "":
		return "", fmt.Errorf("%w at %s", errNoVenv, py)
	}
	return "", fmt.Errorf("interop peer interpreter KVRELAY_PYTHON=%s: %w (run `make venv`, or point KVRELAY_PYTHON at an interpreter with pyzmq, msgspec and the SMG packages)", py, err)
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
