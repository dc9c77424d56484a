// The layering test: every package's imports point down the house that
// docs/architecture.md draws, and nothing the binaries link pulls in test
// support. It reads the real import graph from `go list -json`.
//
// The table below is a statement of policy, not a list to edit until the
// build goes green: a new arrow across layers is a design decision. Put a new
// package in the layer it belongs to; if it needs an import the table
// forbids, move the code, not the rule.
package kvrelay_test

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os/exec"
	"path/filepath"
	"runtime"
	"sort"
	"strings"
	"sync"
	"testing"
)

const module = "github.com/kvrelay/kvrelay"

// layers lists who may import whom, bottom first, in the notation of Go's own
// go/build deps_test.go: "a, b < c" means c may import a and b and everything
// a and b may import. Rules are separated by ";". A package that appears in
// no rule fails the test: place it before it lands.
const layers = `
	# The ground: no kvrelay imports. Generated protobuf, small runtime
	# helpers, the simulator's pure models, build tools.
	proto/kvpb, internal/buildinfo, internal/latencyprobe, internal/livedigest,
	internal/natslog, internal/tlsconfig, internal/freeport, internal/logthrottle,
	internal/exposure, internal/reload, internal/sdnotify, internal/procs, internal/quietio,
	sim/prefixcache, sim/workload, gateway/index/tracegen, engines/discover,
	proto, proto/generate, deploy, deploy/image;

	# NATS connections: the options every one starts with, and auth and
	# TLS from flags; they log through natslog's redaction.
	internal/natslog < internal/natsconn;

	# The HTTP listeners' web config; their error lines are throttled.
	internal/logthrottle < internal/webserve;

	# Codecs over the protobuf.
	proto/kvpb < proto/kvenc, proto/kvdec;

	# The engine side: the wire decoder, then the engine configs.
	proto/kvenc < engines/wire < engines < engines/vllm, engines/sglang, engines/tokenspeed;
	# Each engine's load (its servicer's GetLoads, its /metrics, /v1/loads):
	# engine knowledge both the relay and the gateway read.
	proto/kvpb < engines/load;

	# The simulated engines publish what the real ones do.
	engines/vllm, engines/sglang, engines/tokenspeed, sim/prefixcache, sim/workload < sim;

	# The relay: sockets and the live-block record, then admission and
	# fan-out, then the gRPC server.
	internal/livedigest, proto/kvpb < relay/record;
	internal/quietio < relay/zmqsource;
	engines/vllm, engines/sglang, engines/tokenspeed, internal/latencyprobe,
	relay/record, relay/zmqsource < relay;
	relay, engines/load, internal/logthrottle, internal/quietio < relay/server;

	# The gateway module: the index, the policies on it, the stream monitor.
	internal/livedigest, proto/kvpb < gateway/index < gateway/picker, gateway/placement;
	proto/kvdec < gateway/monitor;
	# The gateway polls GetLoads where a worker pushes no load, with the
	# relay's own mapping of each engine's answer (a leaf on the protos).
	gateway/picker, gateway/placement, gateway/monitor, engines/load, internal/logthrottle < gateway;
	gateway < gateway/membership;
	internal/natslog, internal/natsconn, internal/logthrottle < gateway/placementsync;
	# The partitioned tier's scatter: the gateway's query and answer over NATS.
	gateway, internal/natslog, internal/natsconn, internal/logthrottle < gateway/partitionsync;
	gateway/picker, gateway/placement, sim/prefixcache, sim/workload < sim/fleetsim;

	# NATS bridges the relay's stream and the gateway's monitor.
	relay, engines/load, gateway/monitor, internal/natslog, internal/natsconn, internal/logthrottle < natsevents;

	# The processes the binary runs: serve's relays, listeners, sink and
	# metrics endpoint; the gateway's HTTP API.
	relay/server, natsevents, engines/discover, internal/buildinfo,
	internal/tlsconfig, internal/exposure, internal/webserve,
	internal/reload, internal/sdnotify < relayd;
	gateway, internal/webserve < gateway/httpapi;

	# Programs built on the packages: benchmarks, the demo, the binaries.
	relay/server, gateway, gateway/placementsync, sim/fleetsim < bench < bench/charts;
	relay/server, gateway, gateway/membership, sim, internal/freeport < demo;
	bench, demo, relayd, gateway/httpapi, gateway/placementsync, gateway/partitionsync,
	natsevents, internal/buildinfo, internal/tlsconfig, internal/exposure,
	internal/reload, internal/webserve, gateway/membership, internal/natsconn, internal/procs < cmd/kvrelay;
	bench/charts < cmd/kvrelay-plot;
`

// testSupport is the tree that only tests and benchmarks may import. Its
// packages may import anything below the binaries.
const testSupport = "testkit"

// testOnly are packages that hold nothing but tests.
var testOnly = map[string]bool{"": true, "interop": true}

type goPackage struct {
	ImportPath string
	Name       string
	Imports    []string
	Deps       []string
	GoFiles    []string
	Error      *struct{ Err string }
}

