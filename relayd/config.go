package relayd

import (
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"strings"
	"time"

	"github.com/kvrelay/kvrelay/engines"
	"github.com/kvrelay/kvrelay/engines/sglang"
	"github.com/kvrelay/kvrelay/engines/tokenspeed"
	"github.com/kvrelay/kvrelay/engines/vllm"
	"github.com/kvrelay/kvrelay/internal/natslog"
	"github.com/kvrelay/kvrelay/internal/tlsconfig"
)

// EngineByName maps --engine values (and a config's "engine") to engine
// descriptions.
func EngineByName(name string) (engines.Engine, error) {
	switch name {
	case "vllm":
		return vllm.Engine, nil
	case "sglang":
		return sglang.Engine, nil
	case "tokenspeed":
		return tokenspeed.Engine, nil
	}
	return engines.Engine{}, fmt.Errorf("unknown engine %q (want vllm, sglang or tokenspeed)", name)
}

// File is the --config file: several relays, on one listener or several.
type File struct {
	MetricsListen string `json:"metrics_listen"`
	LogLevel      string `json:"log_level"`
	LogFormat     string `json:"log_format"`
	// WebConfigFile is the metrics listener's exporter-toolkit web config
	// (TLS, basic auth).
	WebConfigFile string `json:"web_config_file"`
	// NATS, when present, publishes every relay's stream to JetStream (the
	// --nats… flags' settings; each relay's name is its nats_worker).
	NATS   *NATSConfig   `json:"nats"`
	Relays []RelayConfig `json:"relays"`
}

// NATSConfig is the file's "nats" block: what serve's --nats,
// --nats-stream, --nats-events-subject-prefix, --nats-alive-every and
// their authentication and TLS flags set, under the keys of the README's
// table. cmd/kvrelay checks and applies it.
type NATSConfig struct {
	URL                 string `json:"url"`
	Stream              string `json:"stream"`
	EventsSubjectPrefix string `json:"events_subject_prefix"`
	// AliveEvery is a duration; "" is the flag's default, "0s" never.
	AliveEvery   string        `json:"alive_every"`
	Creds        string        `json:"creds"`
	NKeySeed     string        `json:"nkey_seed"`
	User         string        `json:"user"`
	PasswordFile string        `json:"password_file"`
	TokenFile    string        `json:"token_file"`
	TLS          NATSTLSConfig `json:"tls"`
	// Password and Token are read only to be refused: a secret comes from
	// a file (password_file, token_file) or the environment, never from
	// the file that configures the relays.
	Password json.RawMessage `json:"password"`
	Token    json.RawMessage `json:"token"`
}

// NATSTLSConfig is the "nats" block's "tls": PEM files as --nats-tls-ca,
// --nats-tls-cert and --nats-tls-key.
type NATSTLSConfig struct {
	CA   string `json:"ca"`
	Cert string `json:"cert"`
	Key  string `json:"key"`
}

// RelayConfig is one relay. KVEventsConfig is the exact JSON the engine got,
// as a JSON object or as a string holding it.
type RelayConfig struct {
	Name           string          `json:"name"`
	Engine         string          `json:"engine"`
	KVEventsConfig json.RawMessage `json:"kv_events_config"`
	DPSize         int             `json:"dp_size"`
	Listen         string          `json:"listen"`
	Upstream       string          `json:"upstream"`
	HistoryBatches int             `json:"history_batches"`
	HistoryBytes   int64           `json:"history_bytes"`
	ReplayTimeout  string          `json:"replay_timeout"`
	// TLS secures the listener (every relay on one listener gives the same).
	TLS tlsconfig.Server `json:"tls"`
	// Reflection is auto (on for a loopback listener), on or off.
	Reflection string `json:"reflection"`
	// UpstreamTLS applies to a grpcs:// upstream.
	UpstreamTLS tlsconfig.Client `json:"upstream_tls"`
	// UpstreamServices are services forwarded besides the engine's own.
	UpstreamServices          []string `json:"upstream_services"`
	UpstreamDropAuthorization bool     `json:"upstream_drop_authorization"`
	// AllowUnknownConfigKeys accepts kv_events_config keys the engine does
	// not read (a config shared with other engines), with a warning.
	AllowUnknownConfigKeys bool `json:"allow_unknown_config_keys"`
	// ReportModeFull and SuppressReannounced: see --report-mode-full and
	// --suppress-reannounced-stores.
	ReportModeFull      bool `json:"report_mode_full"`
	SuppressReannounced bool `json:"suppress_reannounced_stores"`
	// EngineMetricsURL is the engine's HTTP server (base URL: /v1/loads
	// first, /metrics when refused; or a URL ending in either) read for the
	// engine's load. LoadSource chooses: auto (the URL when given, else the
	// upstream's GetLoads, else none), getloads, http or off.
	// LoadInterval and LoadMaxAge are durations (load.DefaultInterval,
	// load.DefaultMaxAge when empty).
	EngineMetricsURL string `json:"engine_metrics_url"`
	LoadSource       string `json:"load_source"`
	LoadInterval     string `json:"load_interval"`
	LoadMaxAge       string `json:"load_max_age"`
	// NATSWorker and NATSMember are the relay's --nats-worker and
	// --nats-member: the name its batches go under ("" : HOSTNAME:PORT of
	// Listen) and how gateways taking workers from NATS reach it.
	NATSWorker string `json:"nats_worker"`
	NATSMember string `json:"nats_member"`
	// PublishersOnUpstreamHost: discovery replaced the engine's wildcard
	// bind hosts by the upstream's host (PublishersOnHost); the engine
	// binds them all the same. Set by Learn, never by a file.
	PublishersOnUpstreamHost bool `json:"-"`
}

