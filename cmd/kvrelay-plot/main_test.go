package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kvrelay/kvrelay/bench"
)

func TestPlotsARunAndListsThem(t *testing.T) {
	dir := t.TempDir()
	res := &bench.Results{Quick: true, Route: &bench.RouteResults{Points: []bench.RoutePoint{
		{Workers: 8, PromptTokens: 512, RouteP50us: 4}, {Workers: 8, PromptTokens: 4096, RouteP50us: 9},
	}}}
	if err := bench.WriteResults(dir, res); err != nil {
		t.Fatal(err)
	}
	if code := run([]string{dir}); code != 0 {
		t.Fatalf("exit %d", code)
	}
	if fi, err := os.Stat(filepath.Join(dir, "route.png")); err != nil || fi.Size() == 0 {
		t.Fatalf("route.png: %v", err)
	}
	back, err := bench.ReadResults(dir)
	if err != nil {
		t.Fatal(err)
	}
	if len(back.Plots) != 1 || filepath.Base(back.Plots[0]) != "route.png" {
		t.Fatalf("results.json lists plots %v", back.Plots)
	}
	md, _ := os.ReadFile(filepath.Join(dir, "results.md"))
	if !strings.Contains(string(md), "route.png") {
		t.Fatalf("results.md does not list the plot:\n%s", md)
	}
}

func TestNoResultsIsAnError(t *testing.T) {
	if code := run([]string{t.TempDir()}); code != 1 {
		t.Fatalf("exit %d, want 1", code)
	}
	if code := run([]string{"a", "b"}); code != 2 {
		t.Fatalf("exit %d for two arguments, want 2", code)
	}
}
