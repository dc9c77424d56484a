// Package tokenspeed describes TokenSpeed's KV-event publisher to kvrelay.
package tokenspeed

import (
	"github.com/kvrelay/kvrelay/engines"
	"github.com/kvrelay/kvrelay/engines/wire"
)

// Engine is TokenSpeed.
var Engine = engines.Engine{
	Name:             "tokenspeed",
	ServiceName:      "tokenspeed.grpc.scheduler.TokenSpeedScheduler",
	DisabledMessage:  "KV cache events not enabled. Start TokenSpeed with --kv-events-config '...'",
	ParseConfig:      ParseConfig,
	ConfigKeys:       append([]string{"enable_kv_cache_events"}, engines.CommonConfigKeys...),
	Dialect:          wire.TokenSpeed,
	ReplayTopicFrame: false,
	StartupClear:     false,
}

// ParseConfig reads --kv-events-config as TokenSpeed resolves it (smg's
// TokenSpeed resolver, relay-semantics §5.4):
//   - the text must be a JSON object (else an error);
//   - enable_kv_cache_events must be true for events to flow;
//   - publisher absent or JSON null means "zmq"; any other value than
//     "zmq" disables events (it is not an error);
//   - an empty or null endpoint means tcp://*:5557, a null topic means "";
//     a non-string endpoint or topic is an error;
//   - a replay_endpoint that is not a string is ignored (no replay).
//
// Unknown keys are ignored here; kvrelay serve refuses keys outside
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
	publisher := "zmq"
	if !obj.IsNull("publisher") {
		s, _, err := obj.String("publisher")
		if err != nil || s != "zmq" {
			// Any value other than "zmq" (a string or not) disables.
			publisher = "null"
			if err == nil {
				publisher = s
			}
		}
	}
	if _, _, err := obj.String("replay_endpoint"); err != nil {
		delete(obj, "replay_endpoint")
	}
	if err := obj.ReadCommon(&cfg); err != nil {
		return cfg, err
	}
	if cfg.Endpoint == "" {
		cfg.Endpoint = engines.DefaultEndpoint
	}
	cfg.Publisher = publisher
	cfg.Enabled = enabled && publisher == "zmq"
	return cfg, nil
}
