package bench

import (
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// goalsFolder writes a bench/goals.sh results folder whose kvrelay bench
// parts are this package's own result types marshalled (so a renamed JSON
// field breaks the table here, not in the lead's run) and whose go benchmark
// parts are lines in the format `go test -bench` prints.
func goalsFolder(t *testing.T, kvCPU, addedP50 float64, pass10k bool, route128 float64) string {
	t.Helper()
	dir := t.TempDir()
	write := func(rel string, data []byte) {
		p := filepath.Join(dir, rel)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, data, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	writeJSON := func(rel string, res *Results) {
		data, err := json.Marshal(res)
		if err != nil {
			t.Fatal(err)
		}
		write(rel, data)
	}
	step := func(target, cpu float64, pass bool) Step {
		return Step{Target: target, CPUPerMBlocks: cpu, Pass: pass, Received: 100}
	}
	for _, run := range []string{"run-1", "run-2", "run-3"} {
		writeJSON("sidebyside/"+run+"/results.json", &Results{SideBySide: &SideBySide{Relays: []RelayRun{
			{Name: "kvrelay", Steps: []Step{step(1000, kvCPU, true)}, Sustained: 20000},
			{Name: "python (smg_grpc_servicer.kv_relay)", Steps: []Step{step(1000, 12, true)}, Sustained: 1000},
			{Name: "no relay (control: the bench reads the PUB sockets itself)", Steps: []Step{step(1000, 0, true)}},
		}}})
		writeJSON("route/"+run+"/results.json", &Results{Route: &RouteResults{Points: []RoutePoint{
			{Workers: 128, PromptTokens: 8192, RouteP50us: route128, RouteCPUP50us: route128, FindP50us: 10},
			{Workers: 512, PromptTokens: 8192, RouteP50us: 30, RouteCPUP50us: 30, FindP50us: 20},
			{Workers: 128, PromptTokens: 1024, RouteP50us: 1, RouteCPUP50us: 1, FindP50us: 1},
		}}})
	}
	writeJSON("latency/run-1/results.json", &Results{Latency: &LatencyResults{
		Added: []AddedLatency{
			{Relay: "kvrelay", Pacing: evenPacing.name, Rate: 1000, P50ms: []float64{addedP50, addedP50, 9}, P99ms: []float64{1, 1, 1}, ControlP50ms: []float64{0.2, 0.2, 0.2}, ControlP99ms: []float64{1, 1, 1}},
			// Bursty pacing is not the goal's: its huge figures must not count.
			{Relay: "kvrelay", Pacing: burstyPacing.name, Rate: 1000, P50ms: []float64{5, 5, 5}, P99ms: []float64{9, 9, 9}, ControlP50ms: []float64{1, 1, 1}, ControlP99ms: []float64{2, 2, 2}},
			{Relay: "kvrelay", Pacing: evenPacing.name, Rate: 10000, P50ms: []float64{0.1, 0.1, 0.1}, P99ms: []float64{0.5, 0.5, 0.5}, ControlP50ms: []float64{0.2, 0.2, 0.2}, ControlP99ms: []float64{1, 1, 1}},
		},
		Runs: []LatencyRun{
			{Round: 1, Relay: "kvrelay", Pacing: evenPacing.name, Steps: []Step{step(1000, 5, true), step(10000, 2, pass10k)}},
			{Round: 1, Relay: controlName, Pacing: evenPacing.name, Steps: []Step{step(1000, 0, true), step(10000, 0, true)}},
		},
	}})
	write("decode/stream.txt", []byte(`goos: linux
BenchmarkDecodeAndNormalize/decode/vllm-map-2         	    5120	     82513 ns/op	  77.48 MB/s	        82.22 blocks/batch	   6803582 blocks/cpu-s	      1004 ns/block	    2038 B/op	      21 allocs/op
BenchmarkDecodeAndNormalize/normalize/vllm-map-2      	    5120	    120890 ns/op	  52.88 MB/s	        82.22 blocks/batch	   5510942 blocks/cpu-s	      1470 ns/block	   22859 B/op	      30 allocs/op
BenchmarkDecodeAndNormalize/normalize/sglang-array-2  	    5120	    120890 ns/op	  52.88 MB/s	        81.78 blocks/batch	   4900000 blocks/cpu-s	      1470 ns/block	   22859 B/op	      30 allocs/op
`))
	write("recordbytes/memory.txt", []byte(`BenchmarkRecordMemory/fresh-2   	       1	1633371741 ns/op	       114.8 B/block	       505.2 cpu-ns/block-applied	       815.1 ns/block-applied
BenchmarkRecordMemory/fresh-every-store-salted-2   	       1	1633371741 ns/op	        99.0 B/block	       505.2 cpu-ns/block-applied	       815.1 ns/block-applied
`))
	write("indexbytes/replay.txt", []byte("BenchmarkReplaySynthetic/bs128/hashed-input \t       1\t4290712493 ns/op\t   2639042 block-ops/cpu-s\t        47.90 est-B/worker-block\t        27.00 rev-B/block\n"))
	// The snapshot part ran out of time: its rows say so and show no figure.
	write("parts.tsv", []byte("sidebyside\t0\t100\t400\t0.5 0.4 0.3\t0.9 0.5 0.3\nlatency\t0\t100\t600\t1.0 0.5 0.3\t1.1 0.6 0.3\n"+
		"decode\t0\t10\t60\t1 1 1\t1 1 1\nsnapshot\t124\t180\t180\t1 1 1\t1 1 1\nroute\t0\t10\t60\t1 1 1\t1 1 1\n"+
		"indexbytes\t0\t25\t300\t1 1 1\t1 1 1\nrecordbytes\t0\t60\t90\t1 1 1\t1 1 1\n"))
	return dir
}

// goalsRows runs goals_table.py on dir and returns the goals table's
// rows by goal (the first cell), each as its cells.
func goalsRows(t *testing.T, dir string) map[string][]string {
	t.Helper()
	py, err := exec.LookPath("python3")
	if err != nil {
		t.Skip("goals_table.py needs python3")
	}
	out, err := exec.Command(py, "goals_table.py", dir).CombinedOutput()
	if err != nil {
		t.Fatalf("goals_table.py: %v\n%s", err, out)
	}
	rows := map[string][]string{}
	for _, line := range strings.Split(string(out), "\n") {
		if !strings.HasPrefix(line, "| ") {
			continue
		}
		cells := strings.Split(strings.Trim(line, "| "), " | ")
		if len(cells) == 6 {
			rows[cells[0]] = cells
		}
	}
	return rows
}

func TestGoalsTableVerdicts(t *testing.T) {
	const (
		cpuGoal   = "CPU per block ≤ 1/10 of SMG's Python relay, at 1k batches/s"
		susGoal   = "sustained rate ≥ 20× Python, `kvrelay serve` as its own process"
		p50Goal   = "added latency ≤ 0.2 ms at the median, 1k batches/s (even pacing)"
		p99Goal   = "p99 ≤ 2× the no-relay control's at 10k batches/s"
		decGoal   = "decode + normalize ≥ 5 M blocks per CPU-second"
		snapGoal  = "whole snapshot at 1 M live blocks delivered ≤ 250 ms"
		r128Goal  = "route ≤ 20 µs at 8k tokens × 128 workers (`--only route`)"
		r512Goal  = "route ≤ 25 µs at 8k tokens × 512 workers (`--only route`)"
		ixGoal    = "index ≥ 20 M block ops per CPU-second, and ≥ 1.0× the fastest Rust indexer"
		ibGoal    = "≤ 48 B per indexed block at block size 128"
		recGoal   = "≤ 100 B per live block in the relay's record, namespaced blocks measured"
		met       = "**met**"
		notMet    = "**not met**"
		notTested = "**not assessed**"
	)
	for _, tc := range []struct {
		name     string
		kvCPU    float64 // s per M blocks; Python's is 12
		addedP50 float64 // ms, two rounds of three (the third is 9 ms)
		pass10k  bool
		route128 float64
		want     map[string]string // goal → met column
		contains map[string]string // goal → text its measured cell must hold
	}{
		{
			name: "goals met", kvCPU: 1.1, addedP50: 0.15, pass10k: true, route128: 19,
			want: map[string]string{cpuGoal: met, susGoal: met, p50Goal: met, p99Goal: met, decGoal: notMet, r128Goal: met, r512Goal: notMet, ibGoal: met, recGoal: notMet, snapGoal: "–", ixGoal: "–"},
			contains: map[string]string{
				cpuGoal:  "0.092", // 1.1 / 12
				p99Goal:  "1.50",  // (1 + 0.5) / 1
				decGoal:  "4.90 M (sglang-array)",
				snapGoal: "part timed out after 180 s",
				ixGoal:   "part not run",
				recGoal:  "a salt per store 99.0 B",
			},
		},
		{
			name: "goals missed", kvCPU: 2.4, addedP50: 0.3, pass10k: false, route128: 21,
			want:     map[string]string{cpuGoal: notMet, p50Goal: notMet, p99Goal: notTested, r128Goal: notMet},
			contains: map[string]string{cpuGoal: "0.200", p50Goal: "+0.300", p99Goal: "fell behind in 1 of 1"},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rows := goalsRows(t, goalsFolder(t, tc.kvCPU, tc.addedP50, tc.pass10k, tc.route128))
			for goal, want := range tc.want {
				row, ok := rows[goal]
				if !ok {
					t.Fatalf("no row %q in %v", goal, rows)
				}
				if row[2] != want {
					t.Errorf("%s: met? = %q, want %q (row %q)", goal, row[2], want, row)
				}
			}
			for goal, want := range tc.contains {
				if row := rows[goal]; row == nil || !strings.Contains(row[1], want) {
					t.Errorf("%s: measured %q does not hold %q", goal, row, want)
				}
			}
		})
	}
}

// TestGoalsDecodeRowIsTheRelaysPath: the decode row's figure and verdict
// are AppendNormalized's (wire, the relay's path), with Normalize's messages
// and the decoder alone as extra wording; a run without wire lines falls
// back to Normalize and says so.
func TestGoalsDecodeRowIsTheRelaysPath(t *testing.T) {
	const decGoal = "decode + normalize ≥ 5 M blocks per CPU-second"
	line := func(kind, form string, perCPUs float64) string {
		return fmt.Sprintf("BenchmarkDecodeAndNormalize/%s/%s-2 \t    5120\t     82513 ns/op\t        82.22 blocks/batch\t   %.0f blocks/cpu-s\n", kind, form, perCPUs)
	}
	for _, tc := range []struct {
		name     string
		stream   string
		want     string   // met? column
		contains []string // in the measured column
		excludes []string
	}{
		{
			name: "wire meets it while the message path does not",
			stream: line("decode", "vllm-map", 8.1e6) + line("decode", "sglang-map", 11e6) +
				line("normalize", "vllm-map", 3.2e6) + line("normalize", "sglang-map", 4.4e6) +
				line("wire", "vllm-map", 5.1e6) + line("wire", "sglang-map", 6.3e6),
			want: "**met**",
			contains: []string{"AppendNormalized (the relay's path: decode, normalize, wire bytes) 5.10 M (vllm-map) to 6.30 M (sglang-map)",
				"Normalize's messages 3.20 M (vllm-map) to 4.40 M (sglang-map)", "decode alone 8.10 M (vllm-map) to 11.00 M (sglang-map)"},
		},
		{
			name: "one wire form short of it",
			stream: line("normalize", "vllm-map", 5.5e6) + line("normalize", "sglang-map", 6e6) +
				line("wire", "vllm-map", 4.9e6) + line("wire", "sglang-map", 6.3e6),
			want:     "**not met**",
			contains: []string{"4.90 M (vllm-map)", "Normalize's messages 5.50 M (vllm-map)"},
		},
		{
			name:     "no wire runs: Normalize stands in",
			stream:   line("normalize", "vllm-map", 5.5e6) + line("normalize", "sglang-map", 6e6),
			want:     "**met**",
			contains: []string{"Normalize (messages) 5.50 M (vllm-map) to 6.00 M (sglang-map)"},
			excludes: []string{"AppendNormalized", "Normalize's messages"},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := goalsFolder(t, 1.1, 0.15, true, 19)
			if err := os.WriteFile(filepath.Join(dir, "decode", "stream.txt"), []byte("goos: linux\n"+tc.stream), 0o644); err != nil {
				t.Fatal(err)
			}
			row := goalsRows(t, dir)[decGoal]
			if row == nil {
				t.Fatalf("no row %q", decGoal)
			}
			if row[2] != tc.want {
				t.Errorf("met? = %q, want %q (row %q)", row[2], tc.want, row)
			}
			for _, s := range tc.contains {
				if !strings.Contains(row[1], s) {
					t.Errorf("measured %q does not hold %q", row[1], s)
				}
			}
			for _, s := range tc.excludes {
				if strings.Contains(row[1], s) {
					t.Errorf("measured %q holds %q", row[1], s)
				}
			}
		})
	}
}
