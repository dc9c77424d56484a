// Package vllm describes vLLM's KV-event publisher to kvrelay.
package vllm

import (
	"fmt"

	"github.com/kvrelay/kvrelay/engines"
	"github.com/kvrelay/kvrelay/engines/wire"
)

// Engine is vLLM.
var Engine = engines.Engine{
	Name:             "vllm",
	ServiceName:      "vllm.grpc.engine.VllmEngine",
	DisabledMessage:  "KV cache events not enabled. Start vLLM with --kv-events-config '...'",
	ParseConfig:      ParseConfig,
	ConfigKeys:       append([]string{"enable_kv_cache_events"}, engines.CommonConfigKeys...),
	Dialect:          wire.VLLM,
	ReplayTopicFrame: true,
	StartupClear:     false,
}

// ParseConfig reads --kv-events-config as vLLM's KVEventsConfig does:
// enable_kv_cache_events (default false) and publisher, which when unset
// resolves to "zmq" if events are enabled and "null" otherwise. Newer vLLM
// types publisher as Literal["null", "zmq"], and older ones fail at startup
// on any other name, so another value is an error. Events flow only when
// both the flag is on and the publisher is zmq (as smg's resolver requires).
// Unknown keys are ignored here (whether vLLM's config dataclass forbids
// them could not be confirmed); kvrelay serve refuses keys outside
// Engine.ConfigKeys unless told to allow them.
func ParseConfig(text string) (engines.Config, error) {
	cfg := engines.DefaultConfig()
	obj, empty, err := engines.ParseConfigObject(text)
	if err != nil || empty {
		return cfg, err
	}
	enabled, err := obj.Bool("enable_kv_cache_events", false)
	if err != nil {
		return cfg, err
	}
	publisher, set, err := obj.String("publisher")
	if err != nil {
		return cfg, err
	}
	if !set {
		publisher = "null"
		if enabled {
			publisher = "zmq"
		}
	}
	if publisher != "null" && publisher != "zmq" {
		return cfg, fmt.Errorf("publisher: want \"null\" or \"zmq\", got %q", publisher)
	}
	if err := readCommon(obj, &cfg); err != nil {
		return cfg, err
	}
	cfg.Publisher = publisher
	cfg.Enabled = enabled && publisher == "zmq"
	return cfg, nil
}

// readCommon applies pydantic's str typing: endpoint and topic may not be
// null in vLLM (only replay_endpoint is Optional).
func readCommon(obj engines.ConfigObject, cfg *engines.Config) error {
	for _, name := range []string{"endpoint", "topic"} {
		if obj.Has(name) && obj.IsNull(name) {
			return fmt.Errorf("%s: want a string, got null", name)
		}
	}
	return obj.ReadCommon(cfg)
}
