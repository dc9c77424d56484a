// Package engines describes the inference engines kvrelay subscribes to:
// how each one's --kv-events-config is read, where each DP rank publishes,
// and which wire dialect its payloads use. The per-engine packages
// (engines/vllm, engines/sglang, engines/tokenspeed) each export one Engine.
package engines

import (
	"fmt"
	"strconv"
	"strings"

	"github.com/kvrelay/kvrelay/engines/wire"
)

// Config is an engine's KV-events configuration after the engine's own
// defaults and rules were applied to the JSON the user gave it.
type Config struct {
	// Enabled is true when the engine publishes events over ZeroMQ
	// (publisher resolved to "zmq").
	Enabled bool
	// Publisher is the resolved publisher name ("zmq" or "null").
	Publisher      string
	Endpoint       string
	ReplayEndpoint string // empty: the engine keeps no replay ROUTER
	BufferSteps    int
	HWM            int
	MaxQueueSize   int
	Topic          string
}

// Engine is everything kvrelay needs to know about one engine family.
type Engine struct {
	// Name is the --engine value: "vllm", "sglang" or "tokenspeed".
	Name string
	// ServiceName is the full gRPC service name gateways call
	// SubscribeKvEvents on.
	ServiceName string
	// DisabledMessage is the UNIMPLEMENTED status message for an engine
	// whose events are off.
	DisabledMessage string
	// ParseConfig reads --kv-events-config exactly as the engine does.
	ParseConfig func(jsonText string) (Config, error)
	// ConfigKeys are the --kv-events-config keys the engine reads; kvrelay
	// refuses others unless told to allow them (ConfigObject.CheckKeys).
	ConfigKeys []string
	// Dialect selects the wire decoder's engine-specific rules.
	Dialect wire.Dialect
	// ReplayTopicFrame is true when the engine's replay replies carry the
	// topic frame before the sequence (vLLM after #45177).
	ReplayTopicFrame bool
	// StartupClear is true when the engine's first batch after start begins
	// with AllBlocksCleared (SGLang).
	StartupClear bool
}

// OffsetEndpointPort applies the engines' per-rank endpoint rule: rank 0 and
// empty endpoints are unchanged; inproc endpoints get a "_dp<rank>" suffix;
// tcp endpoints get port+rank with the host kept verbatim, except port 0,
// which vLLM 0.33 leaves for the OS at every rank (#55844); anything else at
// rank > 0 is an error, as it is in the engines.
func OffsetEndpointPort(endpoint string, rank int) (string, error) {
	if endpoint == "" || rank == 0 {
		return endpoint, nil
	}
	if rank < 0 {
		return "", fmt.Errorf("endpoint %q: negative DP rank %d", endpoint, rank)
	}
	if strings.Contains(endpoint, "inproc") {
		return fmt.Sprintf("%s_dp%d", endpoint, rank), nil
	}
	if strings.Contains(endpoint, "tcp") && strings.Contains(endpoint, ":") {
		i := strings.LastIndex(endpoint, ":")
		port, err := strconv.Atoi(endpoint[i+1:])
		if err != nil {
			return "", fmt.Errorf("endpoint %q: port is not a number: %w", endpoint, err)
		}
		if port == 0 {
			return endpoint, nil
		}
		return endpoint[:i+1] + strconv.Itoa(port+rank), nil
	}
	return "", fmt.Errorf("endpoint %q: cannot offset a non-tcp, non-inproc endpoint for DP rank %d", endpoint, rank)
}

// ConnectEndpoint is where a subscriber on the same host dials rank's
// publisher: the engine's offset endpoint with the bind wildcards "*" and
// "0.0.0.0" replaced by 127.0.0.1. A tcp port of 0 is an error: the engine
// binds a port the OS picks, which only the engine's process knows.
func ConnectEndpoint(endpoint string, rank int) (string, error) {
	ep, err := OffsetEndpointPort(endpoint, rank)
	if err != nil {
		return "", err
	}
	if rest, ok := strings.CutPrefix(ep, "tcp://"); ok {
		i := strings.LastIndex(rest, ":")
		if i >= 0 && rest[i+1:] == "0" {
			return "", fmt.Errorf("endpoint %q: port 0 makes the engine bind a port the OS picks for each rank (vLLM #55844), "+
				"which a subscriber cannot know; give the engine explicit ports in its --kv-events-config", endpoint)
		}
		if i >= 0 {
			host := rest[:i]
			if host == "*" || host == "0.0.0.0" {
				ep = "tcp://127.0.0.1" + rest[i:]
			}
		}
	}
	return ep, nil
}
