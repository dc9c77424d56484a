package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strings"

	"github.com/kvrelay/kvrelay/bench"
)

func init() {
	register("bench", "measure kvrelay against SMG's Python relay and draw the scale curves (BENCHMARKS.md)", runBench)
}

func runBench(ctx context.Context, args []string, _ io.Reader, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("bench", flag.ContinueOnError)
	quick := fs.Bool("quick", false, "a reduced run in seconds that only proves every part works (CI); its figures mean nothing")
	out := fs.String("out", "bench-out", "directory for results.json, results.md and CPU profiles (plots: go run ./cmd/kvrelay-plot DIR)")
	repo := fs.String("repo", "", "the kvrelay repository (default: found from the working directory)")
	python := fs.String("python", "", "interpreter with pyzmq, msgspec and the SMG packages (default: $KVRELAY_PYTHON or <repo>/.venv/bin/python)")
	only := fs.String("only", "", "comma-separated parts to run: sidebyside, scale, route, policy, fleetscale, latency (default: all but fleetscale and latency, the long ones)")
	compareBin := fs.String("compare-bin", "", "another kvrelay binary whose serve the latency part interleaves with this one's (e.g. the build before a change)")
	inProcess := fs.Bool("in-process", false, "run kvrelay inside the bench process instead of as a kvrelay serve process (then its CPU and RSS are not reported)")
	if code, stop := parseFlags(fs, args, stdout, stderr); stop {
		return code
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(stderr, "kvrelay bench: unexpected argument %q\n", fs.Arg(0))
		return 2
	}
	opts := bench.Options{
		Quick: *quick, Out: *out, Repo: *repo, Python: *python,
		Log: slog.New(slog.NewTextHandler(stderr, nil)),
	}
	if *only != "" {
		for _, p := range strings.Split(*only, ",") {
			switch p = strings.TrimSpace(p); p {
			case "sidebyside", "scale", "route", "policy", "fleetscale", "latency":
				opts.Parts = append(opts.Parts, p)
			default:
				fmt.Fprintf(stderr, "kvrelay bench: --only: unknown part %q (want sidebyside, scale, route, policy, fleetscale or latency)\n", p)
				return 2
			}
		}
	}
	if !*inProcess {
		// The relay under test is this very binary's serve subcommand, in its
		// own process so that its CPU time and RSS are its own.
		self, err := os.Executable()
		if err != nil {
			fmt.Fprintf(stderr, "kvrelay bench: %v\n", err)
			return 1
		}
		opts.ServeCommand = []string{self, "serve"}
	}
	if *compareBin != "" {
		opts.CompareServeCommand = []string{*compareBin, "serve"}
	}
	res, err := bench.Run(ctx, opts)
	if err != nil {
		fmt.Fprintf(stderr, "kvrelay bench: %v\n", err)
		return 1
	}
	bench.WriteMarkdown(stdout, res)
	fmt.Fprintf(stderr, "kvrelay bench: results in %s; plots: go run ./cmd/kvrelay-plot %s\n", *out, *out)
	return 0
}
