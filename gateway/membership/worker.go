package membership

import (
	"fmt"
	"net"
	"net/url"
	"strings"

	"github.com/kvrelay/kvrelay/gateway"
	"github.com/kvrelay/kvrelay/gateway/monitor"
)

// Syntax is the form of one worker, as --worker, a --worker-file line, the
// admin API and a relay's NATS announcement write it.
const Syntax = "grpc://HOST:PORT[,model=M][,service=vllm|sglang|tokenspeed] (grpcs:// for TLS)"

// maxSpec bounds one worker's text: an address and two options are far
// shorter, and a line or body longer than this is not a worker.
const maxSpec = 1024

// ParseWorker reads one worker in Syntax. The worker's ID (what routing
// answers) is the URL without its options; its model defaults to
// gateway.DefaultModel, its service to vLLM's.
func ParseWorker(v string) (gateway.Worker, error) {
	if len(v) > maxSpec {
		return gateway.Worker{}, fmt.Errorf("worker of %d bytes: at most %d", len(v), maxSpec)
	}
	parts := strings.Split(v, ",")
	target := strings.TrimSpace(parts[0])
	scheme := "grpc://"
	if strings.HasPrefix(target, "grpcs://") {
		scheme = "grpcs://"
	}
	if !strings.HasPrefix(target, scheme) {
		return gateway.Worker{}, fmt.Errorf("%q: want %s", v, Syntax)
	}
	u, err := url.Parse(target)
	if err != nil {
		return gateway.Worker{}, fmt.Errorf("%q: %w", v, err)
	}
	if u.Path != "" || u.RawQuery != "" || u.User != nil || u.Fragment != "" {
		return gateway.Worker{}, fmt.Errorf("%q: want grpc://HOST:PORT with nothing after the port", v)
	}
	host, port, err := net.SplitHostPort(u.Host)
	if err != nil || host == "" || port == "" {
		return gateway.Worker{}, fmt.Errorf("%q: want grpc://HOST:PORT", v)
	}
	w := gateway.Worker{ID: scheme + u.Host, Addr: u.Host, Service: monitor.ServiceVLLM, Model: gateway.DefaultModel}
	for _, opt := range parts[1:] {
		key, val, ok := strings.Cut(strings.TrimSpace(opt), "=")
		if !ok || val == "" {
			return gateway.Worker{}, fmt.Errorf("%q: option %q is not key=value", v, opt)
		}
		switch key {
		case "model":
			w.Model = val
		case "service":
			svc, err := monitor.ParseService(val)
			if err != nil {
				return gateway.Worker{}, fmt.Errorf("%q: %w", v, err)
			}
			w.Service = svc
		default:
			return gateway.Worker{}, fmt.Errorf("%q: unknown option %q (want model or service)", v, key)
		}
	}
	return w, nil
}

// FormatWorker writes w in Syntax, the inverse of ParseWorker.
func FormatWorker(w gateway.Worker) string {
	scheme := "grpc://"
	if strings.HasPrefix(w.ID, "grpcs://") {
		scheme = "grpcs://"
	}
	s := scheme + w.Addr
	if w.Model != "" {
		s += ",model=" + w.Model
	}
	if w.Service != "" {
		s += ",service=" + string(w.Service)
	}
	return s
}
