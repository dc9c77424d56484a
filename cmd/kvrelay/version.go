package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"

	"github.com/kvrelay/kvrelay/internal/buildinfo"
)

func init() {
	register("version", "print the version, VCS revision and Go version of this binary", runVersion)
}

func runVersion(_ context.Context, args []string, _ io.Reader, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("version", flag.ContinueOnError)
	if code, stop := parseFlags(fs, args, stdout, stderr); stop {
		return code
	}
	fmt.Fprintln(stdout, buildinfo.Read())
	return 0
}

// parseFlags parses a subcommand's flags. -h/--help prints the usage (the
// command's summary and its flags) on stdout and stops with 0; a bad flag
// prints its one-line reason and where the usage is on stderr and stops with
// 2, not the whole usage: the reason would scroll away above it. stop is
// false when the command goes on.
func parseFlags(fs *flag.FlagSet, args []string, stdout, stderr io.Writer) (code int, stop bool) {
	return parseFlagsUsage(fs, args, stdout, stderr, func() {
		fmt.Fprintf(fs.Output(), "usage: kvrelay %s [flags]\n\n%s\n\nflags:\n", fs.Name(), commands[fs.Name()].summary)
		fs.PrintDefaults()
	})
}

// parseFlagsUsage is parseFlags with the command's own usage text, printed
// to fs.Output().
func parseFlagsUsage(fs *flag.FlagSet, args []string, stdout, stderr io.Writer, usage func()) (code int, stop bool) {
	fs.Usage = func() {} // Parse calls it on any error; we print our own
	fs.SetOutput(io.Discard)
	err := fs.Parse(args)
	fs.SetOutput(stderr)
	switch {
	case err == nil:
		return 0, false
	case errors.Is(err, flag.ErrHelp):
		fs.SetOutput(stdout)
		usage()
		fs.SetOutput(stderr)
		return 0, true
	}
	fmt.Fprintf(stderr, "kvrelay %s: %v\nrun 'kvrelay %s --help' for usage\n", fs.Name(), err, fs.Name())
	return 2, true
}
