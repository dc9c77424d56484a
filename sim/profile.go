package sim

import (
	"github.com/kvrelay/kvrelay/engines"
	"github.com/kvrelay/kvrelay/engines/sglang"
	"github.com/kvrelay/kvrelay/engines/tokenspeed"
	"github.com/kvrelay/kvrelay/engines/vllm"
	"github.com/kvrelay/kvrelay/sim/prefixcache"
)

// profile is what the simulator imitates of one engine family: the
// publisher facts engines/<name> records (config parsing, replay framing,
// startup clear) plus how its cache reports blocks.
type profile struct {
	engines.Engine
	// clearEvent: a cache reset is reported as AllBlocksCleared (vLLM and
	// SGLang); TokenSpeed never emits it and reports removals instead.
	clearEvent bool
	// oneBlockPerEvent: SGLang's radix cache and TokenSpeed store one page
	// per event; vLLM stores a request's new blocks in one event.
	oneBlockPerEvent bool
	// secondCopies: vLLM can hold two physical blocks with one hash.
	secondCopies bool
	hasher       prefixcache.Hasher
}

var profiles = map[string]*profile{
	"vllm": {Engine: vllm.Engine, clearEvent: true, secondCopies: true, hasher: prefixcache.VLLMSHA256CBOR{}},
	"sglang": {Engine: sglang.Engine, clearEvent: true, oneBlockPerEvent: true,
		hasher: prefixcache.SGLangSHA256{}},
	"tokenspeed": {Engine: tokenspeed.Engine, oneBlockPerEvent: true, hasher: prefixcache.TokenSpeedFNV{}},
}

// ParseKVEventsConfig reads --kv-events-config as engine does.
func ParseKVEventsConfig(engine, text string) (engines.Config, error) {
	p, ok := profiles[engine]
	if !ok {
		_, err := lookupWire(engine, "")
		return engines.Config{}, err
	}
	return p.ParseConfig(text)
}
