package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"

	"github.com/kvrelay/kvrelay/demo"
)

func init() {
	register("demo", "run engines, relays and a gateway in-process, compare routing, inject faults, check the index (make run)", runDemo)
}

func runDemo(ctx context.Context, args []string, _ io.Reader, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("demo", flag.ContinueOnError)
	duration := fs.Duration("duration", demo.DefaultDuration, "length of the routing comparison (ignored with --requests)")
	requests := fs.Int("requests", 0, "number of requests in the routing comparison (0: as many as --duration allows)")
	rate := fs.Float64("rate", demo.DefaultRate, "requests per second")
	seed := fs.Uint64("seed", 1, "workload seed")
	quiet := fs.Bool("quiet", false, "no progress line; print only the final table")
	verbose := fs.Bool("verbose", false, "log the engines', relays' and gateway's activity to stderr")
	if code, stop := parseFlags(fs, args, stdout, stderr); stop {
		return code
	}
	switch {
	case fs.NArg() > 0:
		fmt.Fprintf(stderr, "kvrelay demo: unexpected argument %q\n", fs.Arg(0))
		return 2
	case *requests < 0:
		fmt.Fprintf(stderr, "kvrelay demo: --requests must be ≥ 0, got %d\n", *requests)
		return 2
	case *duration <= 0:
		fmt.Fprintf(stderr, "kvrelay demo: --duration must be positive, got %v\n", *duration)
		return 2
	case !(*rate > 0) || *rate > 10_000:
		fmt.Fprintf(stderr, "kvrelay demo: --rate must be in (0, 10000], got %v\n", *rate)
		return 2
	}
	opts := demo.Options{Requests: *requests, Duration: *duration, Rate: *rate, Seed: *seed}
	if !*quiet {
		opts.Progress = stdout
		opts.Terminal = isTerminal(stdout)
	}
	if *verbose {
		opts.Logger = slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: slog.LevelInfo}))
	}
	rep, err := demo.Run(ctx, opts)
	if err != nil {
		if errors.Is(err, context.Canceled) {
			fmt.Fprintln(stderr, "kvrelay demo: interrupted")
		} else {
			fmt.Fprintf(stderr, "kvrelay demo: %v\n", err)
		}
		return 1
	}
	rep.WriteTable(stdout)
	if !rep.OK() {
		return 1
	}
	return 0
}

// isTerminal reports whether w is a character device (a terminal), where the
// progress line can be rewritten in place.
func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	if !ok {
		return false
	}
	st, err := f.Stat()
	return err == nil && st.Mode()&os.ModeCharDevice != 0
}
