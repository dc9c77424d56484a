package engines

import (
	"bytes"
	"encoding/json"
	"fmt"
	"math"
	"slices"
	"strconv"
	"strings"
)

// Defaults every engine's KVEventsConfig shares (engine-wire.md §1.3).
const (
	DefaultEndpoint     = "tcp://*:5557"
	DefaultBufferSteps  = 10000
	DefaultHWM          = 100000
	DefaultMaxQueueSize = 100000
)

// DefaultConfig is a disabled configuration holding the shared defaults.
func DefaultConfig() Config {
	return Config{
		Publisher:    "null",
		Endpoint:     DefaultEndpoint,
		BufferSteps:  DefaultBufferSteps,
		HWM:          DefaultHWM,
		MaxQueueSize: DefaultMaxQueueSize,
	}
}

// ConfigObject is a --kv-events-config JSON object, read field by field with
// the coercions the engines' Python config classes apply. The per-engine
// packages compose their ParseConfig from it.
type ConfigObject map[string]json.RawMessage

// ParseConfigObject parses text as a JSON object. empty is true (and the
// object nil) when text is blank: the engine was given no config.
func ParseConfigObject(text string) (obj ConfigObject, empty bool, err error) {
	if strings.TrimSpace(text) == "" {
		return nil, true, nil
	}
	dec := json.NewDecoder(strings.NewReader(text))
	dec.UseNumber()
	var raw any
	if err := dec.Decode(&raw); err != nil {
		return nil, false, fmt.Errorf("--kv-events-config is not valid JSON: %w", err)
	}
	if dec.More() {
		return nil, false, fmt.Errorf("--kv-events-config has data after the JSON value")
	}
	if _, ok := raw.(map[string]any); !ok {
		return nil, false, fmt.Errorf("--kv-events-config must be a JSON object, got %s", jsonKind(raw))
	}
	if err := json.Unmarshal([]byte(text), &obj); err != nil {
		return nil, false, fmt.Errorf("--kv-events-config: %w", err)
	}
	return obj, false, nil
}

func jsonKind(v any) string {
	switch v.(type) {
	case nil:
		return "null"
	case bool:
		return "a boolean"
	case json.Number:
		return "a number"
	case string:
		return "a string"
	case []any:
		return "an array"
	}
	return "an object"
}

// Has reports whether name is present (null included).
func (o ConfigObject) Has(name string) bool {
	_, ok := o[name]
	return ok
}

// IsNull reports whether name is absent or JSON null.
func (o ConfigObject) IsNull(name string) bool {
	raw, ok := o[name]
	return !ok || bytes.Equal(bytes.TrimSpace(raw), []byte("null"))
}

func (o ConfigObject) value(name string) (any, bool, error) {
	if o.IsNull(name) {
		return nil, false, nil
	}
	dec := json.NewDecoder(bytes.NewReader(o[name]))
	dec.UseNumber()
	var v any
	if err := dec.Decode(&v); err != nil {
		return nil, false, fmt.Errorf("%s: %w", name, err)
	}
	return v, true, nil
}

// Bool reads a boolean the way pydantic's lax mode does: true/false, the
// integers 0 and 1, and the usual words ("true", "off", "1", …).
func (o ConfigObject) Bool(name string, def bool) (bool, error) {
	v, ok, err := o.value(name)
	if err != nil || !ok {
		return def, err
	}
	switch v := v.(type) {
	case bool:
		return v, nil
	case json.Number:
		switch v.String() {
		case "0", "0.0":
			return false, nil
		case "1", "1.0":
			return true, nil
		}
	case string:
		switch strings.ToLower(strings.TrimSpace(v)) {
		case "0", "off", "f", "false", "n", "no":
			return false, nil
		case "1", "on", "t", "true", "y", "yes":
			return true, nil
		}
	}
	return def, fmt.Errorf("%s: want a boolean, got %s", name, jsonKind(v))
}

// String reads a string field; set is false when it is absent or null.
func (o ConfigObject) String(name string) (s string, set bool, err error) {
	v, ok, err := o.value(name)
	if err != nil || !ok {
		return "", false, err
	}
	s, isString := v.(string)
	if !isString {
		return "", false, fmt.Errorf("%s: want a string, got %s", name, jsonKind(v))
	}
	return s, true, nil
}

