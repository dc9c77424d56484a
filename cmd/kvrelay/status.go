package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strings"
	"time"

	"github.com/kvrelay/kvrelay/gateway/httpapi"
	"github.com/kvrelay/kvrelay/relayd"
)

func init() {
	register("status", "show a relay's ranks, cursors, holes and subscribers, or a gateway's workers, as a table", runStatus)
}

func runStatus(ctx context.Context, args []string, _ io.Reader, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("status", flag.ContinueOnError)
	asJSON := fs.Bool("json", false, "print the JSON the endpoint answered (the machine interface) instead of a table")
	timeout := fs.Duration("timeout", 10*time.Second, "give up on the endpoint after this")
	if code, stop := parseFlagsUsage(fs, args, stdout, stderr, func() {
		fmt.Fprintln(fs.Output(), "usage: kvrelay status [--json] ADDR|URL")
		fmt.Fprintln(fs.Output(), "\nADDR is a relay's --metrics-listen (its /debug/status is read) or a gateway's --listen")
		fmt.Fprintln(fs.Output(), "(its /v1/workers); a URL (http:// or https://, user:password@ for basic auth) may name")
		fmt.Fprintln(fs.Output(), "either path itself.\n\nflags:")
		fs.PrintDefaults()
	}); stop {
		return code
	}
	if fs.NArg() != 1 {
		fmt.Fprintln(stderr, "kvrelay status: want one ADDR or URL\nrun 'kvrelay status --help' for usage")
		return 2
	}
	targets, err := statusURLs(fs.Arg(0))
	if err != nil {
		fmt.Fprintf(stderr, "kvrelay status: %v\n", err)
		return 2
	}
	ctx, cancel := context.WithTimeout(ctx, *timeout)
	defer cancel()
	client := &http.Client{}
	for _, target := range targets {
		body, code, err := fetch(ctx, client, target)
		if err != nil {
			fmt.Fprintf(stderr, "kvrelay status: %v\n", err)
			return 1
		}
		if code == http.StatusNotFound && len(targets) > 1 {
			continue // the other kind of endpoint
		}
		if code != http.StatusOK {
			fmt.Fprintf(stderr, "kvrelay status: %s answered %d: %s\n", target, code, strings.TrimSpace(string(body)))
			return 1
		}
		if *asJSON {
			var out bytes.Buffer
			if err := json.Indent(&out, body, "", "  "); err != nil {
				fmt.Fprintf(stderr, "kvrelay status: %s: not JSON: %v\n", target, err)
				return 1
			}
			fmt.Fprintln(stdout, out.String())
			return 0
		}
		if err := writeStatusTable(stdout, target, body); err != nil {
			fmt.Fprintf(stderr, "kvrelay status: %s: %v\n", target, err)
			return 1
		}
		return 0
	}
	fmt.Fprintf(stderr, "kvrelay status: %s serves neither /debug/status (a relay's --metrics-listen) nor /v1/workers (a gateway's --listen)\n", fs.Arg(0))
	return 1
}

// statusURLs are the endpoints to try for ADDR or URL: a URL with a path is
// taken as given; otherwise a relay's /debug/status, then a gateway's
// /v1/workers.
func statusURLs(arg string) ([]string, error) {
	if !strings.Contains(arg, "://") {
		arg = "http://" + arg
	}
	u, err := url.Parse(arg)
	if err != nil || u.Host == "" || (u.Scheme != "http" && u.Scheme != "https") {
		return nil, fmt.Errorf("%q: want HOST:PORT or an http(s):// URL", arg)
	}
	if u.Path != "" && u.Path != "/" {
		return []string{u.String()}, nil
	}
	relayURL, gatewayURL := *u, *u
	relayURL.Path, gatewayURL.Path = "/debug/status", "/v1/workers"
	return []string{relayURL.String(), gatewayURL.String()}, nil
}

// fetch GETs target; the body is bounded, as any peer's answer is.
func fetch(ctx context.Context, client *http.Client, target string) ([]byte, int, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, target, nil)
	if err != nil {
		return nil, 0, err
	}
	resp, err := client.Do(req)
	if err != nil {
		return nil, 0, err
	}
	defer resp.Body.Close()
	const limit = 64 << 20
	body, err := io.ReadAll(io.LimitReader(resp.Body, limit+1))
	if err != nil {
		return nil, 0, fmt.Errorf("%s: %w", target, err)
	}
	if len(body) > limit {
		return nil, 0, fmt.Errorf("%s: answer over %d bytes", target, limit)
	}
	return body, resp.StatusCode, nil
}

// writeStatusTable tells a gateway's answer from a relay's by its shape.
func writeStatusTable(w io.Writer, target string, body []byte) error {
	if strings.HasSuffix(strings.TrimRight(target, "/"), "/v1/workers") {
		var ws httpapi.Workers
		if err := json.Unmarshal(body, &ws); err != nil {
			return fmt.Errorf("not a /v1/workers answer: %w", err)
		}
		return httpapi.WriteWorkersTable(w, ws)
	}
	var rs map[string]relayd.RelayStatus
	if err := json.Unmarshal(body, &rs); err != nil {
		return fmt.Errorf("not a /debug/status answer: %w", err)
	}
	if len(rs) == 0 {
		return errors.New("the answer lists no relay")
	}
	return relayd.WriteStatusTable(w, rs)
}
