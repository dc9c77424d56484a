// Package sglang describes SGLang's KV-event publisher to kvrelay.
package sglang

import (
	"fmt"

	"github.com/kvrelay/kvrelay/engines"
	"github.com/kvrelay/kvrelay/engines/wire"
)

// Engine is SGLang.
var Engine = engines.Engine{
	Name:             "sglang",
	ServiceName:      "sglang.grpc.scheduler.SglangScheduler",
	DisabledMessage:  "KV cache events not enabled. Start SGLang with --kv-events-config '...'",
	ParseConfig:      ParseConfig,
	ConfigKeys:       append([]string{"enable_kv_cache_events"}, engines.CommonConfigKeys...),
	Dialect:          wire.SGLang,
	ReplayTopicFrame: false,
	StartupClear:     true,
}

// ParseConfig reads --kv-events-config as SGLang's KVEventsConfig does.
// SGLang has no enable flag: publisher defaults to "null" and events flow
// iff it is "zmq". SGLang's publisher factory rejects any other name at
// startup, so that is an error here too; so is a null publisher, which its
// str-typed field does not accept. An enable_kv_cache_events key (a vLLM
// habit) and other unknown keys are ignored here; kvrelay serve refuses
// keys outside Engine.ConfigKeys unless told to allow them.
func ParseConfig(text string) (engines.Config, error) {
	cfg := engines.DefaultConfig()
	obj, empty, err := engines.ParseConfigObject(text)
	if err != nil || empty {
		return cfg, err
	}
	for _, name := range []string{"publisher", "endpoint", "topic"} {
		if obj.Has(name) && obj.IsNull(name) {
			return cfg, fmt.Errorf("%s: want a string, got null", name)
		}
	}
	publisher, set, err := obj.String("publisher")
	if err != nil {
		return cfg, err
	}
	if !set {
		publisher = "null"
	}
	if publisher != "null" && publisher != "zmq" {
		return cfg, fmt.Errorf("publisher: want \"null\" or \"zmq\", got %q", publisher)
	}
	if err := obj.ReadCommon(&cfg); err != nil {
		return cfg, err
	}
	cfg.Publisher = publisher
	cfg.Enabled = publisher == "zmq"
	return cfg, nil
}
