package main

import (
	"strings"
	"testing"

	"github.com/kvrelay/kvrelay/gateway"
)

func TestWorkersSharingAnAddressAreNamedByService(t *testing.T) {
	parse := func(vs ...string) []gateway.Worker {
		var out []gateway.Worker
		for _, v := range vs {
			w, err := parseWorker(v)
			if err != nil {
				t.Fatal(err)
			}
			out = append(out, w)
		}
		return out
	}
	tests := []struct {
		name    string
		in      []gateway.Worker
		want    []string
		wantErr string
	}{
		{"distinct addresses keep their names", parse("grpc://h:1", "grpc://h:2,service=sglang"), []string{"grpc://h:1", "grpc://h:2"}, ""},
		{"one address, two services", parse("grpc://h:1,service=vllm", "grpc://h:1,service=sglang,model=x"), []string{"grpc://h:1/vllm", "grpc://h:1/sglang"}, ""},
		{"one address, one service twice", parse("grpc://h:1", "grpc://h:1,service=vllm"), nil, "given twice"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := nameWorkers(tt.in)
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("err %v, want %q", err, tt.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			for i, w := range got {
				if w.ID != tt.want[i] {
					t.Fatalf("worker %d named %q, want %q", i, w.ID, tt.want[i])
				}
			}
			// The gateway takes them.
			if _, err := gateway.New(gateway.Config{Workers: got}); err != nil {
				t.Fatalf("gateway.New: %v", err)
			}
		})
	}
}
