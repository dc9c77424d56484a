// Command kvrelay-plot draws the PNG plots of a `kvrelay bench` run from its
// results.json, and lists them in results.json and results.md. It is its own
// binary so that the kvrelay daemon does not carry the plotting libraries.
//
//	go run ./cmd/kvrelay-plot [bench-out]
package main

import (
	"fmt"
	"os"

	"github.com/kvrelay/kvrelay/bench"
	"github.com/kvrelay/kvrelay/bench/charts"
)

func main() {
	os.Exit(run(os.Args[1:]))
}

func run(args []string) int {
	dir := "bench-out"
	switch {
	case len(args) == 1 && (args[0] == "-h" || args[0] == "--help"):
		fmt.Println("usage: kvrelay-plot [DIR]  (DIR holds a kvrelay bench run's results.json; default bench-out)")
		return 0
	case len(args) == 1:
		dir = args[0]
	case len(args) > 1:
		fmt.Fprintln(os.Stderr, "usage: kvrelay-plot [DIR]")
		return 2
	}
	res, err := bench.ReadResults(dir)
	if err != nil {
		fmt.Fprintf(os.Stderr, "kvrelay-plot: %v\n", err)
		return 1
	}
	files, err := charts.Draw(dir, res)
	if err != nil {
		fmt.Fprintf(os.Stderr, "kvrelay-plot: %v\n", err)
		return 1
	}
	res.Plots = files
	if err := bench.WriteResults(dir, res); err != nil {
		fmt.Fprintf(os.Stderr, "kvrelay-plot: %v\n", err)
		return 1
	}
	for _, f := range files {
		fmt.Println(f)
	}
	return 0
}
