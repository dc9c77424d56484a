// Package pyenv finds the Python interpreter that runs the interop peers:
// the venv that `make venv` builds from testdata/requirements.txt, with
// pyzmq, msgspec and the SMG packages in it.
package pyenv

import (
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
	return filepath.Clean(filepath.Join(filepath.Dir(file), "..", ".."))
}

// Python returns the venv interpreter. KVRELAY_PYTHON (set by the Makefile)
// wins; otherwise the repository's .venv is used. A missing interpreter fails
// the test: the interop tests are the point, and `make test` builds the venv.
func Python(t testing.TB) string {
	t.Helper()
	py := os.Getenv("KVRELAY_PYTHON")
	if py == "" {
		py = filepath.Join(RepoRoot(), ".venv", "bin", "python")
	}
	if _, err := os.Stat(py); err != nil {
		t.Fatalf("interop peer interpreter %s: %v (run `make venv`, or set KVRELAY_PYTHON)", py, err)
	}
	return py
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