func TestImportsPointDownTheLayers(t *testing.T) {
	pkgs := listPackages(t)
	allowed := parseLayers(t, layers)

	var problems []string
	for _, p := range pkgs {
		name := local(p.ImportPath)
		if testOnly[name] {
			continue
		}
		if strings.HasPrefix(name, testSupport+"/") {
			for _, imp := range ownImports(p) {
				if strings.HasPrefix(imp, "cmd/") {
					problems = append(problems, name+" (test support) imports "+imp+", a binary")
				}
			}
			continue
		}
		may, placed := allowed[name]
		if !placed {
			problems = append(problems, name+" is in no layer: place it in layers_test.go and docs/architecture.md")
			continue
		}
		for _, imp := range ownImports(p) {
			switch {
			case strings.HasPrefix(imp, testSupport+"/"):
				problems = append(problems, name+" imports "+imp+": non-test code must not import test support")
			case !may[imp]:
				problems = append(problems, name+" imports "+imp+", which its layer may not import (docs/architecture.md)")
			}
		}
	}
	sort.Strings(problems)
	for _, p := range problems {
		t.Error(p)
	}
}

// The binaries must not link test support, directly or through any chain.
func TestBinariesLinkNoTestSupport(t *testing.T) {
	binaries := 0
	for _, p := range listPackages(t) {
		if p.Name != "main" || !strings.HasPrefix(local(p.ImportPath), "cmd/") {
			continue
		}
		binaries++
		for _, dep := range p.Deps {
			if strings.HasPrefix(dep, module+"/"+testSupport+"/") {
				t.Errorf("%s links %s", local(p.ImportPath), local(dep))
			}
		}
	}
	if binaries == 0 {
		t.Fatal("no binary under cmd/ was checked")
	}
}

// The checker must catch what it is for: an upward arrow, a package left out
// of the table, a program importing test support.
func TestLayerRulesCatchUpwardImports(t *testing.T) {
	allowed := parseLayers(t, `a < b < c; a < d;`)
	cases := []struct {
		from, to string
		ok       bool
	}{
		{"b", "a", true},
		{"c", "a", true}, // transitive
		{"c", "b", true},
		{"a", "b", false}, // upward
		{"d", "b", false}, // sideways
		{"b", "c", false},
	}
	for _, c := range cases {
		if got := allowed[c.from][c.to]; got != c.ok {
			t.Errorf("%s imports %s: allowed=%v, want %v", c.from, c.to, got, c.ok)
		}
	}
	if _, placed := allowed["e"]; placed {
		t.Error("a package named in no rule counts as placed")
	}
}

// modulePackages lists every package of the module once per test binary:
// both tests read the same graph, and go list is the slow step.
var modulePackages = sync.OnceValues(func() ([]goPackage, error) {
	goCmd, err := exec.LookPath("go")
	if err != nil {
		goCmd = filepath.Join(runtime.GOROOT(), "bin", "go")
	}
	cmd := exec.Command(goCmd, "list", "-e", "-json", "./...")
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return nil, fmt.Errorf("go list ./...: %w\n%s", err, stderr.String())
	}
	var pkgs []goPackage
	dec := json.NewDecoder(bytes.NewReader(out))
	for {
		var p goPackage
		if err := dec.Decode(&p); errors.Is(err, io.EOF) {
			break
		} else if err != nil {
			return nil, fmt.Errorf("reading go list output: %w", err)
		}
		if p.Error != nil {
			return nil, fmt.Errorf("go list %s: %s", p.ImportPath, p.Error.Err)
		}
		pkgs = append(pkgs, p)
	}
	if len(pkgs) == 0 {
		return nil, errors.New("go list ./... listed no packages")
	}
	return pkgs, nil
})

func listPackages(t *testing.T) []goPackage {
	t.Helper()
	pkgs, err := modulePackages()
	if err != nil {
		t.Fatal(err)
	}
	return pkgs
}

// ownImports are p's non-test imports inside this module, module-relative.
func ownImports(p goPackage) []string {
	var out []string
	for _, imp := range p.Imports {
		if strings.HasPrefix(imp, module+"/") {
			out = append(out, local(imp))
		}
	}
	return out
}

func local(importPath string) string {
	if importPath == module {
		return ""
	}
	return strings.TrimPrefix(importPath, module+"/")
}

// parseLayers reads the rules into, for each package, the set it may import.
func parseLayers(t *testing.T, rules string) map[string]map[string]bool {
	t.Helper()
	var lines []string
	for _, line := range strings.Split(rules, "\n") {
		if i := strings.Index(line, "#"); i >= 0 {
			line = line[:i]
		}
		lines = append(lines, line)
	}
	allowed := map[string]map[string]bool{}
	place := func(pkg string) map[string]bool {
		if allowed[pkg] == nil {
			allowed[pkg] = map[string]bool{}
		}
		return allowed[pkg]
	}
	for _, rule := range strings.Split(strings.Join(lines, " "), ";") {
		if strings.TrimSpace(rule) == "" {
			continue
		}
		var below []string
		for _, group := range strings.Split(rule, "<") {
			var pkgs []string
			for _, name := range strings.Split(group, ",") {
				name = strings.TrimSpace(name)
				if name == "" {
					t.Fatalf("layers: empty package name in rule %q", strings.TrimSpace(rule))
				}
				pkgs = append(pkgs, name)
			}
			for _, pkg := range pkgs {
				may := place(pkg)
				for _, b := range below {
					if b == pkg {
						t.Fatalf("layers: %s is below itself", pkg)
					}
					may[b] = true
					for dep := range allowed[b] {
						may[dep] = true
					}
				}
			}
			below = append(below, pkgs...)
		}
	}
	return allowed
}