// Int reads an integer field (pydantic lax: an integral number or a decimal
// string); absent or null gives def.
func (o ConfigObject) Int(name string, def int) (int, error) {
	v, ok, err := o.value(name)
	if err != nil || !ok {
		return def, err
	}
	var text string
	switch v := v.(type) {
	case json.Number:
		text = v.String()
	case string:
		text = strings.TrimSpace(v)
	default:
		return def, fmt.Errorf("%s: want an integer, got %s", name, jsonKind(v))
	}
	if n, err := strconv.ParseInt(text, 10, 64); err == nil && n >= math.MinInt32 && n <= math.MaxInt32 {
		return int(n), nil
	}
	if f, err := strconv.ParseFloat(text, 64); err == nil && f == math.Trunc(f) && math.Abs(f) <= math.MaxInt32 {
		return int(f), nil
	}
	return def, fmt.Errorf("%s: want an integer, got %q", name, text)
}

// ReadCommon fills the fields every engine reads the same way: endpoint,
// replay_endpoint, buffer_steps, hwm, max_queue_size and topic. Strings
// must be strings; null leaves the default.
func (o ConfigObject) ReadCommon(cfg *Config) error {
	var err error
	if s, set, e := o.String("endpoint"); e != nil {
		return e
	} else if set {
		cfg.Endpoint = s
	}
	if s, set, e := o.String("replay_endpoint"); e != nil {
		return e
	} else if set {
		cfg.ReplayEndpoint = s
	}
	if s, set, e := o.String("topic"); e != nil {
		return e
	} else if set {
		cfg.Topic = s
	}
	if cfg.BufferSteps, err = o.Int("buffer_steps", cfg.BufferSteps); err != nil {
		return err
	}
	if cfg.HWM, err = o.Int("hwm", cfg.HWM); err != nil {
		return err
	}
	if cfg.MaxQueueSize, err = o.Int("max_queue_size", cfg.MaxQueueSize); err != nil {
		return err
	}
	return nil
}

// RankEndpoints is where a subscriber on the publisher's host dials one DP
// rank.
type RankEndpoints struct {
	Rank int
	// Live is the rank's PUB endpoint.
	Live string
	// Replay is the rank's replay ROUTER endpoint, empty when the engine
	// runs none.
	Replay string
}

// PublisherEndpoints lists the connect endpoints of every DP rank's
// publisher: each engine offsets both its endpoint and its replay endpoint
// by the rank (OffsetEndpointPort), and bind wildcards become 127.0.0.1. An
// endpoint the engines cannot offset (ipc:// at rank > 0) is an error, as it
// is in the engines. dpSize < 1 means one rank.
func PublisherEndpoints(cfg Config, dpSize int) ([]RankEndpoints, error) {
	if dpSize < 1 {
		dpSize = 1
	}
	out := make([]RankEndpoints, 0, dpSize)
	for r := 0; r < dpSize; r++ {
		live, err := ConnectEndpoint(cfg.Endpoint, r)
		if err != nil {
			return nil, fmt.Errorf("rank %d endpoint: %w", r, err)
		}
		var replay string
		if cfg.ReplayEndpoint != "" {
			if replay, err = ConnectEndpoint(cfg.ReplayEndpoint, r); err != nil {
				return nil, fmt.Errorf("rank %d replay endpoint: %w", r, err)
			}
		}
		out = append(out, RankEndpoints{Rank: r, Live: live, Replay: replay})
	}
	return out, nil
}

// CommonConfigKeys are the KVEventsConfig fields all three engines share.
var CommonConfigKeys = []string{"publisher", "endpoint", "replay_endpoint", "buffer_steps", "hwm", "max_queue_size", "topic"}

// CheckKeys refuses a key that is not in known, naming it and the nearest
// known key: the engines' own config classes would not read it, so the
// setting it was meant to carry (often a typo: "endpont") silently takes
// its default, and the relay would dial somewhere the engine is not.
func (o ConfigObject) CheckKeys(known []string) error {
	var unknown []string
	for k := range o {
		if !slices.Contains(known, k) {
			unknown = append(unknown, k)
		}
	}
	if len(unknown) == 0 {
		return nil
	}
	slices.Sort(unknown)
	k := unknown[0]
	if near := nearest(k, known); near != "" {
		return fmt.Errorf("unknown key %q (did you mean %q?)", k, near)
	}
	return fmt.Errorf("unknown key %q (known keys: %s)", k, strings.Join(known, ", "))
}

