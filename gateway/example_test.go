package gateway_test

import (
	"context"
	"fmt"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrelay/kvrelay/gateway"
	"github.com/kvrelay/kvrelay/gateway/index"
	"github.com/kvrelay/kvrelay/gateway/monitor"
)

// Example is the package doc's embedding, compiled (it has no output to
// check: it would need live workers).
func Example() {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	reg := prometheus.NewRegistry()
	gw, err := gateway.New(gateway.Config{
		Workers: []gateway.Worker{
			{Addr: "10.0.0.1:50051", Service: monitor.ServiceVLLM, Model: "llama"},
			{Addr: "10.0.0.2:50051", Service: monitor.ServiceVLLM, Model: "llama"},
		},
		Index:      index.Options{TTL: 30 * time.Minute},
		Registerer: reg,
	})
	if err != nil {
		panic(err)
	}
	go gw.Run(ctx) // one subscription per worker, index pruning

	promptTokens := []uint32{1, 2, 3 /* … the tokenized prompt */}
	d, err := gw.Route(gateway.RouteRequest{Model: "llama", TokenIDs: promptTokens, Track: true})
	if err != nil {
		panic(err) // ErrUnknownModel, ErrNoWorkers
	}
	defer d.Done()                  // the worker's in-flight count drops when the request ends
	fmt.Println(d.Worker, d.Reason) // forward the request to d.Worker
}
