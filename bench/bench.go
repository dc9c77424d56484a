package bench

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"time"
)

// The stream shape of issue 7.
const (
	storeBlocks = 64  // blocks per store
	blockSize   = 16  // tokens per block
	dpSize      = 2   // publisher ranks
	evictWindow = 512 // a batch evicts what its rank stored this many batches earlier
)

// Options configure a run.
type Options struct {
	// Quick runs a reduced version in seconds, only to prove that every part
	// works end to end (CI); its figures mean nothing.
	Quick bool
	// Out is the directory for results.json, results.md and the CPU
	// profiles (cmd/kvrelay-plot adds the PNG plots). Created if missing.
	Out string
	// Repo is the repository root (bench/publisher.py and testdata/ are read
	// from it). Empty: found from the working directory upwards.
	Repo string
	// Python runs the publisher and SMG's Python relay. Empty:
	// $KVRELAY_PYTHON, else <Repo>/.venv/bin/python.
	Python string
	// ServeCommand is the argv prefix that runs `kvrelay serve` as its own
	// process (for example {"/path/kvrelay", "serve"}). Nil: the relay runs
	// inside the bench process, and its CPU and RSS are not reported.
	ServeCommand []string
	// Parts selects what runs: "sidebyside", "scale", "route", "policy",
	// "fleetscale", "latency", "pacing". Nil: all but "fleetscale",
	// "latency" and "pacing", which run only when named.
	Parts []string
	// CompareServeCommand is a second `kvrelay serve` argv prefix (another
	// build, e.g. the one before a change) that the latency and pacing parts
	// interleave with ServeCommand. Nil: none.
	CompareServeCommand []string
	// Log receives progress; nil discards it.
	Log *slog.Logger
}

// wants reports whether part was named in Parts.
func (o Options) wants(part string) bool {
	for _, p := range o.Parts {
		if p == part {
			return true
		}
	}
	return false
}

// environment is Options resolved.
type environment struct {
	quick        bool
	out          string
	repo         string
	python       string // empty when no interpreter was found
	pythonErr    error
	serveCommand []string
	// compareCommand is Options.CompareServeCommand.
	compareCommand []string
	log            *slog.Logger
}

func (o Options) resolve() (*environment, error) {
	env := &environment{quick: o.Quick, out: o.Out, serveCommand: o.ServeCommand, compareCommand: o.CompareServeCommand, log: o.Log}
	if env.log == nil {
		env.log = slog.New(slog.NewTextHandler(io.Discard, nil))
	}
	if env.out == "" {
		env.out = "bench-out"
	}
	if err := os.MkdirAll(env.out, 0o755); err != nil {
		return nil, fmt.Errorf("bench: output directory: %w", err)
	}
	env.repo = o.Repo
	if env.repo == "" {
		r, err := findRepo()
		if err != nil {
			return nil, err
		}
		env.repo = r
	}
	if _, err := os.Stat(filepath.Join(env.repo, "bench", "publisher.py")); err != nil {
		return nil, fmt.Errorf("bench: %s is not the kvrelay repository: %w", env.repo, err)
	}
	env.python = o.Python
	if env.python == "" {
		env.python = os.Getenv("KVRELAY_PYTHON")
	}
	if env.python == "" {
		env.python = filepath.Join(env.repo, ".venv", "bin", "python")
	}
	if _, err := os.Stat(env.python); err != nil {
		env.pythonErr = fmt.Errorf("python interpreter %s: %w (run `make venv`)", env.python, err)
		env.python = ""
	}
	return env, nil
}

// findRepo walks up from the working directory to the module's go.mod.
func findRepo() (string, error) {
	dir, err := os.Getwd()
	if err != nil {
		return "", fmt.Errorf("bench: %w", err)
	}
	for d := dir; ; d = filepath.Dir(d) {
		data, err := os.ReadFile(filepath.Join(d, "go.mod"))
		if err == nil && strings.Contains(string(data), "module github.com/kvrelay/kvrelay\n") {
			return d, nil
		}
		if filepath.Dir(d) == d {
			return "", fmt.Errorf("bench: no kvrelay repository above %s (pass --repo)", dir)
		}
	}
}

// Results is everything one run measured; results.json holds it.
type Results struct {
	Quick      bool               `json:"quick"`
	Started    time.Time          `json:"started"`
	Duration   string             `json:"duration"`
	Machine    Machine            `json:"machine"`
	SideBySide *SideBySide        `json:"side_by_side,omitempty"`
	Scale      *ScaleResults      `json:"scale,omitempty"`
	Route      *RouteResults      `json:"route,omitempty"`
	Policy     *PolicyResults     `json:"policy,omitempty"`
	FleetScale *FleetScaleResults `json:"fleet_scale,omitempty"`
	Latency    *LatencyResults    `json:"latency,omitempty"`
	Pacing     *PacingResults     `json:"pacing,omitempty"`
	Plots      []string           `json:"plots"`
	Profiles   []string           `json:"profiles"`
}

// Machine describes where the run happened.
type Machine struct {
	CPUs       int    `json:"cpus"`
	CPUModel   string `json:"cpu_model"`
	MemTotal   string `json:"mem_total"`
	Kernel     string `json:"kernel"`
	GoVersion  string `json:"go_version"`
	Python     string `json:"python"`
	LoadBefore string `json:"load_before"`
	LoadAfter  string `json:"load_after"`
}

