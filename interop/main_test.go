// Package interop runs kvrelay against the real systems it replaces and
// serves, as separate processes on loopback: SMG's Python relay
// (smg_grpc_servicer.kv_relay, the differential oracle), SMG's Rust gateway
// (`smg launch`, which must consume kvrelay unchanged), and the fake engines
// of testdata/peer. It holds tests only; the README's "Compatibility with SMG" records what they
// showed.
//
// The kvrelay binary is built once per run from ./cmd/kvrelay, unless
// KVRELAY_BIN names one already built.
package interop

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"sync"
	"testing"

	"go.uber.org/goleak"

	"github.com/kvrelay/kvrelay/testkit/pyenv"
)

var (
	buildOnce sync.Once
	buildDir  string
	buildBin  string
	buildErr  error
)

func TestMain(m *testing.M) {
	code := m.Run()
	if buildDir != "" {
		_ = os.RemoveAll(buildDir)
	}
	if code == 0 {
		if err := goleak.Find(); err != nil {
			fmt.Fprintf(os.Stderr, "goleak: %v\n", err)
			code = 1
		}
	}
	os.Exit(code)
}

// kvrelayBin returns the path of a kvrelay binary, building it on first use.
func kvrelayBin(t testing.TB) string {
	t.Helper()
	if bin := os.Getenv("KVRELAY_BIN"); bin != "" {
		if _, err := os.Stat(bin); err != nil {
			t.Fatalf("KVRELAY_BIN=%s: %v", bin, err)
		}
		return bin
	}
	buildOnce.Do(func() {
		buildDir, buildErr = os.MkdirTemp("", "kvrelay-interop-")
		if buildErr != nil {
			return
		}
		buildBin = filepath.Join(buildDir, "kvrelay")
		goTool := filepath.Join(runtime.GOROOT(), "bin", "go")
		if _, err := os.Stat(goTool); err != nil {
			goTool = "go"
		}
		cmd := exec.Command(goTool, "build", "-o", buildBin, "./cmd/kvrelay")
		cmd.Dir = pyenv.RepoRoot()
		if out, err := cmd.CombinedOutput(); err != nil {
			buildErr = fmt.Errorf("go build ./cmd/kvrelay: %w\n%s", err, out)
		}
	})
	if buildErr != nil {
		t.Fatalf("kvrelay binary: %v", buildErr)
	}
	return buildBin
}
