package sim

import (
	"bytes"
	"encoding/json"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kvrelay/kvrelay/testkit/pyenv"
)

// TestMsgspecPeer runs every engine and wire generation against a real
// libzmq SUB and DEALER (pyzmq) and msgspec structs declared as the engines
// declare them: every replayed and live payload must decode and re-encode
// to the same bytes, and the framing must be the engine's.
func TestMsgspecPeer(t *testing.T) {
	script, err := filepath.Abs(filepath.Join("testdata", "msgspec_peer.py"))
	if err != nil {
		t.Fatal(err)
	}
	for _, engine := range []string{"vllm", "sglang", "tokenspeed"} {
		for _, gen := range WireGenerations(engine) {
			t.Run(engine+"/"+gen, func(t *testing.T) {
				opts := Options{Engine: engine, Wire: gen, CapacityBlocks: 10}
				if engine != "tokenspeed" && !strings.HasSuffix(gen, "6") {
					opts.HostCapacityBlocks = 4
				}
				e := startSim(t, opts, `, "topic": "kv@sim"`)
				// Second copies, evictions and host offloads all happen in
				// these first steps.
				if _, err := e.RunWorkload(40); err != nil {
					t.Fatal(err)
				}
				if err := e.Fault(Fault{Kind: FaultResetCache}); err != nil {
					t.Fatal(err)
				}
				e.RunWorkload(8)
				ep := e.Endpoints()[0]
				cmd := pyenv.Command(t, script, engine, gen, ep.Live, ep.Replay, "kv@sim", "5")
				var stdout, stderr bytes.Buffer
				cmd.Stdout, cmd.Stderr = &stdout, &stderr
				if err := cmd.Start(); err != nil {
					t.Fatal(err)
				}
				done := make(chan error, 1)
				go func() { done <- cmd.Wait() }()
				want := e.LiveSet()[0].NextSeq
				// Keep publishing until the peer has heard enough live
				// batches (its SUB joins at some point of this loop).
				var werr error
			loop:
				for i := 0; ; i++ {
					select {
					case werr = <-done:
						break loop
					case <-time.After(20 * time.Millisecond):
						if _, err := e.Step(); err != nil {
							t.Fatal(err)
						}
					}
					if i > 1500 {
						cmd.Process.Kill()
						<-done
						t.Fatalf("peer did not finish: %s", stderr.String())
					}
				}
				if werr != nil {
					t.Fatalf("peer: %v\n%s", werr, stderr.String())
				}
				var out struct {
					Replayed   uint64
					Ended      bool
					Live       int
					Mismatches []map[string]string
					Errors     []string
				}
				if err := json.Unmarshal(stdout.Bytes(), &out); err != nil {
					t.Fatalf("peer output %q: %v", stdout.String(), err)
				}
				if len(out.Errors) > 0 || len(out.Mismatches) > 0 {
					t.Fatalf("peer errors %v, mismatches %v", out.Errors, out.Mismatches)
				}
				if out.Replayed < want || !out.Ended || out.Live != 5 {
					t.Fatalf("peer replayed %d (≥ %d wanted), ended %v, live %d", out.Replayed, want, out.Ended, out.Live)
				}
			})
		}
	}
}
