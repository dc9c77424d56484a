package load

import (
	"bufio"
	"context"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/testing/protocmp"

	"github.com/kvrelay/kvrelay/proto/kvpb"
	"github.com/kvrelay/kvrelay/testkit/pyenv"
)

// TestGetLoadsMatchesSMGServicerConversion: a servicer built on SMG's own
// generated messages answers GetLoads; kvrelay's source reads it over gRPC
// and must make of every rank's report the record smg-grpc-servicer's own
// engine_load_from makes, field for field.
func TestGetLoadsMatchesSMGServicerConversion(t *testing.T) {
	services := map[string]string{
		"vllm":       kvpb.VllmEngine_ServiceDesc.ServiceName,
		"sglang":     kvpb.SglangScheduler_ServiceDesc.ServiceName,
		"tokenspeed": kvpb.TokenSpeedScheduler_ServiceDesc.ServiceName,
	}
	for engine, service := range services {
		t.Run(engine, func(t *testing.T) {
			cmd := pyenv.Command(t, pyenv.Script("load", "getloads_servicer.py"), "--engine", engine)
			stdin, err := cmd.StdinPipe()
			if err != nil {
				t.Fatal(err)
			}
			out, err := cmd.StdoutPipe()
			if err != nil {
				t.Fatal(err)
			}
			if err := cmd.Start(); err != nil {
				t.Fatal(err)
			}
			defer func() { _ = stdin.Close(); _ = cmd.Wait() }()
			var ready struct {
				Port int               `json:"port"`
				Want map[string]string `json:"want"`
			}
			sc := bufio.NewScanner(out)
			if !sc.Scan() {
				t.Fatalf("the servicer printed nothing: %v", sc.Err())
			}
			if err := json.Unmarshal(sc.Bytes(), &ready); err != nil {
				t.Fatalf("%v: %s", err, sc.Bytes())
			}
			cc, err := grpc.NewClient(fmt.Sprintf("127.0.0.1:%d", ready.Port), grpc.WithTransportCredentials(insecure.NewCredentials()))
			if err != nil {
				t.Fatal(err)
			}
			defer cc.Close()
			f, err := NewGetLoads(cc, service)
			if err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			got, err := f.Fetch(ctx, DefaultMaxBytes)
			if err != nil {
				t.Fatal(err)
			}
			if len(got) != len(ready.Want) {
				t.Fatalf("%d ranks, want %d", len(got), len(ready.Want))
			}
			for rank, hexWant := range ready.Want {
				raw, err := hex.DecodeString(hexWant)
				if err != nil {
					t.Fatal(err)
				}
				want := &kvpb.EngineLoad{}
				if err := proto.Unmarshal(raw, want); err != nil {
					t.Fatal(err)
				}
				r, err := strconv.ParseInt(rank, 10, 32)
				if err != nil {
					t.Fatalf("the servicer's rank %q: %v", rank, err)
				}
				if d := cmp.Diff(want, got[int32(r)], protocmp.Transform()); d != "" {
					t.Errorf("rank %s: kvrelay's record differs from smg-grpc-servicer's (-smg +kvrelay):\n%s", rank, d)
				}
			}
			// A reply over the byte cap is refused as too large.
			if _, err := f.Fetch(ctx, 16); outcomeOf(err) != "too_large" {
				t.Errorf("a reply over a 16-byte cap: %v, want too_large", err)
			}
		})
	}
}

// TestGetLoadsRanksAreChecked: a GetLoads reply names its ranks; one with
// a negative rank, or more ranks than any engine has, is malformed rather
// than kept.
func TestGetLoadsRanksAreChecked(t *testing.T) {
	ranks := func(rs ...int32) []*kvpb.VllmSchedulerLoad {
		out := make([]*kvpb.VllmSchedulerLoad, len(rs))
		for i, r := range rs {
			out[i] = &kvpb.VllmSchedulerLoad{DpRank: r}
		}
		return out
	}
	many := make([]int32, maxRanks+1)
	for i := range many {
		many[i] = int32(i)
	}
	for _, tc := range []struct {
		name    string
		loads   []*kvpb.VllmSchedulerLoad
		want    int
		wantErr bool
	}{
		{"two ranks", ranks(0, 1), 2, false},
		{"a rank twice keeps one", ranks(3, 3), 1, false},
		{"negative rank", ranks(0, -1), 0, true},
		{"over the rank cap", ranks(many...), 0, true},
		{"at the rank cap", ranks(many[:maxRanks]...), maxRanks, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := byRank(tc.loads, fromVllm)
			if tc.wantErr {
				if !errors.Is(err, ErrMalformed) {
					t.Fatalf("err = %v, want ErrMalformed", err)
				}
				return
			}
			if err != nil || len(got) != tc.want {
				t.Fatalf("%d ranks, %v; want %d", len(got), err, tc.want)
			}
		})
	}
}