// Relay is a RelayConfig checked and parsed.
type Relay struct {
	RelayConfig
	Engine        engines.Engine
	KV            engines.Config
	ReplayTimeout time.Duration
	// Load is how the relay reads the engine's load (Load.Kind "" : none).
	Load         LoadSettings
	upstreamAddr string // HOST:PORT of Upstream
	upstreamTLS  bool
	// UnknownKeys is the refused-key error CheckKeys gave, kept as a start
	// warning when AllowUnknownConfigKeys is on.
	UnknownKeys error
}

// ReadFile reads a --config file, refusing keys it does not know.
func ReadFile(path string) (File, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return File{}, fmt.Errorf("--config: %w", err)
	}
	dec := json.NewDecoder(strings.NewReader(string(data)))
	dec.DisallowUnknownFields()
	var f File
	if err := dec.Decode(&f); err != nil {
		return File{}, fmt.Errorf("--config %s: %w", path, err)
	}
	if len(f.Relays) == 0 {
		return File{}, fmt.Errorf("--config %s: \"relays\" is empty", path)
	}
	if err := f.NATS.refuseSecrets(); err != nil {
		return File{}, fmt.Errorf("--config %s: %w", path, err)
	}
	return f, nil
}

// refuseSecrets refuses a password or token written in the block, in
// either of its keys or in the URL.
func (n *NATSConfig) refuseSecrets() error {
	if n == nil {
		return nil
	}
	if n.Password != nil {
		return errors.New("nats.password: a password is never written in the config; put it in a file named by nats.password_file (or $KVRELAY_NATS_PASSWORD)")
	}
	if n.Token != nil {
		return errors.New("nats.token: a token is never written in the config; put it in a file named by nats.token_file (or $KVRELAY_NATS_TOKEN)")
	}
	if natslog.HasCredentials(n.URL) {
		// Not even redacted: a server list without a scheme hides its
		// credential from the redaction.
		return errors.New("nats.url: it carries a credential (user:password@ or token@), which is never written in the config; give nats.user with nats.password_file, nats.token_file, nats.creds or nats.nkey_seed")
	}
	return nil
}