// nearest is the known key closest to k in edit distance, or "" when none
// is close enough to be a plausible typo.
func nearest(k string, known []string) string {
	best, bestDist := "", len(k)/3+2
	for _, c := range known {
		if d := editDistance(k, c); d < bestDist {
			best, bestDist = c, d
		}
	}
	return best
}

// editDistance is the Levenshtein distance between a and b (bytes; keys are
// ASCII).
func editDistance(a, b string) int {
	prev := make([]int, len(b)+1)
	cur := make([]int, len(b)+1)
	for j := range prev {
		prev[j] = j
	}
	for i := 1; i <= len(a); i++ {
		cur[0] = i
		for j := 1; j <= len(b); j++ {
			cost := 1
			if a[i-1] == b[j-1] {
				cost = 0
			}
			cur[j] = min(prev[j]+1, cur[j-1]+1, prev[j-1]+cost)
		}
		prev, cur = cur, prev
	}
	return prev[len(b)]
}

// CheckEndpoints refuses endpoints kvrelay can never reach and DP layouts
// where two ranks' sockets would share a port: a transport other than
// tcp:// or ipc:// (ZeroMQ PUB has no udp://; inproc:// is reachable only
// inside the engine's process), and a replay_endpoint whose per-rank ports
// (base + rank) overlap the publishers' (the engine fails to bind the
// second socket, or kvrelay dials the wrong one).
func CheckEndpoints(cfg Config, dpSize int) error {
	for _, f := range []struct{ name, ep string }{{"endpoint", cfg.Endpoint}, {"replay_endpoint", cfg.ReplayEndpoint}} {
		if f.ep == "" {
			continue
		}
		scheme, _, ok := strings.Cut(f.ep, "://")
		switch {
		case !ok:
			return fmt.Errorf("%s %q: want tcp://HOST:PORT or ipc://PATH", f.name, f.ep)
		case scheme == "inproc":
			return fmt.Errorf("%s %q: inproc:// is reachable only inside the engine's own process; use tcp:// or ipc://", f.name, f.ep)
		case scheme != "tcp" && scheme != "ipc":
			return fmt.Errorf("%s %q: ZeroMQ PUB/ROUTER sockets cannot use %s://; want tcp:// or ipc://", f.name, f.ep, scheme)
		}
	}
	eps, err := PublisherEndpoints(cfg, dpSize)
	if err != nil {
		return err
	}
	owner := map[string]string{} // socket address -> which rank's which socket
	for _, r := range eps {
		for _, s := range []struct{ what, ep string }{{"endpoint", r.Live}, {"replay_endpoint", r.Replay}} {
			if s.ep == "" {
				continue
			}
			key := socketKey(s.ep)
			me := fmt.Sprintf("rank %d's %s %s", r.Rank, s.what, s.ep)
			if other, dup := owner[key]; dup {
				return fmt.Errorf("%s is also %s: each engine rank adds its rank to both ports, so endpoint and replay_endpoint must be at least dp-size (%d) ports apart", me, other, dpSize)
			}
			owner[key] = me
		}
	}
	return nil
}

// socketKey identifies where a socket listens on this host: the port for
// tcp (a wildcard and 127.0.0.1 are one port), the path for ipc.
func socketKey(ep string) string {
	if rest, ok := strings.CutPrefix(ep, "tcp://"); ok {
		if i := strings.LastIndex(rest, ":"); i >= 0 {
			return "tcp:" + rest[i+1:]
		}
	}
	return ep
}

// BindRule says PublisherBinds's rule in the words the relay's warning and
// the simulator's error both use, so the two ends of one mistake read alike.
const BindRule = "the engines bind only an endpoint with a wildcard (tcp://*:PORT), an IPv6 \"::\" or ipc://"

// PublisherBinds applies the engines' bind rule (engine-wire.md §1.2): the
// PUB socket binds when its endpoint contains "*" or "::", or is ipc:// or
// inproc://; otherwise the engine connects to that address and listens
// nowhere. (The replay ROUTER always binds.)
func PublisherBinds(endpoint string) bool {
	return strings.Contains(endpoint, "*") || strings.Contains(endpoint, "::") ||
		strings.HasPrefix(endpoint, "ipc://") || strings.HasPrefix(endpoint, "inproc://")
}
