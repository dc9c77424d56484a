// Package prereq decides what a test does when something it needs from
// outside the Go module is not there: the Python venv with the interop peers
// (`make venv`), the engine releases' own modules (`make engines`).
//
// A plain `go test ./...` on a fresh clone skips such a test, and the skip
// names the command that fetches what is missing. `make test` exports
// KVRELAY_REQUIRE_PREREQS=1 (and CI runners set CI=true), which turns every
// such skip into a failure: a full run can never pass by skipping.
package prereq

import (
	"fmt"
	"os"
	"testing"
)

// Env is the switch `make test` sets.
const Env = "KVRELAY_REQUIRE_PREREQS"

// Required reports whether a missing prerequisite fails the test rather
// than skipping it.
func Required() bool {
	return required(os.Getenv(Env), os.Getenv("CI"))
}

func required(env, ci string) bool { return env == "1" || ci == "true" }

// Missing ends the test for want of what (a short description), which fetch
// (a command run at the repository's root) provides; cause says what was
// looked for and not found. It skips, or fails when Required.
func Missing(t testing.TB, what, fetch string, cause error) {
	t.Helper()
	msg := message(what, fetch, cause)
	if Required() {
		t.Fatalf("%s (%s=1 or CI=true: a missing prerequisite fails the run)", msg, Env)
	}
	t.Skip(msg)
}

func message(what, fetch string, cause error) string {
	return fmt.Sprintf("%s is not there (%v): run `%s` to fetch it", what, cause, fetch)
}