// Run measures what opts selects and writes results.json, results.md and
// the profiles under opts.Out (cmd/kvrelay-plot draws the plots from
// results.json). Parts that cannot run here (no
// Python, for one) are reported as not available rather than failing.
func Run(ctx context.Context, opts Options) (*Results, error) {
	env, err := opts.resolve()
	if err != nil {
		return nil, err
	}
	want := func(part string) bool {
		if len(opts.Parts) == 0 {
			return part != "latency" && part != "pacing" // minutes of interleaved rounds: only on request
		}
		for _, p := range opts.Parts {
			if p == part {
				return true
			}
		}
		return false
	}
	res := &Results{Quick: env.quick, Started: time.Now(), Machine: describeMachine(env)}
	if want("sidebyside") {
		res.SideBySide = runSideBySide(ctx, env)
		if res.SideBySide.Profile != "" {
			res.Profiles = append(res.Profiles, res.SideBySide.Profile)
		}
	}
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	if want("scale") {
		sc, profiles, err := runScale(ctx, env)
		if err != nil {
			return nil, err
		}
		res.Scale = sc
		res.Profiles = append(res.Profiles, profiles...)
	}
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	if want("route") {
		rt, err := runRoute(ctx, env)
		if err != nil {
			return nil, err
		}
		res.Route = rt
	}
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	if want("policy") {
		pr, err := runPolicy(ctx, env)
		if err != nil {
			return nil, err
		}
		res.Policy = pr
	}
	// The fleet scale study is long (tens of minutes) and asked for by
	// name: a default run leaves it out.
	if opts.wants("fleetscale") {
		fs, err := runFleetScale(ctx, env)
		if err != nil {
			return nil, err
		}
		res.FleetScale = fs
	}
	if want("latency") {
		lt, err := runLatency(ctx, env)
		if err != nil {
			return nil, err
		}
		res.Latency = lt
	}
	if want("pacing") {
		pr, err := runPacing(ctx, env)
		if err != nil {
			return nil, err
		}
		res.Pacing = pr
	}
	res.Machine.LoadAfter = loadAverage()
	res.Duration = time.Since(res.Started).Round(time.Second).String()
	if err := WriteResults(env.out, res); err != nil {
		return nil, err
	}
	return res, nil
}

func describeMachine(env *environment) Machine {
	m := Machine{CPUs: runtime.NumCPU(), GoVersion: runtime.Version(), LoadBefore: loadAverage()}
	if f, err := os.Open("/proc/cpuinfo"); err == nil {
		sc := bufio.NewScanner(f)
		for sc.Scan() {
			if k, v, ok := strings.Cut(sc.Text(), ":"); ok && strings.TrimSpace(k) == "model name" {
				m.CPUModel = strings.TrimSpace(v)
				break
			}
		}
		f.Close()
	}
	if data, err := os.ReadFile("/proc/meminfo"); err == nil {
		for _, line := range strings.Split(string(data), "\n") {
			if v, ok := strings.CutPrefix(line, "MemTotal:"); ok {
				m.MemTotal = strings.TrimSpace(v)
			}
		}
	}
	if data, err := os.ReadFile("/proc/sys/kernel/osrelease"); err == nil {
		m.Kernel = strings.TrimSpace(string(data))
	}
	if env.python != "" {
		out, err := exec.Command(env.python, "-c",
			"import sys, zmq, msgspec; print(sys.version.split()[0], 'pyzmq', zmq.__version__, 'libzmq', zmq.zmq_version(), 'msgspec', msgspec.__version__)").Output()
		if err == nil {
			m.Python = strings.TrimSpace(string(out))
		}
	}
	return m
}

func loadAverage() string {
	data, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return ""
	}
	f := strings.Fields(string(data))
	if len(f) < 3 {
		return ""
	}
	return strings.Join(f[:3], " ")
}

// ReadResults reads the results.json a run wrote under out.
func ReadResults(out string) (*Results, error) {
	data, err := os.ReadFile(filepath.Join(out, "results.json"))
	if err != nil {
		return nil, fmt.Errorf("bench: results: %w", err)
	}
	var res Results
	if err := json.Unmarshal(data, &res); err != nil {
		return nil, fmt.Errorf("bench: results %s: %w", filepath.Join(out, "results.json"), err)
	}
	return &res, nil
}

// WriteResults writes res as results.json and results.md under out.
func WriteResults(out string, res *Results) error {
	data, err := json.MarshalIndent(res, "", "  ")
	if err != nil {
		return fmt.Errorf("bench: results: %w", err)
	}
	if err := os.WriteFile(filepath.Join(out, "results.json"), append(data, '\n'), 0o644); err != nil {
		return fmt.Errorf("bench: results: %w", err)
	}
	var md strings.Builder
	WriteMarkdown(&md, res)
	if err := os.WriteFile(filepath.Join(out, "results.md"), []byte(md.String()), 0o644); err != nil {
		return fmt.Errorf("bench: results: %w", err)
	}
	return nil
}
