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
	fs.SetOutput(stderr)
	if err := fs.Parse(args); err != nil {
		return flagExitCode(err)
	}
	fmt.Fprintln(stdout, buildinfo.Read())
	return 0
}

// flagExitCode is a subcommand's exit code after its flags failed to parse:
// 0 for -h/--help (the usage was asked for and printed), 2 for a bad flag.
func flagExitCode(err error) int {
	if errors.Is(err, flag.ErrHelp) {
		return 0
	}
	return 2
}