// Resolve checks every relay's settings and parses its engine config, so a
// start fails on a bad setting before anything listens.
func Resolve(cfgs []RelayConfig) ([]Relay, error) {
	names := map[string]bool{}
	out := make([]Relay, 0, len(cfgs))
	for i, c := range cfgs {
		where := fmt.Sprintf("relay %d", i)
		if c.Name != "" {
			where = fmt.Sprintf("relay %q", c.Name)
		}
		eng, err := EngineByName(c.Engine)
		if err != nil {
			return nil, fmt.Errorf("%s: engine: %w", where, err)
		}
		if c.Name == "" {
			c.Name = c.Engine
		}
		if names[c.Name] {
			return nil, fmt.Errorf("%s: name is used twice", where)
		}
		names[c.Name] = true
		text, err := kvConfigText(c.KVEventsConfig)
		if err != nil {
			return nil, fmt.Errorf("%s: kv_events_config: %w", where, err)
		}
		kv, err := eng.ParseConfig(text)
		if err != nil {
			return nil, fmt.Errorf("%s: kv-events-config: %w", where, err)
		}
		var unknownKeys error
		if obj, _, err := engines.ParseConfigObject(text); err == nil {
			unknownKeys = obj.CheckKeys(eng.ConfigKeys)
		}
		if unknownKeys != nil && !c.AllowUnknownConfigKeys {
			return nil, fmt.Errorf("%s: kv-events-config: %w; %s does not read it (allow such keys with --allow-unknown-config-keys, or allow_unknown_config_keys in --config)", where, unknownKeys, eng.Name)
		}
		if c.DPSize == 0 {
			c.DPSize = 1
		}
		if c.DPSize < 1 || c.DPSize > 1024 {
			return nil, fmt.Errorf("%s: dp-size %d is out of range (1..1024)", where, c.DPSize)
		}
		if c.Listen == "" {
			return nil, fmt.Errorf("%s: listen is required", where)
		}
		if _, _, err := net.SplitHostPort(c.Listen); err != nil {
			return nil, fmt.Errorf("%s: listen %q: %w", where, c.Listen, err)
		}
		upstreamAddr, upstreamTLS, err := ParseUpstream(c.Upstream, c.UpstreamTLS)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", where, err)
		}
		if (len(c.UpstreamServices) > 0 || c.UpstreamDropAuthorization) && c.Upstream == "" {
			return nil, fmt.Errorf("%s: upstream services and authorization settings need an upstream", where)
		}
		if err := c.TLS.Check(); err != nil {
			return nil, fmt.Errorf("%s: TLS: %w", where, err)
		}
		switch c.Reflection {
		case "":
			c.Reflection = "auto"
		case "auto", "on", "off":
		default:
			return nil, fmt.Errorf("%s: reflection %q: want auto, on or off", where, c.Reflection)
		}
		if c.HistoryBatches < 0 {
			return nil, fmt.Errorf("%s: history-batches %d is negative", where, c.HistoryBatches)
		}
		if c.HistoryBytes < 0 {
			return nil, fmt.Errorf("%s: history-bytes %d is negative", where, c.HistoryBytes)
		}
		if c.SuppressReannounced && !c.ReportModeFull {
			return nil, fmt.Errorf("%s: suppress-reannounced-stores needs report-mode-full (the record tells re-announcements apart)", where)
		}
		timeout := 5 * time.Second
		if c.ReplayTimeout != "" {
			timeout, err = time.ParseDuration(c.ReplayTimeout)
			if err != nil || timeout <= 0 {
				return nil, fmt.Errorf("%s: replay-timeout %q is not a positive duration", where, c.ReplayTimeout)
			}
		}
		loadSettings, err := resolveLoad(c)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", where, err)
		}
		if kv.Enabled {
			// Fail now, not at the first connect, on endpoints no rank can
			// use or that two ranks' sockets would share.
			if err := engines.CheckEndpoints(kv, c.DPSize); err != nil {
				return nil, fmt.Errorf("%s: kv-events-config: %w", where, err)
			}
		}
		out = append(out, Relay{RelayConfig: c, Engine: eng, KV: kv, ReplayTimeout: timeout, Load: loadSettings, upstreamAddr: upstreamAddr, upstreamTLS: upstreamTLS, UnknownKeys: unknownKeys})
	}
	return out, nil
}

// ParseUpstream reads an upstream target (HOST:PORT, grpc:// or grpcs://;
// "" is none) and checks its TLS settings, which need grpcs://.
func ParseUpstream(upstream string, settings tlsconfig.Client) (addr string, useTLS bool, err error) {
	if upstream != "" {
		addr, useTLS, err = tlsconfig.ParseTarget(upstream)
		if err != nil {
			return "", false, fmt.Errorf("upstream: %w", err)
		}
	}
	if err := settings.Check(); err != nil {
		return "", false, fmt.Errorf("upstream TLS: %w", err)
	}
	if !useTLS && settings.Set() {
		return "", false, fmt.Errorf("upstream TLS settings are given but upstream %q is plaintext (use grpcs://HOST:PORT)", upstream)
	}
	return addr, useTLS, nil
}

// kvConfigText accepts the engine's JSON as an object or as a string.
func kvConfigText(raw json.RawMessage) (string, error) {
	if len(raw) == 0 {
		return "", errors.New("missing")
	}
	var s string
	if err := json.Unmarshal(raw, &s); err == nil {
		return s, nil
	}
	return string(raw), nil
}
